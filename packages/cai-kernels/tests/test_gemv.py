"""The single-row linear kernel (gemv) against a float64 reference, and the cases that must take ``F.linear``.
Tolerances relative to the largest reference magnitude: fp32 1e-5, bf16 1e-2 (the output's rounding)."""

import pytest
import torch
import torch.nn.functional as F

import cai.kernels._gemv as gemv_mod
from cai.kernels import gemv

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture
def launches(monkeypatch):
    """How many times the Triton kernel was launched."""
    calls = []
    real = gemv_mod._launch
    monkeypatch.setattr(gemv_mod, "_launch", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def _data(n, k, dtype, device, seed, rows=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 1, k, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(device=device, dtype=dtype)
    b = torch.randn(n, generator=g).to(device=device, dtype=dtype)
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,k", [(1, 64), (7, 100), (33, 1000), (300, 48), (5, 2500)], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_gemv_matches_float64(n, k, dtype, bias, impl, device, launches):
    x, w, b = _data(n, k, dtype, device, seed=n + k)
    b = b if bias else None
    with torch.no_grad():
        y = gemv(x, w, b)
        flat = gemv(x.view(k), w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.dtype == dtype and y.shape == ref.shape and flat.shape == (n,)
    err = (y.double() - ref).abs().max().item()
    assert err <= TOL[dtype] * ref.abs().max().item(), err
    assert torch.equal(flat, y.view(n))
    assert len(launches) == (2 if impl == "triton" else 0)


def test_other_inputs_take_f_linear(device, monkeypatch, launches):
    monkeypatch.setenv("CAI_KERNELS_IMPL", "triton")
    x, w, b = _data(5, 32, torch.float32, device, seed=0, rows=3)
    with torch.no_grad():
        torch.testing.assert_close(gemv(x, w, b), F.linear(x, w, b))  # several rows
        transposed = w.t().contiguous().t()  # the same values, column-major
        torch.testing.assert_close(gemv(x[:1], transposed, b), F.linear(x[:1], w, b))
        torch.testing.assert_close(gemv(x[:1].double(), w.double()), F.linear(x[:1].double(), w.double()))
    xg = x[:1].clone().requires_grad_()  # a gradient to record
    gemv(xg, w).sum().backward()
    torch.testing.assert_close(xg.grad, w.sum(0).view(1, 1, -1))
    assert launches == []
