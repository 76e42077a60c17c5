"""cai-infer against transformers on one device: offline throughput, single-stream decode, serving latency under
Poisson arrivals, and prefix caching.

Modes (``--modes``, a comma list; default all four, run in this order, every transformers peer before the first
cai engine since the engine switches the model's attention and may patch its modules):

offline  N requests, prompt lengths uniform in [--min-prompt, --max-prompt], --output-len new tokens each with EOS
         ignored, all submitted at once; output tokens/s for cai's engine, transformers' continuous batching
         (``generate_batch``, its paged cache; peer ``hf-batch``) and transformers' ``generate`` over padded
         static batches of --max-batch-size (peer ``hf-generate``).
single   one --single-prompt-token prompt, --single-new new tokens; decode tokens/s (tokens after the first over
         the time after the first) and time to first token for cai, ``generate`` eager with its dynamic cache
         (peer ``hf-generate``) and ``generate`` with a static cache and torch.compile (peer ``hf-compile``:
         ``cache_implementation="static"`` and a ``CompileConfig``, by default inductor in ``reduce-overhead``
         mode, i.e. CUDA graphs; two untimed calls compile and warm it, their time is reported apart), each
         against the weight-read limit (the model's bytes over the copy bandwidth measured in the same run).
server   cai's OpenAI-compatible server (``build_app`` over an ``AsyncInferenceEngine``) under uvicorn in a
         thread of this process, on a free local port; a client in a separate process streams
         ``/v1/completions`` requests arriving as a Poisson process at each of --rates requests/s
         (--server-requests each, random prompts with the offline lengths, --output-len tokens each, greedy,
         EOS off); per rate: time to first token and time per output token (p50, p99), achieved request rate and
         output tokens/s. Client: httpx, else aiohttp (``--client``). Without FastAPI/uvicorn, or with
         ``--server-via engine``, the same arrivals go straight to ``AsyncInferenceEngine.generate`` in this
         process (no HTTP); the table says which ran.
prefix   N prompts that each are one shared --system-len-token system prompt plus a random suffix of
         --min-suffix..--max-suffix tokens, --output-len new tokens each, all submitted at once; output
         tokens/s of cai with ``enable_prefix_caching=True`` and ``False`` in the same run, and their ratio.

    python examples/benchmarks/bench_infer.py -c tiny -n 16 --min-prompt 8 --max-prompt 32 --output-len 16 \\
        --single-prompt 32 --single-new 32 --max-batch-size 8 --rates 4,16 --server-requests 16 \\
        --system-len 256 --min-suffix 4 --max-suffix 16          # CPU smoke of every mode

One GPU, Llama-3-8B's shape (bf16 by default there), one mode a command (all four together take longer than
10 minutes):

    python examples/benchmarks/bench_infer.py -c 8b --modes offline -n 1000 --min-prompt 128 --max-prompt 1024 \\
        --output-len 256
    python examples/benchmarks/bench_infer.py -c 8b --modes single --single-prompt 512 --single-new 512
    python examples/benchmarks/bench_infer.py -c 8b --modes server --rates 4,16 --server-requests 200 \\
        --min-prompt 128 --max-prompt 1024 --output-len 256
    python examples/benchmarks/bench_infer.py -c 8b --modes prefix -n 1000 --system-len 1000 --output-len 256
    python examples/benchmarks/bench_infer.py -c 8b -n 1000 --min-prompt 128 --max-prompt 1024 \\
        --output-len 256                                         # every mode in one run

Models are the presets of examples/_models.py (random weights, random prompts); every row uses the same model
object. Every cai engine runs two short untimed requests first (kernel compilation and allocation stay out of the
figures). A progress line runs on stderr for every long phase. With ``OUT`` set the results are also written to
``$OUT/bench_infer_<config>.json`` (``--tag T``: ``bench_infer_<config>_T.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples' shared helpers

import torch
from _infer_client import Progress
from _infer_common import DTYPES, cai_engine, ms, note, random_prompts, release, sync, table, warm
from _infer_server import CLIENTS, print_server, server_bench
from _models import PRESETS, preset_config
from transformers import CompileConfig, ContinuousBatchingConfig, GenerationConfig, LlamaForCausalLM

from cai.infer import InferenceEngine, SamplingParams

ALL_MODES = ("offline", "single", "server", "prefix")
ALL_PEERS = ("hf-batch", "hf-generate", "hf-compile")


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a device-to-device copy (read plus write, counted as the bytes moved), median of 10. On CUDA:
    1 GiB timed by CUDA events, as BENCHMARKS.md measures it (a smaller copy timed from the host reads ~10% low
    and would flatter the weight-read fraction)."""
    nbytes = 1 << 30 if device.type == "cuda" else 1 << 26
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(10):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
    del src, dst
    return 2 * nbytes / sorted(times)[5]  # read + write per element


