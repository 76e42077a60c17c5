"""Executes one stage's plan: forward and backward of its model chunks, messages to and from its neighbours.

[Note: channel order]
Messages between two ranks are matched in send order (NCCL has no tags), but a stage may need them in another
order: on the zero-bubble V one pair of ranks carries chunk 0's activations and chunk 1's gradients in the same
direction. Every rank knows every stage's plan, so it derives, per sending rank, the order in which that rank will
send; to get a message it receives the ones its sender sent before it into a buffer first. That never waits longer
than the message itself would: the sender posted them earlier, and sends never block.

[Note: split backward and gradient hooks]
In plans with W actions, B is ``torch.autograd.grad`` with respect to the stage's received inputs only: autograd runs
just the nodes on the path to them, so no parameter gradient is computed or accumulated and no gradient hook fires.
W is ``torch.autograd.backward(..., inputs=params)``, which accumulates through autograd's AccumulateGrad, so
post-accumulate hooks (cai-zero's buckets) and tensor hooks (cai-shardformer's tp reductions) run as in a plain
backward. W re-traverses the activation-gradient path to reach the weights (B's intermediate gradients are not
kept), so a split step costs about 1.5 backward passes of compute; collectives inside autograd Functions on that
path run again in W, on every rank of their group at the same point of the plan, so they still match.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from cai.pipeline._p2p import PipelineP2P
from cai.pipeline._plan import Action, Plan
from cai.pipeline._timeline import Event, Timeline

Msg = tuple[str, int, int]  # ("fwd" | "bwd", destination virtual stage, micro-batch)


def _grad_tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor) and x.requires_grad]


def _local_copy(tree: Any) -> Any:
    """What a message to this same rank delivers: tensors detached (new autograd leaves), other values as they are."""
    return pytree.tree_map(
        lambda x: x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x, tree
    )


def channel_orders(plan: Plan, me: int) -> dict[int, deque[Msg]]:
    """Per sending stage, the messages it sends to stage ``me``, in its send order (see [Note: channel order])."""
    lay, last = plan.layout, plan.layout.num_virtual - 1
    out: dict[int, deque[Msg]] = {}
    for s, acts in enumerate(plan.actions):
        for a in acts:
            v = lay.virtual(s, a.chunk)
            if a.kind == "F" and v < last:
                msg: Msg | None = ("fwd", v + 1, a.mb)
            elif a.kind == "B" and v > 0:
                msg = ("bwd", v - 1, a.mb)
            else:
                msg = None
            if msg is not None:
                dst = lay.place(msg[1])[0]
                if dst == me and s != me:
                    out.setdefault(s, deque()).append(msg)
    return out


@dataclass
class _Live:
    """A micro-batch's state on one chunk between its forward and its last backward action."""

    inputs: list[torch.Tensor]  # received tensors that need a gradient
    roots: list[torch.Tensor]  # outputs to backpropagate from (the scaled loss on the last virtual stage)
    grads: list[torch.Tensor] | None = None  # gradients of roots, kept from B for W


@dataclass
class StepResult:
    loss: torch.Tensor | None = None
    outputs: Any = None
    timeline: Timeline | None = None
    p2p_bytes: dict[tuple[int, str], int] = field(default_factory=dict)


