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
import asyncio
import contextlib
import gc
import importlib.util
import json
import math
import multiprocessing
import os
import random
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples' shared helpers

import torch
from _models import PRESETS, preset_config
from transformers import CompileConfig, ContinuousBatchingConfig, GenerationConfig, LlamaForCausalLM

from cai.infer import AsyncInferenceEngine, InferenceConfig, InferenceEngine, SamplingParams

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ALL_MODES = ("offline", "single", "server", "prefix")
ALL_PEERS = ("hf-batch", "hf-generate", "hf-compile")
CLIENTS = ("httpx", "aiohttp")
SERVED_NAME = "bench"


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


def note(text: str) -> None:
    """A phase without counts (a compile, a server start) on the progress stream."""
    print(text, file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Give the memory of a dropped engine (its KV pool) back before the next one is built."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


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


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between the closest ranks; None for no values."""
    s = sorted(values)
    if not s:
        return None
    k = (len(s) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def random_prompts(rng: random.Random, n: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def workload(args, vocab: int) -> list[list[int]]:
    return random_prompts(
        random.Random(args.seed), args.num_requests, args.min_prompt, args.max_prompt, vocab
    )


# ---- cai's engine ---------------------------------------------------------------------------------------------


def cai_engine(
    model,
    args,
    *,
    max_input: int,
    max_output: int,
    batch: int,
    prefix_caching: bool = False,
    drop_eos: bool = False,
) -> InferenceEngine:
    """An engine on ``model``. ``drop_eos``: built as for a model without an EOS token, so that requests that
    cannot say ``ignore_eos`` (the HTTP API has no such field) still run to their length."""
    gen = getattr(model, "generation_config", None)
    saved = getattr(gen, "eos_token_id", None)
    if drop_eos and gen is not None:
        gen.eos_token_id = None  # the engine reads the model's EOS once, when it is built
    try:
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
                # Off unless measured: random prompts share nothing and the lookups would only cost.
                enable_prefix_caching=prefix_caching,
                ignore_eos=True,
                use_cuda_kernel={"default": None, "on": True, "off": False}[args.use_cuda_kernel],
            ),
        )
    finally:
        if drop_eos and gen is not None:
            gen.eos_token_id = saved


def warm(engine: InferenceEngine, vocab: int) -> None:
    """Two short untimed requests (a short and a full-length prompt): kernels compile, buffers are allocated."""
    rng = random.Random(-1)
    longest = engine.config.max_input_len
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in sorted({min(8, longest), longest})]
    engine.add_request(
        prompts_token_ids=prompts, sampling_params=SamplingParams(max_new_tokens=2, ignore_eos=True)
    )
    while engine.has_unfinished_requests():
        engine.step()


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


# ---- server: Poisson arrivals against the HTTP server (or the async engine) ---------------------------------

Submit = Callable[[list[int], int], AsyncIterator[int]]  # (prompt, max_tokens) -> new tokens per chunk


def poisson_plan(args, vocab: int, rates: list[float]) -> list[dict]:
    """Per rate: arrival offsets (exponential gaps, the first at 0) and random prompts of the offline lengths."""
    rng = random.Random(args.seed + 3)
    plan = []
    for rate in rates:
        arrivals, t = [], 0.0
        for i in range(args.server_requests):
            arrivals.append(t)
            if i + 1 < args.server_requests:
                t += rng.expovariate(rate)
        prompts = random_prompts(rng, args.server_requests, args.min_prompt, args.max_prompt, vocab)
        plan.append({"rate": rate, "arrivals": arrivals, "prompts": prompts})
    return plan


async def drive(entry: dict, submit: Submit, output_len: int) -> list[dict]:
    """Send each prompt at its arrival time, stream it, and time its tokens (client side)."""
    prompts = entry["prompts"]
    bar = Progress(f"cai server {entry['rate']:g} req/s", len(prompts), "requests")
    counts = {"done": 0, "tokens": 0}
    t0 = time.perf_counter()

    async def one(at: float, prompt: list[int]) -> dict:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        sent = time.perf_counter()
        first = last = None
        n = 0
        try:
            async for k in submit(prompt, output_len):
                if not k:
                    continue
                last = time.perf_counter()
                if first is None:
                    first = last
                n += k
                counts["tokens"] += k
                bar.update(counts["done"], counts["tokens"])
        except Exception as e:  # counted as a failed request; the others go on
            return {"error": f"{type(e).__name__}: {e}"}
        counts["done"] += 1
        if first is None:
            return {"error": "the stream ended without a token"}
        return {
            "sent_s": sent - t0,
            "late_s": sent - t0 - at,
            "ttft_s": first - sent,
            "end_s": last - t0,
            "tokens": n,
            "tpot_s": (last - first) / (n - 1) if n > 1 else None,
        }

    records = await asyncio.gather(*(one(a, p) for a, p in zip(entry["arrivals"], prompts, strict=True)))
    bar.close(counts["done"], counts["tokens"])
    return records


def summarize(rate: float, records: list[dict], output_len: int) -> dict:
    ok = [r for r in records if "error" not in r]
    errors = [r["error"] for r in records if "error" in r]
    row: dict = {"rate": rate, "requests": len(records), "ok": len(ok), "errors": len(errors)}
    if errors:
        row["first_error"] = errors[0]
    if not ok:
        return row
    start = min(r["sent_s"] for r in ok)
    duration = max(r["end_s"] for r in ok) - start
    sends = max(r["sent_s"] for r in ok) - start
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["ttft_s"] for r in ok]
    tpot = [r["tpot_s"] for r in ok if r["tpot_s"] is not None]
    row.update(
        short=sum(r["tokens"] != output_len for r in ok),  # requests that stopped before --output-len
        output_tokens=tokens,
        seconds=duration,
        sent_rate=(len(ok) - 1) / sends if sends > 0 else None,
        completed_rate=len(ok) / duration,
        tokens_per_s=tokens / duration,
        ttft_p50_s=percentile(ttft, 50),
        ttft_p99_s=percentile(ttft, 99),
        ttft_mean_s=sum(ttft) / len(ttft),
        tpot_p50_s=percentile(tpot, 50),
        tpot_p99_s=percentile(tpot, 99),
        tpot_mean_s=sum(tpot) / len(tpot) if tpot else None,
        max_send_late_s=max(r["late_s"] for r in ok),
    )
    return row


def sse_tokens(line: str) -> int | None:
    """Tokens in one server-sent event line of a completions stream (0 for other lines, None at ``[DONE]``).
    Without a tokenizer the server's text is the token ids joined by spaces."""
    if not line.startswith("data:"):
        return 0
    data = line[5:].strip()
    if data == "[DONE]":
        return None
    return len(json.loads(data)["choices"][0]["text"].split())


def completion_body(prompt: list[int], max_tokens: int) -> dict:
    return {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }


@contextlib.asynccontextmanager
async def http_submitter(url: str, client: str):
    endpoint = url + "/v1/completions"
    if client == "httpx":
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=None, limits=limits) as session:

            async def submit(prompt: list[int], max_tokens: int) -> AsyncIterator[int]:
                async with session.stream("POST", endpoint, json=completion_body(prompt, max_tokens)) as r:
                    if r.status_code != 200:
                        raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
                    async for line in r.aiter_lines():
                        n = sse_tokens(line)
                        if n is None:
                            return
                        yield n

            yield submit
    elif client == "aiohttp":
        import aiohttp

        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

            async def submit(prompt: list[int], max_tokens: int) -> AsyncIterator[int]:
                async with session.post(endpoint, json=completion_body(prompt, max_tokens)) as r:
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
                    async for raw in r.content:
                        n = sse_tokens(raw.decode())
                        if n is None:
                            return
                        yield n

            yield submit
    else:
        raise ValueError(f"unknown client {client!r}; choose from {CLIENTS}")