def workload(args, vocab: int) -> list[list[int]]:
    return random_prompts(
        random.Random(args.seed), args.num_requests, args.min_prompt, args.max_prompt, vocab
    )


# ---- cai's engine ---------------------------------------------------------------------------------------------


def run_engine(engine: InferenceEngine, prompts: list[list[int]], output_len: int, label: str) -> dict:
    """All ``prompts`` submitted at once and run to the end; output tokens/s over the whole."""
    params = SamplingParams(max_new_tokens=output_len, ignore_eos=True)
    hits = engine.blocks.num_hit_tokens
    device = engine.runner.device
    sync(device)
    t0 = time.perf_counter()
    engine.add_request(prompts_token_ids=prompts, sampling_params=params)
    bar = Progress(label, len(prompts), "requests")
    done = tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += 1  # one token per output and step without speculative decoding
            done += out.finished
        bar.update(done, tokens)
    sync(device)
    elapsed = time.perf_counter() - t0
    bar.close(done, tokens)
    return {
        "output_tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        "prompt_tokens": sum(map(len, prompts)),
        "prefix_hit_tokens": engine.blocks.num_hit_tokens - hits,
    }


def offline_cai(model, prompts: list[list[int]], args) -> dict:
    engine = cai_engine(
        model, args, max_input=max(map(len, prompts)), max_output=args.output_len, batch=args.max_batch_size
    )
    warm(engine, model.config.vocab_size)
    return run_engine(engine, prompts, args.output_len, "cai offline")


def single_cai(model, prompt: list[int], args) -> dict:
    engine = cai_engine(model, args, max_input=len(prompt), max_output=args.single_new, batch=1)
    warm(engine, model.config.vocab_size)
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


# ---- transformers' peers --------------------------------------------------------------------------------------


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


def _timed_generate(model, ids: torch.Tensor, new: int, **gen) -> float:
    config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, **gen)
    sync(model.device)
    t = time.perf_counter()
    out = model.generate(input_ids=ids, generation_config=config)
    sync(model.device)
    elapsed = time.perf_counter() - t
    if out.shape[1] != ids.shape[1] + new:
        raise RuntimeError(f"generate gave {out.shape[1] - ids.shape[1]} new tokens, not {new}")
    return elapsed


def single_hf(model, prompt: list[int], args) -> dict:
    ids = torch.tensor([prompt], device=model.device)
    note("hf generate single stream ...")
    _timed_generate(model, ids, 2)  # untimed: lazy initialisation of the libraries
    first = _timed_generate(model, ids, 1)  # prefill and one token
    full = _timed_generate(model, ids, args.single_new)
    return {"ttft_s": first, "decode_tokens_per_s": (args.single_new - 1) / (full - first)}


