"""ParallelDims validation (exact messages) and the process groups of every axis on 8 gloo ranks."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from cai.mesh import AXES, ParallelDims
from cai.mesh.testing import CollectiveCounter, run_distributed


@dataclass(frozen=True, kw_only=True)
class BadDims:
    name: str
    kwargs: dict
    message: str


BAD = [
    BadDims(
        name="product-too-small",
        kwargs=dict(dp=3, tp=2, world_size=8),
        message="ParallelDims: dp (3) x pp (1) x tp (2) x sp (1) x ep (1) = 6 does not match world_size 8; "
        "with tp=2 try dp=4",
    ),
    BadDims(
        name="product-too-large",
        kwargs=dict(dp=2, pp=2, tp=2, sp=2, ep=1, world_size=8),
        message="ParallelDims: dp (2) x pp (2) x tp (2) x sp (2) x ep (1) = 16 does not match world_size 8; "
        "with pp=2, tp=2, sp=2 try dp=1",
    ),
    BadDims(
        name="only-dp",
        kwargs=dict(dp=3, world_size=4),
        message="ParallelDims: dp (3) x pp (1) x tp (1) x sp (1) x ep (1) = 3 does not match world_size 4; try dp=4",
    ),
    BadDims(
        name="no-dp-fits",
        kwargs=dict(tp=3, world_size=8),
        message="ParallelDims: pp (1) x tp (3) x sp (1) x ep (1) = 3 does not divide world_size 8, so no dp fits "
        "(dp (1) x pp (1) x tp (3) x sp (1) x ep (1)); choose pp, tp, sp and ep whose product divides 8 "
        "(one of 1, 2, 4, 8)",
    ),
    BadDims(
        name="no-dp-fits-auto",
        kwargs=dict(dp=-1, ep=4, sp=2, world_size=4),
        message="ParallelDims: pp (1) x tp (1) x sp (2) x ep (4) = 8 does not divide world_size 4, so no dp fits "
        "(dp (-1) x pp (1) x tp (1) x sp (2) x ep (4)); choose pp, tp, sp and ep whose product divides 4 "
        "(one of 1, 2, 4)",
    ),
    BadDims(
        name="zero-axis",
        kwargs=dict(tp=0, world_size=4),
        message="ParallelDims: tp must be a positive int (1 = unused), got 0 "
        "(dp (1) x pp (1) x tp (0) x sp (1) x ep (1))",
    ),
    BadDims(
        name="negative-dp",
        kwargs=dict(dp=-2, world_size=4),
        message="ParallelDims: dp must be a positive int, or -1 to fill the world, got -2 "
        "(dp (-2) x pp (1) x tp (1) x sp (1) x ep (1))",
    ),
    BadDims(
        name="float-axis",
        kwargs=dict(pp=2.0, world_size=4),
        message="ParallelDims: pp must be a positive int (1 = unused), got 2.0 "
        "(dp (1) x pp (2.0) x tp (1) x sp (1) x ep (1))",
    ),
    BadDims(
        name="bad-world",
        kwargs=dict(world_size=0),
        message="ParallelDims: world_size must be a positive int, got 0 (dp (1) x pp (1) x tp (1) x sp (1) x ep (1))",
    ),
    BadDims(
        name="no-world",
        kwargs=dict(tp=2),
        message="ParallelDims: dp (1) x pp (1) x tp (2) x sp (1) x ep (1): world_size is None and torch.distributed "
        "is not initialised; pass world_size=... or call launch_from_torch() first",
    ),
]


@pytest.mark.parametrize("case", BAD, ids=[c.name for c in BAD])
def test_invalid_dims_name_every_factor(case: BadDims) -> None:
    with pytest.raises(ValueError) as err:
        ParallelDims(**case.kwargs)
    assert str(err.value) == case.message


def test_dp_fills_the_world() -> None:
    dims = ParallelDims(dp=-1, tp=2, pp=2, world_size=16)
    assert dims.dp == 4 and dims.shape == (2, 4, 1, 1, 2)
    assert dims.size() == 16 and dims.size(("dp", "tp")) == 8 and dims.size("pp") == 2


def test_unknown_axis_is_an_error() -> None:
    dims = ParallelDims(dp=2, world_size=2)
    for bad in ("cp", ("dp", "dp"), ()):
        with pytest.raises(ValueError, match="the axes are pp, dp, ep, sp, tp"):
            dims.size(bad)


def test_build_mesh_needs_distributed() -> None:
    with pytest.raises(RuntimeError, match=r"torch\.distributed is not initialised"):
        ParallelDims(world_size=1).build_mesh()


# ---- 8 gloo ranks ------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MeshCase:
    name: str
    dp: int = 1
    pp: int = 1
    tp: int = 1
    sp: int = 1
    ep: int = 1


MESHES = [
    MeshCase(name="pp2-dp2-tp2", pp=2, dp=2, tp=2),
    MeshCase(name="dp2-ep2-sp2", dp=2, ep=2, sp=2),
    MeshCase(name="dp8", dp=8),
    MeshCase(name="tp8", tp=8),
    MeshCase(name="pp2-sp2-tp2", pp=2, sp=2, tp=2),
]

# Every single axis, the combinations plugins use, and one given out of mesh order.
GROUPS: list[tuple[str, ...]] = [
    *((a,) for a in AXES),
    ("dp", "sp"),
    ("dp", "ep"),
    ("pp", "tp"),
    ("dp", "ep", "sp"),
    ("sp", "dp"),
    AXES,
]


# The documented layout, outer to inner: tp innermost (consecutive ranks), pp outermost.
LAYOUT = ("pp", "dp", "ep", "sp", "tp")


def test_axis_order_is_the_documented_one() -> None:
    assert AXES == LAYOUT


def _expected(case: MeshCase, rank: int, axes: tuple[str, ...]) -> list[int]:
    """Ranks of ``rank``'s group over ``axes``, from the documented row-major layout."""
    shape = [getattr(case, a) for a in LAYOUT]
    coords = {r: dict(zip(LAYOUT, c)) for r, c in enumerate(itertools.product(*(range(s) for s in shape)))}
    members = [r for r in coords if all(coords[r][a] == coords[rank][a] for a in LAYOUT if a not in axes)]
    return sorted(members)


