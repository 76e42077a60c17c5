"""Schedules as data: each stage's ordered list of actions, and a unit-cost simulation that checks and times them.

A schedule is a list, per pipeline stage, of :class:`Action` s. The runtime executes a stage's list in order; a
stage blocks only when it needs a tensor another stage has not sent yet (sends never block), so a plan runs
without deadlock exactly when its simulation below completes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal[
    "F", "B", "W"
]  # forward; backward (input and weight gradients, or input only when split); weight


@dataclass(frozen=True)
class Action:
    """One unit of work on a stage: ``kind`` of micro-batch ``mb`` through the stage's model chunk ``chunk``.

    ``B`` is the whole backward in plans without ``W`` actions, and the input-gradient half where the plan has them.
    """

    kind: Kind
    chunk: int
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}{self.chunk}.{self.mb}"


@dataclass(frozen=True)
class Layout:
    """How the model's virtual stages map onto ``num_stages`` ranks with ``num_chunks`` chunks each.

    ``style="loop"``: chunk c of stage s is virtual stage ``c * S + s`` (GPipe, 1F1B, interleaved).
    ``style="v"``: chunk 0 of stage s is ``s`` and chunk 1 is ``2S - 1 - s``, so the last virtual stage, which
    computes the loss, sits on stage 0 next to the first (zero-bubble V).
    """

    num_stages: int
    num_chunks: int
    style: Literal["loop", "v"] = "loop"

    @property
    def num_virtual(self) -> int:
        return self.num_stages * self.num_chunks

    def virtual(self, stage: int, chunk: int) -> int:
        if self.style == "v" and chunk == 1:
            return 2 * self.num_stages - 1 - stage
        return chunk * self.num_stages + stage

    def place(self, virtual: int) -> tuple[int, int]:
        """(stage, chunk) that runs ``virtual``."""
        if self.style == "v" and virtual >= self.num_stages:
            return 2 * self.num_stages - 1 - virtual, 1
        return virtual % self.num_stages, virtual // self.num_stages


@dataclass(frozen=True)
class Plan:
    layout: Layout
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]  # per stage, in execution order
    split_backward: bool  # B computes input gradients only; W computes the weight gradients later


def gpipe(num_stages: int, m: int) -> Plan:
    per = tuple(Action("F", 0, i) for i in range(m)) + tuple(Action("B", 0, i) for i in range(m))
    return Plan(Layout(num_stages, 1), m, (per,) * num_stages, False)


def one_f_one_b(num_stages: int, m: int) -> Plan:
    stages = []
    for s in range(num_stages):
        # stage s runs ahead by the number of stages after it, so that the first backward arrives just as its
        # last warm-up forward ends; at most num_stages - s micro-batches are alive on it at once
        warm = min(num_stages - s - 1, m)
        acts = [Action("F", 0, i) for i in range(warm)]
        for i in range(m - warm):
            acts += [Action("F", 0, warm + i), Action("B", 0, i)]
        acts += [Action("B", 0, i) for i in range(m - warm, m)]
        stages.append(tuple(acts))
    return Plan(Layout(num_stages, 1), m, tuple(stages), False)


def interleaved(num_stages: int, m: int, num_chunks: int) -> Plan:
    """Interleaved 1F1B: micro-batches move through the chunks in groups of ``num_stages`` (needs m % S == 0)."""
    p, c = num_stages, num_chunks
    total = m * c

    def fwd(k: int) -> tuple[int, int]:
        return (k // p) % c, (k // (p * c)) * p + k % p

    def bwd(k: int) -> tuple[int, int]:
        chunk, mb = fwd(k)
        return c - 1 - chunk, mb

    stages = []
    for s in range(p):
        # warm-up: fill the chunks of this stage and the stages behind it before the first backward can arrive
        warm = min((p - s - 1) * 2 + (c - 1) * p, total)
        acts = [Action("F", *fwd(k)) for k in range(warm)]
        for i in range(total - warm):
            acts += [Action("F", *fwd(warm + i)), Action("B", *bwd(i))]
        acts += [Action("B", *bwd(k)) for k in range(total - warm, total)]
        stages.append(tuple(acts))
    return Plan(Layout(p, c), m, tuple(stages), False)


def zero_bubble_v(num_stages: int, m: int) -> Plan:
    """Zero-bubble V: two chunks per stage in a V, backward split into B and W, ordered by a greedy simulation.

    Each stage, whenever it is free, runs a ready B (it unblocks the stage before it; chunk 0 first, whose input
    gradient the previous stage waits for), else a ready F (chunk 1 first, nearer the loss) while it holds fewer than
    ``2 * num_stages`` chunk activations (the memory of 1F1B's first stage), else a pending W, which fills what would
    otherwise be a bubble. Costs are equal units (F = B = W), the case the V shape is designed for. These priorities
    reach the lower bound (the last stage idles only for its first ``num_stages - 1`` forwards) at m = 2S for S in
    {2, 4}; other orders tried (chunk 1's B first, chunk 0's F first) lose one to four units.
    """
    layout = Layout(num_stages, 2, "v")
    limit = 2 * num_stages
    done: dict[tuple[str, int, int], int] = {}  # (kind, virtual, mb) -> finish time
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(num_stages)]
    alive = [0] * num_stages
    next_f = [[0, 0] for _ in range(num_stages)]
    next_b = [[0, 0] for _ in range(num_stages)]
    acts: list[list[Action]] = [[] for _ in range(num_stages)]
    last = layout.num_virtual - 1
    t = 0
    remaining = 3 * 2 * m * num_stages
    while remaining:
        if t > 12 * m * num_stages:  # every action is ready within a few units of its predecessors
            raise AssertionError(f"zero-bubble V plan did not complete (S={num_stages}, m={m})")
        for s in range(num_stages):
            choice = None
            for chunk in (0, 1):
                v, mb = layout.virtual(s, chunk), next_b[s][chunk]
                if (
                    mb < m
                    and done.get(("F", v, mb), t + 1) <= t
                    and (v == last or done.get(("B", v + 1, mb), t + 1) <= t)
                ):
                    choice = Action("B", chunk, mb)
                    break
            if choice is None and alive[s] < limit:
                for chunk in (1, 0):
                    v, mb = layout.virtual(s, chunk), next_f[s][chunk]
                    if mb < m and (v == 0 or done.get(("F", v - 1, mb), t + 1) <= t):
                        choice = Action("F", chunk, mb)
                        break
            if choice is None and pending_w[s]:
                chunk, mb = pending_w[s].pop(0)
                choice = Action("W", chunk, mb)
            if choice is None:
                continue
            v = layout.virtual(s, choice.chunk)
            done[(choice.kind, v, choice.mb)] = t + 1
            acts[s].append(choice)
            remaining -= 1
            if choice.kind == "F":
                next_f[s][choice.chunk] += 1
                alive[s] += 1
            elif choice.kind == "B":
                next_b[s][choice.chunk] += 1
                pending_w[s].append((choice.chunk, choice.mb))
            else:
                alive[s] -= 1
        t += 1
    return Plan(layout, m, tuple(tuple(a) for a in acts), True)


def simulate(
    plan: Plan, cost: dict[str, float] | None = None
) -> tuple[list[list[tuple[Action, float, float]]], float]:
    """Run ``plan`` with per-action costs (per chunk; default 1 each) and free communication.

    Returns each stage's (action, start, end) list and the predicted bubble fraction. Raises ValueError naming the
    stuck actions when the plan would deadlock (an action waits for one that comes after it on its stage).
    """
    cost = cost or {"F": 1.0, "B": 1.0, "W": 1.0}
    lay, m = plan.layout, plan.num_microbatches
    if not plan.split_backward:
        cost = {**cost, "B": cost["B"] + cost.get("W", 0.0)}
    finish: dict[tuple[str, int, int], float] = {}
    pos = [0] * lay.num_stages
    clock = [0.0] * lay.num_stages
    out: list[list[tuple[Action, float, float]]] = [[] for _ in range(lay.num_stages)]
    last = lay.num_virtual - 1
    progressed = True
    while progressed:
        progressed = False
        for s, acts in enumerate(plan.actions):
            while pos[s] < len(acts):
                a = acts[pos[s]]
                v = lay.virtual(s, a.chunk)
                if a.kind == "F":
                    deps = [] if v == 0 else [("F", v - 1, a.mb)]
                elif a.kind == "B":
                    deps = [("F", v, a.mb)] + ([] if v == last else [("B", v + 1, a.mb)])
                else:
                    deps = [("B", v, a.mb)]
                if any(d not in finish for d in deps):
                    break
                start = max([clock[s]] + [finish[d] for d in deps])
                clock[s] = start + cost[a.kind]
                finish[(a.kind, v, a.mb)] = clock[s]
                out[s].append((a, start, clock[s]))
                pos[s] += 1
                progressed = True
    stuck = [f"stage {s}: {acts[pos[s]]}" for s, acts in enumerate(plan.actions) if pos[s] < len(acts)]
    if stuck:
        raise ValueError(
            f"pipeline plan deadlocks (m={m}, stages={lay.num_stages}); waiting: {', '.join(stuck)}"
        )
    expected = m * lay.num_chunks * (3 if plan.split_backward else 2)
    for s, acts in enumerate(plan.actions):
        if len(acts) != expected or len(set(acts)) != expected:
            raise ValueError(
                f"pipeline plan: stage {s} has {len(acts)} actions ({len(set(acts))} distinct), "
                f"expected {expected}"
            )
    span = max(clock)
    busy = sum(e - b for stage in out for _, b, e in stage)
    return out, 1.0 - busy / (span * lay.num_stages)
