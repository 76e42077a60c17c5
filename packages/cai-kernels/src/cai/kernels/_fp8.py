"""FP8 linear layers for training: row-wise dynamic scaling, FP8 operands in all three matmuls.

[Note: fp8 linear]
``y = x W^T`` and its two backward products (``dx = dy W``, ``dW = dy^T x``) each multiply FP8 operands with one
scale per row of the reduction (``amax(|row|) / fp8_max``, computed from the tensor at hand every call: dynamic
scaling, no history to keep or checkpoint) and accumulate in fp32. Activations and weights are e4m3 (more mantissa),
gradients e5m2 (more range), as in torchao's float8 training recipe. On a CUDA device of compute capability 8.9 or
more the bf16 products are ``torch._scaled_mm`` with row-wise scales; elsewhere the same quantised operands are
dequantised and multiplied in fp32 (the emulation the CPU tests check against), which gives the same values up to
the order of accumulation. The parameters stay in their dtype (the optimizer's master copy is untouched): only the
matmul inputs are quantised, each time.

Projections that read the same input (q, k and v; gate and up) would quantise it once each, in forward and again
(transposed) for their weight gradients. The last few quantisations of activations are kept, keyed by the storage's
address, the layout, the version counter and the target dtype; an entry holds the storage, so no other tensor can
take that address while it lives, and an in-place change bumps the version: a hit is the same bytes quantised the
same way. Leaves are never kept: parameters (whose flat ZeRO buffers are rewritten without their version changing)
and gradients (each read once).
"""

from __future__ import annotations

import functools
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from cai.kernels._dispatch import use_triton

__all__ = ["Fp8Linear", "convert_to_fp8", "fp8_linear", "fp8_matmul", "quantize_rowwise"]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_EPS = 1e-12


