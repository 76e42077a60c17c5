"""Schedules on gloo against the same model trained in one process, activation memory, bubble, and bad input.

One spawn per pipeline size runs the whole matrix (schedules x micro-batch counts) in a loop.
"""

from __future__ import annotations

import json
import time
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cai.mesh.testing import run_distributed
from cai.pipeline import InterleavedSchedule, PipelineP2P, build_schedule, split_batch
from cai.pipeline._plan import gpipe, interleaved, one_f_one_b, simulate, zero_bubble_v

WIDTH, BLOCKS, BATCH, STEPS = 32, 8, 16, 10


class Blocks(nn.Module):
    """A run of tanh-MLP blocks following the stage contract; the first one reads ``batch["x"]``."""

    def __init__(self, blocks: list[nn.Module], first: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.first = first
        self.tracker: _SavedTracker | None = None

    def forward(self, hidden, batch):
        if self.first:
            assert hidden is None
            h = batch["x"]
        else:
            # non-tensor values, None and integer tensors travel with the activations
            assert hidden["tag"] == "mlp" and hidden["aux"] is None and hidden["pos"].dtype == torch.int64
            h = hidden["h"]
        ctx = (
            self.tracker.hooks(batch) if self.tracker else torch.autograd.graph.saved_tensors_hooks(_id, _id)
        )
        with ctx:
            for b in self.blocks:
                h = torch.tanh(b(h)) + h
        return {"h": h, "aux": None, "tag": "mlp", "pos": batch["idx"]}


def _id(x):
    return x


def _criterion(out, batch):
    return ((out["h"][:, :4] - batch["y"]) ** 2).mean()


class _Holder:
    def __init__(self, t, mb):
        self.t, self.mb = t, mb


class _SavedTracker:
    """Counts micro-batches whose saved activations are alive (packed by autograd and not yet freed)."""

    def __init__(self) -> None:
        self.live: weakref.WeakSet[_Holder] = weakref.WeakSet()
        self.max_mbs = 0

    def hooks(self, batch):
        mb = int(batch["idx"][0]) // len(batch["idx"])

        def pack(t):
            h = _Holder(t, mb)
            self.live.add(h)
            self.max_mbs = max(self.max_mbs, len({x.mb for x in self.live}))
            return h

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.t)


def _model() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS)]


def _batches():
    g = torch.Generator().manual_seed(1)
    return [
        {
            "x": torch.randn(BATCH, WIDTH, generator=g),
            "y": torch.randn(BATCH, 4, generator=g),
            "idx": torch.arange(BATCH),
        }
        for _ in range(STEPS)
    ]


