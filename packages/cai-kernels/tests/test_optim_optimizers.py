"""CPUAdam, HybridAdam and FusedAdam against torch.optim.AdamW / Adam, step by step over 100 steps."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch

from cai.kernels.optim import CPUAdam, FusedAdam, HybridAdam, _loader

SHAPES = [(1,), (7,), (1031,), (33, 65)]
LR = 1e-2
cuda = pytest.mark.gpu


def _assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, name: str = "") -> None:
    # Relative to the tensor's scale (see [Note: relative tolerance] in test_optim_functional.py).
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=rtol, atol=rtol * scale,
                               msg=lambda m: f"{name}: {m}")  # fmt: skip


def _set_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    if g.dtype == p.dtype:
        p.grad = g.clone()
    else:  # fp32 master weight with a low-precision gradient, as ZeRO/Gemini hand it over
        p.grad = torch.zeros_like(p)
        p.grad.data = g.clone()


def _reference_no_bias_correction(params, lr, betas, eps, weight_decay, adamw_mode):
    """Adam(W) without bias correction in plain torch ops: the Colossal-AI `bias_correction=False` semantics."""
    state = {p: (torch.zeros_like(p), torch.zeros_like(p)) for p in params}

    def step():
        with torch.no_grad():
            for p in params:
                g, (m, v) = p.grad.float(), state[p]
                if adamw_mode:
                    p.mul_(1 - lr * weight_decay)
                else:
                    g = g + weight_decay * p
                m.lerp_(g, 1 - betas[0])
                v.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
                p.addcdiv_(m, v.sqrt().add_(eps), value=-lr)

    return step


@dataclass(frozen=True, kw_only=True)
class Config:
    optimizer: type
    adamw_mode: bool = True
    weight_decay: float = 0.0
    bias_correction: bool = True
    grad_dtype: torch.dtype = torch.float32
    fallback: bool = False

    def __str__(self) -> str:
        parts = [self.optimizer.__name__, "adamw" if self.adamw_mode else "adam", f"wd{self.weight_decay}"]
        parts += [] if self.bias_correction else ["nobc"]
        parts += [] if self.grad_dtype == torch.float32 else [str(self.grad_dtype).removeprefix("torch.")]
        return "-".join(parts + (["fallback"] if self.fallback else []))


CONFIGS = [
    Config(optimizer=opt, adamw_mode=aw, weight_decay=wd, bias_correction=bc)
    for opt in (CPUAdam, HybridAdam, FusedAdam)
    for aw in (True, False)
    for wd in (0.0, 0.05)
    for bc in (True, False)
] + [
    Config(optimizer=CPUAdam, weight_decay=0.05, grad_dtype=torch.bfloat16),
    Config(optimizer=HybridAdam, adamw_mode=False, weight_decay=0.05, grad_dtype=torch.float16),
    Config(optimizer=FusedAdam, weight_decay=0.05, grad_dtype=torch.bfloat16),
    Config(optimizer=CPUAdam, weight_decay=0.05, fallback=True),
    Config(optimizer=HybridAdam, weight_decay=0.05, grad_dtype=torch.bfloat16, fallback=True),
]


def _run_against_reference(config: Config, device: str, steps: int = 100) -> None:
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    ours = [torch.nn.Parameter(t.clone().to(device)) for t in init]
    ref = [torch.nn.Parameter(t.clone().to(device)) for t in init]
    hyper = dict(lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=config.weight_decay)
    opt = config.optimizer(
        ours, adamw_mode=config.adamw_mode, bias_correction=config.bias_correction, **hyper
    )
    if config.bias_correction:
        # torch's fused kernels: the same arithmetic order as the native kernel (see kernels/cpu_adam).
        ref_opt = (torch.optim.AdamW if config.adamw_mode else torch.optim.Adam)(ref, fused=True, **hyper)
        ref_step = ref_opt.step
    else:
        ref_step = _reference_no_bias_correction(ref, adamw_mode=config.adamw_mode, **hyper)
    for _ in range(steps):
        for p, q in zip(ours, ref):
            g = torch.randn(p.shape, generator=gen).to(device=device, dtype=config.grad_dtype)
            _set_grad(p, g)
            q.grad = g.float()
        opt.step()
        ref_step()
    for i, (p, q) in enumerate(zip(ours, ref)):
        _assert_rel_close(p.detach(), q.detach(), 1e-6, f"param {i} {tuple(p.shape)}")
        if config.bias_correction:
            st, rst = opt.state[p], ref_opt.state[q]
            _assert_rel_close(st["exp_avg_sq"], rst["exp_avg_sq"], 1e-6, f"exp_avg_sq {i}")
            assert st["step"].item() == rst["step"].item() == steps


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_matches_torch_over_100_steps(config: Config, monkeypatch):
    monkeypatch.setenv(_loader.FALLBACK_ENV, "1" if config.fallback else "0")
    _run_against_reference(config, "cpu")


@cuda
@pytest.mark.parametrize(
    "config",
    [Config(optimizer=o, weight_decay=0.05, grad_dtype=gd) for o in (HybridAdam, FusedAdam)
     for gd in (torch.float32, torch.bfloat16)] + [Config(optimizer=FusedAdam, bias_correction=False)],
    ids=str,
)  # fmt: skip
def test_matches_torch_on_cuda(config: Config):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _run_against_reference(config, "cuda")


@cuda
def test_hybrid_adam_updates_cpu_and_gpu_params_where_they_live():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(1)
    init = [torch.randn(1031, generator=gen), torch.randn(7, 5, generator=gen)]
    devices = ["cpu", "cuda"]
    ours = [torch.nn.Parameter(t.clone().to(d)) for t, d in zip(init, devices)]
    # Each parameter is checked against torch's fused AdamW on its own device: the CUDA and CPU kernels round
    # differently (a few ulp per step), so a CPU reference for a CUDA parameter would test the hardware, not us.
    ref = [torch.nn.Parameter(t.clone().to(d)) for t, d in zip(init, devices)]
    opt = HybridAdam(ours, lr=LR, weight_decay=0.05)
    ref_opts = [torch.optim.AdamW([q], lr=LR, weight_decay=0.05, fused=True) for q in ref]
    for _ in range(100):
        for p, q in zip(ours, ref):
            g = torch.randn(q.shape, generator=gen)
            p.grad, q.grad = g.to(p.device), g.to(q.device)
        opt.step()
        for ref_opt in ref_opts:
            ref_opt.step()
    for p, q, d in zip(ours, ref, devices):
        assert p.device.type == d and opt.state[p]["exp_avg"].device.type == d
        _assert_rel_close(p.detach().cpu(), q.detach().cpu(), 1e-6, d)


def test_bf16_params_use_torch_kernels_and_match():
    gen = torch.Generator().manual_seed(2)
    init = torch.randn(1031, generator=gen).bfloat16()
    p, q = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    opt, ref_opt = (
        CPUAdam([p], lr=LR, weight_decay=0.05),
        torch.optim.AdamW([q], lr=LR, weight_decay=0.05, fused=True),
    )
    for _ in range(20):
        g = torch.randn(1031, generator=gen).bfloat16()
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    assert torch.equal(p, q)


def test_non_contiguous_param_matches():
    gen = torch.Generator().manual_seed(3)
    init = torch.randn(7, 33, generator=gen)
    p, q = torch.nn.Parameter(init.clone().t()), torch.nn.Parameter(init.clone().t())
    assert not p.is_contiguous()
    # torch's own fused CPU AdamW mis-updates non-contiguous parameters; its single-tensor path is the reference.
    opt, ref_opt = CPUAdam([p], lr=LR), torch.optim.AdamW([q], lr=LR, weight_decay=0, foreach=False)
    for _ in range(20):
        g = torch.randn(33, 7, generator=gen)
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    _assert_rel_close(p.detach(), q.detach(), 1e-6)


def test_params_without_grad_are_skipped_and_closure_returns_loss():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = CPUAdam([a, b], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (a * 2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 6.0
    assert torch.allclose(a.detach(), torch.full((3,), 0.9)) and torch.equal(b.detach(), torch.ones(3))
    assert b not in opt.state


def test_div_scale_divides_gradients():
    gen = torch.Generator().manual_seed(4)
    init = torch.randn(1031, generator=gen)
    p, q = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    opt, ref_opt = HybridAdam([p], lr=LR), HybridAdam([q], lr=LR)
    for _ in range(10):
        g = torch.randn(1031, generator=gen)
        p.grad, q.grad = g * 512, g.clone()
        opt.step(div_scale=512.0)
        ref_opt.step()
    assert torch.equal(p, q)


@pytest.mark.parametrize("optimizer", [CPUAdam, HybridAdam, FusedAdam], ids=lambda o: o.__name__)
def test_unsupported_options_raise(optimizer):
    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        optimizer(params, amsgrad=True)
    with pytest.raises(ValueError, match=r"betas=\(0.9, 1.0\) is invalid"):
        optimizer(params, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr=-1 is invalid"):
        optimizer(params, lr=-1)
    if optimizer is not FusedAdam:
        with pytest.raises(NotImplementedError, match=r"nvme_offload_fraction=0\.5"):
            optimizer(params, nvme_offload_fraction=0.5)


def test_colossal_defaults():
    opt = HybridAdam([torch.nn.Parameter(torch.zeros(2))], foreach=False)
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (1e-3, (0.9, 0.999), 1e-8, 0)
    assert g["adamw_mode"] is True and g["bias_correction"] is True and g["foreach"] is False
    fused = FusedAdam([torch.nn.Parameter(torch.zeros(2))])
    assert fused.set_grad_none is True


def _train(opt, params, gen, steps):
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


@pytest.mark.parametrize("optimizer", [CPUAdam, HybridAdam, FusedAdam], ids=lambda o: o.__name__)
def test_state_dict_round_trip(optimizer):
    gen = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    opt = optimizer(params, lr=LR, weight_decay=0.05)
    _train(opt, params, gen, 10)
    sd = copy.deepcopy(opt.state_dict())
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}  # torch Adam's layout
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = optimizer(clones, lr=0.5)  # hyperparameters come back from the state_dict
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == LR
    _train(opt, params, torch.Generator().manual_seed(6), 10)
    _train(opt2, clones, torch.Generator().manual_seed(6), 10)
    for p, c in zip(params, clones):
        assert torch.equal(p, c)


def test_loads_torch_adamw_state_dict_and_continues_identically():
    gen = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    ref_opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.05, fused=True)
    _train(ref_opt, params, gen, 10)
    ours = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = CPUAdam(ours)
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    assert opt.param_groups[0]["adamw_mode"] is True and opt.param_groups[0]["bias_correction"] is True
    _train(ref_opt, params, torch.Generator().manual_seed(8), 10)
    _train(opt, ours, torch.Generator().manual_seed(8), 10)
    for p, q in zip(ours, params):
        _assert_rel_close(p.detach(), q.detach(), 1e-6)
    back = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in ours], lr=LR)
    back.load_state_dict(copy.deepcopy(opt.state_dict()))  # and the other way round
    assert back.state[back.param_groups[0]["params"][0]]["step"].item() == 20
