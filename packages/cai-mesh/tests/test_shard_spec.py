"""Property tests of ShardSpec: round trips, exact coverage of even splits, region reads, serialisation, errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cai.mesh import LocalShard, ShardSpec, assemble

settings.register_profile("cai", max_examples=40, deadline=None)
settings.load_profile("cai")

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)


@st.composite
def blocks(draw: st.DrawFn) -> ShardSpec:
    """A random rectangular block of a random global shape."""
    shape = draw(shapes)
    offsets, block = [], []
    for g in shape:
        o = draw(st.integers(0, g))
        offsets.append(o)
        block.append(draw(st.integers(0, g - o)))
    return ShardSpec(global_shape=shape, offsets=tuple(offsets), block_shape=tuple(block))


@st.composite
def specs(draw: st.DrawFn) -> ShardSpec:
    """A block, optionally narrowed to an arbitrary flat range with arbitrary padding."""
    spec = draw(blocks())
    if draw(st.booleans()):
        start = draw(st.integers(0, spec.block_numel))
        stop = draw(st.integers(start, spec.block_numel))
        spec = ShardSpec(
            global_shape=spec.global_shape,
            offsets=spec.offsets,
            block_shape=spec.block_shape,
            flat_range=(start, stop),
            padding=draw(st.integers(0, 3)),
        )
    return spec


def _arange(shape: tuple[int, ...]) -> torch.Tensor:
    # Distinct non-zero values, so a misplaced element can never look right.
    return torch.arange(1, math.prod(shape) + 1, dtype=torch.float64).reshape(shape)


def _mask(spec: ShardSpec) -> torch.Tensor:
    """The global elements ``spec`` holds, computed independently of ``place``."""
    mask = torch.zeros(spec.global_shape, dtype=torch.bool)
    block = torch.zeros(spec.block_shape, dtype=torch.bool)
    if spec.flat_range is None:
        block.fill_(True)
    else:
        block.view(-1)[spec.flat_range[0] : spec.flat_range[1]] = True
    mask[tuple(slice(o, o + b) for o, b in zip(spec.offsets, spec.block_shape))] = block
    return mask


@given(specs())
def test_cut_then_place_round_trips(spec: ShardSpec) -> None:
    full = _arange(spec.global_shape)
    local = spec.cut(full)
    assert tuple(local.shape) == spec.local_shape
    if spec.flat_range is not None and spec.padding:
        assert torch.count_nonzero(local[spec.numel :]) == 0, "padding must be zeros"
    out = spec.place(local, torch.zeros(spec.global_shape, dtype=full.dtype))
    mask = _mask(spec)
    assert torch.equal(out[mask], full[mask])
    assert torch.count_nonzero(out[~mask]) == 0, "place wrote outside the piece"
    assert int(mask.sum()) == spec.numel


@given(specs())
def test_read_region_then_cut_region_equals_cut(spec: ShardSpec) -> None:
    full = _arange(spec.global_shape)
    region = full[spec.read_region()]
    assert torch.equal(spec.cut_region(region), spec.cut(full))
    # The region never reads outside the block.
    for sl, o, b in zip(spec.read_region(), spec.offsets, spec.block_shape):
        assert o <= sl.start and sl.stop <= o + b


@given(blocks(), st.integers(1, 9))
def test_even_flat_split_covers_the_block_exactly_once(block: ShardSpec, world_size: int) -> None:
    pieces = [block.split_flat(rank, world_size) for rank in range(world_size)]
    assert len({p.local_shape for p in pieces}) == 1, "every rank of an even split holds the same length"
    count = torch.zeros(block.global_shape, dtype=torch.int64)
    for p in pieces:
        count += _mask(p)
    assert torch.equal(count, _mask(block).long())
    assert sum(p.numel for p in pieces) == block.block_numel
    per = pieces[0].local_shape[0]
    assert per == math.ceil(block.block_numel / world_size) if block.block_numel else per == 0


@given(shapes.filter(lambda s: math.prod(s) > 0), st.integers(1, 9))
def test_assemble_of_flat_split_is_the_tensor(shape: tuple[int, ...], world_size: int) -> None:
    full = _arange(shape)
    specs_ = [ShardSpec.flat_shard(shape, r, world_size) for r in range(world_size)]
    out = assemble([LocalShard(s.cut(full), s) for s in specs_])
    assert torch.equal(out, full)


@given(st.lists(st.integers(1, 4), min_size=1, max_size=3), st.data())
def test_block_split_then_flat_split_assembles(sizes: list[int], data: st.DataObject) -> None:
    # The tensor-parallel block of a ZeRO shard: a block split along one dim, each block split flat again.
    dim = data.draw(st.integers(0, len(sizes) - 1))
    parts = data.draw(st.integers(1, 3))
    shape = tuple(s * parts if d == dim else s for d, s in enumerate(sizes))
    world = data.draw(st.integers(1, 4))
    full = _arange(shape)
    pieces = []
    for i in range(parts):
        blk = ShardSpec.block(shape, dim=dim, index=i, parts=parts)
        assert torch.equal(blk.cut(full), full.chunk(parts, dim=dim)[i])
        pieces += [LocalShard(s.cut(full), s) for s in (blk.split_flat(r, world) for r in range(world))]
    assert torch.equal(assemble(pieces, dtype=torch.float32), full.float())


@given(specs())
def test_to_dict_from_dict_round_trips_through_json(spec: ShardSpec) -> None:
    d = json.loads(json.dumps(spec.to_dict()))
    assert ShardSpec.from_dict(d) == spec


@given(shapes)
def test_full_spec_is_full(shape: tuple[int, ...]) -> None:
    spec = ShardSpec.full(shape)
    assert spec.is_full and spec.local_shape == shape
    assert ShardSpec.flat_shard(shape, 0, 1).is_full


def test_flat_shard_example() -> None:
    spec = ShardSpec.flat_shard((10, 3), rank=1, world_size=4)
    assert spec.flat_range == (8, 16) and spec.padding == 0
    last = ShardSpec.flat_shard((10, 3), rank=3, world_size=4)
    assert last.flat_range == (24, 30) and last.padding == 2 and not last.is_full


@pytest.mark.parametrize("world_size", [2, 4])
def test_padded_last_rank_cut_and_place_exact_values(world_size: int) -> None:
    # 251 elements (prime): every rank holds ceil(251 / world) of them and the last rank's piece ends in padding.
    # The values are spelled out, not derived from cut/place, so a piece read or written at a shifted offset fails.
    shape = (251,)
    full = torch.arange(1, 252, dtype=torch.float32)
    per = -(-251 // world_size)
    last = world_size - 1
    spec = ShardSpec.flat_shard(shape, last, world_size)
    assert spec.flat_range == (last * per, 251) and spec.padding == per * world_size - 251 > 0
    local = spec.cut(full)
    expected = torch.cat([torch.arange(last * per + 1, 252, dtype=torch.float32), torch.zeros(spec.padding)])
    assert torch.equal(local, expected)
    # place writes exactly the held elements, from the start of the local piece, and drops the padding
    marked = local.clone()
    marked[spec.numel :] = -1.0  # padding that must never reach the global tensor
    out = spec.place(marked, torch.zeros(shape))
    assert torch.equal(out[last * per :], full[last * per :])
    assert not out[: last * per].any()
    # every rank's piece placed back rebuilds the tensor; none but the last one is padded
    rebuilt = torch.zeros(shape)
    for rank in range(world_size):
        piece = ShardSpec.flat_shard(shape, rank, world_size)
        assert piece.padding == (0 if rank < last else per * world_size - 251)
        assert torch.equal(piece.cut(full)[: piece.numel], full[rank * per : rank * per + piece.numel])
        piece.place(piece.cut(full), rebuilt)
    assert torch.equal(rebuilt, full)


def test_padded_last_rank_of_a_2d_block() -> None:
    # A (7, 5) tensor over 4 ranks: 9 elements each; the last rank holds flat elements [27, 35) (the last three of
    # row 5 and all of row 6), then one zero of padding. Its read region starts at row 5.
    full = torch.arange(1, 36, dtype=torch.float32).reshape(7, 5)
    spec = ShardSpec.flat_shard((7, 5), 3, 4)
    assert spec.flat_range == (27, 35) and spec.padding == 1
    assert spec.read_region() == (slice(5, 7), slice(0, 5))
    local = spec.cut(full)
    assert torch.equal(local, torch.tensor([28.0, 29, 30, 31, 32, 33, 34, 35, 0]))
    assert torch.equal(spec.cut_region(full[spec.read_region()]), local)
    out = spec.place(torch.tensor([28.0, 29, 30, 31, 32, 33, 34, 35, -1]), torch.zeros(7, 5))
    expected = torch.zeros(7, 5)
    expected.view(-1)[27:] = full.view(-1)[27:]
    assert torch.equal(out, expected)


def test_place_into_non_contiguous_target() -> None:
    full = _arange((4, 6))
    target = torch.zeros(6, 4, dtype=full.dtype).t()  # (4, 6) view that is not contiguous
    spec = ShardSpec(global_shape=(4, 6), offsets=(1, 2), block_shape=(2, 3), flat_range=(1, 5), padding=1)
    spec.place(spec.cut(full), target)
    mask = _mask(spec)
    assert torch.equal(target[mask], full[mask]) and torch.count_nonzero(target[~mask]) == 0


ERRORS = {
    "length": (
        lambda: ShardSpec(global_shape=(2, 3), offsets=(0,)),
        "global_shape (2, 3), offsets (0,) and block_shape (2,) must have the same length",
    ),
    "outside": (
        lambda: ShardSpec(global_shape=(4,), offsets=(3,), block_shape=(2,)),
        "block [3, 5) in dim 0 lies outside global size 4",
    ),
    "negative-offset": (
        lambda: ShardSpec(global_shape=(4,), offsets=(-1,), block_shape=(2,)),
        "block [-1, 1) in dim 0 lies outside global size 4",
    ),
    "flat-range": (
        lambda: ShardSpec(global_shape=(2, 2), flat_range=(1, 5)),
        "flat_range (1, 5) must satisfy 0 <= start <= stop <= 4",
    ),
    "flat-range-reversed": (
        lambda: ShardSpec(global_shape=(4,), flat_range=(3, 2)),
        "flat_range (3, 2) must satisfy",
    ),
    "padding-without-range": (
        lambda: ShardSpec(global_shape=(4,), padding=1),
        "padding 1 needs a flat_range",
    ),
    "negative-padding": (
        lambda: ShardSpec(global_shape=(4,), flat_range=(0, 4), padding=-1),
        "padding -1 needs a flat_range and must be >= 0",
    ),
    "block-not-divisible": (
        lambda: ShardSpec.block((5, 2), dim=0, index=0, parts=2),
        "size 5 of dim 0 of (5, 2) is not divisible by 2",
    ),
    "block-index": (lambda: ShardSpec.block((4, 2), dim=0, index=2, parts=2), "index 2 must be in [0, 2)"),
    "split-twice": (
        lambda: ShardSpec.flat_shard((4,), 0, 2).split_flat(0, 2),
        "spec already has a flat_range",
    ),
    "split-rank": (lambda: ShardSpec.flat_shard((4,), 2, 2), "rank 2 must be in [0, 2)"),
    "place-shape": (
        lambda: ShardSpec.flat_shard((4,), 0, 2).place(torch.zeros(3), torch.zeros(4)),
        "local shape (3,) != expected (2,)",
    ),
    "cut-global-shape": (
        lambda: ShardSpec.full((4,)).cut(torch.zeros(5)),
        "tensor of shape (5,) is not the global shape (4,)",
    ),
    "assemble-empty": (lambda: assemble([]), "assemble: no pieces"),
    "assemble-shapes": (
        lambda: assemble(
            [
                LocalShard(torch.zeros(2), ShardSpec.full((2,))),
                LocalShard(torch.zeros(3), ShardSpec.full((3,))),
            ]
        ),
        "pieces disagree on the global shape: (3,) vs (2,)",
    ),
    "assemble-uncovered": (
        lambda: assemble([LocalShard(torch.zeros(3), ShardSpec.flat_shard((5,), 0, 2))]),
        "pieces leave 2 of 5 elements of (5,) uncovered",
    ),
}


@pytest.mark.parametrize("case", list(ERRORS), ids=list(ERRORS))
def test_validation_errors(case: str) -> None:
    make, message = ERRORS[case]
    with pytest.raises(ValueError) as err:
        make()
    assert message in str(err.value)
