"""SwiGLU: `silu(gate) * up`, forward and backward in one elementwise pass each, and an MLP module."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cai.kernels._dispatch import use_triton
from cai.kernels._projections import has_hooks
from cai.kernels._tune import pick

# (elements per program, num_warps); the first is the static choice, the rest are timed once per shape on CUDA.
_CANDIDATES = [(4096, 8), (1024, 4), (2048, 4), (2048, 8), (4096, 4), (8192, 8), (8192, 16)]


def _swiglu_fwd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    import triton

    from cai.kernels._swiglu_triton import swiglu_fwd_kernel as fwd

    c = torch.empty_like(a)
    n = a.numel()

    def run(cfg):
        fwd[(triton.cdiv(n, cfg[0]),)](a, b, c, n, BLOCK=cfg[0], num_warps=cfg[1])

    run(pick(("swiglu_fwd", a.dtype, n >= 2**20), lambda: _CANDIDATES, run, a.device))
    return c


def _swiglu_bwd(a: torch.Tensor, b: torch.Tensor, dc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    import triton

    from cai.kernels._swiglu_triton import swiglu_bwd_kernel as bwd

    dc = dc.contiguous()
    da, db = torch.empty_like(a), torch.empty_like(b)
    n = a.numel()

    def run(cfg):
        bwd[(triton.cdiv(n, cfg[0]),)](a, b, dc, da, db, n, BLOCK=cfg[0], num_warps=cfg[1])

    run(pick(("swiglu_bwd", a.dtype, dc.dtype, n >= 2**20), lambda: _CANDIDATES, run, a.device))
    return da, db


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        a, b = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(a, b)
        return _swiglu_fwd(a, b)

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        return _swiglu_bwd(a, b, dc)


class _GateUpFunction(torch.autograd.Function):
    """``swiglu(x @ w_gate.T, x @ w_up.T)`` with one gradient for ``x``: ``dx = dg @ w_gate + du @ w_up``, the second
    product accumulated into the first by the matmul (``addmm_``), where autograd would add the two products in a
    separate pass over a tokens x hidden tensor. Saves what the two linears and the SwiGLU saved: x, g, u."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up):
        x2d = x.reshape(-1, x.shape[-1])
        g, u = x2d @ w_gate.T, x2d @ w_up.T
        ctx.save_for_backward(x2d, w_gate, w_up, g, u)
        ctx.shape = x.shape
        return _swiglu_fwd(g, u).view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, dc):
        x2d, w_gate, w_up, g, u = ctx.saved_tensors
        dg, du = _swiglu_bwd(g, u, dc.reshape(g.shape))
        dx = dw_gate = dw_up = None
        if ctx.needs_input_grad[0]:
            dx = (dg @ w_gate).addmm_(du, w_up).view(ctx.shape)
        if ctx.needs_input_grad[1]:
            dw_gate = dg.T @ x2d
        if ctx.needs_input_grad[2]:
            dw_up = du.T @ x2d
        return dx, dw_gate, dw_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` computed in fp32 and stored in the inputs' dtype.

    Args:
        gate, up: tensors of the same shape and dtype (fp32, bf16 or fp16).

    Returns:
        A tensor shaped like `gate`. The backward recomputes silu from the saved inputs (no extra activation).
    """
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} must match in shape and dtype"
        )
    if gate.numel() > 0 and use_triton(gate):
        return _SwiGLUFunction.apply(gate, up)
    acc = torch.promote_types(gate.dtype, torch.float32)
    return (F.silu(gate.to(acc)) * up.to(acc)).to(gate.dtype)


def swiglu_packed(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of `x = [gate | up]` along the last dimension (one matmul's output for both), without
    splitting `x` into two contiguous tensors first. Inference only: a Triton kernel on CUDA when autograd is off,
    else the torch expression (differentiable).

    Args:
        x: (..., 2 * f), the last dimension contiguous.

    Returns:
        (..., f) in `x`'s dtype.
    """
    f = x.shape[-1] // 2
    if x.shape[-1] != 2 * f:
        raise ValueError(f"swiglu_packed: the last dimension ({x.shape[-1]}) must be even: [gate | up]")
    if x.numel() == 0 or not use_triton(x) or (torch.is_grad_enabled() and x.requires_grad):
        acc = torch.promote_types(x.dtype, torch.float32)
        return (F.silu(x[..., :f].to(acc)) * x[..., f:].to(acc)).to(x.dtype)
    import triton

    from cai.kernels._swiglu_triton import swiglu_packed_fwd_kernel as kernel

    rows = x.reshape(-1, 2 * f) if x.stride(-1) == 1 else x.contiguous().reshape(-1, 2 * f)
    out = torch.empty(rows.shape[0], f, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(f))
    kernel[(rows.shape[0], triton.cdiv(f, block))](
        rows, out, f, rows.stride(0), out.stride(0), BLOCK=block, num_warps=4
    )
    return out.view(*x.shape[:-1], f)


def _plain_linear(m: nn.Module) -> bool:
    """A bias-free ``nn.Linear`` that no module hook (its own or a global one) would see called."""
    return type(m) is nn.Linear and m.bias is None and not has_hooks(m)


class SwiGLUMLP(nn.Module):
    """`down_proj(swiglu(gate_proj(x), up_proj(x)))`, the Llama/Qwen/Mistral MLP.

    Attributes `gate_proj`, `up_proj`, `down_proj` are plain `nn.Linear` modules, so parameter names and state
    dicts match Hugging Face's `LlamaMLP`. Build one around an existing MLP with :meth:`from_mlp` (the
    Linear modules are taken over, not copied).
    """

    def __init__(self, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear) -> None:
        super().__init__()
        self.gate_proj = gate_proj
        self.up_proj = up_proj
        self.down_proj = down_proj

    @classmethod
    def from_mlp(cls, mlp: nn.Module) -> SwiGLUMLP:
        return cls(mlp.gate_proj, mlp.up_proj, mlp.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj, self.up_proj
        # Plain bias-free Linear layers (not FP8, LoRA or tensor-parallel ones) without hooks (Gemini gathers a
        # module's chunk in its forward pre-hook, ZeRO's overlapped all-gather waits in one) on the Triton path: one
        # function for both projections and the SwiGLU (see _GateUpFunction).
        if (
            _plain_linear(gate)
            and _plain_linear(up)
            and x.numel() > 0
            and x.dtype == gate.weight.dtype == up.weight.dtype
            and use_triton(x)  # False while torch.compile traces: Inductor then fuses the torch path
        ):
            return self.down_proj(_GateUpFunction.apply(x, gate.weight, up.weight))
        return self.down_proj(swiglu(gate(x), up(x)))
