"""Pipeline schedules with Colossal-AI's names: GPipe, 1F1B, interleaved 1F1B and zero-bubble V.

[Note: token-weighted pipeline loss]
Hugging Face's loss divides a micro-batch's token sum by ``num_items_in_batch`` when given one, so a batch whose
``num_items_in_batch`` counts the whole step's target tokens (``Booster.num_items_in_batch``) makes each
micro-batch's loss its share of the step's token mean. The schedule then sums the micro-batches' losses and
backpropagates each one unscaled, where otherwise it averages them. The count is a number or a 0-d tensor, which
``split_batch`` hands to every micro-batch whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from cai.pipeline import _plan
from cai.pipeline._p2p import PipelineP2P
from cai.pipeline._runtime import StepResult, run_plan
from cai.pipeline._timeline import Timeline


def split_batch(
    batch: Any, *, num_microbatches: int | None = None, microbatch_size: int | None = None
) -> list[Any]:
    """Split every tensor of ``batch`` (any pytree) along dim 0; 0-d tensors and other values go to every part."""
    leaves, spec = pytree.tree_flatten(batch)
    sizes = {tuple(x.shape[:1]) for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(
            f"split_batch: the batch's tensors must share their first dim (the batch size), got {sorted(sizes)}; "
            "put per-batch values in 0-d tensors or plain Python values"
        )
    (size,) = sizes.pop()
    if microbatch_size is not None:
        if size % microbatch_size:
            raise ValueError(
                f"batch size {size} is not divisible by microbatch_size={microbatch_size}; use a batch size that is "
                f"a multiple of {microbatch_size} or a microbatch_size that divides {size}"
            )
        num_microbatches = size // microbatch_size
    assert num_microbatches is not None
    if size % num_microbatches:
        divisors = [d for d in range(1, size + 1) if size % d == 0]
        raise ValueError(
            f"batch size {size} is not divisible by num_microbatches={num_microbatches}; use a batch size that is a "
            f"multiple of {num_microbatches}, or num_microbatches in {divisors}"
        )
    step = size // num_microbatches
    return [
        pytree.tree_unflatten(
            [
                x[i * step : (i + 1) * step] if isinstance(x, torch.Tensor) and x.dim() > 0 else x
                for x in leaves
            ],
            spec,
        )
        for i in range(num_microbatches)
    ]


def _token_weighted(batch: Any) -> bool:
    """Whether ``batch`` carries the step's token count (see [Note: token-weighted pipeline loss])."""
    if not isinstance(batch, Mapping) or batch.get("num_items_in_batch") is None:
        return False
    n = batch["num_items_in_batch"]
    if isinstance(n, torch.Tensor) and n.dim() > 0:
        raise ValueError(
            f"num_items_in_batch in a pipeline batch must be a number or a 0-d tensor (the step's target tokens, "
            f"given to every micro-batch), got a tensor of shape {tuple(n.shape)}"
        )
    return True


def _pp_group(stage_manager: Any) -> dist.ProcessGroup | None:
    if stage_manager is None or isinstance(stage_manager, dist.ProcessGroup):
        return stage_manager
    get = getattr(stage_manager, "get_p2p_process_group", None)
    if get is None:
        raise TypeError(
            f"pipeline schedule: stage_manager must be a PipelineStageManager, a ProcessGroup over the pipeline "
            f"stages or None (the default group); got {type(stage_manager).__name__}"
        )
    return get()