def single_hf_compile(model, prompt: list[int], args) -> dict:
    """``generate`` with a static cache, whose decode steps transformers runs through ``torch.compile`` (the
    prefill stays eager). The cache is sized for the longest call (``max_cache_len``), so the one-token call that
    times the first token reuses the compiled decode step's shapes and nothing recompiles between calls."""
    ids = torch.tensor([prompt], device=model.device)
    inductor = args.compile_backend == "inductor"
    compile_config = CompileConfig(backend=args.compile_backend, mode=args.compile_mode if inductor else None)
    if model.device.type != "cuda":
        compile_config._compile_all_devices = True  # transformers compiles on accelerators only unless told
    gen = dict(
        cache_implementation="static",
        max_cache_len=len(prompt) + args.single_new,
        compile_config=compile_config,
    )
    note(f"hf-compile single stream: compiling ({args.compile_backend}) and warming up, untimed ...")
    first_call = _timed_generate(model, ids, args.single_new, **gen)
    # A second call: whatever the first left to do (a recompile, CUDA graphs to record) happens untimed too.
    second_call = _timed_generate(model, ids, args.single_new, **gen)
    if getattr(model, "_compiled_call", None) is None:
        raise RuntimeError(
            "generate did not compile the decode step (its auto-compile criteria were not met)"
        )
    note("hf-compile single stream: timing ...")
    first = _timed_generate(model, ids, 1, **gen)
    full = _timed_generate(model, ids, args.single_new, **gen)
    return {
        "ttft_s": first,
        "decode_tokens_per_s": (args.single_new - 1) / (full - first),
        "compile_warmup_s": first_call + second_call,
        "first_call_s": first_call,
        "compile_backend": args.compile_backend,
        "compile_mode": compile_config.mode,
    }


# ---- prefix caching -------------------------------------------------------------------------------------------


def prefix_bench(model, args) -> dict:
    vocab = model.config.vocab_size
    rng = random.Random(args.seed + 2)
    system = [rng.randrange(vocab) for _ in range(args.system_len)]
    prompts = [
        system + p for p in random_prompts(rng, args.num_requests, args.min_suffix, args.max_suffix, vocab)
    ]
    out: dict = {}
    for caching in (False, True):
        name = f"caching {'on' if caching else 'off'}"
        engine = cai_engine(
            model,
            args,
            max_input=args.system_len + args.max_suffix,
            max_output=args.output_len,
            batch=args.max_batch_size,
            prefix_caching=caching,
        )
        warm(engine, vocab)
        out[name] = run_engine(engine, prompts, args.output_len, f"cai prefix, {name}")
        del engine
        release(model.device)
    out["ratio"] = out["caching on"]["tokens_per_s"] / out["caching off"]["tokens_per_s"]
    return out


# ---- tables ---------------------------------------------------------------------------------------------------


def ratio(cai: float, peer: float) -> str:
    return f"{cai / max(peer, 1e-9):.2f}x"


def print_offline(results: dict, args) -> None:
    rows_in = results["offline"]
    print(
        f"\noffline: {args.num_requests} requests, prompts {args.min_prompt}-{args.max_prompt}, "
        f"{args.output_len} new tokens each"
    )
    cai = rows_in["cai"]["tokens_per_s"]
    rows = []
    for name, row in rows_in.items():
        if "error" in row:
            rows.append([name, "error", "", row["error"][:80]])
            continue
        vs = "" if name == "cai" else ratio(cai, row["tokens_per_s"])
        rows.append([name, f"{row['tokens_per_s']:,.1f}", f"{row['seconds']:.2f}", vs])
    table(["", "output tok/s", "seconds", "cai vs it"], rows)


def print_single(results: dict, args) -> None:
    limit = results["weight_read_limit_tokens_per_s"]
    rows_in = results["single"]
    print(f"\nsingle stream: {args.single_prompt}-token prompt, {args.single_new} new tokens")
    cai = rows_in["cai"]["decode_tokens_per_s"]
    rows = []
    for name, row in rows_in.items():
        if "error" in row:
            rows.append([name, "error", "", "", "", row["error"][:80]])
            continue
        rate = row["decode_tokens_per_s"]
        warmup = f"{row['compile_warmup_s']:.1f}" if "compile_warmup_s" in row else ""
        vs = "" if name == "cai" else ratio(cai, rate)
        rows.append([name, f"{rate:,.1f}", f"{100 * rate / limit:.1f}%", ms(row["ttft_s"]), warmup, vs])
    table(
        ["", "decode tok/s", "of weight-read limit", "first token ms", "compile+warmup s", "cai vs it"], rows
    )


