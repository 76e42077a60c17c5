"""Chunk-size search: the size that wastes the least memory when parameters are packed in order."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ChunkSearchResult", "pack", "search_chunk_size"]

_M = 1024**2


@dataclass(frozen=True, kw_only=True)
class ChunkSearchResult:
    """The chosen chunk size and what it costs.

    ``waste`` counts the unused elements of every chunk (including the last one and the padding that makes the size
    divisible by the world size); ``keep_gathered`` is True when the whole group is smaller than the minimum chunk
    size and becomes one chunk that is never sharded.
    """

    chunk_size: int
    waste: int
    total: int
    num_chunks: int
    keep_gathered: bool = False

    @property
    def waste_frac(self) -> float:
        return self.waste / max(1, self.total + self.waste)

    def __str__(self) -> str:
        return (
            f"chunk_size={self.chunk_size} elements, {self.num_chunks} chunks, waste {self.waste} elements "
            f"({100 * self.waste_frac:.2f}%)" + (", kept gathered" if self.keep_gathered else "")
        )


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def pack(numels: Sequence[int], chunk_size: int) -> list[list[int]]:
    """Greedy packing in order: indices of the parameters in each chunk.

    A parameter starts a new chunk when it does not fit in the current one; a parameter larger than ``chunk_size``
    gets a chunk of its own (sized to it).
    """
    chunks: list[list[int]] = []
    used = chunk_size  # forces a new chunk for the first parameter
    for i, n in enumerate(numels):
        if n > chunk_size:
            chunks.append([i])
            used = chunk_size
            continue
        if used + n > chunk_size:
            chunks.append([])
            used = 0
        chunks[-1].append(i)
        used += n
    return chunks


def _waste(numels: Sequence[int], chunk_size: int, world_size: int) -> tuple[int, int]:
    waste = 0
    groups = pack(numels, chunk_size)
    for idx in groups:
        used = sum(numels[i] for i in idx)
        size = _round_up(max(chunk_size, used), world_size)
        waste += size - used
    return waste, len(groups)


def _filter_exlarge(numels: Sequence[int]) -> list[int]:
    if len(numels) < 2:
        return list(numels)
    mean, std = statistics.fmean(numels), statistics.pstdev(numels)
    return [n for n in numels if n <= mean + 3 * std]


def search_chunk_size(
    numels: Sequence[int],
    *,
    search_range_m: float = 32.0,
    search_interval: int = 1024,
    min_chunk_size_m: float = 32.0,
    filter_exlarge_params: bool = True,
    world_size: int = 1,
) -> ChunkSearchResult:
    """Pick the chunk size that wastes the fewest elements for parameters of ``numels`` packed in this order.

    Args:
        numels: element counts in packing (registration) order.
        search_range_m: sizes from the start point up to ``start + search_range_m * 2**20`` are tried.
        search_interval: step between tried sizes (use the hidden size: parameters are multiples of it).
        min_chunk_size_m: no chunk is smaller than this many million (2**20) elements; a group whose total is
            smaller becomes a single kept-gathered chunk.
        filter_exlarge_params: leave parameters above mean + 3 std out of the start point (they get own chunks).
        world_size: the result is a multiple of it, so that every rank owns an equal contiguous piece.

    Example::

        >>> search_chunk_size([1024] * 8, search_range_m=0, search_interval=1024, min_chunk_size_m=0).chunk_size
        1024
    """
    if search_interval <= 0 or world_size <= 0:
        raise ValueError(
            f"search_chunk_size: search_interval={search_interval}, world_size={world_size} must be > 0"
        )
    numels = [int(n) for n in numels]
    total = sum(numels)
    min_chunk = int(min_chunk_size_m * _M)
    if total == 0:
        return ChunkSearchResult(
            chunk_size=world_size, waste=world_size, total=0, num_chunks=0, keep_gathered=True
        )
    if total < min_chunk:
        size = _round_up(total, world_size)
        return ChunkSearchResult(
            chunk_size=size, waste=size - total, total=total, num_chunks=1, keep_gathered=True
        )
    considered = _filter_exlarge(numels) if filter_exlarge_params else numels
    start = _round_up(max(min_chunk, max(considered)), search_interval)
    stop = start + int(search_range_m * _M)
    best: tuple[int, int, int] | None = None  # (waste, size, chunks)
    for size in range(start, stop + 1, search_interval):
        size_w = _round_up(size, world_size)
        waste, count = _waste(numels, size_w, world_size)
        if best is None or waste < best[0]:
            best = (waste, size_w, count)
    assert best is not None
    return ChunkSearchResult(chunk_size=best[1], waste=best[0], total=total, num_chunks=best[2])


def default_interval(hidden_dim: int | None, search_interval: int | None) -> int:
    """The search step: an explicit interval, else the hidden size, else 1024."""
    return int(search_interval or hidden_dim or 1024)
