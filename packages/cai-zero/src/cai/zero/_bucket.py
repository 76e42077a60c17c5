"""Flat buckets: parameters as views into one padded buffer, each rank owning an even flat slice.

[Note: bucket layout]
A bucket is a contiguous flat buffer holding several parameters of one optimizer param group and one dtype,
back to back, followed by zeros so that its length is ``shard * world_size``. Rank r owns elements
``[r * shard, (r + 1) * shard)``: its fp32 master shard, optimizer state and (stage 2) gradient shard cover exactly
that range. A parameter may straddle several ranks' ranges; its piece on rank r is the intersection, which is
what ``ShardSpec(flat_range=...)`` describes (``cai.mesh.flat_pieces``). Padding lives only at the bucket's end, is always zero in the
working buffer and gradients, and therefore stays zero in every elementwise optimizer's state: it never leaks out.
Stage 0 plans every bucket as if the group had one rank (``world_size=1``: ``lo = 0``, ``hi = padded``), so each
rank's master, state and gradient shard is the whole bucket, the same on every rank (``replicated``).
A parameter named in ``alone`` (a ``shared`` parameter) gets a bucket of its own: its shard then depends only on its
own size and the group size, so two ranks holding copies of it in different models own the same range of it.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class Slot:
    """One parameter's place in its bucket."""

    name: str
    param: torch.nn.Parameter
    offset: int  # first element inside the bucket's flat buffer
    numel: int
    shape: tuple[int, ...]


@dataclass(eq=False)
class Bucket:
    """A flat bucket of parameters and the per-step bookkeeping of its gradient reduction."""

    index: int
    group_index: int
    dtype: torch.dtype
    slots: list[Slot]
    numel: int  # unpadded
    shard: int  # elements per rank
    world_size: int
    rank: int
    replicated: bool = False  # stage 0: every rank of the group holds the whole bucket (world_size is 1)
    comm: int = 0  # which of the optimizer's reduction groups this bucket is reduced and sharded over
    working: torch.Tensor | None = None  # (shard * world_size,) working dtype; params are views of it
    master: torch.Tensor | None = None  # (shard,) fp32, on the host with cpu_offload
    grad: torch.Tensor | None = None  # (shard * world_size,) comm dtype, alive while gradients accumulate
    # slots whose range of ``grad`` holds no gradient yet (copied into, not added to; zeroed if none comes)
    unwritten: set[int] = field(default_factory=set)
    # this rank's reduced gradient: fp32 next to the master shard, or the host landing buffer with cpu_offload
    # (any dtype; which is why it is not stored as master.grad, whose dtype torch ties to the master's)
    grad_shard: torch.Tensor | None = None
    received: int = 0  # gradients received in the current backward
    reduced_in_window: int = 0  # reductions since the last step()/zero_grad()
    gather_work: list = field(default_factory=list)  # async all-gather handles (overlap_allgather)

    @property
    def padded(self) -> int:
        return self.shard * self.world_size

    @property
    def lo(self) -> int:
        return self.rank * self.shard

    @property
    def hi(self) -> int:
        return self.lo + self.shard


def plan_buckets(
    groups: list[list[tuple[str, torch.nn.Parameter]]],
    *,
    bucket_numel,
    world_size: int,
    rank: int,
    replicated: bool = False,
    alone: Collection[str] = (),
    comm: Mapping[str, tuple[int, int, int]] | None = None,
) -> list[Bucket]:
    """Split trainable parameters into buckets in reverse order (the order backward produces gradients).

    ``bucket_numel(dtype)`` gives the target size; a parameter larger than it, or named in ``alone``, gets a
    bucket of its own. Buckets never mix param groups or dtypes, so each master shard has one set of
    hyperparameters. ``replicated``: stage 0 (pass ``world_size=1, rank=0``; see [Note: bucket layout]).
    ``comm`` maps the names of parameters reduced over another group to ``(group index, its size, this rank in
    it)``; buckets never mix groups either.
    """
    comm = comm or {}
    default = (0, world_size, rank)
    order: list[tuple[int, str, torch.nn.Parameter]] = [
        (g, name, p) for g, named in enumerate(groups) for name, p in named
    ]
    buckets: list[Bucket] = []
    current: list[tuple[int, str, torch.nn.Parameter]] = []

    def close() -> None:
        if not current:
            return
        slots, offset = [], 0
        for _, name, p in current:
            slots.append(Slot(name=name, param=p, offset=offset, numel=p.numel(), shape=tuple(p.shape)))
            offset += p.numel()
        g, name0, p0 = current[0]
        index, size, where = comm.get(name0, default)
        shard = max(1, math.ceil(offset / size))
        buckets.append(
            Bucket(
                index=len(buckets),
                group_index=g,
                dtype=p0.dtype,
                slots=slots,
                numel=offset,
                shard=shard,
                world_size=size,
                rank=where,
                replicated=replicated,
                comm=index,
            )
        )
        current.clear()

    size = 0
    for g, name, p in reversed(order):
        if current and (
            current[-1][0] != g
            or current[-1][2].dtype != p.dtype
            or size + p.numel() > bucket_numel(p.dtype)
            or name in alone
            or current[-1][1] in alone
            or comm.get(name, default)[0] != comm.get(current[-1][1], default)[0]
        ):
            close()
            size = 0
        current.append((g, name, p))
        size += p.numel()
    close()
    return buckets
