#!/usr/bin/env python
"""Training throughput of a Llama through cai's Booster, with Colossal-AI's benchmark flags, optionally against
plain PyTorch eager, torch.compile and FSDP2 in the same process (``--compare``), each also with Liger-Kernel.

Prints one markdown table: tokens/s per GPU, MFU (6N + 12 L h s over 989 TFLOP/s), Colossal-AI's two TFLOPS
figures (Megatron-style with recomputation, and 2 (3 + ckpt) N per token), peak memory, and the ratio of each
row's tokens/s to each peer's. Writes ``$OUT/benchmark_<config>_<plugins>[_w<world>].json`` when ``OUT`` is set.

Examples::

    python examples/benchmarks/benchmark.py -c 1b -p zero2 -b 8 -l 2048 --compare           # one H200
    torchrun --nproc_per_node 8 examples/benchmarks/benchmark.py -c 8b -p zero2 -b 2 -g --compare --peers fsdp2
    python examples/benchmarks/benchmark.py -c 1b -b 8 -l 2048 -s 10 -i 3 -p zero2 --compare \
        --peers fsdp2,fsdp2-liger,compile,compile-liger                                      # fair peers
    python examples/benchmarks/benchmark.py -c tiny -b 2 -l 64 -s 3 -i 1 --compare         # CPU smoke
    python examples/benchmarks/benchmark.py -c 8b -b 2 -l 2048 -g -p zero2 --lazy --profile  # where time goes
    torchrun --nproc_per_node 8 examples/benchmarks/benchmark.py -c 8b -p hybrid --tp 2 --pp 2 -b 8 -g

Random weights, random tokens (never all zeros), labels = inputs. ``-b`` is the batch per data-parallel replica:
per GPU for the data-parallel plugins; with ``-p hybrid`` the tp x pp x sp ranks of one replica share it (as
Colossal-AI's benchmark counts it), and tokens/s per GPU is ``b x l x dp / world`` over the step time.

The ``-liger`` peers (``eager-liger``, ``compile-liger``, ``fsdp2-liger``) are the same peers with Liger-Kernel's
Llama kernels (RoPE, RMSNorm, SwiGLU and the fused linear cross-entropy, through the model's forward with
``labels=``); they need ``pip install liger-kernel``, and without it their rows say so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _workloads
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the examples' shared helpers

import torch
import torch.distributed as dist
from _launch import resolve_device, run
from _models import PRESETS, preset_config
from _perf import PEAK_FLOPS, ModelShape, Throughput, peak_memory_gib
from _plugins import PLUGINS, SP_MODES, HybridLayout, PluginChoice

# eager-pure: parameters in bf16, no fp32 master (opt-in); -liger: with Liger-Kernel's Llama kernels (opt-in)
PEERS = ("eager", "compile", "fsdp2", "eager-pure", "eager-liger", "compile-liger", "fsdp2-liger")
SHARDED_PEERS = ("fsdp2", "fsdp2-liger")  # run on every rank; the others at world size 1 only


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-c", "--config", default="1b", help=f"preset ({', '.join(PRESETS)}) or a config path")
    p.add_argument(
        "-p",
        "--plugin",
        default="zero2",
        help=f"one of {', '.join(PLUGINS)}, zero (LowLevelZero at --zero's stage), or a comma list: one row each",
    )
    p.add_argument(
        "--zero",
        type=int,
        choices=(0, 1, 2),
        default=None,
        help="ZeRO stage for -p zero (1 or 2, default 2) and -p hybrid (0, 1 or 2, default 1)",
    )
    p.add_argument("--tp", type=int, default=1, help="-p hybrid: tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="-p hybrid: pipeline stages (1F1B)")
    p.add_argument("--sp", type=int, default=1, help="-p hybrid: sequence-parallel axis size")
    p.add_argument(
        "--sp-mode",
        "--sp_mode",
        choices=SP_MODES,
        default=None,
        help="-p hybrid: sequence parallelism (split_gather/ring over tp; all_to_all, the default with --sp > 1, "
        "and ring_attn over --sp)",
    )
    p.add_argument(
        "--mbs", type=int, default=None, help="-p hybrid with --pp > 1: micro-batch size (default 1)"
    )
    p.add_argument("--microbatches", type=int, default=None, help="-p hybrid with --pp > 1: instead of --mbs")
    p.add_argument("-b", "--batch-size", "--batch_size", type=int, default=8, help="batch per GPU")
    p.add_argument(
        "--accum",
        type=int,
        default=1,
        metavar="N",
        help="micro-batches of -b sequences per optimizer step, in every row (cai rows under no_sync, FSDP2 "
        "reducing after the last only); tokens/s count all of them",
    )
    p.add_argument("-s", "--steps", "--num_steps", type=int, default=10, help="timed steps")
    p.add_argument("-i", "--warmup", "--ignore_steps", type=int, default=3, help="untimed steps first")
    p.add_argument("-l", "--max-length", "--max_length", type=int, default=2048, help="sequence length")
    p.add_argument(
        "-g",
        "--grad-checkpoint",
        "--grad_checkpoint",
        nargs="?",
        const="full",
        default=False,
        choices=("full", "selective"),
        help="activation checkpointing for every run: -g / -g full recomputes every block, -g selective keeps the "
        "matmul and attention outputs and recomputes the elementwise ops",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="after timing, profile 2 steps of each row and print where the time goes (matmul, attention, fused "
        "kernels, optimizer, communication, copies, other, idle)",
    )
    p.add_argument(
        "--trace",
        metavar="DIR",
        help="with --profile: also write each row's profiled steps as a gzipped Chrome trace into DIR",
    )
    p.add_argument(
        "--offload-activations",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="cai rows: the leading fraction of blocks whose activations wait in pinned host memory, copied on a "
        "side stream (cai.booster.activation_checkpointing(offload=...)); -g then applies to the other blocks",
    )
    p.add_argument(
        "--precision",
        choices=("auto", "bf16", "fp16", "fp32"),
        default="auto",
        help="auto: bf16 on GPU, fp32 on CPU",
    )
    p.add_argument(
        "--kernels",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="cai's fused kernels in the cai run (default on; peers never use them)",
    )
    p.add_argument("--lazy", action="store_true", help="build the cai model under LazyInitContext")
    p.add_argument(
        "--compile-blocks",
        action="store_true",
        help="cai rows: each decoder layer's forward under torch.compile (cai.booster.compile_blocks; the --fp8 "
        "rows compile them anyway on FP8 GPUs)",
    )
    p.add_argument(
        "--fp8",
        action="store_true",
        help="zero1/zero2/gemini: also time each such plugin with use_fp8=True (FP8 linear layers), one row more each",
    )
    p.add_argument(
        "--fp8-recipe",
        choices=("tensorwise", "rowwise"),
        default="tensorwise",
        help="the --fp8 rows' scales: one per tensor (the plugins' default) or per row (cai.kernels.convert_to_fp8)",
    )
    p.add_argument("--cpu-offload", action="store_true", help="optimizer offload (zero1/zero2/fsdp)")
    p.add_argument(
        "--plugin-options",
        type=json.loads,
        default={},
        help="more keyword arguments for cai's plugin, as a JSON object, e.g. '{\"max_prefetch\": 2}'",
    )
    p.add_argument("--shard-param-frac", "--shard_param_frac", type=float, default=1.0, help="Gemini")
    p.add_argument("--offload-optim-frac", "--offload_optim_frac", type=float, default=0.0, help="Gemini")
    p.add_argument("--offload-param-frac", "--offload_param_frac", type=float, default=0.0, help="Gemini")
    p.add_argument(
        "--compare",
        action="store_true",
        help="also time the peers (FSDP2 with or without Liger on every rank; the others at world 1)",
    )
    p.add_argument(
        "--peers",
        default="eager,compile,fsdp2",
        help=f"which peers --compare runs (from {','.join(PEERS)}; the -liger ones need pip install liger-kernel)",
    )
    p.add_argument("--no-cai", action="store_true", help="time the peers only")
    p.add_argument("--peak-tflops", type=float, default=PEAK_FLOPS / 1e12, help="MFU denominator per GPU")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="processes to spawn here when not under torchrun (one per GPU; default 1, tp x pp x sp for -p hybrid)",
    )
    args = p.parse_args(argv)
    names = [x for x in args.plugin.split(",") if x]
    if args.zero == 0 and "zero" in names:
        p.error("--zero 0 is -p hybrid's (no ZeRO); -p zero takes --zero 1 or 2")
    args.plugins = [f"zero{args.zero or 2}" if x == "zero" else x for x in names]
    bad = [x for x in args.plugins if x not in PLUGINS]
    if bad or not args.plugins:
        p.error(f"-p {args.plugin}: {', '.join(bad) or 'nothing'} is not among {', '.join(PLUGINS)}, zero")
    if args.zero is not None and not {"zero", "hybrid"} & set(names):
        p.error(f"--zero {args.zero} goes with -p zero or -p hybrid, not -p {args.plugin}")
    try:
        args.layout = hybrid_layout(args)
    except ValueError as e:
        p.error(str(e))
    if args.fp8_recipe != "tensorwise" and not args.fp8:
        p.error(f"--fp8-recipe {args.fp8_recipe} needs --fp8")
    if not isinstance(args.plugin_options, dict):
        p.error(f"--plugin-options {args.plugin_options!r}: give a JSON object of keyword arguments")
    args.peers = [x for x in args.peers.split(",") if x]
    unknown = sorted(set(args.peers) - set(PEERS))
    if unknown:
        p.error(f"--peers {','.join(unknown)} unknown; choose from {','.join(PEERS)}")
    if args.steps < 1 or args.warmup < 0:
        p.error(f"-s {args.steps} must be >= 1 and -i {args.warmup} >= 0")
    if args.accum < 1:
        p.error(f"--accum {args.accum} must be >= 1")
    if args.accum > 1 and args.layout is not None and args.layout.pp > 1:
        p.error("--accum with --pp > 1: a pipelined step already runs --microbatches micro-batches")
    return args


def hybrid_layout(args: argparse.Namespace) -> HybridLayout | None:
    """-p hybrid's sizes, checked against the model, the sequence length, the batch and the world size."""
    flags = {"--tp": args.tp != 1, "--pp": args.pp != 1, "--sp": args.sp != 1, "--sp-mode": args.sp_mode,
             "--mbs": args.mbs, "--microbatches": args.microbatches}  # fmt: skip
    if "hybrid" not in args.plugins:
        given = [k for k, v in flags.items() if v]
        if given:
            raise ValueError(f"{', '.join(given)}: -p hybrid's flags, not -p {args.plugin}'s")
        return None
    if args.mbs and args.microbatches:
        raise ValueError(f"--mbs {args.mbs} and --microbatches {args.microbatches}: give one of them")
    pipelined = args.pp > 1
    layout = HybridLayout(
        tp=args.tp,
        pp=args.pp,
        sp=args.sp,
        sp_mode=args.sp_mode,
        zero_stage=1 if args.zero is None else args.zero,
        num_microbatches=args.microbatches if pipelined else None,
        microbatch_size=(args.mbs or (None if args.microbatches else 1)) if pipelined else None,
    )
    config = preset_config(args.config, max_seq=args.max_length)
    layout.check_model(
        heads=config.num_attention_heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        layers=config.num_hidden_layers,
        source=f"-c {args.config}",
    )
    layout.check_batch(args.batch_size, flag=f"-b {args.batch_size}")
    if args.max_length % layout.seq_multiple:
        raise ValueError(
            f"-l {args.max_length} must be a multiple of {layout.seq_multiple}: sequence parallelism "
            f"({layout.mode}) cuts every sequence evenly"
        )
    if args.nproc is None and "WORLD_SIZE" not in os.environ:
        args.nproc = layout.model_parallel
    layout.dp_size(int(os.environ.get("WORLD_SIZE", args.nproc or 1)))
    return layout


