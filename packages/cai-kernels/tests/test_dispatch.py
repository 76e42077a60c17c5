"""Choosing the implementation: environment variables, the report `cai check` prints, and the fallback path."""

import pytest
import torch

import cai.kernels as ck
from cai.kernels import _dispatch
from cai.kernels.optim import cpu_adam_status


def test_report_lists_every_kernel(monkeypatch):
    monkeypatch.delenv("CAI_KERNELS_FALLBACK", raising=False)
    monkeypatch.delenv("CAI_KERNELS_IMPL", raising=False)
    rows = ck.kernel_report()
    assert [r[0] for r in rows] == [
        "rms_norm",
        "layer_norm",
        "rotary",
        "swiglu",
        "fused_linear_cross_entropy",
        "paged_attention",
        "gemv",
        "cpu_adam",
    ]
    expected = "triton" if torch.cuda.is_available() else "torch"
    assert all(impl == expected and reason for _, impl, reason in rows[:-1])
    assert rows[-1][1:] == cpu_adam_status() and rows[-1][2]
    assert rows[-1][1] in ("native-avx512", "native-avx2", "native-scalar", "torch-fused")
    if not torch.cuda.is_available():
        assert "no CUDA device" in rows[0][2]


def test_fallback_variable_wins(monkeypatch):
    monkeypatch.setenv("CAI_KERNELS_FALLBACK", "1")
    monkeypatch.setenv("CAI_KERNELS_IMPL", "triton")
    report = ck.kernel_report()
    assert report[0][1:] == ("torch", "CAI_KERNELS_FALLBACK is set")
    assert report[-1][0] == "cpu_adam" and report[-1][1] == "torch-fused"  # the fallback covers CPU Adam too
    assert not _dispatch.use_triton(torch.zeros(1))
    x = torch.randn(3, 8, requires_grad=True)
    assert "_NormFunction" not in type(ck.rms_norm(x, torch.ones(8)).grad_fn).__name__


def test_forced_triton_uses_the_kernels(monkeypatch):
    monkeypatch.delenv("CAI_KERNELS_FALLBACK", raising=False)
    monkeypatch.setenv("CAI_KERNELS_IMPL", "triton")
    x = torch.randn(3, 8, requires_grad=True)
    assert "_NormFunction" in type(ck.rms_norm(x, torch.ones(8)).grad_fn).__name__
    assert "_SwiGLUFunction" in type(ck.swiglu(x, x).grad_fn).__name__
    impl, reason = ck.kernel_report()[0][1:]
    assert impl == "triton" and "CAI_KERNELS_IMPL=triton" in reason


def test_forced_triton_on_cpu_without_interpreter_fails_clearly(monkeypatch):
    monkeypatch.setenv("CAI_KERNELS_IMPL", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="needs TRITON_INTERPRET=1"):
        _dispatch.use_triton(torch.zeros(1))


def test_unknown_impl_is_rejected(monkeypatch):
    monkeypatch.delenv("CAI_KERNELS_FALLBACK", raising=False)
    monkeypatch.setenv("CAI_KERNELS_IMPL", "cuda")
    with pytest.raises(
        ValueError, match=r"CAI_KERNELS_IMPL='cuda' is not one of \('auto', 'triton', 'torch'\)"
    ):
        _dispatch.use_triton(torch.zeros(1))
    assert ck.kernel_report()[0][1] == "error"


def test_missing_triton_falls_back(monkeypatch):
    monkeypatch.delenv("CAI_KERNELS_FALLBACK", raising=False)
    monkeypatch.delenv("CAI_KERNELS_IMPL", raising=False)
    monkeypatch.setattr(_dispatch, "_triton_import", lambda: (False, "triton is not importable (test)"))
    assert ck.kernel_report()[0][1:] == ("torch", "triton is not importable (test)")
    assert not _dispatch.use_triton(torch.zeros(1))
