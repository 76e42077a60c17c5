"""Layout-independent state: each rank's pieces of every parameter, described with ShardSpec."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from cai.gemini._chunk import Chunk, TensorInfo
from cai.mesh import FlatPiece, all_gather_into_tensor, flat_pieces

__all__ = ["gather_full", "iter_pieces", "source_shard"]


def iter_pieces(chunks: list[Chunk]) -> Iterator[tuple[Chunk, FlatPiece[TensorInfo]]]:
    """Every (parameter, this rank) intersection, in chunk order, with its chunk; ``start:stop`` index the shard."""
    for c in chunks:
        for pc in flat_pieces(c.tensors, *c.shard_range):
            yield c, pc


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
