"""Projections that read the same input merged into one matmul for serving: q, k and v, and an MLP's gate and up.

[Note: fused projections]
A decode step reads every weight once for a handful of tokens, so a projection's time is its weight bytes over
the memory bandwidth a matmul reaches, and small matmuls reach less of it: the k and v projections of a
grouped-query model (1,024 x 4,096 on Llama-3-8B) ran at 1.6 TB/s against 3.6 TB/s for the larger ones. One matmul
over the concatenated weights reads the same bytes at the larger rate and launches one kernel instead of three.

The attention modules of Hugging Face's decoders call ``q_proj``, ``k_proj`` and ``v_proj`` on the same hidden
states, in that order, and no forward is copied here: the module left in ``q_proj``'s place runs the merged matmul
and keeps its output, and the ones in ``k_proj``'s and ``v_proj``'s places return their slices of it when called
on that same tensor (the last one lets it go). Called on anything else, or in another order, each computes its own
slice of the merged weight, so the result is the same either way. An MLP of SiLU-gated shape (``gate_proj``,
``up_proj``, ``down_proj``) becomes one module whose ``gate_up`` matmul feeds ``cai.kernels.swiglu_packed``.

At batch 1 the merged matmuls, the MLP's down projection, the attention's ``o_proj`` and the model's output
projection run through ``cai.kernels.gemv`` ([Note: decode GEMV]), which reaches more of the bandwidth than cuBLAS
does at one row; more rows take the same matmuls as before.

The merged weights replace the originals (the model's parameter names change); tensor-parallel engines keep the
sharded projections as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cai.kernels import gemv, is_swiglu_mlp, swiglu_packed

__all__ = ["fuse_projections"]


def _merge(linears: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the outputs of ``linears`` side by side."""
    first = linears[0]
    merged = nn.Linear(
        first.in_features,
        sum(m.out_features for m in linears),
        bias=first.bias is not None,
        device=first.weight.device,
        dtype=first.weight.dtype,
    )
    with torch.no_grad():
        merged.weight.copy_(torch.cat([m.weight for m in linears]))
        if first.bias is not None:
            merged.bias.copy_(torch.cat([m.bias for m in linears]))
    return merged.requires_grad_(False)


class _MergedQKV(nn.Module):
    """The merged q/k/v matmul and the last input it ran on, shared by the three slices."""

    def __init__(self, q: nn.Linear, k: nn.Linear, v: nn.Linear) -> None:
        super().__init__()
        self.qkv = _merge([q, k, v])
        q_end = q.out_features
        self.bounds = (
            (0, q_end),
            (q_end, q_end + k.out_features),
            (q_end + k.out_features, self.qkv.out_features),
        )
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None


class _Slice(nn.Module):
    """One of q (``part`` 0), k (1) or v (2) of a ``_MergedQKV`` (see [Note: fused projections])."""

    def __init__(self, merged: _MergedQKV, part: int) -> None:
        super().__init__()
        # the slices share the merged module; only the q slice registers it, so its weight appears once
        self._merged = [merged]
        if part == 0:
            self.merged = merged
        self.part = part
        self.lo, self.hi = merged.bounds[part]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self._merged[0]
        if self.part == 0:
            y = gemv(x, m.qkv.weight, m.qkv.bias)
            m.last = (x, y)
            return y[..., self.lo : self.hi]
        last, m.last = m.last, (m.last if self.part == 1 else None)
        if last is not None and last[0] is x:
            return last[1][..., self.lo : self.hi]
        m.last = None
        return self._own(x)

    def _own(self, x: torch.Tensor) -> torch.Tensor:
        """This slice's rows of the merged weight applied to ``x``."""
        qkv = self._merged[0].qkv
        bias = None if qkv.bias is None else qkv.bias[self.lo : self.hi]
        return F.linear(x, qkv.weight[self.lo : self.hi], bias)


class FusedSwiGLUMLP(nn.Module):
    """``down_proj(silu(gate) * up)`` with ``[gate | up] = gate_up(x)`` in one matmul."""

    def __init__(self, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear) -> None:
        super().__init__()
        self.gate_up = _merge([gate_proj, up_proj])
        self.down_proj = down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = swiglu_packed(gemv(x, self.gate_up.weight, self.gate_up.bias))
        return gemv(act, self.down_proj.weight, self.down_proj.bias)


class _GemvLinear(nn.Linear):
    """A Linear whose single-row calls take ``cai.kernels.gemv`` (same parameters, same names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemv(x, self.weight, self.bias)


def _linears(mod: nn.Module, names: tuple[str, ...]) -> list[nn.Linear] | None:
    """The ``names`` children of ``mod`` if they are plain Linear layers that can be merged: same input size, dtype,
    device and bias presence."""
    subs = [getattr(mod, n, None) for n in names]
    if not all(type(s) is nn.Linear for s in subs):
        return None
    first = subs[0]
    same = all(
        s.in_features == first.in_features
        and s.weight.dtype == first.weight.dtype
        and s.weight.device == first.weight.device
        and (s.bias is None) == (first.bias is None)
        for s in subs
    )
    return subs if same else None


def fuse_projections(model: nn.Module) -> tuple[int, int]:
    """Merge q/k/v projections and SiLU-gated MLPs' gate/up projections of ``model`` in place, and give the
    attention's and the model's output projections the single-row kernel (see [Note: fused projections]); returns
    (attention modules, MLPs) merged."""
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(out) is nn.Linear:
        out.__class__ = _GemvLinear
    attentions = mlps = 0
    for name, mod in list(model.named_modules()):
        qkv = _linears(mod, ("q_proj", "k_proj", "v_proj"))
        if qkv is not None:
            merged = _MergedQKV(*qkv)
            for part, attr in enumerate(("q_proj", "k_proj", "v_proj")):
                setattr(mod, attr, _Slice(merged, part))
            if type(getattr(mod, "o_proj", None)) is nn.Linear:
                mod.o_proj.__class__ = _GemvLinear
            attentions += 1
        gate_up = _linears(mod, ("gate_proj", "up_proj"))
        silu = is_swiglu_mlp(mod)
        if name and gate_up is not None and silu and type(getattr(mod, "down_proj", None)) is nn.Linear:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, FusedSwiGLUMLP(*gate_up, mod.down_proj))
            mlps += 1
    return attentions, mlps
