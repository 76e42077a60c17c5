"""An OpenAI-compatible HTTP server over ``AsyncInferenceEngine`` (FastAPI; the extra ``cai-infer[serve]``).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the tokenizer's chat template; both stream by
server-sent events with ``"stream": true``), ``GET /v1/models``, ``GET /health`` and ``GET /metrics``
(Prometheus text: requests, tokens, queue length, KV blocks in use, time to first token).

[Note: errors before the stream]
A request is added to the engine, and its first output awaited, before the response starts: a request the
engine refuses (prompt over ``max_input_len``, ``max_tokens`` over ``max_output_len`` or below 1) gets a 400
with the engine's message instead of a stream that breaks after its headers are sent.
"""

# No ``from __future__ import annotations``: FastAPI reads the handlers' annotations (``fastapi.Request``, a
# local name here since FastAPI is imported lazily) at definition time.
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from ._async import AsyncInferenceEngine
from ._engine import RequestOutput
from ._sampling import SamplingParams

# Upper bounds (seconds) of the time-to-first-token histogram's buckets.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _fastapi() -> Any:
    try:
        import fastapi
    except ImportError as exc:
        raise ImportError(
            "the cai-infer server needs FastAPI and uvicorn: pip install 'cai-infer[serve]'"
        ) from exc
    return fastapi


class _RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class Metrics:
    """Counters and the time-to-first-token histogram, written out in Prometheus' text format."""

    def __init__(self) -> None:
        self.requests: dict[str, int] = {}  # by outcome: "ok", "error", "abort"
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft_counts = [0] * len(TTFT_BUCKETS)
        self.ttft_sum = 0.0
        self.ttft_count = 0

    def count_request(self, outcome: str) -> None:
        self.requests[outcome] = self.requests.get(outcome, 0) + 1

    def observe_ttft(self, seconds: float) -> None:
        for i, bound in enumerate(TTFT_BUCKETS):
            if seconds <= bound:
                self.ttft_counts[i] += 1
        self.ttft_sum += seconds
        self.ttft_count += 1

    def render(self, engine: Any) -> str:
        sched, blocks = engine.scheduler, engine.blocks
        used = blocks.num_blocks - blocks.num_free
        lines = [
            "# HELP cai_requests_total Requests answered, by outcome.",
            "# TYPE cai_requests_total counter",
            *(f'cai_requests_total{{outcome="{k}"}} {v}' for k, v in sorted(self.requests.items())),
            "# HELP cai_prompt_tokens_total Prompt tokens of accepted requests.",
            "# TYPE cai_prompt_tokens_total counter",
            f"cai_prompt_tokens_total {self.prompt_tokens}",
            "# HELP cai_generation_tokens_total Tokens generated.",
            "# TYPE cai_generation_tokens_total counter",
            f"cai_generation_tokens_total {self.generation_tokens}",
            "# HELP cai_queue_length Requests waiting for a batch slot.",
            "# TYPE cai_queue_length gauge",
            f"cai_queue_length {len(sched.waiting)}",
            "# HELP cai_running_requests Requests in the running batch.",
            "# TYPE cai_running_requests gauge",
            f"cai_running_requests {len(sched.running)}",
            "# HELP cai_kv_blocks_used KV-cache blocks held by requests.",
            "# TYPE cai_kv_blocks_used gauge",
            f"cai_kv_blocks_used {used}",
            "# HELP cai_kv_blocks_total KV-cache blocks in the pool.",
            "# TYPE cai_kv_blocks_total gauge",
            f"cai_kv_blocks_total {blocks.num_blocks}",
            "# HELP cai_spec_draft_tokens_total Speculative draft tokens verified.",
            "# TYPE cai_spec_draft_tokens_total counter",
            f"cai_spec_draft_tokens_total {engine.num_drafted}",
            "# HELP cai_spec_accepted_tokens_total Speculative draft tokens accepted.",
            "# TYPE cai_spec_accepted_tokens_total counter",
            f"cai_spec_accepted_tokens_total {engine.num_accepted}",
            "# HELP cai_time_to_first_token_seconds From a request's arrival to its first token.",
            "# TYPE cai_time_to_first_token_seconds histogram",
            *(
                f'cai_time_to_first_token_seconds_bucket{{le="{b}"}} {c}'
                for b, c in zip(TTFT_BUCKETS, self.ttft_counts, strict=True)
            ),
            f'cai_time_to_first_token_seconds_bucket{{le="+Inf"}} {self.ttft_count}',
            f"cai_time_to_first_token_seconds_sum {self.ttft_sum}",
            f"cai_time_to_first_token_seconds_count {self.ttft_count}",
        ]
        return "\n".join(lines) + "\n"