def run_plan(
    plan: Plan,
    *,
    stage: int,
    chunks: Sequence[nn.Module],
    micro_batches: list[Any],
    criterion: Callable[[Any, Any], torch.Tensor] | None,
    p2p: PipelineP2P | None,
    optimizer: Any = None,
    return_outputs: bool = False,
    record_timeline: bool = False,
    group: dist.ProcessGroup | None = None,
    sum_losses: bool = False,
) -> StepResult:
    lay, m = plan.layout, plan.num_microbatches
    last = lay.num_virtual - 1
    training = torch.is_grad_enabled()
    actions = [a for a in plan.actions[stage] if training or a.kind == "F"]
    channels = channel_orders(
        Plan(
            lay,
            m,
            tuple(tuple(a for a in acts if training or a.kind == "F") for acts in plan.actions),
            plan.split_backward,
        ),
        stage,
    )
    buffer: dict[Msg, Any] = {}
    live: dict[tuple[int, int], _Live] = {}
    losses: list[torch.Tensor] = []
    outputs: list[Any] = []
    scale = float(getattr(optimizer, "loss_scale", 1.0) or 1.0)
    if not sum_losses:  # the step's loss is the mean of its micro-batches' losses
        scale /= m
    no_sync = getattr(optimizer, "no_sync", None)
    grad_kind = "W" if plan.split_backward else "B"
    last_grad_action = max((i for i, a in enumerate(actions) if a.kind == grad_kind), default=-1)
    timeline = Timeline(lay.num_stages) if record_timeline else None

    waited = [0.0]

    def get(msg: Msg) -> Any:
        if msg in buffer:
            return buffer.pop(msg)
        v = msg[1] - 1 if msg[0] == "fwd" else msg[1] + 1
        src = lay.place(v)[0]
        queue = channels.get(src)
        while queue:
            nxt = queue.popleft()
            t0 = time.perf_counter()
            payload = p2p.recv(src, nxt[0])
            waited[0] += time.perf_counter() - t0
            if nxt == msg:
                return payload
            buffer[nxt] = payload
        raise AssertionError(f"stage {stage}: message {msg} from stage {src} is not in its plan")

    def put(msg: Msg, tree: Any) -> None:
        dst = lay.place(msg[1])[0]
        if dst == stage:
            buffer[msg] = _local_copy(tree)
        else:
            p2p.send(tree, dst, msg[0])

    if record_timeline and lay.num_stages > 1:
        dist.barrier(group=group)
    t_start = time.perf_counter()

    def record(a: Action, t0: float) -> None:
        if timeline is not None:
            timeline.events.append(
                Event(stage, a.kind, a.chunk, a.mb, t0 - t_start, time.perf_counter() - t_start)
            )

    for i, a in enumerate(actions):
        v = lay.virtual(stage, a.chunk)
        sync = contextlib.nullcontext() if no_sync is None or i == last_grad_action else no_sync()
        if a.kind == "F":
            hidden = None if v == 0 else get(("fwd", v, a.mb))
            t0 = time.perf_counter()
            out = chunks[a.chunk](hidden, micro_batches[a.mb])
            if v == last and criterion is not None:
                loss = criterion(out, micro_batches[a.mb])
                losses.append(loss.detach())
                roots = [loss * scale] if training else []
            else:
                roots = _grad_tensors(out) if training else []
            record(a, t0)
            if v == last and return_outputs:
                outputs.append(
                    pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, out)
                )
            if v < last:
                put(("fwd", v + 1, a.mb), out)
            if training:
                live[(a.chunk, a.mb)] = _Live(_grad_tensors(hidden), roots)
            del out
        elif a.kind == "B":
            st = live[(a.chunk, a.mb)]
            grads = None if v == last else get(("bwd", v, a.mb))
            t0 = time.perf_counter()
            if plan.split_backward:
                st.grads = grads
                got = (
                    torch.autograd.grad(st.roots, st.inputs, grads, retain_graph=True, allow_unused=True)
                    if st.inputs and st.roots
                    else [None] * len(st.inputs)
                )
            else:
                with sync:
                    if st.roots:
                        torch.autograd.backward(st.roots, grads)
                got = [x.grad for x in st.inputs]
                del live[(a.chunk, a.mb)]
            in_grads = [torch.zeros_like(x) if g is None else g for x, g in zip(st.inputs, got, strict=True)]
            record(a, t0)
            if v > 0:
                put(("bwd", v - 1, a.mb), in_grads)
        else:
            st = live.pop((a.chunk, a.mb))
            t0 = time.perf_counter()
            params = [p for p in chunks[a.chunk].parameters() if p.requires_grad]
            if st.roots and params:
                with sync:
                    torch.autograd.backward(st.roots, st.grads, inputs=params)
            record(a, t0)
        if p2p is not None:
            p2p._reap()
    if timeline is not None:
        timeline.span[stage] = time.perf_counter() - t_start
        timeline.wait[stage] = waited[0]
    if p2p is not None:
        p2p.wait_sends()
    result = StepResult(timeline=timeline, p2p_bytes=dict(p2p.bytes_sent) if p2p is not None else {})
    if losses:
        stacked = torch.stack([x.float() for x in losses])
        result.loss = stacked.sum() if sum_losses else stacked.mean()
    if outputs:
        result.outputs = merge_outputs(outputs)
    return result


def merge_outputs(parts: list[Any]) -> Any:
    """Concatenate micro-batch outputs along dim 0 (0-d tensors are stacked; other values become lists)."""
    flat = [pytree.tree_flatten(p) for p in parts]
    spec = flat[0][1]
    merged = []
    for leaves in zip(*(f[0] for f in flat), strict=True):
        if isinstance(leaves[0], torch.Tensor):
            merged.append(torch.cat(leaves) if leaves[0].dim() else torch.stack(leaves))
        else:
            merged.append(list(leaves))
    return pytree.tree_unflatten(merged, spec)
