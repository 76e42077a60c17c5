"""SwiGLU: `silu(gate) * up`, forward and backward in one elementwise pass each, and an MLP module."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cai.kernels._dispatch import use_triton
from cai.kernels._tune import pick

# (elements per program, num_warps); the first is the static choice, the rest are timed once per shape on CUDA.
_CANDIDATES = [(4096, 8), (1024, 4), (2048, 4), (2048, 8), (4096, 4), (8192, 8), (8192, 16)]


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        import triton

        from cai.kernels._swiglu_triton import swiglu_fwd_kernel as fwd

        a, b = gate.contiguous(), up.contiguous()
        c = torch.empty_like(a)
        n = a.numel()

        def run(cfg):
            fwd[(triton.cdiv(n, cfg[0]),)](a, b, c, n, BLOCK=cfg[0], num_warps=cfg[1])

        run(pick(("swiglu_fwd", a.dtype, n >= 2**20), lambda: _CANDIDATES, run, a.device))
        ctx.save_for_backward(a, b)
        return c

    @staticmethod
    def backward(ctx, dc):
        import triton

        from cai.kernels._swiglu_triton import swiglu_bwd_kernel as bwd

        a, b = ctx.saved_tensors
        dc = dc.contiguous()
        da, db = torch.empty_like(a), torch.empty_like(b)
        n = a.numel()

        def run(cfg):
            bwd[(triton.cdiv(n, cfg[0]),)](a, b, dc, da, db, n, BLOCK=cfg[0], num_warps=cfg[1])

        run(pick(("swiglu_bwd", a.dtype, dc.dtype, n >= 2**20), lambda: _CANDIDATES, run, a.device))
        return da, db


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
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
