#!/usr/bin/env python
"""Where a compiled block's activation checkpoint runs: outside its graph or inside it. A Llama forward and
backward (cai-kernels' ``patch_hf_model``, bf16 on GPU, fp32 on CPU; no optimizer), every block checkpointed.

Rows:
- ``eager``: ``activation_checkpointing(model, "full")``, blocks eager;
- ``outside``: the blocks compiled (``compile_blocks``) under a checkpoint function that cai does not adopt (torch's
  non-reentrant checkpoint behind a plain function): the checkpoint runs around the graph, and the recompute calls
  the compiled forward again before the compiled backward runs (compiled blocks did this before they traced
  their checkpoint);
- ``inside``: the blocks compiled under ``activation_checkpointing(model, "full")``: the checkpoint is traced with
  the block, and its backward graph holds the recompute ([Note: compiled blocks]); blocks with FP8 layers
  (``--fp8``) keep the checkpoint around the graph there too, so with ``--fp8`` this row is ``outside`` with cai's
  checkpoint;
- ``compiled``: the blocks compiled, nothing recomputed (the floor; it keeps every activation).

On a CPU with a tiny model the arithmetic is negligible and a step's time is the host's: what each arrangement
costs in Python, dispatch and autograd bookkeeping, the cost that bounds a backward whose host work is barely
ahead of the GPU. On a GPU the same rows give the throughput. Rows are built first, then timed in alternating
rounds, so drift of the machine falls on every row alike; the figure is each row's median over its rounds.

Example::

    python examples/benchmarks/bench_compiled_checkpoint.py -c tiny -L 8 -b 2 -l 16        # host time, CPU
    python examples/benchmarks/bench_compiled_checkpoint.py -c 8b -b 2 -l 2048 --fp8        # one H200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples' shared helpers

import torch
from _models import PRESETS, preset_config
from _perf import peak_memory_gib, synchronize
from torch.utils.checkpoint import checkpoint

ROWS = ("eager", "outside", "inside", "compiled")


def _around(fn, *args):
    """torch's non-reentrant checkpoint as a plain function: compile_blocks leaves it around the graph."""
    return checkpoint(fn, *args, use_reentrant=False)


def build(row: str, config, device: torch.device, batch: torch.Tensor, *, fp8: bool):
    """One row's forward and backward as a zero-argument function."""
    from transformers import LlamaForCausalLM

    from cai.booster import activation_checkpointing, compile_blocks
    from cai.kernels import convert_to_fp8, patch_hf_model

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).train()
    model.config.use_cache = False
    patch_hf_model(model)
    if fp8:
        convert_to_fp8(model)
    if row == "outside":
        model.gradient_checkpointing_enable()
        for layer in model.model.layers:
            layer._gradient_checkpointing_func = _around
    elif row in ("eager", "inside"):
        activation_checkpointing(model, "full")
    elif row != "compiled":
        raise ValueError(f"unknown row {row!r}: use one of {ROWS}")
    if row != "eager":
        compile_blocks(model)

    def step() -> None:
        model(input_ids=batch, labels=batch).loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-c", "--config", default="tiny", help=f"preset ({', '.join(PRESETS)}) or a config path")
    p.add_argument("-L", "--layers", type=int, default=None, help="override the preset's number of blocks")
    p.add_argument("-b", "--batch-size", type=int, default=2)
    p.add_argument("-l", "--max-length", type=int, default=16)
    p.add_argument("--fp8", action="store_true", help="FP8 linear layers (cai.kernels.convert_to_fp8)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {ROWS}")
    p.add_argument(
        "--rounds", type=int, default=5, help="alternating rounds; each row runs --steps per round"
    )
    p.add_argument("--steps", type=int, default=10, help="timed steps per row per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per row first (the first compiles)")
    args = p.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # a host-time measurement: one thread, no intra-op parallelism to vary
    config = preset_config(args.config, max_seq=args.max_length)
    if args.layers:
        config.num_hidden_layers = args.layers
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(1, config.vocab_size, (args.batch_size, args.max_length), generator=gen).to(device)

    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    steps = {row: build(row, config, device, batch, fp8=args.fp8) for row in rows}
    for row in rows:
        for _ in range(args.warmup):
            steps[row]()
    times: dict[str, list[float]] = {row: [] for row in rows}
    for r in range(args.rounds):
        for row in rows if r % 2 == 0 else rows[::-1]:
            synchronize(device)
            start = time.perf_counter()
            for _ in range(args.steps):
                steps[row]()
            synchronize(device)
            times[row].append((time.perf_counter() - start) / args.steps)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    blocks = config.num_hidden_layers
    base = statistics.median(times[rows[0]])
    print(
        f"\n{args.config} ({blocks} blocks{', FP8 linears' if args.fp8 else ''}), batch {args.batch_size} x "
        f"{args.max_length}, {device.type}, forward + backward, peak {peak_memory_gib(device):.2f} GiB (all rows)"
    )
    print(f"| row | ms per step (median of {args.rounds}) | min-max | ms per block | vs {rows[0]} |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        med = statistics.median(times[row])
        lo, hi = min(times[row]), max(times[row])
        print(
            f"| {row} | {med * 1e3:.2f} | {lo * 1e3:.2f}-{hi * 1e3:.2f} | {med * 1e3 / blocks:.3f} | "
            f"{med / base:.2f}x |"
        )


if __name__ == "__main__":
    main()
