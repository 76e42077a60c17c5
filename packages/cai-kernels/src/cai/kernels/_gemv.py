"""A linear layer applied to a single row at the weight-read bandwidth: the matmuls of batch-1 decoding.

[Note: decode GEMV]
Decoding one sequence multiplies one row by every weight matrix, so each projection's time is its weight bytes over
the bandwidth it reaches, plus a launch. cuBLAS reaches 2.6-4.0 TB/s on an H200 for Llama-3-8B's matrices at one row,
and splits K for the smaller ones with a reduction kernel after. ``gemv_kernel`` gives each program one row of the
weight: it streams it once in 1,024-wide slices, multiplies by ``x`` (read by every program, from L2), keeps per-lane
fp32 sums and reduces them once at the end. Thousands of small programs keep every SM's loads in flight; there is
one launch and no second pass. ``bench_gemv.py`` (each matrix walked over enough copies to defeat L2, replayed from
a CUDA graph) measured 8-22% less time than cuBLAS for every matrix of the 8B model: q/k/v 13.9 against 17.0 us,
o 10.2 against 13.1, gate/up 59.1 against 64.3, down 31.4 against 34.9, lm_head 241 against 261 (3.3-4.4 TB/s).
Wider tiles (2-8 rows a program) were slower in the sweep, and pipelining stages made no difference.

Folding the RMSNorm (or the SwiGLU) before a projection into it was tried and measured slower than the two kernels:
every program must read the whole input row, the residual and the norm's weight to apply it, which triples the L2
traffic at one row a program, and more rows a program slow the matmul itself.

More than one row, a tensor that needs a gradient, or no Triton (CPU) take ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cai.kernels._dispatch import use_triton

__all__ = ["gemv"]


def _single_row(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel applies: one row of K contiguous elements against a row-major (N, K) weight of the same
    dtype, with no gradient to record."""
    k = x.shape[-1]
    return (
        x.numel() == k
        and x.stride(-1) == 1
        and weight.dim() == 2
        and weight.shape[1] == k
        and weight.stride() == (k, 1)
        and x.dtype == weight.dtype
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and use_triton(x)
    )


def _config(k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): one row a program in 1,024-wide slices (``bench_gemv.py --sweep`` on an H200:
    within 0.3 us of the best configuration for every 8B matrix)."""
    return 1, min(1024, max(16, 1 << (k - 1).bit_length())), 8


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config=None) -> torch.Tensor:
    import triton

    from cai.kernels._gemv_triton import gemv_kernel

    n, k = weight.shape
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = config or _config(k)
    gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        bias if bias is not None else y,
        y,
        n,
        K=k,
        HAS_BIAS=bias is not None,
        EVEN_K=k % block_k == 0,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
    )
    return y


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, by one bandwidth-bound Triton kernel when ``x`` is a single row on CUDA (see
    [Note: decode GEMV]).

    Args:
        x: (..., K) holding one row (e.g. (1, 1, K)); other shapes go to ``F.linear``.
        weight: (N, K), row-major, in x's dtype.
        bias: optional (N,).

    Returns:
        (..., N) in x's dtype.
    """
    if not _single_row(x, weight):
        return F.linear(x, weight, bias)
    return _launch(x, weight, bias).view(*x.shape[:-1], -1)