class PipelineSchedule:
    """A schedule: which forward and backward each stage runs in which order, executed by one runtime.

    Args:
        stage_manager: a :class:`PipelineStageManager` (its ``get_p2p_process_group()``), or the pipeline process
            group itself (rank r of the group is stage r), or None for the default group.
        num_microbatches / microbatch_size: exactly one of them.
        num_model_chunks: model chunks per stage (virtual stages).
        enable_metadata_cache: send tensor metadata only when it changes (see [Note: P2P messages and the metadata
            cache]).
        record_timeline: record each action's start and end; the step's :class:`Timeline` is then in
            :attr:`timeline` (this stage's events; ``timeline.gather(group)`` collects all stages).
    """

    v_layout = False  # chunk 1 of stage s is virtual stage 2S-1-s (the stage manager's use_zbv)

    def __init__(
        self,
        stage_manager: Any = None,
        num_microbatches: int | None = None,
        microbatch_size: int | None = None,
        *,
        num_model_chunks: int = 1,
        enable_metadata_cache: bool = True,
        record_timeline: bool = False,
    ) -> None:
        name = type(self).__name__
        if (num_microbatches is None) == (microbatch_size is None):
            raise ValueError(
                f"{name}: give exactly one of num_microbatches and microbatch_size, got num_microbatches="
                f"{num_microbatches}, microbatch_size={microbatch_size}"
            )
        for arg, val in (("num_microbatches", num_microbatches), ("microbatch_size", microbatch_size)):
            if val is not None and val < 1:
                raise ValueError(f"{name}: {arg} must be at least 1, got {val}")
        self.group = _pp_group(stage_manager)
        distributed = dist.is_available() and dist.is_initialized()
        self.num_stages = dist.get_world_size(self.group) if distributed else 1
        self.stage = dist.get_rank(self.group) if distributed else 0
        manager_chunks = getattr(stage_manager, "num_model_chunks", num_model_chunks)
        if manager_chunks != num_model_chunks:
            raise ValueError(
                f"{name}: the stage manager has num_model_chunks={manager_chunks}, the schedule runs "
                f"{num_model_chunks} chunks per stage; build both with the same count"
            )
        if getattr(stage_manager, "use_zbv", self.v_layout) != self.v_layout:
            raise ValueError(
                f"{name}: the stage manager's use_zbv={stage_manager.use_zbv} does not match the schedule; the V "
                "layout (use_zbv=True) goes with ZeroBubbleVPipeScheduler only"
            )
        self.num_microbatches = num_microbatches
        self.microbatch_size = microbatch_size
        self.num_model_chunks = num_model_chunks
        self.record_timeline = record_timeline
        self.timeline: Timeline | None = None
        self.p2p_bytes: dict[tuple[int, str], int] = {}
        self._p2p = (
            PipelineP2P(self.group, enable_metadata_cache=enable_metadata_cache)
            if self.num_stages > 1
            else None
        )
        self._plans: dict[int, _plan.Plan] = {}
        if num_microbatches is not None:
            self.plan(num_microbatches)  # bad counts fail here, before any step

    def _build_plan(self, m: int) -> _plan.Plan:
        raise NotImplementedError

    def plan(self, num_microbatches: int) -> _plan.Plan:
        """The plan for ``num_microbatches`` (built, checked by simulation and cached on first use)."""
        if num_microbatches not in self._plans:
            p = self._build_plan(num_microbatches)
            _plan.simulate(p)  # raises on a plan that would deadlock
            self._plans[num_microbatches] = p
        return self._plans[num_microbatches]

    def forward_backward_step(
        self,
        model_chunks: nn.Module | Sequence[nn.Module],
        data_iter: Iterator[Any],
        criterion: Callable[[Any, Any], torch.Tensor],
        optimizer: Any = None,
        return_loss: bool = True,
        return_outputs: bool = False,
    ) -> dict[str, Any]:
        """Run one batch from ``data_iter`` through the pipeline: forward, and backward when grad is enabled.

        Every stage reads the same batch from its own iterator and splits it into micro-batches. Gradients accumulate
        in the parameters' ``.grad`` over the micro-batches (the optimizer is not stepped). With an ``optimizer``
        that has ``no_sync()`` (cai-zero), every backward but this stage's last runs inside it, and a ``loss_scale``
        attribute scales the loss. Returns ``{"loss": mean over micro-batches (every stage gets it), "outputs": the
        last stage's outputs concatenated over micro-batches, None elsewhere}``.

        A batch that carries ``num_items_in_batch`` (a number or a 0-d tensor: the target tokens of the whole step)
        gives it to every micro-batch's forward, whose loss is then a token sum over that count, so the step's loss
        and gradient are the micro-batches' sum instead of their mean ([Note: token-weighted pipeline loss]).
        """
        if isinstance(getattr(model_chunks, "chunks", None), nn.ModuleList):  # a PipelineModel
            model_chunks = model_chunks.chunks
        chunks = (
            list(model_chunks) if isinstance(model_chunks, (list, tuple, nn.ModuleList)) else [model_chunks]
        )
        batch = next(data_iter)
        sum_losses = _token_weighted(batch)
        micro = split_batch(
            batch, num_microbatches=self.num_microbatches, microbatch_size=self.microbatch_size
        )
        plan = self.plan(len(micro))
        if len(chunks) != plan.layout.num_chunks:
            raise ValueError(
                f"{type(self).__name__}: stage {self.stage} got {len(chunks)} model chunks, the schedule runs "
                f"{plan.layout.num_chunks} per stage"
            )
        res: StepResult = run_plan(
            plan,
            stage=self.stage,
            chunks=chunks,
            micro_batches=micro,
            criterion=criterion,
            p2p=self._p2p,
            optimizer=optimizer,
            return_outputs=return_outputs,
            record_timeline=self.record_timeline,
            group=self.group,
            sum_losses=sum_losses,
        )
        self.timeline, self.p2p_bytes = res.timeline, res.p2p_bytes
        loss = res.loss
        if return_loss and self.num_stages > 1:
            # one 4-byte broadcast, so every stage can log the loss
            owner = plan.layout.place(plan.layout.num_virtual - 1)[0]
            buf = loss if loss is not None else torch.zeros((), device=self._p2p.device)
            src = owner if self.group is None else dist.get_global_rank(self.group, owner)
            dist.broadcast(buf, src=src, group=self.group)
            loss = buf
        return {"loss": loss if return_loss else None, "outputs": res.outputs}