@dataclass(kw_only=True)
class Row:
    name: str
    key: str = ""  # the peer's --peers name, or the cai plugin's label
    status: str = "ok"  # "ok", "OOM", or the error
    tokens_per_s: float = 0.0  # per GPU
    mfu: float = 0.0
    tflops_megatron: float = 0.0
    tflops_simple: float = 0.0
    peak_gib: float = 0.0
    step_s: float = 0.0  # median step time
    host_s: float = 0.0  # host time to issue a step, blocked launches included (see time_steps)
    breakdown: dict | None = None  # --profile: ms per step by kind of work (_breakdown.py)
    top_kernels: list | None = None  # --profile: the largest kernels besides matmul and attention
    idle_gaps: list | None = None  # --profile: what the device waited for (the kernels after idle time)
    host_syncs: list | None = None  # --profile: where the host waited for the device during one step
    matmul_callers: list | None = None  # --profile: matmul time by the operators that launched it


def time_steps(step, *, warmup: int, steps: int, device: torch.device) -> tuple[float, float]:
    """Median seconds per step after ``warmup`` untimed steps (CUDA events on GPU), and the host's mean seconds
    to issue one step (on GPU: until the last step returns, before waiting for the device). The host figure includes
    the time the host is blocked on a full launch queue, so it bounds the host's own work from above: close to the
    step time it means the host is ahead of the device by a full queue as much as that it is the bottleneck
    (``--profile`` tells them apart: idle device time and the places where the host waited)."""
    for _ in range(warmup):
        step()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)
        ]
        t0 = time.perf_counter()
        for start, end in events:
            start.record()
            step()
            end.record()
        host = (time.perf_counter() - t0) / steps
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) / 1e3 for start, end in events]
    else:
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        host = statistics.mean(times)
    return statistics.median(times), host


