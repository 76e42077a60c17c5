"""What ran when: per-rank records of each F/B/W of a pipeline step, as text, a Chrome trace and a bubble fraction."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch.distributed as dist


@dataclass(frozen=True)
class Event:
    stage: int
    kind: str  # "F", "B" or "W"
    chunk: int
    mb: int
    start: float  # seconds since the step began on this rank (time.perf_counter, a monotonic clock)
    end: float


@dataclass
class Timeline:
    """The events of one step, for one stage or (after :meth:`gather`) for all of them.

    Each rank's clock starts when the step begins, right after a barrier over the pipeline group, so the stages'
    times are comparable to within the barrier's exit skew. Events cover the compute of each action; time spent
    waiting for a peer's message is outside every event.

    [Note: measured bubble]
    The bubble is the time stages spend idle: waiting for a peer's message, or done while the slowest stage still
    runs. ``bubble_fraction = 1 - sum_s (span_s - wait_s) / (S * max_s span_s)``. Python bookkeeping between actions
    counts as busy, not as bubble, so the measure compares schedules rather than the host's speed.
    """

    num_stages: int
    events: list[Event] = field(default_factory=list)
    span: dict[int, float] = field(default_factory=dict)  # stage -> end of its step
    wait: dict[int, float] = field(default_factory=dict)  # stage -> time spent waiting for peers' messages

    def gather(self, group: dist.ProcessGroup | None = None) -> Timeline:
        """All stages' events on every rank of ``group`` (collective)."""
        parts: list[Timeline | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, self, group=group)
        events = sorted((e for p in parts if p for e in p.events), key=lambda e: (e.stage, e.start))
        span = {k: v for p in parts if p for k, v in p.span.items()}
        wait = {k: v for p in parts if p for k, v in p.wait.items()}
        return Timeline(self.num_stages, events, span, wait)

    def bubble_fraction(self) -> float:
        """Idle share of the step over the stages recorded (see [Note: measured bubble])."""
        total = max(self.span.values()) * len(self.span)
        busy = sum(v - self.wait.get(k, 0.0) for k, v in self.span.items())
        return 1.0 - busy / total if total > 0 else 0.0

    def text(self, width: int = 100) -> str:
        """One line per stage: each event as its kind letter (lower case for chunk 1 and up), gaps as dots."""
        total = max(self.span.values())
        lines = []
        for stage in sorted(self.span):
            row = ["."] * width
            for e in self.events:
                if e.stage != stage:
                    continue
                a, b = (
                    int(e.start / total * width),
                    max(int(e.end / total * width), int(e.start / total * width) + 1),
                )
                ch = e.kind if e.chunk == 0 else e.kind.lower()
                for i in range(a, min(b, width)):
                    row[i] = ch
            lines.append(f"stage {stage:>2} |{''.join(row)}|")
        lines.append(f"bubble {self.bubble_fraction():.3f} over {total * 1e3:.1f} ms")
        return "\n".join(lines)

    def chrome_trace(self) -> dict:
        """Chrome trace events (``chrome://tracing``, Perfetto): one thread per stage, times in microseconds."""
        return {
            "traceEvents": [
                {
                    "name": f"{e.kind}{e.chunk}.{e.mb}",
                    "cat": e.kind,
                    "ph": "X",
                    "pid": 0,
                    "tid": e.stage,
                    "ts": e.start * 1e6,
                    "dur": (e.end - e.start) * 1e6,
                    "args": asdict(e),
                }
                for e in self.events
            ],
            "otherData": {"bubble_fraction": self.bubble_fraction()},
        }

    def save_chrome_trace(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.chrome_trace()))
