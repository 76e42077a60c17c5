"""Autograd collectives of the tensor- and sequence-parallel regions: one Function per collective, then the
functional ops that layers call.

[Note: tp regions]
A column-parallel layer needs its input replicated on every tp rank and produces a slice of the output
features; a row-parallel layer takes such a slice and produces a partial sum. The four region ops move
activations in and out of that state, and each one's backward is the forward of its mirror:

    copy_to_tp_region       forward identity          backward all-reduce   (the input's gradient is partial)
    reduce_from_tp_region   forward all-reduce        backward identity
    gather_from_tp_region   forward all-gather dim -1 backward keep this rank's slice
    scatter_to_tp_region    forward keep the slice    backward all-gather dim -1

Megatron sequence parallelism replaces the first two, outside the tp region activations are split along the
sequence dim instead of replicated:

    gather_seq   forward all-gather along dim   backward reduce-scatter along dim
    reduce_scatter_seq   forward reduce-scatter along dim   backward all-gather along dim

and at the ends of the sequence-split part of a model (see `_sequence`), where the activations are the same on
every rank of the group (the embedding output, the final hidden states):

    split_forward_gather_backward   forward keep this rank's slice of dim   backward all-gather along dim
    gather_forward_split_backward   forward all-gather along dim   backward keep this rank's slice

Every collective is issued through `torch.distributed` module attributes (or cai-mesh's flat wrappers, which
do the same) so `cai.mesh.testing.CollectiveCounter` sees it. With a group of one rank every op is the
identity and issues nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cai.mesh import all_gather_into_tensor, reduce_scatter_tensor

__all__ = [
    "copy_to_tp_region",
    "gather_forward_split_backward",
    "gather_from_tp_region",
    "gather_seq",
    "reduce_from_tp_region",
    "reduce_grad",
    "reduce_scatter_seq",
    "scatter_to_tp_region",
    "split_forward_gather_backward",
]


def _world(group) -> int:
    return dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    out = x.contiguous().clone()  # all_reduce works in place: a copy keeps the caller's tensor intact
    dist.all_reduce(out, group=group)
    return out


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world, rank = _world(group), dist.get_rank(group)
    if x.shape[dim] % world:
        raise ValueError(
            f"cannot split dim {dim} of size {x.shape[dim]} over {world} ranks: it must be divisible by the "
            f"group size (pad the input, or choose a size that divides)"
        )
    return x.chunk(world, dim=dim)[rank].contiguous()


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = _world(group)
    moved = x.movedim(dim, 0).contiguous()  # the flat collective concatenates along dim 0
    out = moved.new_empty((world * moved.shape[0], *moved.shape[1:]))
    all_gather_into_tensor(out, moved, group=group)
    # Contiguous, so a layer that saves the gathered tensor saves this storage (see [Note: the gathered
    # sequence is not saved] in `_sequence`) rather than a copy made by its reshape.
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = _world(group)
    if x.shape[dim] % world:
        raise ValueError(
            f"cannot reduce-scatter dim {dim} of size {x.shape[dim]} over {world} ranks: it must be divisible "
            f"by the group size (pad the sequence to a multiple of {world})"
        )
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // world, *moved.shape[1:]))
    reduce_scatter_tensor(out, moved, group=group)
    return out.movedim(0, dim)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, -1, group)

    @staticmethod
    def backward(ctx, g):
        return _split(g, -1, ctx.group), None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, -1, ctx.group), None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, ctx.dim, ctx.group), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.dim, ctx.group), None, None


class _SplitForwardGatherBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.dim, ctx.group), None, None


class _GatherForwardSplitBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _split(g, ctx.dim, ctx.group), None, None


def _trivial(group) -> bool:
    return group is not None and _world(group) == 1


def copy_to_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward (see [Note: tp regions])."""
    return x if _trivial(group) else _CopyToTP.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce (sum) forward, identity backward."""
    return x if _trivial(group) else _ReduceFromTP.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather along the last dim forward; backward keeps this rank's slice of the gradient."""
    return x if _trivial(group) else _GatherFromTP.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Keep this rank's slice of the last dim forward; all-gather the gradient backward."""
    return x if _trivial(group) else _ScatterToTP.apply(x, group)


def gather_seq(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """All-gather along `dim` (the sequence) forward, reduce-scatter along `dim` backward."""
    return x if _trivial(group) else _GatherSeq.apply(x, dim, group)


def reduce_scatter_seq(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """Reduce-scatter along `dim` (the sequence) forward, all-gather along `dim` backward."""
    return x if _trivial(group) else _ReduceScatterSeq.apply(x, dim, group)


def reduce_grad(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient over `group` backward: for a weight replicated on the
    ranks of `group` whose uses on each rank see only part of the batch's work (replicated kv heads)."""
    return x if group is None or _world(group) == 1 else _CopyToTP.apply(x, group)


def split_forward_gather_backward(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """Keep this rank's slice of `dim` forward; all-gather the gradient along `dim` backward. For an activation
    that is the same on every rank (the embedding output) entering a sequence-split region."""
    return x if _trivial(group) else _SplitForwardGatherBackward.apply(x, dim, group)


def gather_forward_split_backward(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """All-gather along `dim` forward; keep this rank's slice of the gradient backward. For leaving a
    sequence-split region into code that every rank runs on the whole sequence (the loss)."""
    return x if _trivial(group) else _GatherForwardSplitBackward.apply(x, dim, group)
