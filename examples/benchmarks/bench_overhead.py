#!/usr/bin/env python
"""What cai's parallel wrappers cost at size 1: a Llama training step with the same kernels (cai-kernels'
``patch_hf_model``), fused AdamW and bf16 autocast, plainly and through each wrapper at size 1.

Rows: ``plain`` (the patched model), ``shardformer-tp1`` (``ShardFormer.optimize`` with a one-rank tensor-parallel
group). All rows are built first and then timed in alternating rounds, so drift of the machine falls on every row
alike; each row's figure is the median step time over its rounds, and the ratio is against ``plain``.

Example::

    python examples/benchmarks/bench_overhead.py -c 1b -b 8 -l 2048     # one H200
    python examples/benchmarks/bench_overhead.py -c tiny -b 2 -l 64 --rounds 2 --steps 2   # CPU smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples' shared helpers

import torch
import torch.distributed as dist
from _models import PRESETS, preset_config
from _perf import peak_memory_gib, synchronize

ROWS = ("plain", "shardformer-tp1")


def build(row: str, config, device: torch.device):
    from transformers import LlamaForCausalLM

    from cai.kernels import patch_hf_model

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.config.use_cache = False
    patch_hf_model(model)
    if row == "shardformer-tp1":
        from cai.shardformer import ShardConfig, ShardFormer

        group = dist.new_group([dist.get_rank()])
        model, _ = ShardFormer(ShardConfig(tensor_parallel_process_group=group)).optimize(model)
    elif row != "plain":
        raise ValueError(f"unknown row {row!r}: use one of {ROWS}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    return model, optimizer


def step(model, optimizer, batch: torch.Tensor, device: torch.device) -> None:
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-c", "--config", default="1b", help=f"preset ({', '.join(PRESETS)}) or a config path")
    p.add_argument("-b", "--batch-size", type=int, default=8)
    p.add_argument("-l", "--max-length", type=int, default=2048)
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {ROWS}")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds; each row runs --steps per round")
    p.add_argument("--steps", type=int, default=5, help="timed steps per row per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per row first")
    args = p.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    config = preset_config(args.config, max_seq=args.max_length)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(1, config.vocab_size, (args.batch_size, args.max_length), generator=gen).to(device)

    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    built = {row: build(row, config, device) for row in rows}
    for row in rows:
        for _ in range(args.warmup):
            step(*built[row], batch, device)
    times: dict[str, list[float]] = {row: [] for row in rows}
    for r in range(args.rounds):
        for row in rows if r % 2 == 0 else rows[::-1]:
            synchronize(device)
            start = time.perf_counter()
            for _ in range(args.steps):
                step(*built[row], batch, device)
            synchronize(device)
            times[row].append((time.perf_counter() - start) / args.steps)
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    tokens = args.batch_size * args.max_length
    base = statistics.median(times[rows[0]])
    print(f"\n{args.config}, batch {args.batch_size} x {args.max_length}, {device.type}, peak {peak_memory_gib(device):.1f} GiB")
    print(f"| row | step ms (median of {args.rounds}) | min-max ms | tokens/s | vs {rows[0]} |")
    print("|---|---|---|---|---|")
    for row in rows:
        med = statistics.median(times[row])
        lo, hi = min(times[row]), max(times[row])
        print(f"| {row} | {med * 1e3:.1f} | {lo * 1e3:.1f}-{hi * 1e3:.1f} | {tokens / med:,.0f} | {med / base:.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
