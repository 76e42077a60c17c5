"""bench_infer.py's server mode: cai's OpenAI-compatible app under uvicorn in a thread of this process, and a client
in a process of its own that streams ``/v1/completions`` requests arriving as a Poisson process; or, without
FastAPI and uvicorn, the same arrivals straight to ``AsyncInferenceEngine.generate``."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import multiprocessing
import random
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable

from _infer_common import Progress, cai_engine, ms, note, percentile, random_prompts, table, warm

from cai.infer import AsyncInferenceEngine, SamplingParams

CLIENTS = ("httpx", "aiohttp")
SERVED_NAME = "bench"


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
