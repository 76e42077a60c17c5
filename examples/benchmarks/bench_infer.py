"""cai-infer against transformers on one device: offline throughput and single-stream decode.

Offline: N requests, prompt lengths uniform in [--min-prompt, --max-prompt], --output-len new tokens each with EOS
ignored, all submitted at once; output tokens/s for cai's engine, transformers' continuous batching
(``generate_batch``, its paged cache) and transformers' ``generate`` over padded batches. Single stream: one
prompt, decode tokens/s (tokens after the first over the time after the first) for cai and ``generate``, against
the weight-read limit (the model's bytes over the copy bandwidth measured in the same run).

    python examples/benchmarks/bench_infer.py -c tiny -n 16 --min-prompt 8 --max-prompt 32 --output-len 16 \\
        --single-prompt 32 --single-new 32          # CPU smoke
    python examples/benchmarks/bench_infer.py -c 8b -n 1000 --min-prompt 128 --max-prompt 1024 \\
        --output-len 256 --dtype bf16               # one GPU

Random weights and random prompts; every row uses the same model object (cai's engine last, since it switches the
model's attention implementation). With ``OUT`` set the results are also written to ``$OUT/bench_infer_<config>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM

from cai.infer import InferenceConfig, InferenceEngine, SamplingParams

PRESETS = {
    "tiny": dict(
        vocab_size=251,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "1b": dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
    ),
    "8b": dict(  # Llama-3-8B's shape
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_theta=500000.0,
    ),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ALL_PEERS = ("hf-batch", "hf-generate")


class Progress:
    """One status line on stderr, rewritten at most every ``every`` seconds (a plain line when not a terminal)."""

    def __init__(self, label: str, total: int, unit: str, every: float = 0.5) -> None:
        self.label, self.total, self.unit, self.every = label, total, unit, every
        self.start = self.last = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def update(self, done: int, tokens: int, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self.last < self.every:
            return
        self.last = now
        rate = tokens / max(now - self.start, 1e-9)
        line = f"{self.label}: {done}/{self.total} {self.unit}, {tokens} tokens, {rate:,.0f} tok/s"
        sys.stderr.write(f"\r{line}\033[K" if self.tty else line + "\n")
        sys.stderr.flush()

    def close(self, done: int, tokens: int) -> None:
        self.update(done, tokens, force=True)
        if self.tty:
            sys.stderr.write("\n")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 28) -> float:
    """Bytes/s of a device-to-device copy (read plus write, counted as the bytes read), median of 5."""
    n = nbytes // 4
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * n * 4 / sorted(times)[2]  # read + write per element


def workload(args, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [
        [rng.randrange(vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
        for _ in range(args.num_requests)
    ]


def cai_engine(model, args, *, max_input: int, max_output: int, batch: int) -> InferenceEngine:
    return InferenceEngine(
        model,
        None,
        InferenceConfig(
            dtype=DTYPES[args.dtype],
            max_batch_size=batch,
            max_input_len=max_input,
            max_output_len=max_output,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=False,  # random prompts share nothing; the lookups would only cost
            ignore_eos=True,
        ),
    )


def offline_cai(model, prompts: list[list[int]], args) -> dict:
    engine = cai_engine(
        model, args, max_input=max(map(len, prompts)), max_output=args.output_len, batch=args.max_batch_size
    )
    params = SamplingParams(max_new_tokens=args.output_len, ignore_eos=True)
    sync(model.device)
    t0 = time.perf_counter()
    engine.add_request(prompts_token_ids=prompts, sampling_params=params)
    bar = Progress("cai offline", len(prompts), "requests")
    done = tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += 1  # one token per output and step without speculative decoding
            done += out.finished
        bar.update(done, tokens)
    sync(model.device)
    elapsed = time.perf_counter() - t0
    bar.close(done, tokens)
    return {"output_tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}


def offline_hf_batch(model, prompts: list[list[int]], args) -> dict:
    gen = GenerationConfig(max_new_tokens=args.output_len, do_sample=False, eos_token_id=-1, pad_token_id=0)
    sync(model.device)
    t0 = time.perf_counter()
    cb = None
    if model.device.type == "cpu":
        # Off GPU its cache would be sized from host memory; give it cai's pool and step budget instead.
        per_seq = -(-(args.max_prompt + args.output_len) // args.block_size)
        cb = ContinuousBatchingConfig(
            block_size=max(args.block_size, 4),
            num_blocks=args.num_blocks or args.max_batch_size * per_seq,
            max_batch_tokens=args.max_num_batched_tokens or max(args.max_prompt, args.max_batch_size),
            max_requests_per_batch=args.max_batch_size,
        )
    results = model.generate_batch(
        inputs=prompts, generation_config=gen, continuous_batching_config=cb, progress_bar=True
    )
    sync(model.device)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(r.generated_tokens) for r in results.values())
    if tokens != len(prompts) * args.output_len:
        raise RuntimeError(
            f"generate_batch returned {tokens} tokens for {len(prompts)} x {args.output_len} (requests failed; "
            "see its log above)"
        )
    return {"output_tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}


def offline_hf_generate(model, prompts: list[list[int]], args) -> dict:
    # Padded static batches of --max-batch-size, longest first (less padding), left-padded as generate wants.
    order = sorted(prompts, key=len, reverse=True)
    bar = Progress("hf generate offline", len(prompts), "requests")
    sync(model.device)
    t0 = time.perf_counter()
    tokens = 0
    for i in range(0, len(order), args.max_batch_size):
        chunk = order[i : i + args.max_batch_size]
        width = max(map(len, chunk))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=model.device)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=args.output_len,
            min_new_tokens=args.output_len,  # EOS ignored
            do_sample=False,
            pad_token_id=0,
        )
        tokens += (out.shape[1] - width) * len(chunk)
        bar.update(i + len(chunk), tokens)
    sync(model.device)
    elapsed = time.perf_counter() - t0
    bar.close(len(order), tokens)
    return {"output_tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}


def single_cai(model, prompt: list[int], args) -> dict:
    engine = cai_engine(model, args, max_input=len(prompt), max_output=args.single_new, batch=1)
    params = SamplingParams(max_new_tokens=args.single_new, ignore_eos=True)
    engine.add_request(prompts_token_ids=prompt, sampling_params=params)
    bar = Progress("cai single stream", args.single_new, "tokens")
    sync(model.device)
    t0 = time.perf_counter()
    first = None
    n = 0
    while engine.has_unfinished_requests():
        n += len(engine.step())
        if first is None:
            sync(model.device)
            first = time.perf_counter()
        bar.update(n, n)
    sync(model.device)
    end = time.perf_counter()
    bar.close(n, n)
    return {"ttft_s": first - t0, "decode_tokens_per_s": (n - 1) / (end - first)}


def single_hf(model, prompt: list[int], args) -> dict:
    ids = torch.tensor([prompt], device=model.device)

    def run(new: int) -> float:
        sync(model.device)
        t = time.perf_counter()
        model.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        sync(model.device)
        return time.perf_counter() - t

    print("hf generate single stream ...", file=sys.stderr, flush=True)
    first = run(1)  # prefill and one token
    full = run(args.single_new)
    return {"ttft_s": first, "decode_tokens_per_s": (args.single_new - 1) / (full - first)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-c", "--config", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("-n", "--num-requests", type=int, default=1000)
    p.add_argument("--min-prompt", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--single-prompt", type=int, default=512, help="single stream: prompt tokens")
    p.add_argument("--single-new", type=int, default=512, help="single stream: new tokens")
    p.add_argument("--max-batch-size", type=int, default=256, help="cai's batch; hf generate's static batch")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="cai's KV pool (default: never preempts)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="cai's step token budget")
    p.add_argument("--peers", default=",".join(ALL_PEERS), help=f"comma list of {ALL_PEERS}, or 'none'")
    p.add_argument("--skip", default="", help="comma list of 'offline', 'single'")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    peers = [] if args.peers == "none" else args.peers.split(",")
    unknown = set(peers) - set(ALL_PEERS)
    if unknown:
        p.error(f"--peers {sorted(unknown)} unknown; choose from {ALL_PEERS}")
    skip = set(filter(None, args.skip.split(",")))

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**PRESETS[args.config])).to(DTYPES[args.dtype]).eval()
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    bandwidth = copy_bandwidth(device)
    results: dict = {
        "config": args.config,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "weight_bytes": weight_bytes,
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "weight_read_limit_tokens_per_s": bandwidth / weight_bytes,
    }
    print(
        f"{args.config} ({weight_bytes / 1e9:.3f} GB in {args.dtype}) on {results['device']}: copy bandwidth "
        f"{bandwidth / 1e9:,.1f} GB/s, weight-read limit {bandwidth / weight_bytes:,.1f} tokens/s"
    )

    def guarded(name: str, fn, *a) -> dict:
        try:
            return fn(*a)
        except Exception as e:  # a peer that cannot run here is reported, the other rows still run
            print(f"{name} failed: {type(e).__name__}: {e}", file=sys.stderr)
            return {"error": f"{type(e).__name__}: {e}"}

    # Peers first: cai's engine switches the model's attention implementation to its own.
    if "offline" not in skip:
        prompts = workload(args, model.config.vocab_size)
        offline: dict = {}
        # No inference_mode around the peers: generate_batch's worker thread writes in place into tensors built
        # here, which inference mode would leave read-only outside it; both peers turn gradients off themselves.
        if "hf-batch" in peers:
            offline["hf generate_batch"] = guarded(
                "hf generate_batch", offline_hf_batch, model, prompts, args
            )
        if "hf-generate" in peers:
            offline["hf generate"] = guarded("hf generate", offline_hf_generate, model, prompts, args)
        results["offline"] = offline
    if "single" not in skip:
        rng = random.Random(args.seed + 1)
        prompt = [rng.randrange(model.config.vocab_size) for _ in range(args.single_prompt)]
        single: dict = {}
        if "hf-generate" in peers:
            single["hf generate"] = guarded("hf generate", single_hf, model, prompt, args)
        results["single"] = single
    model.set_attn_implementation("sdpa")  # restored below by the engine; generate_batch may have switched it
    if "offline" not in skip:
        results["offline"]["cai"] = offline_cai(model, prompts, args)
    if "single" not in skip:
        results["single"]["cai"] = single_cai(model, prompt, args)

    if "offline" in results:
        print(
            f"\noffline: {args.num_requests} requests, prompts {args.min_prompt}-{args.max_prompt}, "
            f"{args.output_len} new tokens each"
        )
        cai_rate = results["offline"]["cai"]["tokens_per_s"]
        for name, row in results["offline"].items():
            if "error" in row:
                print(f"  {name:18s} error: {row['error']}")
                continue
            ratio = "" if name == "cai" else f"   cai is {cai_rate / max(row['tokens_per_s'], 1e-9):.2f}x"
            print(f"  {name:18s} {row['tokens_per_s']:12,.1f} output tok/s  ({row['seconds']:.2f} s){ratio}")
    if "single" in results:
        limit = results["weight_read_limit_tokens_per_s"]
        print(f"\nsingle stream: {args.single_prompt}-token prompt, {args.single_new} new tokens")
        for name, row in results["single"].items():
            if "error" in row:
                print(f"  {name:18s} error: {row['error']}")
                continue
            rate = row["decode_tokens_per_s"]
            print(
                f"  {name:18s} {rate:12,.1f} decode tok/s  ({100 * rate / limit:.1f}% of the weight-read limit), "
                f"first token {1000 * row['ttft_s']:.1f} ms"
            )
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], f"bench_infer_{args.config}.json")
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
