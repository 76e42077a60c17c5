"""A linear layer applied to a single row, at the weight-read bandwidth, with the RMSNorm or SwiGLU before it folded
in: the matmuls of batch-1 decoding.

[Note: decode GEMV]
Decoding one sequence multiplies one row by every weight matrix, so each projection's time is its weight bytes over
the bandwidth it reaches. cuBLAS reaches about 4 TB/s on an H200 for the wide MLP matrices of Llama-3-8B but 3.1-3.2
TB/s for the q/k/v (6,144 x 4,096) and o (4,096 x 4,096) projections, and splits K for them with a separate
reduction kernel. ``gemv_kernel`` gives each program a few whole rows of the weight: it streams them once, multiplies
by the row of ``x`` (which every program reads from L2), keeps per-lane fp32 sums and reduces them once at the end,
so there is one launch and no second pass.

The kernel also folds in what produces ``x`` at batch 1, each a launch-bound kernel of its own there:
- ``rms_norm_gemv``: ``rms_norm(x + residual) @ W.T``. ``x + residual`` is rounded to the activation dtype as an
  unfused add rounds it (program 0 stores it: the residual stream); the mean square is summed on the way through K
  and its reciprocal root scales the dot products at the end, since ``W (h * g * s) = s * W (h * g)``. The
  normalised row is never rounded to bf16, unlike the unfused norm's output: the results differ from the unfused
  pair by that rounding (about one bf16 ulp of the input), like any change of summation order.
- ``swiglu_gemv``: ``(silu(gate) * up) @ W.T`` from the packed ``[gate | up]`` row, rounded as ``swiglu_packed``
  stores it.

More than one row, a tensor that needs a gradient, or no Triton (CPU) take the unfused torch composition, which
defines the result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cai.kernels._dispatch import use_triton
from cai.kernels._norm import rms_norm
from cai.kernels._swiglu import swiglu_packed

__all__ = ["gemv", "rms_norm_gemv", "swiglu_gemv"]


def _single_row(x: torch.Tensor, weight: torch.Tensor, k: int) -> bool:
    """Whether the kernel applies: one row of ``k`` contiguous elements against a row-major (N, k) weight of the
    same dtype, with no gradient to record."""
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


def _config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages): a few rows a program, enough programs to keep every SM
    streaming."""
    block_k = min(512, max(16, 1 << (k - 1).bit_length()))
    block_n = 8 if n <= 8192 else 16
    return block_n, block_k, 4, 2


def _launch(prologue, x, weight, bias, k, *, residual=None, norm_weight=None, eps=0.0, config=None):
    import triton

    from cai.kernels._gemv_triton import gemv_kernel

    n = weight.shape[0]
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    h = torch.empty(k, dtype=x.dtype, device=x.device) if residual is not None else None
    block_n, block_k, warps, stages = config or _config(n, k)
    gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        residual if residual is not None else x,
        h if h is not None else y,
        norm_weight if norm_weight is not None else x,
        weight,
        bias if bias is not None else y,
        y,
        n,
        eps,
        K=k,
        PROLOGUE=prologue,
        HAS_RES=residual is not None,
        HAS_BIAS=bias is not None,
        EVEN_K=k % block_k == 0,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return y, h


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
    k = x.shape[-1]
    if not _single_row(x, weight, k):
        return F.linear(x, weight, bias)
    y, _ = _launch(0, x, weight, bias, k)
    return y.view(*x.shape[:-1], -1)


def rms_norm_gemv(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
):
    """``F.linear(rms_norm(x + residual, norm_weight, eps), weight, bias)`` in one kernel for a single row on CUDA
    (see [Note: decode GEMV]).

    Returns:
        ``y``, or ``(y, x + residual)`` when a residual is given (the sum rounded to x's dtype, as
        :func:`cai.kernels.rms_norm` returns it).
    """
    k = x.shape[-1]
    fused = (
        _single_row(x, weight, k)
        and norm_weight.shape == (k,)
        and norm_weight.dtype == x.dtype
        and (
            residual is None
            or (residual.shape == x.shape and residual.is_contiguous() and residual.dtype == x.dtype)
        )
    )
    if not fused:
        if residual is None:
            return F.linear(rms_norm(x, norm_weight, eps), weight, bias)
        normed, summed = rms_norm(x, norm_weight, eps, residual=residual)
        return F.linear(normed, weight, bias), summed
    y, h = _launch(1, x, weight, bias, k, residual=residual, norm_weight=norm_weight, eps=eps)
    y = y.view(*x.shape[:-1], -1)
    return y if residual is None else (y, h.view(x.shape))


def swiglu_gemv(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(swiglu_packed(gate_up), weight, bias)`` in one kernel for a single row on CUDA (see
    [Note: decode GEMV]); ``gate_up`` is ``[gate | up]`` along its last dimension."""
    k = gate_up.shape[-1] // 2
    single = gate_up.shape[-1] == 2 * k and gate_up.numel() == 2 * k
    if not (single and _single_row(gate_up[..., :k], weight, k)):
        return F.linear(swiglu_packed(gate_up), weight, bias)
    y, _ = _launch(2, gate_up, weight, bias, k)
    return y.view(*gate_up.shape[:-1], -1)
