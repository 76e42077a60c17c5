"""AsyncInferenceEngine: asyncio streams over one InferenceEngine, whose steps run in a worker thread; under tensor
parallelism it runs on rank 0, through a ``LockstepDriver`` that feeds the other ranks."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Any

import torch.distributed as dist

from ._engine import InferenceEngine, RequestOutput
from ._lockstep import LockstepDriver
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

    Tensor parallelism (``tp_size > 1``): build it on rank 0 only, from the engine (it then builds a
    ``LockstepDriver`` with the default keepalive) or from a ``LockstepDriver``; requests, aborts and steps go
    through the driver, while the other ranks run ``LockstepDriver(engine).follow()``. ``close()`` ends their
    ``follow()`` (see _lockstep.py [Note: lockstep driver]).
    """

    def __init__(self, engine: InferenceEngine | LockstepDriver | Any, *args: Any, **kwargs: Any) -> None:
        driver = None
        if isinstance(engine, LockstepDriver):
            driver, engine = engine, engine.engine
        elif not isinstance(engine, InferenceEngine):
            engine = InferenceEngine(engine, *args, **kwargs)
        if engine._tp_group is not None:  # see _lockstep.py [Note: lockstep driver]
            rank = dist.get_rank(engine._tp_group)
            if rank != 0:
                raise ValueError(
                    f"AsyncInferenceEngine on tensor-parallel rank {rank}: requests enter on rank 0 only; build it "
                    "there, and run LockstepDriver(engine).follow() on this rank"
                )
            if driver is None:
                driver = LockstepDriver(engine)
        self.engine: InferenceEngine = engine
        self.driver: LockstepDriver | None = driver  # None without tensor parallelism
        self._target: InferenceEngine | LockstepDriver = driver if driver is not None else engine
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
            (rid,) = self._target.add_request(
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
            self._target.abort_request(request_id)
        if self.driver is not None:
            # The followers hear of it with the next step, which runs even when nothing else is left to run;
            # outside an event loop the keepalive or the next request sends it.
            with contextlib.suppress(RuntimeError):
                self._ensure_loop()

    def close(self) -> None:
        """Under tensor parallelism, close the driver: the other ranks' ``follow()`` returns (requests still
        unfinished stay queued). Without it, nothing to do."""
        if self.driver is not None:
            with self._lock:
                self.driver.close()

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def _locked_step(self) -> list[RequestOutput]:
        with self._lock:
            return self._target.step()

    async def _run(self) -> None:
        try:
            while self._target.has_unfinished_requests():
                for out in await asyncio.to_thread(self._locked_step):
                    queue = self._streams.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
        except Exception as exc:  # a failed step ends every open stream with the error
            for queue in self._streams.values():
                queue.put_nowait(exc)
            raise