async def client_runs(
    url: str, client: str, plan: list[dict], output_len: int, vocab: int
) -> list[list[dict]]:
    async with http_submitter(url, client) as submit:
        rng = random.Random(-2)
        for n in (8, 8):  # untimed: connections opened, the server's first requests served
            async for _ in submit([rng.randrange(vocab) for _ in range(n)], 2):
                pass
        return [await drive(entry, submit, output_len) for entry in plan]


def client_process(url: str, client: str, plan: list[dict], output_len: int, vocab: int, conn) -> None:
    """The client's process: its own interpreter, so that parsing streams does not compete with the engine for
    the server's GIL. Sends back ("ok", records per rate) or ("error", message)."""
    try:
        conn.send(("ok", asyncio.run(client_runs(url, client, plan, output_len, vocab))))
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


@contextlib.contextmanager
def serving(engine: AsyncInferenceEngine):
    """cai's app under uvicorn in a daemon thread, on a free port of 127.0.0.1; yields the base URL."""
    import uvicorn

    from cai.infer._server import build_app

    app = build_app(engine, SERVED_NAME)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # the kernel picks a free port; uvicorn serves on this very socket
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="uvicorn")
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError("uvicorn did not start (see its log above)")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def server_transport(args) -> tuple[str, str | None]:
    """("http", client) or ("engine", None), from --server-via and --client and what is installed."""
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    clients = [
        c for c in (CLIENTS if args.client == "auto" else (args.client,)) if importlib.util.find_spec(c)
    ]
    if args.server_via == "engine":
        return "engine", None
    why = None
    if missing:
        why = f"{', '.join(missing)} not installed (pip install 'cai-infer[serve]')"
    elif not clients:
        why = f"no HTTP client ({' or '.join(CLIENTS) if args.client == 'auto' else args.client}) installed"
    if why is None:
        return "http", clients[0]
    if args.server_via == "http":
        raise RuntimeError(f"--server-via http: {why}")
    note(f"server mode: {why}; requests go to AsyncInferenceEngine.generate in this process, without HTTP")
    return "engine", None