def _mesh_groups(sizes: dict[str, int]) -> dict:
    dims = ParallelDims(**sizes)
    mesh = dims.build_mesh()
    out = {}
    for axes in GROUPS:
        group = mesh.group(axes)
        t = torch.tensor([float(2 ** dist.get_rank())], dtype=torch.float64)
        with CollectiveCounter() as cc:
            dist.all_reduce(t, group=group)  # a bitmask of the members, measured through the group itself
        out[axes] = {
            "ranks": mesh.ranks(axes),
            "pg_ranks": sorted(dist.get_process_group_ranks(group)),
            "members": sorted(r for r in range(8) if int(t.item()) >> r & 1),
            "size": mesh.size(axes),
            "coordinate": mesh.coordinate(axes),
            "counted": [e.group_ranks for e in cc.events],
        }
    out["same-object"] = mesh.group(("sp", "dp")) is mesh.group(("dp", "sp"))
    errors = []
    for make in (lambda: ParallelDims(dp=4, world_size=4).build_mesh(), lambda: ParallelDims(tp=2)):
        try:
            make()
        except ValueError as e:
            errors.append(str(e))
    out["errors"] = errors
    out["world"] = mesh.group() is dist.group.WORLD and mesh.ranks() == list(range(8))
    return out


@pytest.mark.parametrize("case", MESHES, ids=[c.name for c in MESHES])
def test_process_groups_on_8_ranks(case: MeshCase) -> None:
    # Plain values travel to the workers (the case's class lives in this test module).
    results = run_distributed(_mesh_groups, 8, {a: getattr(case, a) for a in AXES}, timeout=180)
    for rank, got in enumerate(results):
        assert got["same-object"] and got["world"]
        assert got["errors"] == [
            "ParallelMesh: dims are for world_size 4 but the default process group has 8 ranks",
            # world_size defaults to the initialised world
            "ParallelDims: dp (1) x pp (1) x tp (2) x sp (1) x ep (1) = 2 does not match world_size 8; "
            "with tp=2 try dp=4",
        ]
        for axes in GROUPS:
            expected = _expected(case, rank, axes)
            g = got[axes]
            assert g["ranks"] == expected, (rank, axes)
            assert g["pg_ranks"] == expected and g["members"] == expected, (rank, axes)
            assert g["size"] == len(expected) == math.prod(getattr(case, a) for a in set(axes))
            # The coordinate is this rank's position among its group, ordered row-major in mesh order.
            assert g["coordinate"] == expected.index(rank), (rank, axes)
            assert [sorted(r) for r in g["counted"]] == [expected]
