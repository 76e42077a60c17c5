"""The single-row linear kernels (gemv, rms_norm_gemv, swiglu_gemv) against float64 references, the residual sum bit
for bit against torch's add, and the cases that must take the unfused torch path. Tolerances relative to the
largest reference magnitude: fp32 1e-5, bf16 1e-2 (the output's rounding)."""

import pytest
import torch
import torch.nn.functional as F

import cai.kernels._gemv as gemv_mod
from cai.kernels import gemv, rms_norm_gemv, swiglu_gemv

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
SHAPES = pytest.mark.parametrize("n,k", [(1, 64), (7, 100), (33, 1000), (300, 48)], ids=str)


@pytest.fixture
def launches(monkeypatch):
    """How many times the Triton kernel was launched."""
    calls = []
    real = gemv_mod._launch

    def spy(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(gemv_mod, "_launch", spy)
    return calls


def _close(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    err = (out.double() - ref).abs().max().item()
    assert err <= TOL[dtype] * ref.abs().max().item(), err


def _data(n, k, dtype, device, seed, rows=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 1, k, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(device=device, dtype=dtype)
    b = torch.randn(n, generator=g).to(device=device, dtype=dtype)
    return x, w, b


@DTYPES
@SHAPES
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_gemv_matches_float64(n, k, dtype, bias, impl, device, launches):
    x, w, b = _data(n, k, dtype, device, seed=n + k)
    b = b if bias else None
    with torch.no_grad():
        y = gemv(x, w, b)
    _close(y, F.linear(x.double(), w.double(), None if b is None else b.double()), dtype)
    assert launches == ([0] if impl == "triton" else [])


@DTYPES
@SHAPES
@pytest.mark.parametrize("residual", [False, True], ids=["nores", "res"])
def test_rms_norm_gemv_matches_float64(n, k, dtype, residual, impl, device, launches):
    x, w, b = _data(n, k, dtype, device, seed=3 * n + k)
    r = torch.randn_like(x) if residual else None
    g = (1 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(5))).to(device=device, dtype=dtype)
    with torch.no_grad():
        out = rms_norm_gemv(x, g, 1e-5, w, b, residual=r)
    h = x if r is None else x + r  # rounded to dtype, as the kernel must store it
    hd = h.double()
    normed = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + 1e-5) * g.double()
    ref = F.linear(normed, w.double(), b.double())
    if residual:
        y, summed = out
        assert summed.shape == x.shape
        if summed.device.type == "cuda" or dtype == torch.float32:
            assert torch.equal(summed, h)
        else:  # the interpreter's fp32 -> bf16 cast truncates where the GPU's rounds to nearest: one ulp
            torch.testing.assert_close(summed, h, rtol=2**-7, atol=0)
    else:
        y = out
    _close(y, ref, dtype)
    assert launches == ([1] if impl == "triton" else [])


@DTYPES
@SHAPES
def test_swiglu_gemv_matches_float64(n, k, dtype, impl, device, launches):
    gate_up = (torch.randn(1, 1, 2 * k, generator=torch.Generator().manual_seed(k)) * 2).to(device, dtype)
    _, w, b = _data(n, k, dtype, device, seed=n)
    with torch.no_grad():
        y = swiglu_gemv(gate_up, w, b)
    a = gate_up.double()
    # the kernel rounds silu(gate) * up to dtype, as swiglu_packed stores it
    act = (F.silu(a[..., :k]) * a[..., k:]).to(dtype).double()
    _close(y, F.linear(act, w.double(), b.double()), dtype)
    assert launches == ([2] if impl == "triton" else [])


def test_unfused_cases_take_torch(device, monkeypatch, launches):
    monkeypatch.setenv("CAI_KERNELS_IMPL", "triton")
    x, w, b = _data(5, 32, torch.float32, device, seed=0, rows=3)
    g = torch.ones(32, device=device)
    with torch.no_grad():
        # several rows: the torch composition
        torch.testing.assert_close(gemv(x, w, b), F.linear(x, w, b))
        y, h = rms_norm_gemv(x, g, 1e-6, w, residual=x)
        torch.testing.assert_close(y, F.linear(F.rms_norm(x + x, (32,), g, 1e-6), w))
        torch.testing.assert_close(h, x + x)
        # a transposed weight
        torch.testing.assert_close(gemv(x[:1], w.t().contiguous().t(), b), F.linear(x[:1], w, b))
    # a gradient to record
    xg = x[:1].clone().requires_grad_()
    y = swiglu_gemv(torch.cat([xg, xg], -1), w)
    y.sum().backward()
    assert xg.grad is not None
    assert launches == []
