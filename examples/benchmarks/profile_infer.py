"""Where an engine step's time goes: graph-replayed decode steps against eager (prefill and mixed) steps.

Runs one offline workload through cai's ``InferenceEngine`` and times every ``ModelRunner.run`` with a device
synchronisation after it, split by whether the step replayed a decode graph; with ``--profile`` it also prints
torch.profiler's kernel table for one graph-replayed and one eager decode step once the batch is decoding.

    python examples/benchmarks/profile_infer.py -c 8b -n 1000 --output-len 256 --max-num-batched-tokens 4096
    python examples/benchmarks/profile_infer.py -c 8b -n 256 --output-len 64 --profile
    python examples/benchmarks/profile_infer.py -c tiny -n 8 --output-len 8     # CPU smoke (eager steps only)

The synchronisation after each step removes the overlap of one step's host work with the previous step's GPU
work, so the total is a little slower than ``bench_infer.py``'s offline figure for the same workload.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from cai.infer import InferenceEngine, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _infer_common import DTYPES, cai_engine
from _models import PRESETS, preset_config


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-c", "--config", choices=sorted(PRESETS), default="tiny")
    p.add_argument("-n", "--num-requests", type=int, default=1000)
    p.add_argument("--min-prompt", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument(
        "--use-cuda-kernel", choices=("default", "on", "off"), default="default",
        help="InferenceConfig.use_cuda_kernel (default: the config's default)",
    )  # fmt: skip
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="cai's KV pool (default: never preempts)")
    p.add_argument(
        "--profile", action="store_true", help="print kernel tables of one graph and one eager step"
    )
    args = p.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    torch.manual_seed(0)
    config = preset_config(args.config, max_seq=args.max_prompt + args.output_len)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(DTYPES[args.dtype]).eval()
    engine = cai_engine(
        model, args, max_input=args.max_prompt, max_output=args.output_len, batch=args.max_batch_size
    )
    runner, graphs = engine.runner, engine.runner.graphs
    times: dict[str, list[float]] = {"graph": [], "eager": []}
    run = runner.run

    def timed_run(batch, drafts=None):
        kind = "graph" if graphs is not None and graphs.covers(batch, drafts) else "eager"
        start = time.perf_counter()
        out = run(batch, drafts)
        sync(device)
        times[kind].append(time.perf_counter() - start)
        return out

    runner.run = timed_run
    rng = random.Random(0)
    prompts = [
        [rng.randrange(config.vocab_size) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
        for _ in range(args.num_requests)
    ]
    engine.add_request(
        prompts_token_ids=prompts,
        sampling_params=SamplingParams(max_new_tokens=args.output_len, ignore_eos=True),
    )
    sync(device)
    start = time.perf_counter()
    steps = tokens = 0
    profiled = not args.profile
    while engine.has_unfinished_requests():
        tokens += len(engine.step())
        steps += 1
        decoding = all(s.num_computed == s.num_tokens - 1 for s in engine.scheduler.running)
        if not profiled and decoding and graphs is not None and steps > 5:
            profiled = True
            tokens += _profile(engine, device)
        if steps % 100 == 0:
            print(f"{steps} steps, {tokens} tokens", file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - start
    result = {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed, "steps": steps}
    print(
        f"{args.config} on {device}: {tokens} output tokens in {elapsed:.2f} s = {tokens / elapsed:,.0f} tok/s, "
        f"{steps} steps"
    )
    for kind, ts in times.items():
        if ts:
            print(
                f"  {kind:5s} steps: {len(ts):5d}, {1000 * sum(ts) / len(ts):8.2f} ms each, {sum(ts):7.2f} s in all"
            )
        result[kind] = {"steps": len(ts), "seconds": sum(ts)}
    return result


def _profile(engine: InferenceEngine, device: torch.device) -> int:
    """Profile one graph-replayed and one eager step; returns the tokens they produced."""
    from torch.profiler import ProfilerActivity, profile

    graphs = engine.runner.graphs
    tokens = 0
    for label, use in (("graph-replayed", graphs), ("eager", None)):
        engine.runner.graphs = use
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            tokens += len(engine.step())
            sync(device)
        print(f"=== one {label} decode step of {len(engine.scheduler.running)} sequences")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    engine.runner.graphs = graphs
    return tokens


if __name__ == "__main__":
    main()
