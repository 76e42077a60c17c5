"""AsyncInferenceEngine: asyncio streams over one InferenceEngine, whose steps run in a worker thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

from ._engine import InferenceEngine, RequestOutput
from ._sampling import SamplingParams


class AsyncInferenceEngine:
    """Serve many concurrent callers from one engine: each ``generate`` call is an async stream of its request's
    ``RequestOutput``s, and one background task runs ``step`` while any request is unfinished.

    Args: an ``InferenceEngine``, or the arguments that build one (``model_or_path, tokenizer, inference_config``).

    Example::

        engine = AsyncInferenceEngine(model, tokenizer, InferenceConfig(dtype="bf16"))
        async for out in engine.generate(prompt="Hello", sampling_params=SamplingParams(max_new_tokens=16)):
            print(out.text)

    Steps run in a worker thread (``asyncio.to_thread``) so the event loop keeps serving while the model runs;
    a lock keeps ``add_request`` / ``abort_request`` out of a running step. Closing a stream early aborts its
    request and frees its blocks: a cancelled task does at once; after a ``break``, close it with
    ``contextlib.aclosing`` (else Python closes it only when it is collected).
    """

    def __init__(self, engine: InferenceEngine | Any, *args: Any, **kwargs: Any) -> None:
        self.engine = (
            engine if isinstance(engine, InferenceEngine) else InferenceEngine(engine, *args, **kwargs)
        )
        self._lock = threading.Lock()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop_task: asyncio.Task | None = None

    async def generate(
        self,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        generation_config: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        """Add one request and yield its outputs as tokens arrive; the last one has ``finished=True``."""
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        with self._lock:
            (rid,) = self.engine.add_request(
                request_id,
                prompt,
                prompt_token_ids,
                generation_config=generation_config,
                sampling_params=sampling_params,
            )
        self._streams[rid] = queue
        self._ensure_loop()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (its stream, if any, ends without a finished output)."""
        with self._lock:
            self.engine.abort_request(request_id)

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def _locked_step(self) -> list[RequestOutput]:
        with self._lock:
            return self.engine.step()

    async def _run(self) -> None:
        try:
            while self.engine.has_unfinished_requests():
                for out in await asyncio.to_thread(self._locked_step):
                    queue = self._streams.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
        except Exception as exc:  # a failed step ends every open stream with the error
            for queue in self._streams.values():
                queue.put_nowait(exc)
            raise
