"""Kernel tests run the real Triton kernels on CPU through the Triton interpreter.

TRITON_INTERPRET must be set before any kernel is defined; cai.kernels defines them on first use, so setting
it here (before the tests import anything) is enough. On a CUDA machine the compiled kernels run instead.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

IMPLS = ("triton", "torch")


@pytest.fixture(params=IMPLS)
def impl(request, monkeypatch):
    """Run the test once with the Triton kernels forced and once with the pure-torch fallback."""
    monkeypatch.delenv("CAI_KERNELS_FALLBACK", raising=False)
    monkeypatch.setenv("CAI_KERNELS_IMPL", request.param)
    return request.param


@pytest.fixture
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"
