"""adam_update: the native CPU kernel against torch's fused Adam, the copy-out casts, the fallback path."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import torch

from cai.kernels.optim import _loader, adam_update, cpu_adam_status


def _assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, name: str = "") -> None:
    # [Note: relative tolerance] Relative to the tensor's scale: an element that crosses zero has no meaningful
    # elementwise relative error, while a few-ulp difference of a 1.0-sized value must still be caught.
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale, msg=lambda m: f"{name}: {m}")


@pytest.fixture
def native(monkeypatch):
    monkeypatch.delenv(_loader.FALLBACK_ENV, raising=False)
    lib = _loader.native_adam()
    assert lib is not None, f"native build failed here: {cpu_adam_status()}"
    return lib


@dataclass(frozen=True, kw_only=True)
class Case:
    numel: int
    adamw: bool
    weight_decay: float
    grad_dtype: torch.dtype = torch.float32

    def __str__(self) -> str:
        mode = "adamw" if self.adamw else "adam"
        return f"n{self.numel}-{mode}-wd{self.weight_decay}-{str(self.grad_dtype).removeprefix('torch.')}"


CASES = [
    Case(numel=n, adamw=aw, weight_decay=wd, grad_dtype=gd)
    for n in (1, 7, 1031)
    for aw in (True, False)
    for wd in (0.0, 0.1)
    for gd in (torch.float32, torch.bfloat16)
] + [Case(numel=70001, adamw=True, weight_decay=0.1, grad_dtype=torch.float16)]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_native_matches_torch_fused_over_100_steps(native, case: Case):
    gen = torch.Generator().manual_seed(case.numel)
    p0 = torch.randn(case.numel, generator=gen)
    ours, ref = p0.clone(), p0.clone()
    m, v, m_ref, v_ref = (torch.zeros(case.numel) for _ in range(4))
    fused = torch._fused_adamw_ if case.adamw else torch._fused_adam_
    for step in range(1, 101):
        g = torch.randn(case.numel, generator=gen).to(case.grad_dtype)
        adam_update(ours, g, m, v, step=step, lr=1e-2, weight_decay=case.weight_decay, adamw_mode=case.adamw)
        fused([ref], [g.float()], [m_ref], [v_ref], [], [torch.tensor(float(step))], lr=1e-2, beta1=0.9,
              beta2=0.999, weight_decay=case.weight_decay, eps=1e-8, amsgrad=False, maximize=False)  # fmt: skip
    _assert_rel_close(ours, ref, 1e-6, "param")
    _assert_rel_close(m, m_ref, 1e-6, "exp_avg")
    _assert_rel_close(v, v_ref, 1e-6, "exp_avg_sq")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("numel", [7, 1031, 70001])
def test_copy_out_equals_cast_of_fp32_result(native, out_dtype, numel):
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(numel, generator=gen) * 3
    m, v = torch.zeros(numel), torch.zeros(numel)
    # One element past a 64-byte boundary: the streaming-store path must realign (numel 70001 runs it).
    buf = torch.full((numel + 1,), float("nan"), dtype=out_dtype)
    out = buf[1:]
    for step in (1, 2, 3):
        adam_update(p, torch.randn(numel, generator=gen), m, v, step=step, lr=0.1, out=out, num_threads=1)
        assert torch.equal(out.view(torch.int16 if out_dtype != torch.float32 else torch.int32),
                           p.to(out_dtype).view(torch.int16 if out_dtype != torch.float32 else torch.int32))  # fmt: skip
    assert buf[0].isnan()


def _special_values() -> torch.Tensor:
    bits = [
        0x3F808000,  # halfway between two bf16 values, even below: rounds down
        0x3F818000,  # halfway, odd below: rounds up
        0x3F80FFFF,
        0x7F7FFFFF,  # largest float: bf16 rounds to inf
        0x00000001,  # smallest subnormal
        0x80000000,  # -0.0
        0x7F800000,  # inf
        0xFF800000,  # -inf
        0x7FC00000,  # NaN
        0x7F800001,  # signalling NaN
        0x477FF000,  # fp16 rounding boundary to inf
        0x477FEFFF,
        0x33000000,  # 2^-25: fp16 ties to zero
        0x33000001,
        0x38800000,  # smallest normal fp16
        0x387FC000,  # fp16 subnormal
    ]
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_copy_out_rounds_like_torch_on_special_values(native, out_dtype):
    special = _special_values()
    gen = torch.Generator().manual_seed(2)
    p = torch.cat([special, torch.randn(61, generator=gen) * 1e4, special])  # both vector and scalar bodies
    p_before = p.clone()
    zeros = torch.zeros_like(p)
    out = torch.empty(p.numel(), dtype=out_dtype)
    # lr=0 and a zero gradient leave the parameter unchanged, so `out` is exactly its cast.
    adam_update(p, zeros, zeros.clone(), zeros.clone(), step=1, lr=0.0, out=out)
    keep = ~p_before.isnan()  # arithmetic quiets a signalling NaN; every other value is unchanged
    assert torch.equal(p.isnan(), ~keep) and torch.equal(
        p[keep].view(torch.int32), p_before[keep].view(torch.int32)
    )
    expected = p.to(out_dtype)
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan].view(torch.int16), expected[~nan].view(torch.int16))
    if out_dtype == torch.bfloat16:  # torch's canonical NaN
        assert (out[nan].view(torch.int16) == 0x7FC0).all()


def test_result_does_not_depend_on_thread_count(native):
    gen = torch.Generator().manual_seed(3)
    n = 3 * 65536 + 13
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen).bfloat16()
    results = []
    for threads in (1, 2, 3):
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        out = torch.empty(n, dtype=torch.bfloat16)
        for step in (1, 2):
            adam_update(p, g, m, v, step=step, lr=1e-2, weight_decay=0.1, out=out, num_threads=threads)
        results.append((p, m, v, out))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a.view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32),
                               b.view(torch.int16 if b.dtype == torch.bfloat16 else torch.int32))  # fmt: skip


# Other bodies of the same source, built for an older x86 CPU: the portable scalar body (software fp16
# conversion, libm fma) always, and the AVX2 body where this CPU runs it and the native build is AVX-512.
_OTHER_BUILDS = [("scalar", "-march=x86-64")]
if " avx2" in _loader._cpu_signature() and " avx512f" in _loader._cpu_signature():
    _OTHER_BUILDS.append(("avx2", "-march=haswell"))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize(("isa", "march"), _OTHER_BUILDS, ids=[isa for isa, _ in _OTHER_BUILDS])
def test_other_isa_builds_match_native_build_bitwise(native, isa, march):
    """Every body computes exactly what the native body computes (see the Note in cpu_adam.cpp)."""
    other = _loader._build(flags=["-O2", "-std=c++17", "-fopenmp", march, "-ffp-contract=off", "-w"])
    assert other.isa == isa and native.isa != isa
    gen = torch.Generator().manual_seed(4)
    n = 2 * 65536 + 4099  # two threads, each long enough for the streaming stores, plus tails
    specials = _special_values()
    p0 = torch.cat([torch.randn(n - 32, generator=gen), specials.abs().clamp(max=6e4), -specials])
    variants = [(gd, od, adamw, beta1) for gd in (torch.float32, torch.bfloat16, torch.float16)
                for od in (torch.bfloat16, torch.float16) for adamw in (0, 1) for beta1 in (0.9, 0.3)]  # fmt: skip
    for grad_dtype, out_dtype, adamw, beta1 in variants:
        g = torch.randn(n, generator=gen).to(grad_dtype)
        states = []
        for lib in (native, other):
            p, m, v = p0.clone(), torch.randn(n, generator=torch.Generator().manual_seed(9)), torch.ones(n)
            out = torch.empty(n, dtype=out_dtype)
            # beta1, beta2, 1-beta1, 1-beta2, eps, wd, 1-lr*wd, adamw, step_size, bc2_sqrt, grad_scale, threads
            rc = lib.step(p.data_ptr(), g.data_ptr(), _grad_code(grad_dtype), m.data_ptr(), v.data_ptr(),
                          out.data_ptr(), _grad_code(out_dtype), n, beta1, 0.999, 1 - beta1, 0.001, 1e-8, 0.1,
                          1 - 0.05 * 0.1, adamw, 0.05, 0.03, 2.0, 2)  # fmt: skip
            assert rc == 0
            states.append((p, m, v, out))
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq", "out"), *states):
            assert torch.equal(_bits(a), _bits(b)), (name, grad_dtype, out_dtype, adamw, beta1)


def _grad_code(dtype: torch.dtype) -> int:
    return {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[dtype]


@pytest.mark.parametrize("bias_correction", [True, False])
def test_grad_scale_and_bias_correction_match_torch_path(native, bias_correction):
    gen = torch.Generator().manual_seed(5)
    n = 1031
    p0 = torch.randn(n, generator=gen)
    (a, b), (ma, mb), (va, vb) = [
        (p0.clone(), p0.clone()),
        (torch.zeros(n), torch.zeros(n)),
        (torch.zeros(n), torch.zeros(n)),
    ]
    for step in range(1, 51):
        g = torch.randn(n, generator=gen) * 1024
        g_before = g.clone()
        hyper = dict(step=step, lr=1e-2, weight_decay=0.1, bias_correction=bias_correction, grad_scale=1024.0)
        adam_update(a, g, ma, va, **hyper)
        assert torch.equal(g, g_before), "the gradient must not be modified"
        from cai.kernels.optim._functional import torch_adam_update

        torch_adam_update([b], [g], [mb], [vb], [step], beta1=0.9, beta2=0.999, eps=1e-8, adamw_mode=True,
                          **{k: v for k, v in hyper.items() if k != "step"})  # fmt: skip
    # The foreach reference rounds lerp without an FMA (torch's own single-tensor and fused Adam differ the same
    # way), so it agrees to a few ulp per step rather than bitwise.
    _assert_rel_close(a, b, 1e-6, "param")


def test_fallback_env_uses_torch_and_agrees(monkeypatch):
    gen = torch.Generator().manual_seed(6)
    n = 1031
    p0, grads = torch.randn(n, generator=gen), [torch.randn(n, generator=gen).bfloat16() for _ in range(20)]
    results = {}
    for mode in ("0", "1"):
        monkeypatch.setenv(_loader.FALLBACK_ENV, mode)
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        out = torch.empty(n, dtype=torch.bfloat16)
        for step, g in enumerate(grads, 1):
            adam_update(p, g, m, v, step=step, lr=1e-2, weight_decay=0.1, out=out)
        assert torch.equal(out, p.bfloat16())
        results[mode] = p
    assert cpu_adam_status() == ("torch-fused", f"{_loader.FALLBACK_ENV}=1 forces the fallback")
    _assert_rel_close(results["0"], results["1"], 1e-6, "native vs fallback")


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """A loader that has not built anything yet, with an empty cache."""
    monkeypatch.delenv(_loader.FALLBACK_ENV, raising=False)
    monkeypatch.setenv(_loader.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(_loader, "_native", None)
    monkeypatch.setattr(_loader, "_failure", None)
    monkeypatch.setattr(_loader, "_warned", False)


def test_builds_with_the_compiler_alone_when_ninja_is_missing(fresh_loader, monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_adam_status()[0].startswith("native-")


def test_no_compiler_warns_once_and_falls_back(fresh_loader, monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    p, g, m, v = torch.ones(8), torch.ones(8), torch.zeros(8), torch.zeros(8)
    out = torch.empty(8, dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning, match=r"native CPU Adam unavailable \(RuntimeError: no C\+\+ compiler"):
        adam_update(p, g, m, v, step=1, lr=0.1, out=out)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # only once
        adam_update(p, g, m, v, step=2, lr=0.1, out=out)
    assert cpu_adam_status() == (
        "torch-fused",
        "native build failed: RuntimeError: no C++ compiler (/nonexistent/c++) and no ninja",
    )
    assert torch.allclose(p, torch.full((8,), 1.0 - 0.2), atol=1e-6)  # two unit steps of lr 0.1
    assert torch.equal(out, p.bfloat16())


def test_errors_name_the_bad_values():
    p = torch.zeros(4)
    with pytest.raises(ValueError, match="grad has 5 elements but param has 4"):
        adam_update(p, torch.zeros(5), torch.zeros(4), torch.zeros(4), step=1, lr=0.1)
    with pytest.raises(TypeError, match=r"float64 .* use float32, bfloat16 or float16"):
        adam_update(p, torch.zeros(4, dtype=torch.float64), torch.zeros(4), torch.zeros(4), step=1, lr=0.1)


def test_source_is_found_in_checkout():
    src = _loader.find_source_dir()
    assert src is not None and (src / "cpu_adam.cpp").is_file()


@pytest.mark.gpu
@pytest.mark.parametrize("step_on_device", [False, True])
def test_cuda_tensors_use_torch_fused_kernel_and_copy_out(step_on_device):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(10)
    n = 70001
    p = torch.randn(n, generator=gen)
    pc, mc, vc = p.cuda(), torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    m, v = torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    for step in range(1, 21):
        g = torch.randn(n, generator=gen).bfloat16()
        s = torch.tensor(float(step), device="cuda") if step_on_device else step
        adam_update(pc, g.cuda(), mc, vc, step=s, lr=1e-2, weight_decay=0.1, out=out)
        adam_update(p, g, m, v, step=step, lr=1e-2, weight_decay=0.1)
    torch.cuda.synchronize()
    assert torch.equal(out, pc.cpu().bfloat16())
    _assert_rel_close(pc.cpu(), p, 1e-6, "cuda vs cpu")


# ---- the Triton kernel ([Note: device Adam]): run here through the Triton interpreter, on the GPU compiled -------


@pytest.fixture
def triton_adam(monkeypatch, device):
    """adam_update on `device` through the Triton kernel (forced on CPU, where the interpreter runs it)."""
    monkeypatch.delenv("CAI_KERNELS_FALLBACK", raising=False)
    monkeypatch.setenv("CAI_KERNELS_IMPL", "triton")
    return device


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("step_on_device", [False, True], ids=["host-step", "device-step"])
def test_triton_kernel_matches_torch_and_writes_the_cast(
    triton_adam, adamw, grad_dtype, out_dtype, step_on_device
):
    from cai.kernels.optim._functional import torch_adam_update

    dev = triton_adam
    gen = torch.Generator().manual_seed(11)
    n = 5003  # two programs, the second one partial
    p0 = torch.randn(n, generator=gen)
    p, m, v = p0.to(dev), torch.zeros(n, device=dev), torch.zeros(n, device=dev)
    pr, mr, vr = p0.clone(), torch.zeros(n), torch.zeros(n)
    out = None if out_dtype is None else torch.full((n,), 7.0, dtype=out_dtype, device=dev)
    step_t = torch.zeros((), device=dev)
    hyper = dict(lr=1e-2, weight_decay=0.1, adamw_mode=adamw)
    for step in range(1, 11):
        g = torch.randn(n, generator=gen).to(grad_dtype)
        g_dev = g.to(dev)
        step_t += 1
        adam_update(p, g_dev, m, v, step=step_t if step_on_device else step, out=out, **hyper)
        assert torch.equal(g_dev.cpu(), g), "the gradient must not be modified"
        torch_adam_update([pr], [g], [mr], [vr], [step], beta1=0.9, beta2=0.999, eps=1e-8, bias_correction=True,
                          **{k: v for k, v in hyper.items()})  # fmt: skip
        if out is not None:  # the cast of the new fp32 values, rounded to nearest even, in the same pass
            assert torch.equal(out.cpu(), p.cpu().to(out_dtype)), f"step {step}"
    for name, got, want in (("param", p, pr), ("exp_avg", m, mr), ("exp_avg_sq", v, vr)):
        _assert_rel_close(got.cpu(), want, 2e-6, name)


@pytest.mark.parametrize("bias_correction", [True, False])
def test_triton_kernel_grad_scale_and_early_bias_correction(triton_adam, bias_correction):
    # The first steps are where 1 - beta2 ** step loses digits if computed naively in fp32 (beta2 = 0.999: about
    # 1e-4 relative at step 1); the reference is the same update in float64. Parameters start near zero, so that
    # they are mostly the updates and their relative error is the update's.
    dev = triton_adam
    gen = torch.Generator().manual_seed(12)
    n = 1031
    p0 = torch.randn(n, generator=gen, dtype=torch.float64) * 1e-4
    p, m, v = p0.float().to(dev), torch.zeros(n, device=dev), torch.zeros(n, device=dev)
    pr, mr, vr = p0.clone(), torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.999, 1e-8, 0.1
    for step in range(1, 4):
        g = torch.randn(n, generator=gen, dtype=torch.float64) * 1024
        adam_update(p, g.float().to(dev), m, v, step=step, lr=lr, weight_decay=wd, bias_correction=bias_correction,
                    grad_scale=1024.0)  # fmt: skip
        gs = g.float().double() / 1024
        pr.mul_(1 - lr * wd)
        mr.mul_(b1).add_(gs, alpha=1 - b1)
        vr.mul_(b2).addcmul_(gs, gs, value=1 - b2)
        bc1, bc2 = (1 - b1**step, 1 - b2**step) if bias_correction else (1.0, 1.0)
        pr.addcdiv_(mr, (vr.sqrt() / bc2**0.5).add_(eps), value=-lr / bc1)
        _assert_rel_close(p.cpu().double(), pr, 1e-6, f"step {step}")
