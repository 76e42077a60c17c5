"""RMSNorm and LayerNorm with an optional fused residual add: functions and modules."""

from __future__ import annotations

import torch
from torch import nn

from cai.kernels._dispatch import use_triton

MAX_N = 65536  # widest row the kernels keep in registers; wider rows take the torch path


class _NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, is_rms, return_input):
        from cai.kernels import _norm_triton as kt

        shape = x.shape
        n = shape[-1]
        x2d = x.reshape(-1, n)
        if x2d.stride(-1) != 1:
            x2d = x2d.contiguous()
        r2d = None
        if residual is not None:
            r2d = residual.reshape(-1, n)
            if r2d.stride(-1) != 1:
                r2d = r2d.contiguous()
        out_dtype = torch.promote_types(x.dtype, weight.dtype)
        y, res_out, mean, rstd = kt.norm_fwd(x2d, r2d, weight, bias, eps, is_rms, out_dtype)
        saved_x = res_out if res_out is not None else x2d
        ctx.save_for_backward(saved_x, weight, bias, mean, rstd)
        ctx.is_rms = is_rms
        ctx.has_res = residual is not None
        ctx.shape = shape
        ctx.x_dtype = x.dtype
        ctx.set_materialize_grads(False)  # an unused residual output then costs no zero-filled gradient
        if return_input:  # x itself; its gradient arrives as dres and is added inside the backward kernel
            return y.view(shape), x
        if residual is None:
            return y.view(shape)
        return y.view(shape), res_out.view(shape)

    @staticmethod
    def backward(ctx, dy, dres=None):
        from cai.kernels import _norm_triton as kt

        x2d, weight, bias, mean, rstd = ctx.saved_tensors
        n = ctx.shape[-1]
        if dy is None:  # only the residual output was used
            dy = torch.zeros(
                ctx.shape, dtype=torch.promote_types(ctx.x_dtype, weight.dtype), device=x2d.device
            )
        dy2d = dy.reshape(-1, n)
        if dy2d.stride(-1) != 1:
            dy2d = dy2d.contiguous()
        dres2d = None
        if dres is not None:
            dres2d = dres.reshape(-1, n)
            if dres2d.stride(-1) != 1:
                dres2d = dres2d.contiguous()
        dx, dw, db = kt.norm_bwd(x2d, weight, bias, dy2d, dres2d, mean, rstd, ctx.is_rms, ctx.x_dtype)
        dx = dx.view(ctx.shape)
        dw = dw.to(weight.dtype)
        db = db.to(bias.dtype) if db is not None else None
        return dx, (dx if ctx.has_res else None), dw, db, None, None, None


def _torch_norm(x, residual, weight, bias, eps, is_rms, return_input=False):
    # Same numerics as the kernel: the residual sum is rounded to the input dtype, statistics in fp32.
    x_in = x
    if residual is not None:
        x = x + residual
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    if is_rms:
        xc = xf
    else:
        xc = xf - xf.mean(-1, keepdim=True)
    y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps) * weight.to(xf.dtype)
    if bias is not None:
        y = y + bias.to(xf.dtype)
    y = y.to(torch.promote_types(x.dtype, weight.dtype))
    if return_input:
        return y, x_in
    return y if residual is None else (y, x)


def _check(x, weight, residual, bias, return_input):
    n = x.shape[-1]
    if return_input and residual is not None:
        raise ValueError("return_input=True takes no residual (the input is then the residual stream itself)")
    if weight.shape != (n,):
        raise ValueError(
            f"weight has shape {tuple(weight.shape)}; expected ({n},) for input {tuple(x.shape)}"
        )
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}; expected ({n},)")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)}; it must equal x's {tuple(x.shape)}")


def _norm(x, residual, weight, bias, eps, is_rms, return_input=False):
    _check(x, weight, residual, bias, return_input)
    if x.numel() > 0 and x.shape[-1] <= MAX_N and use_triton(x):
        return _NormFunction.apply(x, residual, weight, bias, float(eps), is_rms, return_input)
    return _torch_norm(x, residual, weight, bias, eps, is_rms, return_input)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    *,
    return_input: bool = False,
):
    """RMSNorm over the last dim: `x * rsqrt(mean(x**2) + eps) * weight`, statistics in fp32.

    Args:
        x: `(..., N)` in fp32, bf16 or fp16.
        weight: `(N,)`.
        eps: added to the mean square. Default 1e-6 (Llama).
        residual: optional tensor shaped like `x`; when given, the kernel computes `s = x + residual` (rounded to
            x's dtype, as an unfused add would) and returns `(rms_norm(s), s)` so that the next block's residual
            stream never takes an extra pass over memory.
        return_input: return `(y, x)`, for a residual branch that goes on with `x`: the gradient reaching that `x`
            is added to the norm's input gradient inside the backward kernel, where autograd would add the two in
            a pass of its own. No residual with it.

    Returns:
        `y` (dtype `promote(x.dtype, weight.dtype)`, as Hugging Face's LlamaRMSNorm), or `(y, s)` with a residual,
        or `(y, x)` with `return_input`.

    Example:
        >>> y, h = rms_norm(attn_out, ln.weight, 1e-5, residual=h)
    """
    return _norm(x, residual, weight, None, eps, True, return_input)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
):
    """LayerNorm over the last dim with fp32 statistics; `residual` as in :func:`rms_norm`."""
    return _norm(x, residual, weight, bias, eps, False)


class RMSNorm(nn.Module):
    """RMSNorm module; a drop-in replacement for Hugging Face's `LlamaRMSNorm` (same `weight` and
    `variance_epsilon` attributes, so state dicts load unchanged).

    `forward(x)` returns `y`; `forward(x, residual)` returns `(y, x + residual)`; `forward(x, return_input=True)`
    returns `(y, x)` (see :func:`rms_norm`).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, *, return_input: bool = False):
        return rms_norm(x, self.weight, self.variance_epsilon, residual, return_input=return_input)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class LayerNorm(nn.Module):
    """LayerNorm over the last dim (parameters named `weight` and `bias` as in `torch.nn.LayerNorm`)."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-5, *, bias: bool = True, device=None, dtype=None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype)) if bias else None
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return layer_norm(x, self.weight, self.bias, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, bias={self.bias is not None}"
