#!/usr/bin/env python
"""The planner's predictions against measured runs: each configuration trained for a few steps in a fresh
process (lazy init, cai kernels, HybridAdam, accumulation under no_sync), its GPU peak (torch's allocator), host
peak (the process's resident set) and tokens/s set beside what ``cai.booster.plan`` predicted for it.

Prints one markdown table; writes ``$OUT/bench_plan.json`` when ``OUT`` is set. ``--calibrate`` measures the
machine first (``cai plan --calibrate``) and uses that calibration for the predictions.

Examples::

    python examples/benchmarks/bench_plan.py --calibrate                      # every row, one H200
    python examples/benchmarks/bench_plan.py --rows 1b-zero2,3b-gemini-host16  # some rows
    python examples/benchmarks/bench_plan.py --rows tiny-zero2 --device cpu    # CPU smoke
    # the planner's pick for 8b on 24 GiB of GPU and 120 GiB of host, run with the allocator capped at 24 GiB
    python examples/benchmarks/bench_plan.py --pick 8b --gpu-mem 24 --host-mem 120 --gpu-cap 24
    python examples/benchmarks/bench_plan.py --pick 8b --largest --gpu-mem 132   # the deepest 8b-wide model that fits
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples' shared helpers

GiB = 1024**3


@dataclass(frozen=True)
class Row:
    name: str
    model: str  # preset of examples/_models.py and of the planner, or a model directory
    candidate: dict  # cai.booster._plan.Candidate fields


def _c(plugin, recompute, mb, acc=1, **kw) -> dict:
    return dict(plugin=plugin, recompute=recompute, micro_batch=mb, accumulation=acc, **kw)


ROWS = [
    Row("1b-zero2", "1b", _c("zero2", "none", 8)),
    Row("1b-gemini", "1b", _c("gemini", "none", 8)),
    Row("1b-fsdp", "1b", _c("fsdp", "none", 8)),
    Row("1b-ddp", "1b", _c("ddp", "none", 4)),
    Row("1b-zero2-selective-accum", "1b", _c("zero2", "selective", 4, 2)),
    Row("1b-zero2-selective", "1b", _c("zero2", "selective", 8)),
    Row("1b-zero2-accum", "1b", _c("zero2", "none", 4, 2)),
    Row("3b-zero2-full", "3b", _c("zero2", "full", 4)),
    Row("3b-gemini-host", "3b", _c("gemini", "full", 4, offload_optim_frac=1.0)),
    Row("3b-zero2-host", "3b", _c("zero2", "full", 4, offload=True)),
    Row("3b-gemini-host16", "3b", _c("gemini", "full", 16, offload_optim_frac=1.0)),
    Row("3b-zero2-full16", "3b", _c("zero2", "full", 16)),
    Row("8b-zero2-full", "8b", _c("zero2", "full", 2)),
    Row("8b-zero2-none-accum", "8b", _c("zero2", "none", 1, 2)),
    Row("8b-zero2-none-accum8", "8b", _c("zero2", "none", 1, 8)),
    Row("8b-zero2-offload", "8b", _c("zero2", "none", 2, offload_activations=0.25)),
    Row("8b-zero2-full-offload", "8b", _c("zero2", "full", 2, offload_activations=0.25)),
    Row(
        "8b-gemini-host-params", "8b", _c("gemini", "full", 8, offload_optim_frac=0.9, offload_param_frac=1.0)
    ),
    Row("tiny-zero2", "tiny", _c("zero2", "none", 2)),
    Row("tiny-gemini", "tiny", _c("gemini", "full", 2, 2)),
]
TINY_SHAPE = dict(hidden=128, layers=2, ffn=344, vocab=1024, heads=4, kv_heads=4)


def measure(row: Row, args: argparse.Namespace) -> dict:
    """Train ``row`` in this process; return its measurements."""
    import torch
    from _models import preset_config

    from cai.booster import Booster, LazyInitContext, activation_checkpointing
    from cai.booster._plan import Candidate
    from cai.kernels import patch_hf_model
    from cai.kernels.optim import HybridAdam
    from cai.mesh import launch_from_torch

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    launch_from_torch(seed=1234, verbose=False)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if (
        cuda and args.gpu_cap
    ):  # the allocator may hold no more than the budget (it frees its cache and retries)
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(args.gpu_cap * GiB / total, torch.cuda.current_device())
    precision = "bf16" if cuda else "fp32"
    c = Candidate(**row.candidate)
    config = preset_config(row.model, max_seq=args.seq)
    config.use_cache = False
    plugin = c.plugin_call(precision).build()
    booster = Booster(
        plugin=plugin, device=device, **({"mixed_precision": precision} if c.plugin == "ddp" else {})
    )
    from transformers import LlamaForCausalLM

    with LazyInitContext(default_device=device), torch.device(device):  # initialisation replays on the GPU
        model = LlamaForCausalLM(config)
    if c.recompute != "none" or c.offload_activations:
        activation_checkpointing(model, c.recompute, offload=c.offload_activations)
    if args.kernels:
        patch_hf_model(model)
    opt = (
        torch.optim.AdamW(model.parameters(), lr=1e-5)
        if c.plugin == "fsdp"
        else HybridAdam(model.parameters())
    )
    model, opt, *_ = booster.boost(model, opt)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(1, config.vocab_size, (c.micro_batch, args.seq), generator=gen).to(device)
               for _ in range(c.accumulation)]  # fmt: skip

    def step() -> None:
        for i, b in enumerate(batches):
            last = i == len(batches) - 1
            with booster.no_sync(model, opt) if not last else contextlib.nullcontext():
                loss = model(input_ids=b, labels=b).loss / len(batches)
                booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()

    times = []
    for i in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    s = statistics.median(times)
    gemini = getattr(model, "_cai_gemini", None)
    extra = {}
    if gemini is not None:  # cai-gemini's own account of its model data, by kind, for a wrong prediction
        t = gemini.tracker
        extra["gemini_gib"] = {
            loc: {k: round(v / GiB, 3) for k, v in kinds.items() if v} for loc, kinds in t.bytes.items()
        }
        extra["gemini_peak_model_device_gib"] = round(t.peak_model_device / GiB, 3)
    return {
        **extra,
        "step_s": s,
        "tokens_per_s": c.accumulation * c.micro_batch * args.seq / s,
        "gpu_gib": torch.cuda.max_memory_allocated() / GiB if cuda else None,
        "gpu_reserved_gib": torch.cuda.max_memory_reserved() / GiB if cuda else None,
        "host_gib": _host_peak_bytes() / GiB,
    }


def _error_line(stderr: str) -> str:
    """The exception of a failed child: its last line that names an error (warnings at exit come after it)."""
    lines = stderr.strip().splitlines() or ["?"]
    return next((x for x in reversed(lines) if "Error" in x), lines[-1])[:200]


def _host_peak_bytes() -> int:
    """This process's peak resident set: VmHWM belongs to the address space made at exec, whereas ru_maxrss
    carries over the parent's peak at fork."""
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmHWM:"))


