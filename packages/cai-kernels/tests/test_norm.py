"""RMSNorm / LayerNorm (with and without the fused residual) against a float64 reference, forward and backward.

Tolerances: errors are measured relative to the largest magnitude of the reference tensor. fp32: 1e-5;
bf16: 2e-2 (outputs are rounded to bf16, ~8 bits of mantissa; gradients are computed from bf16 inputs).
"""

from dataclasses import dataclass

import pytest
import torch

from cai.kernels import LayerNorm, RMSNorm, layer_norm, rms_norm

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def assert_rel(actual, expected, tol, name):
    err = (actual.double() - expected).abs().max().item()
    scale = expected.abs().max().item() or 1.0
    assert err <= tol * scale, f"{name}: max error {err:.3g} > {tol} x {scale:.3g}"


@dataclass(frozen=True, kw_only=True)
class Case:
    shape: tuple
    dtype: torch.dtype
    residual: bool

    def __str__(self):
        return f"{'x'.join(map(str, self.shape))}-{str(self.dtype)[6:]}-{'res' if self.residual else 'nores'}"


CASES = [
    Case(shape=s, dtype=d, residual=r)
    for s in [(1, 8), (37, 100), (2, 5, 64), (3, 257)]
    for d in (torch.float32, torch.bfloat16)
    for r in (False, True)
] + [Case(shape=(6, 48), dtype=torch.float16, residual=True)]


def reference(x, residual, weight, bias, eps, is_rms):
    s = x if residual is None else x + residual
    xc = s if is_rms else s - s.mean(-1, keepdim=True)
    y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps) * weight
    return y + bias if bias is not None else y, s


@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_norm_matches_float64(case, is_rms, impl, device):
    g = torch.Generator().manual_seed(0)
    n = case.shape[-1]

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=case.dtype).requires_grad_()

    x, w, b = rnd(*case.shape), rnd(n), rnd(n)
    r = rnd(*case.shape) if case.residual else None
    eps = 1e-6
    if is_rms:
        out = rms_norm(x, w, eps, residual=r)
    else:
        out = layer_norm(x, w, b, eps, residual=r)
    y, s = out if case.residual else (out, None)
    assert y.dtype == case.dtype
    dy = torch.randn(case.shape, generator=g).to(device=device, dtype=case.dtype)
    ds = torch.randn(case.shape, generator=g).to(device=device, dtype=case.dtype)
    loss = (y.float() * dy.float()).sum() + ((s.float() * ds.float()).sum() if s is not None else 0)
    loss.backward()

    named = (
        [("dx", x), ("dw", w)] + ([] if is_rms else [("db", b)]) + ([("dres", r)] if r is not None else [])
    )
    ref = {name: t.detach().double().requires_grad_() for name, t in named}
    # The kernel normalises x + residual rounded to the input dtype; the float64 reference does not round,
    # which the bf16 tolerance covers.
    yd, sd = reference(ref["dx"], ref.get("dres"), ref["dw"], ref.get("db"), eps, is_rms)
    ref_loss = (yd * dy.double()).sum() + ((sd * ds.double()).sum() if r is not None else 0)
    ref_loss.backward()

    tol = TOL[case.dtype]
    assert_rel(y, yd, tol, "y")
    if s is not None:
        assert_rel(s, sd, tol, "residual out")
    for name, t in named:
        # dW and dB sum over rows: allow for the longer accumulation.
        assert_rel(t.grad, ref[name].grad, tol * (4 if name in ("dw", "db") else 1), name)


def test_weight_grad_reduced_over_many_rows(impl, device):
    # More rows than programs x rows-per-block: exercises the per-program partial dW and its reduction.
    x = torch.randn(1000, 24, dtype=torch.float64, device=device).float().requires_grad_()
    w = torch.randn(24, device=device).requires_grad_()
    rms_norm(x, w).sum().backward()
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    reference(xd, None, wd, None, 1e-6, True)[0].sum().backward()
    assert_rel(w.grad, wd.grad, 1e-5, "dw")
    assert_rel(x.grad, xd.grad, 1e-5, "dx")


def test_modules_match_torch_layer_norm(impl, device):
    ln = LayerNorm(40, eps=1e-5, device=device)
    ref = torch.nn.LayerNorm(40, eps=1e-5, device=device)
    x = torch.randn(3, 40, device=device)
    assert_rel(ln(x), ref(x).double(), 1e-5, "LayerNorm")
    rms = RMSNorm(40, eps=1e-5, device=device)
    ref_rms = torch.nn.RMSNorm(40, eps=1e-5, device=device)
    assert_rel(rms(x), ref_rms(x).double(), 1e-5, "RMSNorm")
    _, s = rms(x, x)
    assert torch.equal(s, x + x)