class GPipeSchedule(PipelineSchedule):
    """All forwards, then all backwards: every micro-batch's activations are alive at once."""

    def _build_plan(self, m: int) -> _plan.Plan:
        return _plan.gpipe(self.num_stages, m)


class OneForwardOneBackwardSchedule(PipelineSchedule):
    """1F1B: stage s runs S - s - 1 warm-up forwards, then alternates, so it holds at most S - s micro-batches."""

    def __init__(
        self,
        stage_manager: Any = None,
        num_microbatches: int | None = None,
        microbatch_size: int | None = None,
        enable_metadata_cache: bool = True,
        *,
        record_timeline: bool = False,
    ) -> None:
        super().__init__(
            stage_manager,
            num_microbatches,
            microbatch_size,
            enable_metadata_cache=enable_metadata_cache,
            record_timeline=record_timeline,
        )

    def _build_plan(self, m: int) -> _plan.Plan:
        return _plan.one_f_one_b(self.num_stages, m)


class InterleavedSchedule(PipelineSchedule):
    """Interleaved 1F1B over ``num_model_chunks`` chunks per stage; the micro-batch count must be a multiple of S.

    ``num_microbatch`` is Colossal-AI's (singular) spelling.
    """

    def __init__(
        self,
        stage_manager: Any = None,
        num_model_chunks: int = 2,
        num_microbatch: int | None = None,
        microbatch_size: int | None = None,
        enable_metadata_cache: bool = True,
        *,
        record_timeline: bool = False,
    ) -> None:
        if num_model_chunks < 2:
            raise ValueError(
                f"InterleavedSchedule: num_model_chunks must be at least 2, got {num_model_chunks}; use "
                "OneForwardOneBackwardSchedule for one chunk per stage"
            )
        super().__init__(
            stage_manager,
            num_microbatch,
            microbatch_size,
            num_model_chunks=num_model_chunks,
            enable_metadata_cache=enable_metadata_cache,
            record_timeline=record_timeline,
        )

    def _build_plan(self, m: int) -> _plan.Plan:
        if m % self.num_stages:
            raise ValueError(
                f"InterleavedSchedule: {m} micro-batches is not a multiple of the {self.num_stages} pipeline stages; "
                f"use {((m + self.num_stages - 1) // self.num_stages) * self.num_stages} micro-batches (micro-batches "
                "move through the chunks in groups of one per stage)"
            )
        return _plan.interleaved(self.num_stages, m, self.num_model_chunks)


