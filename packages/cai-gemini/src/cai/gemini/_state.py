"""Layout-independent state: each rank's pieces of every parameter, described with ShardSpec."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from cai.gemini._chunk import Chunk, TensorInfo
from cai.mesh import ShardSpec, all_gather_into_tensor

__all__ = ["Piece", "gather_full", "iter_pieces"]


@dataclass(frozen=True)
class Piece:
    """The part of tensor ``info`` that lies in this rank's shard of ``chunk``: shard elements ``[lo, hi)``."""

    chunk: Chunk
    info: TensorInfo
    lo: int
    hi: int
    spec: ShardSpec


def iter_pieces(chunks: list[Chunk]) -> Iterator[Piece]:
    """Every (parameter, this rank) intersection, in chunk order; parameters outside the shard give nothing."""
    for c in chunks:
        s0, s1 = c.shard_range
        for t in c.tensors:
            a, b = max(t.offset, s0), min(t.end, s1)
            if a >= b:
                continue
            spec = ShardSpec(global_shape=tuple(t.shape), flat_range=(a - t.offset, b - t.offset))
            yield Piece(chunk=c, info=t, lo=a - s0, hi=b - s0, spec=spec)


def source_shard(c: Chunk) -> torch.Tensor:
    """The shard that is the source of truth: fp32 master weights when the chunk has them."""
    t = c.master if c.master is not None else c.shard
    assert t is not None
    return t


def gather_full(c: Chunk, local: torch.Tensor) -> torch.Tensor:
    """All-gather one shard-shaped tensor of ``c`` into a full chunk-sized tensor on the host (one collective)."""
    if c.world_size == 1:
        return local.detach().to("cpu", copy=True)
    src = local.detach().to(c.device)
    full = torch.empty(c.chunk_size, dtype=src.dtype, device=c.device)
    all_gather_into_tensor(full, src, group=c.group)
    return full.cpu()