def measure(
    build, *, args, shape: ModelShape, device: torch.device, label: str, tokens_per_gpu: float
) -> Row:
    """Build one workload, time it, free it. An OOM or error becomes a row rather than ending the run.

    ``tokens_per_gpu``: this device's share of one step's tokens. Peak memory is the largest over the ranks.
    """
    import _workloads

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    row = Row(name=label, key=label)
    workload = None
    try:
        workload = build()
        row.name = workload.name
        row.step_s, row.host_s = time_steps(
            workload.step, warmup=args.warmup, steps=args.steps, device=device
        )
        if args.profile:
            from _breakdown import step_breakdown

            row.top_kernels, row.idle_gaps, row.host_syncs, row.matmul_callers = [], [], [], []
            trace = None
            if args.trace:
                slug = "".join(c if c.isalnum() else "_" for c in workload.name).strip("_")
                trace = os.path.join(args.trace, f"trace_{slug}.json.gz")
            row.breakdown = step_breakdown(
                workload.step,
                device=device,
                top=row.top_kernels,
                gaps=row.idle_gaps,
                syncs=row.host_syncs,
                matmuls=row.matmul_callers,
                trace=trace,
            )
    except torch.OutOfMemoryError:
        row.status = "OOM"
    except Exception as exc:  # a failing configuration is reported in the table; the others still run
        row.status = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
        if dist.get_rank() == 0:
            import traceback

            traceback.print_exc()
    finally:
        if workload is not None:
            workload.close()
        _workloads.release()
    row.peak_gib = peak_memory_gib(device)  # on CPU: the process's peak resident set so far
    if dist.get_world_size() > 1:  # pipeline stages differ (the first holds the embedding, the last the head)
        peak = torch.tensor(row.peak_gib, dtype=torch.float64, device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        row.peak_gib = float(peak)
    if row.status == "ok":
        perf = Throughput.measure(
            shape,
            tokens=tokens_per_gpu,
            seconds=row.step_s,
            seq_len=args.max_length,
            grad_ckpt=args.grad_checkpoint,
            peak_flops=args.peak_tflops * 1e12,
        )
        row.tokens_per_s, row.mfu = perf.tokens_per_s, perf.mfu
        row.tflops_megatron, row.tflops_simple = perf.tflops_megatron, perf.tflops_simple
    return row


def table(rows: list[Row], peers: list[Row]) -> str:
    head = [
        "configuration",
        "tok/s/GPU",
        "MFU",
        "TFLOPS Megatron",
        "TFLOPS 2(3+c)N",
        "peak GiB",
        "step / host ms",
    ]
    head += [f"vs {p.key}" for p in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.status != "ok":
            cells = [r.name, r.status, "", "", "", f"{r.peak_gib:.1f}" if r.peak_gib else "", ""]
            cells += [""] * len(peers)
        else:
            cells = [r.name, f"{r.tokens_per_s:,.0f}", f"{100 * r.mfu:.1f}%", f"{r.tflops_megatron:.1f}",
                     f"{r.tflops_simple:.1f}", f"{r.peak_gib:.1f}", f"{r.step_s * 1e3:.1f} / {r.host_s * 1e3:.1f}"]  # fmt: skip
            cells += [f"{r.tokens_per_s / p.tokens_per_s:.2f}x" if p.status == "ok" else "" for p in peers]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> None:
    import _workloads

    from cai.mesh import launch_from_torch

    device = resolve_device(args.device)
    launch_from_torch(seed=1234, verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    precision = args.precision if args.precision != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    gemini_fracs = dict(
        shard_param_frac=args.shard_param_frac, offload_optim_frac=args.offload_optim_frac,
        offload_param_frac=args.offload_param_frac,
    )  # fmt: skip
    choices = [
        PluginChoice(
            name=name, precision=precision, cpu_offload=args.cpu_offload and name in ("zero1", "zero2", "fsdp"),
            **(gemini_fracs if name == "gemini" else {}), **({"hybrid": args.layout} if name == "hybrid" else {}),
            options=args.plugin_options,
        )
        for name in args.plugins
    ]  # fmt: skip
    if args.fp8:
        choices += [
            replace(c, use_fp8=True, fp8_recipe=args.fp8_recipe)
            for c in choices
            if c.name in ("zero1", "zero2", "gemini")
        ]
    config = preset_config(args.config, max_seq=args.max_length)
    with torch.device("meta"):
        shape = ModelShape.of(_workloads.LlamaForCausalLM(config), config)

    def batch_of(replica: int) -> torch.Tensor:
        """Data-parallel replica ``replica``'s batch (every rank of a hybrid replica reads the same one)."""
        gen = torch.Generator().manual_seed(1234 + replica)
        size = (args.batch_size, args.max_length)
        return torch.randint(1, config.vocab_size, size, generator=gen).to(device)

    batch = batch_of(rank)
    tokens = args.batch_size * args.max_length * args.accum

    peer_rows: list[Row] = []
    peers = list(args.peers) if args.compare else []
    if world > 1:  # eager and torch.compile are one-process baselines; FSDP2 shards over every rank
        single = [p for p in peers if p not in SHARDED_PEERS]
        if single and rank == 0:
            print(f"--compare on {world} processes: {', '.join(single)} run at world size 1 only, skipped")
        peers = [p for p in peers if p in SHARDED_PEERS]
    if peers:
        kw = dict(precision=precision, grad_ckpt=args.grad_checkpoint, accum=args.accum)
        builders = {
            "eager": lambda: _workloads.eager(config, batch, **kw),
            "compile": lambda: _workloads.eager(config, batch, compile=True, **kw),
            # FSDP2's CPUOffloadPolicy is all or nothing: the peer offloads with --cpu-offload only, not for
            # Gemini's partial --offload-*-frac
            "fsdp2": lambda: _workloads.fsdp2(config, batch, cpu_offload=args.cpu_offload, **kw),
            "eager-pure": lambda: _workloads.eager(config, batch, pure=True, **kw),
            "eager-liger": lambda: _workloads.eager(config, batch, liger=True, **kw),
            "compile-liger": lambda: _workloads.eager(config, batch, compile=True, liger=True, **kw),
            "fsdp2-liger": lambda: _workloads.fsdp2(
                config, batch, cpu_offload=args.cpu_offload, liger=True, **kw
            ),
        }
        for peer in peers:
            # Liger patches transformers' Llama module for the whole process: undo it before the next row is built.
            scope = (
                _workloads.restoring_llama_module() if peer.endswith("-liger") else contextlib.nullcontext()
            )
            with scope:
                row = measure(
                    builders[peer], args=args, shape=shape, device=device, label=peer, tokens_per_gpu=tokens
                )
            peer_rows.append(row)
    rows = list(peer_rows)
    for choice in [] if args.no_cai else choices:
        build = lambda choice=choice: _workloads.cai(  # noqa: E731
            config, batch_of, device=device, choice=choice, grad_ckpt=args.grad_checkpoint, kernels=args.kernels,
            lazy=args.lazy, offload_activations=args.offload_activations, accum=args.accum,
            compile_blocks=args.compile_blocks,
        )  # fmt: skip
        # A hybrid replica's tp x pp x sp ranks share its batch: each device does 1 / (tp x pp x sp) of it.
        share = choice.hybrid.model_parallel if choice.hybrid else 1
        rows.append(
            measure(build, args=args, shape=shape, device=device, label=f"cai {choice.label}",
                    tokens_per_gpu=tokens / share)
        )  # fmt: skip

    if rank == 0:
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        print(
            f"\n### Llama {args.config}: {shape.num_params / 1e9:.3g}B params (h{config.hidden_size} "
            f"L{config.num_hidden_layers} vocab {config.vocab_size}), b{args.batch_size} s{args.max_length}"
            f"{f' x {args.accum} micro-batches a step' if args.accum > 1 else ''}"
            f"{f' activation checkpointing ({args.grad_checkpoint})' if args.grad_checkpoint else ''}"
            f"{f', cai blocks offloaded: {args.offload_activations:g}' if args.offload_activations else ''}, "
            f"{precision}, {world} x {gpu}, "
            f"median of {args.steps} steps after {args.warmup}; MFU against {args.peak_tflops:g} TFLOP/s\n"
        )
        print(table(rows, [r for r in peer_rows if r.status == "ok"]), flush=True)
        if args.profile:
            import _breakdown

            profiled = {r.name: r.breakdown for r in rows if r.breakdown}
            print(f"\nwhere a step's time goes (2 profiled steps):\n{_breakdown.table(profiled)}", flush=True)
            for r in rows:
                if r.top_kernels:
                    print(f"\nlargest kernels besides matmul and attention, {r.name} (ms per step):")
                    for ms, label, name, callers in r.top_kernels:
                        print(f"  {ms:7.2f}  {label:<14} {name[:110]}")
                        for chain, chain_ms in callers:
                            print(f"           {chain_ms:7.2f} from {chain[:200]}")
                if r.idle_gaps:
                    print(
                        f"\nwhere the device waited (gaps over 20 us), {r.name} (ms per step, count, next kernel):"
                    )
                    for ms, count, chain in r.idle_gaps:
                        print(f"  {ms:7.2f} {count:5d}  {chain[:200]}")
                if r.matmul_callers:
                    print(f"\nmatmul time by launching operators, {r.name} (ms per step):")
                    for ms, chain in r.matmul_callers:
                        print(f"  {ms:7.2f}  {chain[:200]}")
                if r.host_syncs is not None and device.type == "cuda":
                    print(f"\nwhere the host waited for the device in one step, {r.name} (count, place):")
                    for count, where in r.host_syncs or [(0, "nowhere")]:
                        print(f"  {count:5d}  {where}")
        out = os.environ.get("OUT")
        if out:
            ranks = f"_w{world}" if world > 1 else ""
            path = Path(out) / f"benchmark_{Path(args.config).name}_{'-'.join(args.plugins)}{ranks}.json"
            meta = {k: asdict(v) if k == "layout" and v else v for k, v in vars(args).items()}
            meta.update(precision=precision, world_size=world, device=gpu, num_params=shape.num_params)
            path.write_text(json.dumps({"args": meta, "rows": [asdict(r) for r in rows]}, indent=2))
            print(f"wrote {path}")
    failed = any(r.status != "ok" for r in rows if r.name.startswith("cai"))
    dist.destroy_process_group()
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    arguments = parse_args()
    run(main, arguments, nproc=arguments.nproc or 1)