def predict(row: Row, args: argparse.Namespace, hw) -> dict:
    from cai.booster._plan import Candidate, ModelSpec, plan
    from cai.gemini import TransformerShape

    c = Candidate(**row.candidate)
    model = (
        ModelSpec.from_shape(TransformerShape(**TINY_SHAPE), name="tiny")
        if row.model == "tiny"
        else row.model
    )
    cuda = args.device == "cuda"
    p = plan(model, seq_len=args.seq, global_batch=c.micro_batch * c.accumulation, hardware=hw,
             precision="bf16" if cuda else "fp32", kernels=args.kernels, device=args.device,
             plugins=(c.plugin,), recompute=(c.recompute,), micro_batches=(c.micro_batch,),
             offload_activations=(c.offload_activations,))  # fmt: skip
    r = next(r for r in p.rows if r.candidate == c)
    return {"gpu_gib": r.gpu_bytes / GiB, "host_gib": r.host_bytes / GiB, "tokens_per_s": r.tokens_per_s,
            "label": c.label}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--rows", default=None, help=f"comma list (default: all but tiny): {', '.join(r.name for r in ROWS)}"
    )
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--calibrate", action="store_true", help="measure the machine first and store it")
    ap.add_argument(
        "--gpu-cap",
        type=float,
        default=None,
        help="GiB the allocator may hold (torch's per-process fraction)",
    )
    ap.add_argument(
        "--pick",
        default=None,
        metavar="MODEL",
        help="instead of --rows: run the configuration `cai plan` picks for MODEL under --gpu-mem, --host-mem and "
        "--global-batch",
    )
    ap.add_argument(
        "--largest", action="store_true", help="with --pick: the deepest model of MODEL's width that fits"
    )
    ap.add_argument("--gpu-mem", type=float, default=None, help="GiB of GPU budget for --pick")
    ap.add_argument("--host-mem", type=float, default=None, help="GiB of host budget for --pick")
    ap.add_argument("--global-batch", type=int, default=None, help="sequences a step for --pick")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(measure(Row(**json.loads(args.child)), args)), flush=True)
        return
    from cai.booster._plan import Hardware, calibrate

    hw = None
    if args.calibrate:
        hw = calibrate(log=lambda m: print(m, flush=True))
        print(f"stored in {hw.save()}: {json.dumps(hw.to_json())}", flush=True)
    hw = hw or Hardware.load() or Hardware.h200()
    by_name = {r.name: r for r in ROWS}
    if args.pick:
        rows = [picked_row(args, hw)]
    else:
        names = args.rows.split(",") if args.rows else [r.name for r in ROWS if not r.name.startswith("tiny")]
        rows = [by_name[name] for name in names]
    results = []
    for row in rows:
        name = row.name
        pred = predict(row, args, hw)
        cmd = [sys.executable, __file__, "--child", json.dumps(asdict(row)), "--seq", str(args.seq),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device]  # fmt: skip
        cmd += ([] if args.kernels else ["--no-kernels"]) + (
            ["--gpu-cap", str(args.gpu_cap)] if args.gpu_cap else []
        )
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        meas = json.loads(line[7:]) if line else {"error": _error_line(proc.stderr)}
        if not line:
            print(proc.stderr[-4000:], flush=True)
        results.append({"row": asdict(row), "predicted": pred, "measured": meas})
        print(f"{name}: {time.time() - t0:.0f} s; predicted {pred}; measured {meas}", flush=True)
    print(f"\n{hw.device}; rates: {hw.source}; sequence {args.seq}\n")
    print(table(results))
    out = os.environ.get("OUT")
    if out:
        path = Path(out) / "bench_plan.json"
        path.write_text(json.dumps({"hardware": hw.to_json(), "results": results}, indent=2))
        print(f"wrote {path}")


