"""Gradient clipping by the global norm of a model spread over pipeline, tensor and data-parallel ranks.

[Note: counting each gradient once]
The global norm is the norm of the gradient of the one-process model. A rank cannot tell from its parameters alone
which of them other ranks hold too: a tensor-parallel replicated weight (a norm, a replicated kv head) is on every tp
rank, a data-parallel replica on every dp rank, and the last stage's copy of a tied embedding on another stage. The
model's state protocol already names every piece it holds under the full model's name with its block of the global
tensor (``sharded_state_dict``; tied copies left out), so each distinct (name, block) is one piece of the global
gradient: the ranks exchange these keys once (cached on the model; the layout does not change between steps), the
lowest rank holding a key counts it, and one all-reduce of the partial sums over the group gives the norm. Gradients
of data-parallel replicas must already be reduced (equal), as before any optimizer step.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["clip_grad_norm_"]


def _grad_view(p: nn.Parameter, view: torch.Tensor) -> torch.Tensor:
    """The part of ``p.grad`` at the position of ``view`` (a view into ``p``'s storage)."""
    g = p.grad
    if view.data_ptr() == p.data_ptr() and view.shape == p.shape:
        return g
    if g.stride() != p.stride():
        raise RuntimeError(
            f"clip_grad_norm_: a gradient of shape {tuple(g.shape)} has strides {g.stride()} but its parameter "
            f"{p.stride()}; the block of it named in the state dict cannot be located"
        )
    offset = view.storage_offset() - p.storage_offset()
    return g.as_strided(view.shape, view.stride(), g.storage_offset() + offset)


def _owner(params: list[nn.Parameter], view: torch.Tensor) -> nn.Parameter | None:
    """The parameter whose memory holds ``view`` (parameters may share one storage, e.g. a flat buffer)."""
    ptr = view.data_ptr()
    for p in params:
        same = p.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()
        if same and p.data_ptr() <= ptr < p.data_ptr() + p.numel() * p.element_size():
            return p
    return None


def _pieces(model: nn.Module, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """The gradient pieces this rank counts (see [Note: counting each gradient once])."""
    if not hasattr(model, "sharded_state_dict"):
        raise TypeError(
            f"clip_grad_norm_: {type(model).__name__} has no sharded_state_dict(); pass the PipelineModel from "
            "build_stages (or a module with the state protocol)"
        )
    params = list(model.parameters())
    entries = []
    for name, value in sorted(model.sharded_state_dict().items()):
        # A fused projection reports several pieces of one tensor (a list); each is counted on its own.
        for tensor, spec in value if isinstance(value, list) else [value]:
            p = _owner(params, tensor)
            if p is not None:  # a buffer is no parameter
                entries.append(((name, spec.offsets, spec.block_shape, spec.flat_range), p, tensor))
    keys = [k for k, _, _ in entries]
    cached = getattr(model, "_cai_clip_owned", None)
    if cached is None or cached[0] != keys:
        owned = [True] * len(keys)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            everyone: list[list] = [None] * dist.get_world_size(group)  # type: ignore[list-item]
            dist.all_gather_object(everyone, keys, group=group)
            me = dist.get_rank(group)
            earlier = {k for r in range(me) for k in everyone[r]}
            owned = [k not in earlier for k in keys]
        cached = (keys, owned)
        model._cai_clip_owned = cached
    return [
        _grad_view(p, t)
        for (_, p, t), own in zip(entries, cached[1], strict=True)
        if own and p.grad is not None
    ]


def clip_grad_norm_(
    model: nn.Module, max_norm: float, norm_type: float = 2.0, *, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Scale every gradient of ``model`` so that the global norm over all ranks of ``group`` is at most ``max_norm``.

    The norm is that of the one-process model's gradient: each tensor-parallel block, data-parallel replica and tied
    embedding copy counted once (see [Note: counting each gradient once]). Call it on every rank of ``group``
    (default: the world, which spans pp x dp x tp), after ``model.sync_shared_params()`` and the data-parallel
    reduction, before ``optimizer.step()``. For gradients sharded over dp (cai-zero), clip with the optimizer's
    ``clip_grad_norm`` instead. Returns the norm before clipping (fp32, the same on every rank).

    Example::

        schedule.forward_backward_step(model, data, criterion, optimizer)
        model.sync_shared_params()
        clip_grad_norm_(model, 1.0)
        optimizer.step()
    """
    if not max_norm > 0:
        raise ValueError(f"clip_grad_norm_: max_norm={max_norm!r} must be > 0")
    if not (norm_type == math.inf or norm_type > 0):
        raise ValueError(f"clip_grad_norm_: norm_type={norm_type!r} must be > 0 or math.inf")
    pieces = _pieces(model, group)
    device = next(model.parameters()).device
    if norm_type == math.inf:
        total = torch.zeros((), dtype=torch.float32, device=device)
        for g in pieces:
            total = torch.maximum(total, g.detach().abs().max().float())
        op = dist.ReduceOp.MAX
    else:
        total = torch.zeros((), dtype=torch.float32, device=device)
        for g in pieces:
            total += torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32) ** norm_type
        op = dist.ReduceOp.SUM
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(total, op=op, group=group)
    norm = total if norm_type == math.inf else total ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.dtype))
    return norm