class ZeroBubbleVPipeScheduler(PipelineSchedule):
    """Zero-bubble V: two chunks per stage in a V (the loss on stage 0), backward split into B and W.

    ``schedule`` may give the plan's actions per stage (a list of :class:`Action` lists for every stage, checked by
    simulation); by default it is built by :func:`cai.pipeline._plan.zero_bubble_v`. Colossal-AI's ScheduledNode
    lists are not accepted.
    """

    v_layout = True

    def __init__(
        self,
        stage_manager: Any = None,
        schedule: Sequence[Sequence[_plan.Action]] | None = None,
        num_model_chunks: int = 2,
        num_microbatch: int | None = None,
        microbatch_size: int | None = None,
        enable_metadata_cache: bool = True,
        *,
        record_timeline: bool = False,
    ) -> None:
        if num_model_chunks != 2:
            raise ValueError(
                f"ZeroBubbleVPipeScheduler: num_model_chunks must be 2 (the V), got {num_model_chunks}"
            )
        if schedule is not None and not all(isinstance(a, _plan.Action) for acts in schedule for a in acts):
            raise TypeError(
                "ZeroBubbleVPipeScheduler: schedule must be a list, per stage, of cai.pipeline Actions"
            )
        self._given = None if schedule is None else tuple(tuple(acts) for acts in schedule)
        super().__init__(
            stage_manager,
            num_microbatch,
            microbatch_size,
            num_model_chunks=2,
            enable_metadata_cache=enable_metadata_cache,
            record_timeline=record_timeline,
        )

    def _build_plan(self, m: int) -> _plan.Plan:
        if self._given is not None:
            return _plan.Plan(_plan.Layout(self.num_stages, 2, "v"), m, self._given, True)
        return _plan.zero_bubble_v(self.num_stages, m)


SCHEDULES: dict[str, type[PipelineSchedule]] = {
    "gpipe": GPipeSchedule,
    "1f1b": OneForwardOneBackwardSchedule,
    "interleaved": InterleavedSchedule,
    "zbv": ZeroBubbleVPipeScheduler,
}


def build_schedule(
    name: str,
    stage_manager: Any = None,
    *,
    num_microbatches: int | None = None,
    microbatch_size: int | None = None,
    num_model_chunks: int | None = None,
    enable_metadata_cache: bool = True,
    record_timeline: bool = False,
) -> PipelineSchedule:
    """A schedule by name: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` (2 chunks unless given) or ``"zbv"``.

    Example::

        schedule = build_schedule("1f1b", pp_group, num_microbatches=8)
        out = schedule.forward_backward_step(stage, iter(loader), criterion)
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    common = dict(enable_metadata_cache=enable_metadata_cache, record_timeline=record_timeline)
    if name == "interleaved":
        return InterleavedSchedule(
            stage_manager, num_model_chunks or 2, num_microbatches, microbatch_size, **common
        )
    if name == "zbv":
        return ZeroBubbleVPipeScheduler(
            stage_manager, None, num_model_chunks or 2, num_microbatches, microbatch_size, **common
        )
    if num_model_chunks not in (None, 1):
        raise ValueError(
            f"pipeline schedule {name!r} runs one model chunk per stage, got num_model_chunks={num_model_chunks}"
        )
    cls = SCHEDULES[name]
    return cls(
        stage_manager,
        num_microbatches,
        microbatch_size,
        enable_metadata_cache=enable_metadata_cache,
        record_timeline=record_timeline,
    )