def picked_row(args: argparse.Namespace, hw) -> Row:
    """The plan's best configuration of ``args.pick`` under the budgets; with ``--largest``, of the deepest
    model of its width that fits, whose config is written to a temporary model directory."""
    import tempfile

    from _models import preset_config

    from cai.booster._plan import largest_model, plan

    budgets = dict(
        gpu_budget_bytes=int(args.gpu_mem * GiB) if args.gpu_mem else None,
        host_budget_bytes=int(args.host_mem * GiB) if args.host_mem else None,
        global_batch=args.global_batch,
        seq_len=args.seq,
        hardware=hw,
        kernels=args.kernels,
    )
    if args.largest:
        p = largest_model(args.pick, log=lambda m: print(m, flush=True), **budgets)
    else:
        p = plan(args.pick, **budgets)
    print(p.render(limit=5), flush=True)
    if p.best is None:
        raise SystemExit(f"bench_plan: {p.summary()}")
    model, name = args.pick, f"{args.pick} pick"
    if args.largest:
        config = preset_config(args.pick, max_seq=args.seq)
        config.num_hidden_layers = p.model.shape.layers
        model = tempfile.mkdtemp(prefix="cai-largest-")
        config.save_pretrained(model)
        name = f"largest {args.pick} ({p.model.shape.layers} layers, {p.model.params / 1e9:.2f}B)"
    return Row(name, model, asdict(p.best.candidate))


def table(results: list[dict]) -> str:
    def ratio(p, m):
        return f"{p / m - 1:+.0%}" if p and m else ""

    head = ["row", "configuration", "GPU GiB pred / reserved (allocated)", "err", "host GiB pred / meas", "err",
            "tok/s pred / meas", "err"]  # fmt: skip
    # the GPU error is against what the allocator reserved from the device (what a budget must hold); the
    # allocated peak is shown beside it
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        p, m = r["predicted"], r["measured"]
        if "error" in m:
            lines.append(f"| {r['row']['name']} | {p['label']} | {m['error']} | | | | | |")
            continue
        gpu = (
            f"{p['gpu_gib']:.1f} / {m['gpu_reserved_gib']:.1f} ({m['gpu_gib']:.1f})" if m["gpu_gib"] else "-"
        )
        lines.append(
            f"| {r['row']['name']} | {p['label']} | {gpu} | {ratio(p['gpu_gib'], m['gpu_reserved_gib'])} | "
            f"{p['host_gib']:.1f} / {m['host_gib']:.1f} | {ratio(p['host_gib'], m['host_gib'])} | "
            f"{p['tokens_per_s']:,.0f} / {m['tokens_per_s']:,.0f} | {ratio(p['tokens_per_s'], m['tokens_per_s'])} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