def print_prefix(results: dict, args) -> None:
    pre = results["prefix"]
    print(
        f"\nprefix: {args.num_requests} requests, a shared {args.system_len}-token system prompt plus "
        f"{args.min_suffix}-{args.max_suffix} random tokens each, {args.output_len} new tokens each"
    )
    rows = []
    for name in ("caching off", "caching on"):
        row = pre[name]
        vs = f"{pre['ratio']:.2f}x" if name == "caching on" else ""
        rows.append(
            [
                f"cai, {name}",
                f"{row['tokens_per_s']:,.1f}",
                f"{row['seconds']:.2f}",
                f"{row['prefix_hit_tokens']:,}/{row['prompt_tokens']:,}",
                vs,
            ]
        )
    table(["", "output tok/s", "seconds", "prompt tokens from cache", "on vs off"], rows)


# ---- main -----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument(
        "-c", "--config", choices=sorted(PRESETS), default="tiny", help="a preset of examples/_models.py"
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--modes", default=",".join(ALL_MODES), help=f"comma list of {ALL_MODES}")
    p.add_argument("--skip", default="", help="comma list of modes to leave out of --modes")
    p.add_argument("-n", "--num-requests", type=int, default=1000, help="offline and prefix: requests")
    p.add_argument("--min-prompt", type=int, default=128, help="offline and server: shortest prompt")
    p.add_argument("--max-prompt", type=int, default=1024, help="offline and server: longest prompt")
    p.add_argument(
        "--output-len", type=int, default=256, help="offline, server, prefix: new tokens a request"
    )
    p.add_argument("--single-prompt", type=int, default=512, help="single stream: prompt tokens")
    p.add_argument("--single-new", type=int, default=512, help="single stream: new tokens")
    p.add_argument("--max-batch-size", type=int, default=256, help="cai's batch; hf generate's static batch")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="cai's KV pool (default: never preempts)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="cai's step token budget")
    p.add_argument(
        "--use-cuda-kernel", choices=("default", "on", "off"), default="default",
        help="cai's InferenceConfig.use_cuda_kernel (default: the config's default)",
    )  # fmt: skip
    p.add_argument("--peers", default=",".join(ALL_PEERS), help=f"comma list of {ALL_PEERS}, or 'none'")
    p.add_argument("--compile-backend", default="inductor", help="hf-compile: torch.compile's backend")
    p.add_argument(
        "--compile-mode",
        default="reduce-overhead",
        help="hf-compile: inductor's mode (reduce-overhead: CUDA graphs)",
    )
    p.add_argument("--rates", default="4,16", help="server: comma list of request rates (requests/s)")
    p.add_argument("--server-requests", type=int, default=200, help="server: requests at each rate")
    p.add_argument(
        "--server-via",
        choices=("auto", "http", "engine"),
        default="auto",
        help="server: HTTP (needs fastapi, uvicorn), the async engine directly, or HTTP where installed",
    )
    p.add_argument("--client", choices=("auto", *CLIENTS), default="auto", help="server: the HTTP client")
    p.add_argument("--system-len", type=int, default=1000, help="prefix: tokens of the shared system prompt")
    p.add_argument("--min-suffix", type=int, default=16, help="prefix: shortest random suffix")
    p.add_argument("--max-suffix", type=int, default=64, help="prefix: longest random suffix")
    p.add_argument("--tag", default="", help="appended to the JSON file's name")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.peers = [] if args.peers == "none" else args.peers.split(",")
    unknown = set(args.peers) - set(ALL_PEERS)
    if unknown:
        p.error(f"--peers {sorted(unknown)} unknown; choose from {ALL_PEERS}")
    skip = set(filter(None, args.skip.split(",")))
    args.modes = [m for m in filter(None, args.modes.split(",")) if m not in skip]
    unknown = set(args.modes) - set(ALL_MODES) or skip - set(ALL_MODES)
    if unknown:
        p.error(f"mode {sorted(unknown)} unknown; choose from {ALL_MODES}")
    try:
        args.rates = [float(r) for r in args.rates.split(",")]
    except ValueError:
        p.error(f"--rates {args.rates!r}: a comma list of numbers")
    if any(r <= 0 for r in args.rates):
        p.error(f"--rates {args.rates}: each must be above 0")
    for lo, hi in (("min_prompt", "max_prompt"), ("min_suffix", "max_suffix")):
        if not 1 <= getattr(args, lo) <= getattr(args, hi):
            p.error(f"--{lo.replace('_', '-')} must be at least 1 and at most --{hi.replace('_', '-')}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    modes, peers = args.modes, args.peers
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    torch.manual_seed(args.seed)
    longest = max(
        args.max_prompt + args.output_len,
        args.single_prompt + args.single_new,
        args.system_len + args.max_suffix + args.output_len,
    )
    with torch.device(device):
        model = LlamaForCausalLM(preset_config(args.config, max_seq=longest)).to(DTYPES[args.dtype]).eval()
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    bandwidth = copy_bandwidth(device)
    results: dict = {
        "config": args.config,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "modes": modes,
        "peers": peers,
        "args": {k: v for k, v in vars(args).items() if k not in ("modes", "peers")},
        "weight_bytes": weight_bytes,
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "weight_read_limit_tokens_per_s": bandwidth / weight_bytes,
    }
    print(
        f"{args.config} ({weight_bytes / 1e9:.3f} GB in {args.dtype}) on {results['device']}: copy bandwidth "
        f"{bandwidth / 1e9:,.1f} GB/s, weight-read limit {bandwidth / weight_bytes:,.1f} tokens/s; "
        f"modes {','.join(modes)}"
    )

    def guarded(name: str, fn, *a) -> dict:
        try:
            return fn(*a)
        except Exception as e:  # a row that cannot run here is reported, the other rows still run
            print(f"{name} failed: {type(e).__name__}: {e}", file=sys.stderr)
            return {"error": f"{type(e).__name__}: {e}"}

    # Every peer first: cai's engine switches the model's attention implementation to its own (and may patch
    # its modules with fused kernels).
    if "offline" in modes:
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
    if "single" in modes:
        rng = random.Random(args.seed + 1)
        prompt = [rng.randrange(model.config.vocab_size) for _ in range(args.single_prompt)]
        single: dict = {}
        if "hf-generate" in peers:
            single["hf generate"] = guarded("hf generate", single_hf, model, prompt, args)
        if "hf-compile" in peers:  # last of the peers: the compiled forward stays on the model
            single["hf generate static+compile"] = guarded(
                "hf generate static+compile", single_hf_compile, model, prompt, args
            )
        results["single"] = single
    model.set_attn_implementation("sdpa")  # restored below by the engine; generate_batch may have switched it
    if "offline" in modes:
        results["offline"]["cai"] = offline_cai(model, prompts, args)
        release(device)
    if "single" in modes:
        results["single"]["cai"] = single_cai(model, prompt, args)
        release(device)
    if "server" in modes:
        results["server"] = server_bench(model, args, args.rates)
        release(device)
    if "prefix" in modes:
        results["prefix"] = prefix_bench(model, args)

    for mode, show in (("offline", print_offline), ("single", print_single), ("server", print_server),
                       ("prefix", print_prefix)):  # fmt: skip
        if mode in results:
            show(results, args)
    if os.environ.get("OUT"):
        tag = f"_{args.tag}" if args.tag else ""
        path = os.path.join(os.environ["OUT"], f"bench_infer_{args.config}{tag}.json")
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
        print(f"\nwrote {path}")
    return results


if __name__ == "__main__":
    main()
