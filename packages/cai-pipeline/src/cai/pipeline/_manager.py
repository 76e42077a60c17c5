"""PipelineStageManager: this rank's place in the pipeline, its chunks, its neighbours, and the layer split.

[Note: virtual stages]
With ``num_model_chunks = C`` chunks per rank and ``S`` pipeline ranks, the model is cut into ``S * C`` virtual
stages (slots), numbered in the order the data flows through them. Chunk ``c`` of pipeline rank ``r`` holds

- one chunk (1F1B, GPipe): slot ``r``;
- interleaved: slot ``c * S + r`` (the data visits every rank once per chunk, round after round);
- V (zero-bubble V, ``use_zbv``, two chunks): slot ``r`` for chunk 0 and ``2 * S - 1 - r`` for chunk 1, so the
  data goes down the ranks and comes back up, and rank 0 holds both the first and the last slot.

``distribute_layers`` returns layer counts per slot and ``get_stage_index`` turns them into layer ranges.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence

import torch.distributed as dist

from cai.mesh import AXES, ParallelMesh

__all__ = ["PipelineStageManager", "distribute_layers", "slot_of"]


def slot_of(stage: int, chunk: int, num_stages: int, num_model_chunks: int, use_zbv: bool = False) -> int:
    """The virtual stage held by ``chunk`` of pipeline rank ``stage`` (see [Note: virtual stages])."""
    if use_zbv:
        return stage if chunk == 0 else 2 * num_stages - 1 - stage
    return chunk * num_stages + stage


def distribute_layers(num_layers: int, num_slots: int) -> list[int]:
    """Layer counts for ``num_slots`` consecutive slots: an even split, the remainder to the middle slots.

    The first and last slots also hold the embedding and the head, so the extra layers go to the middle ones
    (Colossal-AI's rule). ``[Note: virtual stages]`` says which rank holds which slot.
    """
    if num_slots < 1:
        raise ValueError(f"distribute_layers: num_slots must be >= 1, got {num_slots}")
    if num_layers < num_slots:
        raise ValueError(
            f"distribute_layers: {num_layers} layers cannot fill {num_slots} pipeline slots (stages x chunks); "
            f"every slot needs at least one layer: use at most {num_layers} stages x chunks"
        )
    q, r = divmod(num_layers, num_slots)
    counts = [q] * num_slots
    start = num_slots // 2 - r // 2
    for i in range(start, start + r):
        counts[i] += 1
    return counts


class PipelineStageManager:
    """This rank's pipeline coordinates on a ``ParallelMesh``, with Colossal-AI's names.

    Args:
        pg_mesh: the job's ``cai.mesh.ParallelMesh`` (``ParallelDims(pp=..., ...).build_mesh()``).
        pipeline_axis: the mesh axis of the pipeline, ``"pp"`` (an int is read as an index into
            ``cai.mesh.AXES``, as Colossal-AI's ``ProcessGroupMesh`` axes are numbered).
        enable_interleave: several chunks per rank (interleaved or V schedule).
        num_model_chunks: chunks per rank; must be 1 unless ``enable_interleave``, and 2 with ``use_zbv``.
        use_zbv: the V layout of the zero-bubble V schedule (see [Note: virtual stages]).
        num_layers_per_stage: layer counts per slot (``num_stages * num_model_chunks`` of them, in slot order),
            returned by ``distribute_layers`` instead of the even split.

    Example::

        mesh = ParallelDims(pp=2, dp=2).build_mesh()
        manager = PipelineStageManager(mesh, "pp", enable_interleave=True, num_model_chunks=2)
        with manager.switch_model_chunk_id(1):
            manager.is_last_stage()         # True on the last pipeline rank
        manager.get_stage_index(manager.distribute_layers(8))   # [(0, 2), (4, 6)] on pipeline rank 0
    """

    def __init__(
        self,
        pg_mesh: ParallelMesh,
        pipeline_axis: str | int = "pp",
        enable_interleave: bool = False,
        num_model_chunks: int = 1,
        use_zbv: bool = False,
        num_layers_per_stage: Sequence[int] | None = None,
    ) -> None:
        axis = AXES[pipeline_axis] if isinstance(pipeline_axis, int) else pipeline_axis
        if axis not in AXES:
            raise ValueError(f"PipelineStageManager: pipeline_axis {pipeline_axis!r} is not one of {AXES}")
        if num_model_chunks < 1:
            raise ValueError(f"PipelineStageManager: num_model_chunks must be >= 1, got {num_model_chunks}")
        if num_model_chunks > 1 and not enable_interleave:
            raise ValueError(
                f"PipelineStageManager: num_model_chunks={num_model_chunks} needs enable_interleave=True "
                "(several chunks per rank are only run by the interleaved and V schedules)"
            )
        if use_zbv and num_model_chunks != 2:
            raise ValueError(
                f"PipelineStageManager: use_zbv=True needs num_model_chunks=2 (the V layout), got {num_model_chunks}"
            )
        self.pg_mesh = pg_mesh
        self.pipeline_axis = axis
        self.is_interleave = enable_interleave
        self.use_zbv = use_zbv
        self.num_model_chunks = num_model_chunks
        self.num_stages = pg_mesh.size(axis)
        self.stage = pg_mesh.coordinate(axis)
        self.model_chunk_id: int | None = None
        self.num_layers_per_stage = list(num_layers_per_stage) if num_layers_per_stage is not None else None
        self.p2p_group = pg_mesh.group(axis)
        self._ranks = pg_mesh.ranks(axis)
        self._groups_by_stages: dict[tuple[int, ...], dist.ProcessGroup | None] = {}

    # ---- where this rank is ---------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        """Virtual stages in the whole pipeline: ``num_stages * num_model_chunks``."""
        return self.num_stages * self.num_model_chunks

    @property
    def stage_indices(self) -> list[int]:
        """The slot of each chunk of this rank, by chunk id."""
        return [self.slot(c) for c in range(self.num_model_chunks)]

    def slot(self, chunk: int | None = None, stage: int | None = None) -> int:
        """The virtual stage of ``chunk`` (default: the current ``model_chunk_id``, or 0) on ``stage`` (this rank)."""
        chunk = (self.model_chunk_id or 0) if chunk is None else chunk
        stage = self.stage if stage is None else stage
        return slot_of(stage, chunk, self.num_stages, self.num_model_chunks, self.use_zbv)

    def is_first_stage(self, ignore_chunk: bool = False) -> bool:
        """Whether this rank (and, for several chunks, the current chunk) holds the first slot."""
        if not self.is_interleave or ignore_chunk:
            return self.stage == 0
        self._require_chunk("is_first_stage")
        return self.slot() == 0

    def is_last_stage(self, ignore_chunk: bool = False) -> bool:
        """Whether this rank (and, for several chunks, the current chunk) holds the last slot.

        With ``ignore_chunk`` it is the last pipeline rank, as in Colossal-AI (under V the last slot is on rank 0).
        """
        if not self.is_interleave or ignore_chunk:
            return self.stage == self.num_stages - 1
        self._require_chunk("is_last_stage")
        return self.slot() == self.num_slots - 1

    def _require_chunk(self, what: str) -> None:
        if self.model_chunk_id is None:
            raise RuntimeError(
                f"PipelineStageManager.{what}: with {self.num_model_chunks} chunks per rank, say which chunk: "
                f"call it inside `with manager.switch_model_chunk_id(c):` or pass ignore_chunk=True"
            )

    @contextlib.contextmanager
    def switch_model_chunk_id(self, model_chunk_id: int) -> Iterator[None]:
        """Make ``model_chunk_id`` the current chunk inside the block (restores the previous one after)."""
        if not 0 <= model_chunk_id < self.num_model_chunks:
            raise ValueError(
                f"switch_model_chunk_id: chunk {model_chunk_id} is outside [0, {self.num_model_chunks})"
            )
        old, self.model_chunk_id = self.model_chunk_id, model_chunk_id
        try:
            yield
        finally:
            self.model_chunk_id = old

    # ---- neighbours -----------------------------------------------------------------------------------------
    def get_rank(self) -> int:
        return dist.get_rank()

    def get_prev_rank(self) -> int:
        """Global rank of the previous pipeline rank (a ring: rank 0's previous is the last)."""
        return self._ranks[(self.stage - 1) % self.num_stages]

    def get_next_rank(self) -> int:
        """Global rank of the next pipeline rank (a ring: the last one's next is rank 0)."""
        return self._ranks[(self.stage + 1) % self.num_stages]

    @property
    def prev_rank(self) -> int:
        return self.get_prev_rank()

    @property
    def next_rank(self) -> int:
        return self.get_next_rank()

    def get_p2p_process_group(self) -> dist.ProcessGroup:
        """The pipeline group of this rank (its ranks at every pipeline coordinate, the others fixed)."""
        return self.p2p_group

    def init_process_group_by_stages(self, stages: Sequence[int]) -> dist.ProcessGroup | None:
        """A group of this rank's peers at pipeline coordinates ``stages`` (other axes fixed), e.g. ``[0, S-1]``
        for tied embeddings. None when this rank is not at one of ``stages``.

        Collective on first use for a given ``stages`` (every rank of the world calls it; groups are cached).
        """
        key = tuple(sorted(set(stages)))
        if any(not 0 <= s < self.num_stages for s in key):
            raise ValueError(
                f"init_process_group_by_stages: stages {list(stages)} outside [0, {self.num_stages})"
            )
        if key not in self._groups_by_stages:
            mesh = self.pg_mesh.device_mesh.mesh
            pp_dim = AXES.index(self.pipeline_axis)
            other = [range(n) for d, n in enumerate(mesh.shape) if d != pp_dim]
            mine = None
            # new_group is collective over the world: every rank creates every group in the same order.
            for coords in itertools.product(*other):
                ranks = []
                for s in key:
                    index = list(coords)
                    index.insert(pp_dim, s)
                    ranks.append(int(mesh[tuple(index)]))
                group = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    mine = group
            self._groups_by_stages[key] = mine
        return self._groups_by_stages[key]

    # ---- the layer split ------------------------------------------------------------------------------------
    def distribute_layers(
        self, num_layers: int, num_stages: int | None = None, num_model_chunks: int | None = None
    ) -> list[int]:
        """Layer counts per slot: ``num_layers_per_stage`` when given (checked), else the even split."""
        stages = self.num_stages if num_stages is None else num_stages
        chunks = self.num_model_chunks if num_model_chunks is None else num_model_chunks
        if self.num_layers_per_stage is not None:
            return check_layers_per_stage(self.num_layers_per_stage, num_layers, stages * chunks)
        return distribute_layers(num_layers, stages * chunks)

    def get_stage_index(
        self,
        layers_per_stage: Sequence[int],
        stage: int | None = None,
        num_model_chunks: int | None = None,
        num_stages: int | None = None,
    ) -> tuple[int, int] | list[tuple[int, int]]:
        """Layer range ``(start, end)`` of ``stage`` (default: this rank); one per chunk with several chunks."""
        stage = self.stage if stage is None else stage
        chunks = self.num_model_chunks if num_model_chunks is None else num_model_chunks
        stages = self.num_stages if num_stages is None else num_stages
        if len(layers_per_stage) != stages * chunks:
            raise ValueError(
                f"get_stage_index: {len(layers_per_stage)} layer counts for {stages} stages x {chunks} chunks"
            )
        starts = [0, *itertools.accumulate(layers_per_stage)]
        ranges = []
        for c in range(chunks):
            s = slot_of(stage, c, stages, chunks, self.use_zbv)
            ranges.append((starts[s], starts[s + 1]))
        return ranges[0] if chunks == 1 else ranges

    def __repr__(self) -> str:
        return (
            f"PipelineStageManager(stage={self.stage}/{self.num_stages}, chunks={self.num_model_chunks}, "
            f"interleave={self.is_interleave}, zbv={self.use_zbv}, slots={self.stage_indices})"
        )


def check_layers_per_stage(layers_per_stage: Sequence[int], num_layers: int, num_slots: int) -> list[int]:
    """``layers_per_stage`` after checking it has one positive count per slot and sums to ``num_layers``."""
    counts = [int(n) for n in layers_per_stage]
    if len(counts) != num_slots:
        raise ValueError(
            f"layers_per_stage {counts} has {len(counts)} entries but the pipeline has {num_slots} slots "
            "(stages x chunks); give one layer count per slot"
        )
    if sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(
            f"layers_per_stage {counts} sums to {sum(counts)} but the model has {num_layers} layers; the counts "
            "must be positive and sum to the layer count"
        )
    return counts