def server_bench(model, args, rates: list[float]) -> dict:
    via, client = server_transport(args)
    vocab = model.config.vocab_size
    plan = poisson_plan(args, vocab, rates)
    engine = cai_engine(
        model,
        args,
        max_input=args.max_prompt,
        max_output=args.output_len,
        batch=args.max_batch_size,
        drop_eos=via == "http",
    )
    warm(engine, vocab)
    aengine = AsyncInferenceEngine(engine)
    if via == "http":
        ctx = multiprocessing.get_context("spawn")
        with serving(aengine) as url:
            note(f"cai server at {url}; client ({client}) in a separate process ...")
            mine, theirs = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=client_process, args=(url, client, plan, args.output_len, vocab, theirs), daemon=True
            )
            proc.start()
            theirs.close()
            try:
                status, payload = mine.recv()
            except EOFError:
                status, payload = (
                    "error",
                    f"the client process died (exit code {proc.join(5) or proc.exitcode})",
                )
            proc.join(timeout=30)
        if status != "ok":
            raise RuntimeError(f"server client: {payload}")
        per_rate = payload
        transport = f"HTTP /v1/completions (uvicorn in-process, {client} client in a separate process)"
    else:

        async def submit(prompt: list[int], max_tokens: int) -> AsyncIterator[int]:
            params = SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)
            seen = 0
            async for out in aengine.generate(prompt_token_ids=prompt, sampling_params=params):
                yield len(out.token_ids) - seen
                seen = len(out.token_ids)

        async def runs() -> list[list[dict]]:
            return [await drive(entry, submit, args.output_len) for entry in plan]

        per_rate = asyncio.run(runs())
        transport = "AsyncInferenceEngine.generate in-process (no HTTP)"
    rows = [
        summarize(entry["rate"], recs, args.output_len) for entry, recs in zip(plan, per_rate, strict=True)
    ]
    return {
        "transport": transport,
        "via": via,
        "client": client,
        "preemptions": engine.scheduler.num_preemptions,
        "rates": {f"{row['rate']:g}": row for row in rows},
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


def table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, ["-" * w for w in widths], *rows]:
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        print("  " + "  ".join(cells).rstrip())


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:,.1f}"


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


def print_server(results: dict, args) -> None:
    srv = results["server"]
    print(
        f"\nserver: {srv['transport']}; Poisson arrivals, {args.server_requests} requests a rate, prompts "
        f"{args.min_prompt}-{args.max_prompt}, {args.output_len} tokens each (EOS off), streamed"
    )
    rows = []
    for row in srv["rates"].values():
        if not row.get("ok"):
            rows.append(
                [f"{row['rate']:g}", f"0/{row['requests']}", *[""] * 6, row.get("first_error", "")[:60]]
            )
            continue
        issues = [f"{row['errors']} failed"] if row["errors"] else []
        if row["short"]:
            issues.append(f"{row['short']} stopped short")
        rows.append(
            [
                f"{row['rate']:g}",
                f"{row['ok']}/{row['requests']}",
                f"{row['completed_rate']:.2f}",
                f"{row['tokens_per_s']:,.1f}",
                ms(row["ttft_p50_s"]),
                ms(row["ttft_p99_s"]),
                ms(row["tpot_p50_s"]),
                ms(row["tpot_p99_s"]),
                ", ".join(issues),
            ]
        )
    table(
        ["req/s asked", "ok", "req/s done", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
         "TPOT p99 ms", ""],
        rows,
    )  # fmt: skip
    print(f"  (no transformers peer: it has no server; {srv['preemptions']} preemptions in cai's engine)")


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
