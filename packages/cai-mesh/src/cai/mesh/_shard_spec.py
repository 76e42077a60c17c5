"""ShardSpec: how a local tensor maps into a global one.

[Note: ShardSpec layout]
A global tensor of ``global_shape`` is cut in two steps, either of which may be absent:

1. a rectangular *block* (tensor parallelism): ``global[offsets[d] : offsets[d] + block_shape[d]]`` for every dim d;
2. a *flat range* of that block (ZeRO / chunks): elements ``[start, stop)`` of the block flattened in row-major
   order, followed by ``padding`` zeros so that every rank of an even split holds the same number of elements.

The local tensor is the block itself (shape ``block_shape``) when there is no flat range, else a 1-D tensor of
``stop - start + padding`` elements. Padding is never part of the global tensor: ``place`` drops it and ``cut``
adds zeros. cai-zero, cai-gemini, cai-shardformer and cai-ckpt all describe their state with this one type, which
is what makes checkpoints loadable under any layout.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import torch

__all__ = ["FlatPiece", "LocalShard", "ShardSpec", "assemble", "flat_pieces"]


def _tuple(x: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in x)


@dataclass(frozen=True, kw_only=True)
class ShardSpec:
    """Where a local tensor lives inside a global tensor (see [Note: ShardSpec layout]).

    Args:
        global_shape: shape of the full logical tensor.
        offsets: start of this rank's block in each dim (default: zeros, the whole tensor).
        block_shape: shape of the block (default: ``global_shape``).
        flat_range: ``(start, stop)`` elements of the flattened block held locally, or None for the whole block.
        padding: zeros after the held elements in the local flat piece (only with ``flat_range``).

    Example::

        spec = ShardSpec.flat_shard((10, 3), rank=1, world_size=4)   # 30 elements, 8 per rank
        local = spec.cut(full)               # full.flatten()[8:16]
        spec.place(local, out)               # writes them back into a (10, 3) tensor
    """

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...] = field(default=None)  # type: ignore[assignment]
    block_shape: tuple[int, ...] = field(default=None)  # type: ignore[assignment]
    flat_range: tuple[int, int] | None = None
    padding: int = 0

    def __post_init__(self) -> None:
        gs = _tuple(self.global_shape)
        offsets = _tuple(self.offsets) if self.offsets is not None else (0,) * len(gs)
        block = (
            _tuple(self.block_shape)
            if self.block_shape is not None
            else tuple(g - o for g, o in zip(gs, offsets))
        )
        object.__setattr__(self, "global_shape", gs)
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "block_shape", block)
        if len(offsets) != len(gs) or len(block) != len(gs):
            raise ValueError(
                f"ShardSpec: global_shape {gs}, offsets {offsets} and block_shape {block} must have the same length"
            )
        for d, (g, o, b) in enumerate(zip(gs, offsets, block)):
            if o < 0 or b < 0 or o + b > g:
                raise ValueError(
                    f"ShardSpec: block [{o}, {o + b}) in dim {d} lies outside global size {g} "
                    f"(global_shape {gs}, offsets {offsets}, block_shape {block})"
                )
        if self.flat_range is not None:
            start, stop = _tuple(self.flat_range)
            object.__setattr__(self, "flat_range", (start, stop))
            if not 0 <= start <= stop <= self.block_numel:
                raise ValueError(
                    f"ShardSpec: flat_range ({start}, {stop}) must satisfy 0 <= start <= stop <= "
                    f"{self.block_numel} (the block's element count)"
                )
        if self.padding < 0 or (self.padding and self.flat_range is None):
            raise ValueError(f"ShardSpec: padding {self.padding} needs a flat_range and must be >= 0")

    # ---- constructors -------------------------------------------------------------------------------------
    @classmethod
    def full(cls, shape: tuple[int, ...] | torch.Size) -> ShardSpec:
        """The whole tensor, unsharded."""
        return cls(global_shape=tuple(shape))

    @classmethod
    def flat_shard(cls, shape: tuple[int, ...] | torch.Size, rank: int, world_size: int) -> ShardSpec:
        """Rank ``rank``'s piece of an even flat split of ``shape`` into ``world_size`` parts (last ones padded)."""
        return cls.full(shape).split_flat(rank, world_size)

    @classmethod
    def block(cls, shape: tuple[int, ...] | torch.Size, *, dim: int, index: int, parts: int) -> ShardSpec:
        """Part ``index`` of ``parts`` equal blocks of ``shape`` along ``dim`` (tensor-parallel style)."""
        shape = _tuple(shape)
        dim = dim % len(shape)
        if shape[dim] % parts:
            raise ValueError(
                f"ShardSpec.block: size {shape[dim]} of dim {dim} of {shape} is not divisible by {parts}"
            )
        if not 0 <= index < parts:
            raise ValueError(f"ShardSpec.block: index {index} must be in [0, {parts})")
        size = shape[dim] // parts
        offsets = tuple(index * size if d == dim else 0 for d in range(len(shape)))
        block = tuple(size if d == dim else s for d, s in enumerate(shape))
        return cls(global_shape=shape, offsets=offsets, block_shape=block)

    def split_flat(self, rank: int, world_size: int) -> ShardSpec:
        """Split this spec's block evenly into ``world_size`` flat pieces and return rank ``rank``'s."""
        if self.flat_range is not None:
            raise ValueError("ShardSpec.split_flat: spec already has a flat_range")
        if not 0 <= rank < world_size:
            raise ValueError(f"ShardSpec.split_flat: rank {rank} must be in [0, {world_size})")
        n = self.block_numel
        per = math.ceil(n / world_size) if n else 0
        start = min(rank * per, n)
        stop = min(start + per, n)
        return ShardSpec(
            global_shape=self.global_shape,
            offsets=self.offsets,
            block_shape=self.block_shape,
            flat_range=(start, stop),
            padding=per - (stop - start),
        )

    # ---- properties ---------------------------------------------------------------------------------------
    @property
    def block_numel(self) -> int:
        return math.prod(self.block_shape)

    @property
    def numel(self) -> int:
        """Elements of the global tensor this piece holds (padding excluded)."""
        if self.flat_range is None:
            return self.block_numel
        return self.flat_range[1] - self.flat_range[0]

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.flat_range is None:
            return self.block_shape
        return (self.numel + self.padding,)

    @property
    def is_full(self) -> bool:
        """True when the local tensor is the whole global tensor, unpadded."""
        return self.block_shape == self.global_shape and (
            self.flat_range is None or (self.flat_range == (0, self.block_numel) and not self.padding)
        )

    def block_slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + b) for o, b in zip(self.offsets, self.block_shape))

    def read_region(self) -> tuple[slice, ...]:
        """The smallest slab of the global tensor (block narrowed to the rows it covers) that ``cut`` needs.

        Readers that slice files (safetensors) read only this region and pass it to ``cut_region``.
        """
        slices = list(self.block_slices())
        if self.flat_range is not None and self.block_shape:
            r0, r1 = self._covering_rows()
            o = self.offsets[0]
            slices[0] = slice(o + r0, o + r1)
        return tuple(slices)

    def _covering_rows(self) -> tuple[int, int]:
        row = math.prod(self.block_shape[1:])
        start, stop = self.flat_range  # type: ignore[misc]
        if row == 0 or start == stop:
            return 0, 0
        return start // row, -(-stop // row)

    # ---- moving data --------------------------------------------------------------------------------------
    def cut(self, global_tensor: torch.Tensor) -> torch.Tensor:
        """This rank's local piece of ``global_tensor`` (a view where possible; padding filled with zeros)."""
        self._check_global(global_tensor)
        return self.cut_region(global_tensor[self.read_region()])

    def cut_region(self, region: torch.Tensor) -> torch.Tensor:
        """Like ``cut``, from the slab returned by ``global_tensor[spec.read_region()]``."""
        if self.flat_range is None:
            return region
        r0 = self._covering_rows()[0] if self.block_shape else 0
        base = r0 * math.prod(self.block_shape[1:])
        start, stop = self.flat_range
        flat = region.reshape(-1)[start - base : stop - base]
        if self.padding:
            flat = torch.cat([flat, flat.new_zeros(self.padding)])
        return flat

    def place(self, local: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        """Write ``local`` (padding dropped) into its place in the global tensor ``into``; returns ``into``."""
        self._check_global(into)
        if tuple(local.shape) != self.local_shape:
            raise ValueError(
                f"ShardSpec.place: local shape {tuple(local.shape)} != expected {self.local_shape}"
            )
        block = into[self.block_slices()]
        if self.flat_range is None:
            block.copy_(local)
            return into
        start, stop = self.flat_range
        data = local[: stop - start]
        if block.is_contiguous():
            block.view(-1)[start:stop].copy_(data)
        else:
            flat = block.reshape(-1).clone()
            flat[start:stop] = data
            block.copy_(flat.view(self.block_shape))
        return into

    def _check_global(self, t: torch.Tensor) -> None:
        if tuple(t.shape) != self.global_shape:
            raise ValueError(
                f"ShardSpec: tensor of shape {tuple(t.shape)} is not the global shape {self.global_shape}"
            )

    # ---- serialisation ------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "global_shape": list(self.global_shape),
            "offsets": list(self.offsets),
            "block_shape": list(self.block_shape),
            "flat_range": list(self.flat_range) if self.flat_range is not None else None,
            "padding": self.padding,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShardSpec:
        return cls(
            global_shape=d["global_shape"],
            offsets=d["offsets"],
            block_shape=d["block_shape"],
            flat_range=d.get("flat_range"),
            padding=d.get("padding", 0),
        )


class LocalShard(NamedTuple):
    """A rank's piece of a named global tensor: the local tensor and where it lives."""

    tensor: torch.Tensor
    spec: ShardSpec


class _FlatEntry(Protocol):
    offset: int  # first element inside the flat buffer
    numel: int

    @property
    def shape(self) -> Any: ...


_E = TypeVar("_E", bound=_FlatEntry)


class FlatPiece(NamedTuple, Generic[_E]):
    """The part of ``entry`` that lies in a window ``[lo, hi)`` of a flat buffer: window elements
    ``[start, stop)`` (relative to the window), which are elements ``spec.flat_range`` of the tensor."""

    entry: _E
    start: int
    stop: int
    spec: ShardSpec


def flat_pieces(entries: Iterable[_E], lo: int, hi: int) -> Iterator[FlatPiece[_E]]:
    """The pieces of tensors laid out back to back in a flat buffer that fall in its window ``[lo, hi)``.

    ``entries`` have ``offset`` (first element in the buffer), ``numel`` and ``shape``; the window is what one
    rank owns of a bucket or chunk. Entries outside the window give nothing. This is the one place where the
    flat-buffer layouts (cai-zero's buckets, cai-gemini's chunks) become ``ShardSpec`` pieces.

    Example::

        for piece in flat_pieces(bucket.slots, rank * shard, (rank + 1) * shard):
            out[piece.entry.name] = LocalShard(master[piece.start : piece.stop], piece.spec)
    """
    for e in entries:
        a, b = max(e.offset, lo), min(e.offset + e.numel, hi)
        if a < b:
            spec = ShardSpec(global_shape=tuple(e.shape), flat_range=(a - e.offset, b - e.offset))
            yield FlatPiece(e, a - lo, b - lo, spec)


def assemble(pieces: list[LocalShard], *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Build the global tensor from pieces that together cover it; raises if any element is missing."""
    if not pieces:
        raise ValueError("assemble: no pieces")
    spec0 = pieces[0].spec
    out = torch.empty(spec0.global_shape, dtype=dtype or pieces[0].tensor.dtype)
    covered = torch.zeros(spec0.global_shape, dtype=torch.bool)
    for tensor, spec in pieces:
        if spec.global_shape != spec0.global_shape:
            raise ValueError(
                f"assemble: pieces disagree on the global shape: {spec.global_shape} vs {spec0.global_shape}"
            )
        spec.place(tensor.detach().to(device="cpu", dtype=out.dtype), out)
        spec.place(torch.ones(spec.local_shape, dtype=torch.bool), covered)
    if not bool(covered.all()):
        missing = int((~covered).sum())
        raise ValueError(
            f"assemble: pieces leave {missing} of {covered.numel()} elements of {spec0.global_shape} uncovered"
        )
    return out