@pytest.mark.parametrize("used", ["y", "residual"])
def test_one_output_unused(used, impl, device):
    x = torch.randn(5, 24, device=device, requires_grad=True)
    r = torch.randn(5, 24, device=device, requires_grad=True)
    w = torch.randn(24, device=device, requires_grad=True)
    y, s = rms_norm(x, w, residual=r)
    (y if used == "y" else s).pow(2).sum().backward()
    xd, rd, wd = (t.detach().double().requires_grad_() for t in (x, r, w))
    yd, sd = reference(xd, rd, wd, None, 1e-6, True)
    (yd if used == "y" else sd).pow(2).sum().backward()
    for name, t, td in [("dx", x, xd), ("dres", r, rd)]:
        assert_rel(t.grad, td.grad, 1e-5, name)
    if used == "y":
        assert_rel(w.grad, wd.grad, 1e-5, "dw")
    else:
        assert w.grad is None or not w.grad.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_return_input_adds_the_branch_gradient(dtype, impl, device):
    # (y, x) back; the gradient reaching that x joins the norm's input gradient (inside the kernel on Triton)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 100, generator=g).to(device=device, dtype=dtype).requires_grad_()
    w = torch.randn(100, generator=g).to(device=device, dtype=dtype).requires_grad_()
    dy, dx_branch = (torch.randn(37, 100, generator=g).to(device=device, dtype=dtype) for _ in range(2))
    y, same = rms_norm(x, w, return_input=True)
    assert torch.equal(same, x) and same.requires_grad
    ((y.float() * dy.float()).sum() + (same.float() * dx_branch.float()).sum()).backward()
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    yd, _ = reference(xd, None, wd, None, 1e-6, True)
    ((yd * dy.double()).sum() + (xd * dx_branch.double()).sum()).backward()
    assert_rel(y, yd, TOL[dtype], "y")
    assert_rel(x.grad, xd.grad, TOL[dtype], "dx")
    assert_rel(w.grad, wd.grad, 4 * TOL[dtype], "dw")
    with pytest.raises(ValueError, match="return_input=True takes no residual"):
        rms_norm(x, w, residual=x, return_input=True)


def test_hf_output_dtype_with_fp32_weight(impl, device):
    # Hugging Face's LlamaRMSNorm returns promote(input, weight): bf16 input with an fp32 weight gives fp32.
    y = rms_norm(torch.randn(4, 16, device=device, dtype=torch.bfloat16), torch.ones(16, device=device))
    assert y.dtype == torch.float32


def test_bad_shapes_name_the_values():
    with pytest.raises(ValueError, match=r"weight has shape \(8,\); expected \(16,\)"):
        rms_norm(torch.randn(2, 16), torch.ones(8))
    with pytest.raises(ValueError, match="residual has shape"):
        rms_norm(torch.randn(2, 16), torch.ones(16), residual=torch.randn(3, 16))


def _bwd_configs():
    from cai.kernels import _norm_triton as kt

    # The static choice at N=24 (16 rows per iteration) and single-row iterations: the autotuner may pick any
    # rows-per-iteration / programs-per-SM pair on a GPU.
    return [kt._bwd_candidates(24)[0], (1, 4, 2), (2, 4, 3)]


@pytest.mark.parametrize("cfg", _bwd_configs(), ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
def test_every_backward_launch_config(cfg, is_rms, monkeypatch, device):
    from cai.kernels import _norm_triton as kt
    from cai.kernels import _tune

    monkeypatch.delenv("CAI_KERNELS_FALLBACK", raising=False)
    monkeypatch.setenv("CAI_KERNELS_IMPL", "triton")
    monkeypatch.setattr(kt, "_bwd_candidates", lambda n: [cfg])
    monkeypatch.setattr(_tune, "_CHOICES", {})
    g = torch.Generator().manual_seed(1)
    # 203 rows: a ragged last block for every rows-per-program choice.
    x, r = (torch.randn(203, 24, generator=g).to(device).requires_grad_() for _ in range(2))
    w, b = (torch.randn(24, generator=g).to(device).requires_grad_() for _ in range(2))
    dy, ds = (torch.randn(203, 24, generator=g).to(device) for _ in range(2))
    y, s = rms_norm(x, w, residual=r) if is_rms else layer_norm(x, w, b, residual=r)
    ((y * dy).sum() + (s * ds).sum()).backward()
    ref = {k: t.detach().double().requires_grad_() for k, t in (("x", x), ("r", r), ("w", w), ("b", b))}
    yd, sd = reference(ref["x"], ref["r"], ref["w"], None if is_rms else ref["b"], 1e-6, is_rms)
    ((yd * dy.double()).sum() + (sd * ds.double()).sum()).backward()
    for name, t in (("x", x), ("r", r), ("w", w)) + (() if is_rms else (("b", b),)):
        assert_rel(t.grad, ref[name].grad, 1e-5, f"d{name}")
