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

__all__ = ["Fp8Linear", "convert_to_fp8", "fp8_linear", "fp8_matmul", "quantize_rowwise"]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_EPS = 1e-12


def quantize_rowwise(x: torch.Tensor, dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (M, K) as FP8 with one fp32 scale per row: ``x ~= q.float() * scale``; returns ``(q, scale (M, 1))``,
    ``q`` row-major whatever the layout of ``x`` (a transposed view is read in place)."""
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float().clamp_min(_EPS)
    scale = amax / torch.finfo(dtype).max
    q = (x.float() / scale).to(dtype).contiguous()
    return q, scale


_CACHE_SIZE = 4
_cache: OrderedDict[tuple, tuple[torch.UntypedStorage, torch.Tensor, torch.Tensor]] = OrderedDict()


def _quantized(x: torch.Tensor, dtype: torch.dtype, quantize) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize(x, dtype)``, or the kept result of the same call on the same bytes (see [Note: fp8 linear])."""
    owner = x._base if x._base is not None else x
    if owner.grad_fn is None:
        return quantize(x, dtype)
    storage = x.untyped_storage()
    key = (storage.data_ptr(), x.storage_offset(), tuple(x.shape), x.stride(), x.dtype, x._version, dtype)
    hit = _cache.get(key)
    if hit is not None:
        _cache.move_to_end(key)
        return hit[1], hit[2]
    q, scale = quantize(x, dtype)
    _cache[key] = (storage, q, scale)
    if len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return q, scale


@functools.cache
def _compiled_quantize():
    # One fused kernel per (layout, dtype) instead of five passes (abs, amax, upcast, divide, cast) and a transpose
    # copy over a bf16 tensor: the quantisation is memory-bound and, unfused, cost more than the FP8 matmul saves.
    return torch.compile(quantize_rowwise, dynamic=True)


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
    if out_dtype == torch.bfloat16 and _scaled_mm_ok(a) and a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0:
        quantize = _compiled_quantize()
        qa, sa = _quantized(a, a_dtype, quantize)
        qb, sb = _quantized(b, b_dtype, quantize)
        # the second operand must be column-major: qb is (N, K) row-major, so qb.t() is (K, N) column-major
        return torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb.t(), out_dtype=out_dtype)
    qa, sa = _quantized(a, a_dtype, quantize_rowwise)
    qb, sb = _quantized(b, b_dtype, quantize_rowwise)
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