def _number(body: dict, name: str, kind: type, default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise _RequestError(
            400, f"{name}={value!r} must be {'a number' if kind is float else 'an integer'}", name
        )
    return kind(value)


def _sampling_params(body: dict, default_max_tokens: int) -> SamplingParams:
    temperature = _number(body, "temperature", float, 1.0)
    stop = body.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise _RequestError(400, f"stop={stop!r} must be a string or a list of strings", "stop")
    try:
        return SamplingParams(
            max_new_tokens=_number(body, "max_tokens", int, default_max_tokens),
            do_sample=temperature > 0,
            temperature=temperature,
            top_p=_number(body, "top_p", float, 1.0),
            seed=_number(body, "seed", int, None),
            stop=tuple(stop),
        )
    except ValueError as exc:
        raise _RequestError(400, str(exc).replace("SamplingParams.max_new_tokens", "max_tokens")) from exc


def build_app(engine: AsyncInferenceEngine, model_name: str) -> Any:
    """The FastAPI app serving ``engine`` under the model id ``model_name``."""
    fastapi = _fastapi()
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    app = fastapi.FastAPI(title="cai-infer")
    core = engine.engine
    metrics = Metrics()
    default_max_tokens = min(16, core.config.max_output_len)  # OpenAI's completions default

    def error(exc: _RequestError) -> Any:
        metrics.count_request("error")
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        return JSONResponse(
            {"error": {"message": exc.message, "type": kind, "param": exc.param, "code": exc.code}},
            status_code=exc.status,
        )

    async def read_body(request: Any) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise _RequestError(
                400, f"the request body is not valid JSON ({exc}); send a JSON object"
            ) from exc
        if not isinstance(body, dict):
            raise _RequestError(400, f"the request body is a JSON {type(body).__name__}; send a JSON object")
        model = body.get("model")
        if model is not None and model != model_name:
            raise _RequestError(
                404,
                f"model {model!r} does not exist; this server serves {model_name!r}",
                "model",
                "model_not_found",
            )
        return body

    async def start(prompt: str | None, ids: list[int] | None, params: SamplingParams):
        """Add the request and wait for its first output (see [Note: errors before the stream])."""
        if prompt is not None and core.tokenizer is None:
            raise _RequestError(
                400, "the served model has no tokenizer; send the prompt as a list of token ids"
            )
        arrival = time.perf_counter()
        stream = engine.generate(prompt=prompt, prompt_token_ids=ids, sampling_params=params)
        try:
            first = await stream.__anext__()
        except ValueError as exc:
            await stream.aclose()
            raise _RequestError(400, str(exc)) from exc
        metrics.observe_ttft(time.perf_counter() - arrival)
        metrics.prompt_tokens += len(first.prompt_token_ids)
        return stream, first

    async def outputs(
        stream: AsyncIterator[RequestOutput], first: RequestOutput
    ) -> AsyncIterator[RequestOutput]:
        seen = 0
        out = first
        try:
            while True:
                metrics.generation_tokens += len(out.token_ids) - seen
                seen = len(out.token_ids)
                yield out
                if out.finished:
                    metrics.count_request("ok")
                    return
                out = await stream.__anext__()
        except StopAsyncIteration:  # aborted elsewhere: the stream ended unfinished
            metrics.count_request("abort")
        except GeneratorExit:  # the client went away; closing the engine's stream aborts the request
            metrics.count_request("abort")
            raise
        finally:
            await stream.aclose()

    def finish_reason(out: RequestOutput) -> str | None:
        if not out.finished:
            return None
        return "length" if out.finish_reason == "length" else "stop"

    def text_of(out: RequestOutput) -> str:
        return out.text if out.text is not None else " ".join(map(str, out.token_ids))

    def usage(out: RequestOutput) -> dict:
        n, m = len(out.prompt_token_ids), len(out.token_ids)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}

    def sse(chunks: AsyncIterator[dict]) -> Any:
        async def body() -> AsyncIterator[str]:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    @app.get("/health")
    async def health() -> Any:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> Any:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "cai"}],
        }

    @app.get("/metrics")
    async def prometheus() -> Any:
        return PlainTextResponse(metrics.render(core), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request) -> Any:
        try:
            body = await read_body(request)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                text, ids = None, prompt
            elif isinstance(prompt, str):
                text, ids = prompt, None
            else:
                raise _RequestError(
                    400,
                    f"prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                    "prompt",
                )
            stream, first = await start(text, ids, _sampling_params(body, default_max_tokens))
        except _RequestError as exc:
            return error(exc)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str, out: RequestOutput) -> dict:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(out)}
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model_name,
                "choices": [choice],
            }

        if body.get("stream"):

            async def chunks() -> AsyncIterator[dict]:
                sent = ""
                async for out in outputs(stream, first):
                    text = text_of(out)
                    yield chunk(text[len(sent) :], out)
                    sent = text

            return sse(chunks())
        last = first
        async for out in outputs(stream, first):
            last = out
        return {**chunk(text_of(last), last), "usage": usage(last)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: fastapi.Request) -> Any:
        try:
            body = await read_body(request)
            messages = body.get("messages")
            if (
                not isinstance(messages, list)
                or not messages
                or not all(
                    isinstance(m, dict)
                    and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)
                    for m in messages
                )
            ):
                raise _RequestError(
                    400,
                    "messages must be a non-empty list of {role, content} objects with string values",
                    "messages",
                )
            if core.tokenizer is None or not getattr(core.tokenizer, "chat_template", None):
                raise _RequestError(
                    400, "the served model's tokenizer has no chat template; use /v1/completions", "messages"
                )
            prompt = core.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = core.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            params = _sampling_params(
                {**body, "max_tokens": body.get("max_completion_tokens", body.get("max_tokens"))},
                core.config.max_output_len,
            )
            stream, first = await start(None, ids, params)
        except _RequestError as exc:
            return error(exc)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(delta: dict, out: RequestOutput, obj: str) -> dict:
            key = "delta" if obj.endswith("chunk") else "message"
            choice = {"index": 0, key: delta, "logprobs": None, "finish_reason": finish_reason(out)}
            return {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [choice]}

        if body.get("stream"):

            async def chunks() -> AsyncIterator[dict]:
                sent = ""
                role = {"role": "assistant"}
                async for out in outputs(stream, first):
                    text = text_of(out)
                    yield chunk({**role, "content": text[len(sent) :]}, out, "chat.completion.chunk")
                    role, sent = {}, text

            return sse(chunks())
        last = first
        async for out in outputs(stream, first):
            last = out
        message = {"role": "assistant", "content": text_of(last)}
        return {**chunk(message, last, "chat.completion"), "usage": usage(last)}

    return app