def quantize_rowwise(x: torch.Tensor, dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (M, K) as FP8 with one fp32 scale per row: ``x ~= q.float() * scale``; returns ``(q, scale (M, 1))``,
    ``q`` row-major whatever the layout of ``x`` (a transposed view is read in place). One or two Triton kernels on
    CUDA (``_fp8_triton``), the same values in torch elsewhere."""
    if use_triton(x) and x.dim() == 2:
        return _quantize_rowwise_triton(x, dtype)
    return _quantize_rowwise_torch(x, dtype)


def _quantize_rowwise_torch(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float().clamp_min(_EPS)
    scale = amax / torch.finfo(dtype).max
    q = (x.float() / scale).to(dtype).contiguous()
    return q, scale


# Tiles of 4,096 elements: BLOCK_M x BLOCK_K, long along the contiguous dimension of x (whole 128-byte lines for
# a bf16 row-major tensor; 32-byte sectors of 16 rows for a transposed one).
_ROW_MAJOR_TILE = (8, 512)
_TRANSPOSED_TILE = (16, 256)


def _quantize_rowwise_triton(
    x: torch.Tensor, dtype: torch.dtype, programs: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    # programs: how many programs fill the device (None: two per SM), below which rows are split across programs
    import triton

    from cai.kernels._fp8_triton import quantize_rows_kernel, quantize_split_kernel, row_amax_kernel
    from cai.kernels._norm_triton import _sm_count

    M, K = x.shape
    q = torch.empty(M, K, dtype=dtype, device=x.device)
    scale = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M == 0 or K == 0:
        return q, scale.fill_(_EPS / torch.finfo(dtype).max)
    block_m, block_k = _ROW_MAJOR_TILE if x.stride(1) == 1 else _TRANSPOSED_TILE
    block_k = min(block_k, triton.next_power_of_2(K))
    row_blocks = triton.cdiv(M, block_m)
    # on CPU (the interpreter) any count exercises both paths
    programs = programs or 2 * (_sm_count(x.device.index or 0) if x.is_cuda else 64)
    fp8_max = torch.finfo(dtype).max
    if row_blocks >= programs or block_k >= K:
        quantize_rows_kernel[(row_blocks,)](
            x, q, scale, M, K, x.stride(0), x.stride(1), FP8_MAX=fp8_max, EPS=_EPS, BLOCK_M=block_m, BLOCK_K=block_k,
        )  # fmt: skip
        return q, scale
    splits = min(triton.cdiv(programs, row_blocks), triton.cdiv(K, block_k))
    chunk = triton.cdiv(triton.cdiv(K, splits), block_k) * block_k
    splits = triton.cdiv(K, chunk)
    amax = torch.zeros(M, dtype=torch.float32, device=x.device)
    grid = (row_blocks, splits)
    row_amax_kernel[grid](x, amax, M, K, x.stride(0), x.stride(1), chunk, BLOCK_M=block_m, BLOCK_K=block_k)
    quantize_split_kernel[grid](
        x, q, amax, scale, M, K, x.stride(0), x.stride(1), chunk,
        FP8_MAX=fp8_max, EPS=_EPS, BLOCK_M=block_m, BLOCK_K=block_k,
    )  # fmt: skip
    return q, scale


_CACHE_SIZE = 4
_cache: OrderedDict[tuple, tuple[torch.UntypedStorage, torch.Tensor, torch.Tensor]] = OrderedDict()


def _quantized(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rowwise(x, dtype)``, or the kept result of the same call on the same bytes (see
    [Note: fp8 linear])."""
    owner = x._base if x._base is not None else x
    if owner.grad_fn is None:
        return quantize_rowwise(x, dtype)
    storage = x.untyped_storage()
    key = (storage.data_ptr(), x.storage_offset(), tuple(x.shape), x.stride(), x.dtype, x._version, dtype)
    hit = _cache.get(key)
    if hit is not None:
        _cache.move_to_end(key)
        return hit[1], hit[2]
    q, scale = quantize_rowwise(x, dtype)
    _cache[key] = (storage, q, scale)
    if len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return q, scale


@functools.cache
def _fp8_tensor_cores(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9) and hasattr(torch, "_scaled_mm")


def _scaled_mm_ok(a: torch.Tensor) -> bool:
    # asked three times a linear a step: the device's answer is looked up once
    return a.is_cuda and _fp8_tensor_cores(a.device.index if a.device.index is not None else 0)


def fp8_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    out_dtype: torch.dtype,
    a_dtype: torch.dtype = E4M3,
    b_dtype: torch.dtype = E4M3,
) -> torch.Tensor:
    """``a @ b.T`` for ``a`` (M, K) and ``b`` (N, K), both quantised row-wise over K (see [Note: fp8 linear])."""
    qa, sa = _quantized(a, a_dtype)
    qb, sb = _quantized(b, b_dtype)
    if out_dtype == torch.bfloat16 and _scaled_mm_ok(a) and a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0:
        # the second operand must be column-major: qb is (N, K) row-major, so qb.t() is (K, N) column-major
        return torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb.t(), out_dtype=out_dtype)
    return ((qa.float() * sa) @ (qb.float() * sb).t()).to(out_dtype)


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        y = fp8_matmul(x2, weight, out_dtype=x.dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        ctx.shape = shape
        return y.reshape(*shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        # dx = dy @ W: reduce over out_features, so W's columns are the rows to scale
        # (transposed views: the quantiser reads them in place and writes row-major FP8)
        dx = fp8_matmul(dy2, weight.t(), out_dtype=x2.dtype, a_dtype=E5M2)
        # dW = dy^T @ x: reduce over tokens
        dw = fp8_matmul(dy2.t(), x2.t(), out_dtype=weight.dtype, a_dtype=E5M2)
        db = dy2.sum(0).to(weight.dtype) if ctx.has_bias else None
        return dx.reshape(ctx.shape), dw, db


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its forward and both backward matmuls in FP8 (see [Note: fp8 linear])."""
    return _Fp8LinearFunction.apply(x, weight, bias)


class Fp8Linear(nn.Linear):
    """``nn.Linear`` whose forward and backward matmuls run in FP8 with row-wise dynamic scales (the same
    ``weight`` and ``bias`` Parameters; state dicts are unchanged). Built by :func:`convert_to_fp8`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return F.linear(x, self.weight, self.bias)  # evaluation runs in the parameters' precision
        return fp8_linear(x, self.weight, self.bias)


def convert_to_fp8(model: nn.Module, *, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Turn ``model``'s ``nn.Linear`` layers into :class:`Fp8Linear`, in place; returns how many.

    Skipped: module names ending in one of ``skip`` (the output head by default: its logits feed the loss and
    FP8 there costs accuracy for little time), and layers whose features are not multiples of 16 (what the FP8
    tensor cores take).
    """
    count = 0
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or name.split(".")[-1] in skip:
            continue
        if module.in_features % 16 or module.out_features % 16:
            continue
        module.__class__ = Fp8Linear  # same Parameters, hooks and name; only forward changes
        count += 1
    return count
