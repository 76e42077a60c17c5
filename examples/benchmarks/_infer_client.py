"""The client side of bench_infer.py's server mode, importing nothing beyond the standard library (the HTTP client
aside): run as a script it is the client's process, started by ``_infer_server.server_bench``, so that its start
costs no torch or transformers import. It reads ``(url, client, plan, output_len, vocab)`` pickled on stdin and
writes ``("ok", records per rate)`` or ``("error", message)`` pickled on stdout."""

from __future__ import annotations

import asyncio
import contextlib
import json
import pickle
import random
import sys
import time
from collections.abc import AsyncIterator, Callable

CLIENTS = ("httpx", "aiohttp")
SERVED_NAME = "bench"


Submit = Callable[[list[int], int], AsyncIterator[int]]  # (prompt, max_tokens) -> new tokens per chunk


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


def client_main() -> None:
    """The client's process: its own interpreter, so that parsing streams does not compete with the engine for
    the server's GIL."""
    url, client, plan, output_len, vocab = pickle.load(sys.stdin.buffer)
    try:
        result = ("ok", asyncio.run(client_runs(url, client, plan, output_len, vocab)))
    except BaseException as e:
        result = ("error", f"{type(e).__name__}: {e}")
    sys.stdout.buffer.write(pickle.dumps(result))
    sys.stdout.buffer.flush()


if __name__ == "__main__":
    client_main()
