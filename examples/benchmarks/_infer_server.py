"""bench_infer.py's server mode: cai's OpenAI-compatible app under uvicorn in a thread of this process, and a client
in a process of its own that streams ``/v1/completions`` requests arriving as a Poisson process; or, without
FastAPI and uvicorn, the same arrivals straight to ``AsyncInferenceEngine.generate``."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import pickle
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

from _infer_client import CLIENTS, SERVED_NAME, drive
from _infer_common import cai_engine, ms, note, percentile, random_prompts, table, warm

from cai.infer import AsyncInferenceEngine, SamplingParams

CLIENT_SCRIPT = Path(__file__).resolve().with_name("_infer_client.py")


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
        with serving(aengine) as url:
            note(f"cai server at {url}; client ({client}) in a separate process ...")
            # A plain interpreter on _infer_client.py: a multiprocessing child would import this script's
            # __main__ (torch, transformers, cai.infer) before the client could start.
            proc = subprocess.run(
                [sys.executable, str(CLIENT_SCRIPT)],
                input=pickle.dumps((url, client, plan, args.output_len, vocab)),
                stdout=subprocess.PIPE,
            )
        if proc.stdout:
            status, payload = pickle.loads(proc.stdout)
        else:
            status, payload = "error", f"the client process died (exit code {proc.returncode})"
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