def _reference():
    blocks = _model()
    model = Blocks(blocks, first=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in _batches():
        loss = _criterion(model(None, batch), batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, blocks


def _chunks(schedule, pp: int) -> tuple[list[Blocks], list[int]]:
    """This rank's chunks of the 8 blocks, and the block indices each holds."""
    lay = schedule.plan(schedule.num_microbatches).layout
    per = BLOCKS // lay.num_virtual
    blocks = _model()
    chunks, owned = [], []
    for c in range(lay.num_chunks):
        v = lay.virtual(schedule.stage, c)
        chunks.append(Blocks(blocks[v * per : (v + 1) * per], first=v == 0))
        owned += list(range(v * per, (v + 1) * per))
    return chunks, owned


def _parity_matrix(pp: int):
    ref_losses, ref_blocks = _reference()
    report = {}
    for name in ("gpipe", "1f1b", "interleaved", "zbv"):
        for m in (pp, 2 * pp):
            schedule = build_schedule(name, num_microbatches=m)
            chunks, owned = _chunks(schedule, pp)
            params = [p for c in chunks for p in c.parameters()]
            opt = torch.optim.AdamW(params, lr=1e-2)
            tracker = _SavedTracker() if name in ("gpipe", "1f1b") else None
            for c in chunks:
                c.tracker = tracker
            losses = []
            data = iter(_batches())
            for _ in range(STEPS):
                out = schedule.forward_backward_step(chunks, data, _criterion, opt, return_outputs=True)
                opt.step()
                opt.zero_grad()
                losses.append(out["loss"].item())
                last = schedule.plan(m).layout.place(pp * len(chunks) - 1)[0]
                assert (out["outputs"] is not None) == (schedule.stage == last)
            for got, want in zip(losses, ref_losses, strict=True):
                assert abs(got - want) <= 1e-5 * abs(want), (name, m, losses, ref_losses)
            mine = dict(zip(owned, [b for c in chunks for b in c.blocks], strict=True))
            for i, block in mine.items():
                for (n, p), q in zip(block.named_parameters(), ref_blocks[i].parameters(), strict=True):
                    torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"{name} m={m} block {i} {n}")
            if tracker is not None:
                report[(name, m)] = tracker.max_mbs
            bytes_per_mb = {k: v // (STEPS * m) for k, v in schedule.p2p_bytes.items()}
            report[(name, m, "bytes")] = bytes_per_mb
    return report


@pytest.mark.parametrize("pp", [2, 4])
def test_schedules_match_one_process_and_bound_activation_memory(pp):
    reports = run_distributed(_parity_matrix, pp, pp, timeout=300)
    for stage, report in enumerate(reports):
        for m in (pp, 2 * pp):
            assert report[("gpipe", m)] == m, (stage, report)
            # 1F1B: stage i holds at most pp - i micro-batches' activations, and really reaches that many
            assert report[("1f1b", m)] == min(pp - stage, m), (stage, report)


def test_plans_simulate_to_the_textbook_bubbles():
    for p in (2, 4):
        for m in (p, 2 * p):
            assert simulate(gpipe(p, m))[1] == pytest.approx((p - 1) / (m + p - 1))
            assert simulate(one_f_one_b(p, m))[1] == pytest.approx((p - 1) / (m + p - 1))
            half = {"F": 0.5, "B": 0.5, "W": 0.5}
            assert simulate(interleaved(p, m, 2), half)[1] == pytest.approx((p - 1) / (2 * m + p - 1))
        # zero-bubble V at m = 2p: only the last stage's start-up wait (p - 1 chunk forwards) is left
        zbv = simulate(zero_bubble_v(p, 2 * p), half)[1]
        assert zbv == pytest.approx(1 - 6 * 2 * p * p / (p * (12 * p + p - 1)))
        assert zbv < simulate(one_f_one_b(p, 2 * p))[1] / 4


def test_bad_input_fails_before_the_first_step():
    with pytest.raises(
        ValueError, match=r"unknown pipeline schedule 'pipedream'; choose one of \['1f1b', 'gpipe'"
    ):
        build_schedule("pipedream", num_microbatches=4)
    with pytest.raises(ValueError, match="exactly one of num_microbatches and microbatch_size"):
        build_schedule("1f1b")
    with pytest.raises(
        ValueError, match=r"batch size 10 is not divisible by num_microbatches=4.*\[1, 2, 5, 10\]"
    ):
        split_batch({"x": torch.zeros(10, 3)}, num_microbatches=4)
    with pytest.raises(ValueError, match="batch size 10 is not divisible by microbatch_size=4"):
        split_batch({"x": torch.zeros(10, 3)}, microbatch_size=4)
    with pytest.raises(ValueError, match="deadlocks"):
        from cai.pipeline._plan import Plan

        bad = one_f_one_b(2, 2)
        simulate(Plan(bad.layout, 2, (bad.actions[0][::-1], bad.actions[1]), False))
    assert run_distributed(_bad_input_on_two_stages, 2) == [True, True]


def _bad_input_on_two_stages():
    with pytest.raises(
        ValueError, match=r"3 micro-batches is not a multiple of the 2 pipeline stages; use 4"
    ):
        InterleavedSchedule(None, 2, num_microbatch=3)
    schedule = build_schedule("interleaved", microbatch_size=4)
    chunks = [Blocks(_model()[:2], first=dist.get_rank() == 0), Blocks(_model()[2:4], first=False)]
    batch = {"x": torch.zeros(12, WIDTH), "y": torch.zeros(12, 4), "idx": torch.arange(12)}
    with pytest.raises(ValueError, match=r"3 micro-batches is not a multiple of the 2 pipeline stages"):
        schedule.forward_backward_step(chunks, iter([batch]), _criterion)
    one = build_schedule("1f1b", num_microbatches=4)
    batch = {"x": torch.zeros(10, WIDTH), "y": torch.zeros(10, 4), "idx": torch.arange(10)}
    with pytest.raises(ValueError, match="batch size 10 is not divisible by num_microbatches=4"):
        one.forward_backward_step(chunks[:1], iter([batch]), _criterion)
    assert all(p.grad is None for c in chunks for p in c.parameters())
    # forward only (grad disabled): the plan's forwards alone, the loss of the model in one process
    stage = Blocks(_model()[:2], first=True) if dist.get_rank() == 0 else Blocks(_model()[2:4], first=False)
    batch = _batches()[0]
    with torch.no_grad():
        out = one.forward_backward_step(stage, iter([batch]), _criterion, return_outputs=True)
        want = _criterion(Blocks(_model()[:4], first=True)(None, batch), batch)
    assert abs(out["loss"].item() - want.item()) <= 1e-6 * abs(want.item())
    assert (out["outputs"] is not None) == (dist.get_rank() == 1)
    # a batch carrying the step's token count sums its micro-batches' losses ([Note: token-weighted pipeline loss])
    with torch.no_grad():
        out = one.forward_backward_step(stage, iter([{**batch, "num_items_in_batch": 7}]), _criterion)
        full = Blocks(_model()[:4], first=True)
        want = sum(_criterion(full(None, mb), mb) for mb in split_batch(batch, num_microbatches=4))
    assert abs(out["loss"].item() - want.item()) <= 1e-6 * abs(want.item())
    assert all(p.grad is None for p in stage.parameters())
    with pytest.raises(ValueError, match="num_items_in_batch in a pipeline batch must be a number or a 0-d"):
        one.forward_backward_step(stage, iter([{**batch, "num_items_in_batch": torch.ones(2)}]), _criterion)
    return True


# ---- bubble: a deterministic cost model of sleeps ----------------------------------------------------------------
# [Note: bubble test and latency]
# The sleeps are the cost model: one unit is a chunk's forward, input-gradient or weight-gradient at two chunks per
# stage (one chunk: F = 2, B = 4 units), 30 times the runtime's own cost per action (measured with no sleeps), at
# least 4 ms. P2P latency on the critical path is idle time the sleeps do not model, and plans with little slack feel
# it most: in the unit-cost simulation a latency of 0.1 unit raises 1F1B's bubble at S = 4, m = 8 from 0.273 to
# 0.306 and zero-bubble V's from 0.059 to 0.118. So the measured bubbles are compared with the plan's simulation at
# the measured latency (ping-pong between stages 0 and 1), and 1F1B also with its formula, which it meets within 10%
# at the latencies seen even on a loaded host; the formulas at zero latency (interleaved halves the bubble, the V is
# below a quarter of 1F1B's at m = 2S) are checked on the plans in test_plans_simulate_to_the_textbook_bubbles. The
# measured V is only required to be below half of 1F1B's: on a host with 2 cores and a load of 15, latency and late
# wake-ups put it 0.03 above its simulation at S = 4 (0.11-0.12 against 0.09), which 10% cannot hold. Interleaved
# runs twice the actions of 1F1B, each half as long, so the runtime's own cost per action and late wake-ups weigh
# twice as much: on such a host it measured 0.134 against a simulated 0.114-0.118 at S = 2, m = 4 in three retries
# in a row. Its rows get 0.025 of slack, and must also stay below 0.8 of 1F1B's measured bubble at the same m.
MIN_UNIT, MAX_UNIT = 0.004, 0.04
ROWS = [("1f1b", 1), ("1f1b", 2), ("interleaved", 1), ("interleaved", 2), ("zbv", 2)]  # (schedule, m / S)


class _Sleep(torch.autograd.Function):
    """Identity whose backward sleeps: costs a backward on the path it sits on, and only there."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.seconds)
        return g, None


class SleepStage(nn.Module):
    """F sleeps ``f``; B (input gradient) and W (weight gradient) sleep ``b`` each, on their own autograd paths."""

    def __init__(self, f: float, b: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(WIDTH))
        self.u = nn.Parameter(torch.ones(WIDTH))  # the first stage's input gradient path ends here
        self.f, self.b = f, b

    def forward(self, hidden, batch):
        time.sleep(self.f)
        h = _Sleep.apply(batch["x"] * self.u if hidden is None else hidden["h"], self.b)
        return {"h": h * _Sleep.apply(self.w, self.b)}


def _overhead_per_action(pp: int) -> float:
    schedule = build_schedule("1f1b", num_microbatches=2 * pp)
    batch = {"x": torch.ones(2 * pp, WIDTH)}
    stage = SleepStage(0.0, 0.0)
    spans = []
    for _ in range(3):
        t0 = time.perf_counter()
        schedule.forward_backward_step(stage, iter([batch]), lambda out, _b: out["h"].mean())
        spans.append(time.perf_counter() - t0)
    per = torch.tensor([min(spans) / (2 * 2 * pp)])
    dist.all_reduce(per, op=dist.ReduceOp.MAX)
    return per.item()


def _latency() -> float:
    """Median one-way time of a small activation message between stages 0 and 1 (ping-pong), in seconds."""
    p2p, rank, x = PipelineP2P(), dist.get_rank(), {"h": torch.ones(4, WIDTH)}
    times = []
    for _ in range(21):
        t0 = time.perf_counter()
        if rank == 0:
            p2p.send(x, 1, "fwd")
            p2p.recv(1, "bwd")
        elif rank == 1:
            p2p.recv(0, "fwd")
            p2p.send(x, 0, "bwd")
        times.append((time.perf_counter() - t0) / 2)
    p2p.wait_sends()
    lat = torch.tensor([sorted(times)[len(times) // 2]])
    dist.broadcast(lat, 0)
    return lat.item()


def _bubbles_agree(pp: int, rows) -> bool:
    """The measured bubbles against the plans' simulation and 1F1B's formula (see [Note: bubble test and latency])."""

    def within(got: float, want: float, floor: float = 0.015) -> bool:
        # 10%, or one step's noise from wake-ups on a loaded host
        return abs(got - want) <= max(0.1 * want, floor)

    got = {(n, m): b for n, m, b, _ in rows}
    return (
        all(within(b, want) for n, _, b, want in rows if n == "1f1b")
        and all(within(b, (pp - 1) / (m + pp - 1)) for n, m, b, _ in rows if n == "1f1b")
        and all(within(b, want, 0.025) for n, _, b, want in rows if n == "interleaved")
        and all(b < 0.8 * got[("1f1b", m)] for n, m, b, _ in rows if n == "interleaved")
        # the V has no slack, so latency and wake-ups move it most: at least half 1F1B's bubble must go
        and got[("zbv", 2 * pp)] < got[("1f1b", 2 * pp)] / 2
    )


def _bubble_table(pp: int, trace: str):
    unit = min(max(30 * _overhead_per_action(pp), MIN_UNIT), MAX_UNIT)
    latency = _latency() / unit
    runs = []
    for name, k in ROWS:
        m = k * pp
        schedule = build_schedule(name, num_microbatches=m, record_timeline=True)
        c = 1 if name == "1f1b" else 2
        chunks = [SleepStage(0.0, 0.0) for _ in range(c)]
        batch = {"x": torch.ones(m, WIDTH)}
        # the first step exchanges the metadata, without sleeps
        schedule.forward_backward_step(chunks, iter([batch]), lambda out, _b: out["h"].mean())
        cost = {kind: 2.0 / c for kind in "FBW"}
        predicted = simulate(schedule.plan(m), cost, latency)[1]
        runs.append((name, m, schedule, chunks, batch, c, predicted, []))
    # Up to three measured steps of every row, each row keeping its least disturbed (a late wake-up on a busy host
    # only ever adds idle time); the next round runs only while the table does not agree yet. The bubbles come
    # from the gathered timeline, the same on every rank, so all ranks stop after the same round.
    for _ in range(3):
        for _name, _m, schedule, chunks, batch, c, _predicted, measured in runs:
            for chunk in chunks:
                chunk.f = chunk.b = 2 * unit / c
            schedule.forward_backward_step(chunks, iter([batch]), lambda out, _b: out["h"].mean())
            timeline = schedule.timeline.gather()
            measured.append((timeline.bubble_fraction(), timeline))
        rows = [
            (name, m, min(measured, key=lambda x: x[0])[0], predicted)
            for name, m, *_, predicted, measured in runs
        ]
        if _bubbles_agree(pp, rows):
            break
    timeline = next(min(r[-1], key=lambda x: x[0])[1] for r in runs if (r[0], r[1]) == ("zbv", 2 * pp))
    text = f"unit {unit * 1e3:.1f} ms, latency {latency:.3f} unit\n{timeline.text(60)}"
    if dist.get_rank() == 0:
        timeline.save_chrome_trace(trace)
    return rows, text


@pytest.mark.parametrize("pp", [2, 4])
def test_measured_bubble_follows_the_schedules(pp, tmp_path):
    for _ in range(3):  # sleeps on a loaded host: retry a measurement that a late wake-up spoiled
        rows, text = run_distributed(_bubble_table, pp, pp, str(tmp_path / "zbv.json"), timeout=300)[0]
        print(f"\npp={pp}|   schedule|  m|measured|simulated at latency|(p-1)/(m+p-1)|(p-1)/(2m+p-1)")
        for n, m, got, want in rows:
            f1, f2 = (pp - 1) / (m + pp - 1), (pp - 1) / (2 * m + pp - 1)
            print(f"pp={pp}|{n:>11}|{m:>3}|{got:8.3f}|{want:20.3f}|{f1:13.3f}|{f2:.3f}")
        print(text)
        ok = _bubbles_agree(pp, rows)
        if ok:
            break
    assert ok, rows
    trace = json.loads((tmp_path / "zbv.json").read_text())
    assert len(trace["traceEvents"]) == pp * 2 * (2 * pp) * 3  # every stage's F, B and W of both chunks
    assert {e["tid"] for e in trace["traceEvents"]} == set(range(pp))
    assert 0 <= trace["otherData"]["bubble_fraction"] < 1
