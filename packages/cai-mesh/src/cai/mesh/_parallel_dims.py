"""The parallel sizes of a job as one validated object, and the named device mesh built from them."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["AXES", "ParallelDims", "ParallelMesh"]

# Mesh axes from outermost to innermost. tp is innermost so that its ranks are consecutive and stay inside one
# node (tensor parallelism talks on every layer); pp is outermost because it only sends activations between
# neighbouring stages. ep sits next to dp because expert parallelism borrows data-parallel ranks: the
# data-parallel group of the non-expert weights is ("dp", "ep").
AXES: tuple[str, ...] = ("pp", "dp", "ep", "sp", "tp")
# The order the factors are printed in errors (the order people say them in).
_PRINT_ORDER: tuple[str, ...] = ("dp", "pp", "tp", "sp", "ep")

AxisSpec = str | Iterable[str] | None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """The sizes of the five parallel axes; their product is the world size.

    Axes, outer to inner (the layout of ranks in the mesh): ``pp`` (pipeline stages), ``dp`` (data parallel),
    ``ep`` (expert parallel), ``sp`` (sequence parallel), ``tp`` (tensor parallel). ``tp`` is innermost, so the
    ``tp`` ranks of a group are consecutive and stay within one node; ``pp`` is outermost.

    Args:
        dp: data-parallel size, or -1 to take whatever the other axes leave of the world size.
        pp: pipeline-parallel size.
        tp: tensor-parallel size.
        sp: sequence-parallel size.
        ep: expert-parallel size (an extra factor of the world: non-expert weights are data parallel over
            ``("dp", "ep")``).
        world_size: number of ranks; default (None) is the size of the initialised default process group.

    Example::

        dims = ParallelDims(dp=2, tp=4)              # 8 ranks
        mesh = dims.build_mesh()                     # after launch_from_torch()
        mesh.group("tp"); mesh.group(("dp", "sp"))   # ProcessGroups of this rank
    """

    dp: int = 1
    pp: int = 1
    tp: int = 1
    sp: int = 1
    ep: int = 1
    world_size: int | None = field(default=None)

    def __post_init__(self) -> None:
        ws = self.world_size
        if ws is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError(
                    f"ParallelDims: {self._factors()}: world_size is None and torch.distributed is not "
                    "initialised; pass world_size=... or call launch_from_torch() first"
                )
            ws = dist.get_world_size()
        if not isinstance(ws, int) or isinstance(ws, bool) or ws < 1:
            raise ValueError(
                f"ParallelDims: world_size must be a positive int, got {ws!r} ({self._factors()})"
            )
        object.__setattr__(self, "world_size", ws)
        for axis in AXES:
            v = getattr(self, axis)
            if not isinstance(v, int) or isinstance(v, bool) or (v < 1 and not (axis == "dp" and v == -1)):
                allowed = (
                    "a positive int, or -1 to fill the world"
                    if axis == "dp"
                    else "a positive int (1 = unused)"
                )
                raise ValueError(f"ParallelDims: {axis} must be {allowed}, got {v!r} ({self._factors()})")
        rest = self.pp * self.tp * self.sp * self.ep
        if ws % rest:
            fixed = " x ".join(f"{a} ({getattr(self, a)})" for a in _PRINT_ORDER if a != "dp")
            raise ValueError(
                f"ParallelDims: {fixed} = {rest} does not divide world_size {ws}, so no dp fits "
                f"({self._factors()}); choose pp, tp, sp and ep whose product divides {ws} "
                f"(one of {', '.join(map(str, _divisors(ws)))})"
            )
        if self.dp == -1:
            object.__setattr__(self, "dp", ws // rest)
        if self.dp * rest != ws:
            others = ", ".join(
                f"{a}={getattr(self, a)}" for a in _PRINT_ORDER if a != "dp" and getattr(self, a) > 1
            )
            hint = f"with {others} try dp={ws // rest}" if others else f"try dp={ws // rest}"
            raise ValueError(
                f"ParallelDims: {self._factors()} = {self.dp * rest} does not match world_size {ws}; {hint}"
            )

    def _factors(self) -> str:
        return " x ".join(f"{a} ({getattr(self, a)})" for a in _PRINT_ORDER)

    @property
    def shape(self) -> tuple[int, ...]:
        """Sizes of the axes in mesh order (``AXES``)."""
        return tuple(getattr(self, a) for a in AXES)

    def size(self, axis: AxisSpec = None) -> int:
        """Size of one axis, of several axes combined (their product), or of the world (None)."""
        return math.prod(getattr(self, a) for a in _normalise(axis))

    def build_mesh(self, device_type: str | None = None) -> ParallelMesh:
        """Build the named ``ParallelMesh`` (collective: every rank must call it).

        ``device_type`` defaults to "cuda" when the default process group uses NCCL, else "cpu".
        """
        return ParallelMesh(self, device_type=device_type)


def _normalise(axis: AxisSpec) -> tuple[str, ...]:
    """Axis names in mesh order; None means all axes."""
    if axis is None:
        return AXES
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    unknown = [a for a in names if a not in AXES]
    if unknown or not names or len(set(names)) != len(names):
        raise ValueError(f"unknown, empty or repeated mesh axes {names!r}; the axes are {', '.join(AXES)}")
    return tuple(a for a in AXES if a in names)


class ParallelMesh:
    """A torch ``DeviceMesh`` with the axes of ``ParallelDims`` (pp, dp, ep, sp, tp, outer to inner).

    Groups of combined axes (``mesh.group(("dp", "sp"))``) are flattened sub-meshes, created on first use and
    cached. Creating one is collective: every rank must ask for the same combinations in the same order (ask for
    them right after building the mesh if different ranks take different code paths later). Axes of size 1 work
    like any other (their groups hold one rank).

    Example::

        mesh = ParallelDims(dp=2, tp=2, world_size=4).build_mesh()
        mesh.size("tp"), mesh.coordinate("tp"), mesh.ranks("tp")   # 2, 0 or 1, e.g. [2, 3]
        dist.all_reduce(grad, group=mesh.group(("dp", "sp")))
        fully_shard(model, mesh=mesh.submesh("dp"))                # a 1-D DeviceMesh for torch APIs
    """

    def __init__(self, dims: ParallelDims, *, device_type: str | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "ParallelMesh: torch.distributed is not initialised; call launch_from_torch() first"
            )
        if dims.world_size != dist.get_world_size():
            raise ValueError(
                f"ParallelMesh: dims are for world_size {dims.world_size} but the default process group has "
                f"{dist.get_world_size()} ranks"
            )
        if device_type is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        self.dims = dims
        self.device_type = device_type
        self.device_mesh: DeviceMesh = init_device_mesh(device_type, dims.shape, mesh_dim_names=AXES)
        self._submeshes: dict[tuple[str, ...], DeviceMesh] = {(a,): self.device_mesh[a] for a in AXES}

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return self.dims.world_size  # type: ignore[return-value]

    def submesh(self, axis: AxisSpec) -> DeviceMesh:
        """The 1-D ``DeviceMesh`` of ``axis``, or of several axes flattened into one (collective on first use)."""
        names = _normalise(axis)
        if names not in self._submeshes:
            # DeviceMesh._flatten creates the flattened groups on every rank in the same order.
            self._submeshes[names] = self.device_mesh[names]._flatten("_".join(names))
        return self._submeshes[names]

    def group(self, axis: AxisSpec = None) -> dist.ProcessGroup:
        """The ProcessGroup of this rank along ``axis`` (a name, or several names combined; None: the world)."""
        if axis is None:
            return dist.group.WORLD  # type: ignore[return-value]
        return self.submesh(axis).get_group()

    def size(self, axis: AxisSpec = None) -> int:
        """Number of ranks along ``axis`` (product for combined axes; None: the world)."""
        return self.dims.size(axis)

    def coordinate(self, axis: AxisSpec = None) -> int:
        """This rank's index along ``axis``; for combined axes the row-major index over them in mesh order."""
        if axis is None:
            return self.rank
        names = _normalise(axis)
        coords = dict(zip(AXES, self.device_mesh.get_coordinate() or ()))
        index = 0
        for a in names:
            index = index * self.dims.size(a) + coords[a]
        return index

    def ranks(self, axis: AxisSpec = None) -> list[int]:
        """Global ranks of this rank's group along ``axis``, ordered by their coordinate on it."""
        if axis is None:
            return list(range(self.world_size))
        names = _normalise(axis)
        coords = dict(zip(AXES, self.device_mesh.get_coordinate() or ()))
        index = tuple(slice(None) if a in names else coords[a] for a in AXES)
        return [int(r) for r in self.device_mesh.mesh[index].flatten().tolist()]

    def __repr__(self) -> str:
        sizes = ", ".join(f"{a}={getattr(self.dims, a)}" for a in AXES)
        return f"ParallelMesh({sizes}, device_type={self.device_type!r})"
