"""How much of one training step's communication is exposed: a profile of one step through the Booster, and the
share of the collective kernels' time during which no compute kernel runs on the GPU.

    torchrun --nproc_per_node 8 examples/benchmarks/profile_overlap.py -c 8b -p zero2 -b 1 -l 4096 -g
    python examples/benchmarks/profile_overlap.py --trace trace.json      # analyse a saved Chrome trace only

Each rank profiles one step after the warm-up; rank 0 writes the Chrome trace ($OUT/overlap_<plugin>_w<N>.json,
viewable in Perfetto or chrome://tracing) and prints the collective kernels' total time, the part of it that
overlaps compute kernels, and the exposed fraction. Collective kernels are the GPU kernels whose names start with
"nccl"; every other GPU kernel counts as compute. On CPU (gloo) the trace holds no GPU kernels and nothing is
measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _workloads
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the examples' shared helpers


@dataclass(frozen=True)
class Overlap:
    comm_us: float  # total time of collective kernels
    hidden_us: float  # of which some compute kernel was running
    compute_us: float  # union of compute kernel time

    @property
    def exposed_fraction(self) -> float:
        return 1.0 - self.hidden_us / self.comm_us if self.comm_us else 0.0


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _covered(interval: tuple[float, float], union: list[tuple[float, float]]) -> float:
    start, end = interval
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in union if a < end and b > start)


def analyse(trace: dict) -> Overlap:
    """Collective vs compute kernel overlap in a Chrome trace (``traceEvents`` with ``cat == "kernel"``)."""
    kernels = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e]
    comm = [
        (float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels if e["name"].startswith("nccl")
    ]
    compute = _union(
        [
            (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
            for e in kernels
            if not e["name"].startswith("nccl")
        ]
    )
    comm_union = _union(comm)
    return Overlap(
        comm_us=sum(b - a for a, b in comm_union),
        hidden_us=sum(_covered(iv, compute) for iv in comm_union),
        compute_us=sum(b - a for a, b in compute),
    )


def report(o: Overlap) -> str:
    if not o.comm_us:
        return "no collective kernels in the trace (one rank, or no GPU): nothing to measure"
    return (
        f"collectives {o.comm_us / 1e3:.1f} ms, {o.hidden_us / 1e3:.1f} ms of it under compute; exposed "
        f"{100 * o.exposed_fraction:.1f}% ({(o.comm_us - o.hidden_us) / 1e3:.1f} ms); compute {o.compute_us / 1e3:.1f} ms"
    )


def main(args: argparse.Namespace) -> None:
    import _workloads
    import torch
    import torch.distributed as dist
    from _launch import resolve_device
    from _models import preset_config
    from _plugins import PluginChoice
    from torch.profiler import ProfilerActivity, profile

    from cai.mesh import launch_from_torch

    device = resolve_device(args.device)
    launch_from_torch(seed=1234, verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    precision = "bf16" if device.type == "cuda" else "fp32"
    config = preset_config(args.config, max_seq=args.max_length)
    gen = torch.Generator().manual_seed(1234 + rank)
    batch = torch.randint(1, config.vocab_size, (args.batch_size, args.max_length), generator=gen).to(device)
    choice = PluginChoice(name=args.plugin, precision=precision)
    workload = _workloads.cai(
        config, batch, choice=choice, grad_ckpt=args.grad_checkpoint, kernels=True, lazy=True
    )
    for _ in range(args.warmup):
        workload.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        workload.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    if rank == 0:
        out = Path(os.environ.get("OUT", "."))
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"overlap_{args.plugin}_w{world}.json"
        prof.export_chrome_trace(str(path))
        print(
            f"{workload.name}, {world} ranks: {report(analyse(json.loads(path.read_text())))}; trace {path}"
        )
    workload.close()
    dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-c", "--config", default="8b")
    p.add_argument("-p", "--plugin", default="zero2", choices=("ddp", "fsdp", "zero1", "zero2", "gemini"))
    p.add_argument("-b", "--batch-size", type=int, default=1)
    p.add_argument("-l", "--max-length", type=int, default=4096)
    p.add_argument("-g", "--grad-checkpoint", action="store_true")
    p.add_argument("-i", "--warmup", type=int, default=2)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--trace", help="analyse this Chrome trace and exit (no training)")
    return p.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.trace:
        print(report(analyse(json.loads(Path(arguments.trace).read_text()))))
    else:
        from _launch import run

        run(main, arguments, nproc=1)
