"""LockstepDriver: rank 0 of a tensor-parallel engine takes the requests; the other ranks follow its commands.

See _parallel.py [Note: tensor-parallel engine] for why the ranks stay in step without exchanging their decisions.
What they must share is the requests, in the same order relative to the steps; this module carries them.

[Note: lockstep driver]
On rank 0 the driver wraps the engine: ``add_request`` and ``abort_request`` run on rank 0's engine first (so a
refused request raises there and nothing is sent for it) and are recorded as commands; ``step()`` broadcasts the
recorded commands over the engine's tp group (``broadcast_object_list``, one message per step) and then steps.
Each follower (every other rank) runs ``follow()``: it receives a message, applies its commands in order and
steps, so every engine has seen the same requests before the same step. A message says what follows its
commands: ``step``, ``sync`` (apply only: rank 0 had commands but nothing to run, or the keepalive below) or
``stop`` (from ``close()``, which ends ``follow()``). Each message also carries rank 0's queue lengths and free
blocks after its commands, which the follower compares with its own: ranks that drifted apart (different models,
configs or cai-infer versions) raise there by name rather than sampling different tokens.

Rank 0 sends the resolved request: the prompt's token ids (tokenized on rank 0), the request id the engine gave
it and a ``SamplingParams``. A sampled request without a seed gets one drawn on rank 0 from torch's global
generator, one per prompt, before it is added on rank 0, as a single engine draws one when a request is added;
the engine's own draw (``shared_seed``) is a collective that would wait for followers that are not adding
requests. A call with several prompts adds them one by one and takes back those added if a later one is refused,
so the call still queues all or nothing.

A rank-0 step with no unfinished request and no command sends nothing, so idle followers wait inside the
broadcast rather than spinning. That wait is bounded by the group's collective timeout (10 minutes under
``cai.mesh.launch_*``), so rank 0 also sends a ``sync`` (with any commands still pending, such as an abort that
emptied the engine) whenever it has been silent for ``keepalive_s / 2``, from a daemon thread. Every send holds the
driver's lock, so messages, and the collectives of the model's forward inside a step, keep one order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from ._engine import InferenceEngine, RequestOutput
from ._parallel import shared_seed
from ._sampling import SamplingParams

__all__ = ["LockstepDriver"]

_STEP, _SYNC, _STOP = "step", "sync", "stop"  # what a follower does after a message's commands


def _on_device(device: torch.device) -> contextlib.AbstractContextManager:
    # Steps and keepalives run in worker threads, whose current CUDA device is 0 whatever the rank's device is.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class LockstepDriver:
    """Feed the requests that arrive on rank 0 of a tensor-parallel engine to every rank of its tp group.

    Args:
        engine: an ``InferenceEngine`` built with ``InferenceConfig(tp_size > 1)``; every rank builds its own on
            the same model, tokenizer and config.
        keepalive_s: the longest rank 0 stays silent while idle (it then sends a message that only keeps the
            followers' broadcast from timing out); keep it well under the tp group's collective timeout. None:
            no keepalive.

    On rank 0 use ``add_request`` / ``abort_request`` / ``step`` as on the engine (or hand the driver to
    ``AsyncInferenceEngine``), then ``close()`` (or leave a ``with`` block); every other rank calls ``follow()``,
    which returns once rank 0 closes. While a driver is open, rank 0's requests must go through it (the engine's
    own ``generate`` / ``add_request`` would reach rank 0 only). See [Note: lockstep driver].

    Example::

        engine = InferenceEngine(model, tokenizer, InferenceConfig(tp_size=dist.get_world_size()))
        driver = LockstepDriver(engine)
        if dist.get_rank() == 0:
            with driver:
                driver.add_request("a", prompts="Hello", sampling_params=SamplingParams(max_new_tokens=8))
                while driver.has_unfinished_requests():
                    outs = driver.step()
        else:
            driver.follow()
    """

    def __init__(self, engine: InferenceEngine, keepalive_s: float | None = 30.0) -> None:
        if not isinstance(engine, InferenceEngine):
            raise TypeError(f"LockstepDriver takes an InferenceEngine, got a {type(engine).__name__}")
        if keepalive_s is not None and not keepalive_s > 0:
            raise ValueError(
                f"keepalive_s={keepalive_s!r} must be a positive number of seconds or None (off)"
            )
        group = engine._tp_group
        if group is None:
            raise ValueError(
                f"LockstepDriver drives a tensor-parallel engine, but this one has tp_size={engine.config.tp_size}; "
                "use the engine directly (AsyncInferenceEngine(engine) for serving) or build it with tp_size > 1"
            )
        self.engine = engine
        self.rank = dist.get_rank(group)
        self._group = group
        self._src = dist.get_global_rank(group, 0)
        self._device = engine.runner.device  # where the group's backend communicates, as for shared_seed
        self._lock = threading.Lock()
        self._pending: list[tuple] = []
        self._closed = False
        self._last_send = time.monotonic()
        self._keepalive_s = keepalive_s
        self._stop_keepalive = threading.Event()
        self._keepalive: threading.Thread | None = None
        if self.is_leader and keepalive_s is not None:
            self._keepalive = threading.Thread(
                target=self._keep_alive, name="cai-infer-lockstep-keepalive", daemon=True
            )
            self._keepalive.start()

    @property
    def is_leader(self) -> bool:
        """True on rank 0 of the tp group, which takes the requests."""
        return self.rank == 0

    # -- rank 0 -------------------------------------------------------------------------------------------------
    def add_request(
        self,
        request_ids: str | int | list[str | int] | None = None,
        prompts: str | list[str] | None = None,
        prompts_token_ids: list[int] | list[list[int]] | torch.Tensor | None = None,
        generation_config: Any = None,
        sampling_params: SamplingParams | None = None,
    ) -> list[str]:
        """``InferenceEngine.add_request`` on rank 0, sent to the followers with the next step. A refused request
        raises ValueError here, and nothing of the call is queued on any rank."""
        self._check_leader("add_request")
        engine = self.engine
        ids, token_lists, params = engine.resolve_requests(
            request_ids, prompts, prompts_token_ids, generation_config, sampling_params
        )
        with self._lock:
            self._check_open()
            added: list[tuple] = []
            try:
                for rid, tokens in zip(ids, token_lists, strict=True):
                    own = params
                    if not params.greedy and params.seed is None:  # rank 0's draw, one per prompt
                        own = dataclasses.replace(params, seed=shared_seed(None, self._device))
                    (name,) = engine.add_request(rid, prompts_token_ids=[tokens], sampling_params=own)
                    added.append(("add", name, tokens, own))
            except BaseException:
                for command in added:  # all or nothing, as the engine's add_request
                    engine.abort_request(command[1])
                raise
            self._pending.extend(added)
        return [command[1] for command in added]

    def abort_request(self, request_id: str | int) -> None:
        """``InferenceEngine.abort_request`` on rank 0, sent to the followers with the next message."""
        self._check_leader("abort_request")
        with self._lock:
            self._check_open()
            self.engine.abort_request(request_id)
            self._pending.append(("abort", str(request_id)))

    def has_unfinished_requests(self) -> bool:
        """Whether a step has work: an unfinished request, or (rank 0) commands not yet sent."""
        return self.engine.has_unfinished_requests() or bool(self._pending)

    def step(self) -> list[RequestOutput]:
        """Send the recorded commands and run one step on every rank; returns rank 0's outputs. With no
        unfinished request only the pending commands (if any) are sent and nothing runs."""
        self._check_leader("step")
        with self._lock, _on_device(self._device):
            self._check_open()
            if self.engine.has_unfinished_requests():
                self._send(_STEP)
                return self.engine.step()
            if self._pending:
                self._send(_SYNC)
            return []

    def close(self) -> None:
        """Rank 0: send the pending commands and the stop that ends the followers' ``follow()``; later calls do
        nothing. Requests still unfinished stay queued. On the other ranks it does nothing."""
        if not self.is_leader:
            return
        self._stop_keepalive.set()
        with self._lock, _on_device(self._device):
            if not self._closed:
                self._send(_STOP)
                self._closed = True
        if self._keepalive is not None and self._keepalive is not threading.current_thread():
            self._keepalive.join()

    def __enter__(self) -> LockstepDriver:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the other ranks ----------------------------------------------------------------------------------------
    def follow(self) -> None:
        """Ranks other than 0: apply rank 0's commands and step with it, until rank 0 closes its driver."""
        if self.is_leader:
            raise RuntimeError(
                "follow() runs on the ranks other than 0 of the tp group; rank 0 takes the requests (add_request, "
                "step, then close())"
            )
        with _on_device(self._device):
            while True:
                box: list[Any] = [None]
                dist.broadcast_object_list(box, src=self._src, group=self._group, device=self._device)
                commands, state, action = box[0]
                for command in commands:
                    self._apply(command)
                mine = self._state()
                if mine != state:
                    raise RuntimeError(
                        f"tensor-parallel rank {self.rank} drifted from rank 0: after the same commands it has "
                        f"(waiting, running, free blocks) = {mine}, rank 0 {state}; every rank must build its engine "
                        "from the same model, tokenizer, config and cai-infer version"
                    )
                if action == _STEP:
                    self.engine.step()
                elif action == _STOP:
                    return

    # -- internals ----------------------------------------------------------------------------------------------
    def _state(self) -> tuple[int, int, int]:
        sched = self.engine.scheduler
        return len(sched.waiting), len(sched.running), self.engine.blocks.num_free

    def _send(self, action: str) -> None:
        """Broadcast the pending commands and ``action`` (the caller holds the lock)."""
        box = [(self._pending, self._state(), action)]
        dist.broadcast_object_list(box, src=self._src, group=self._group, device=self._device)
        self._pending = []
        self._last_send = time.monotonic()

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, rid, tokens, params = command
            self.engine.add_request(rid, prompts_token_ids=[tokens], sampling_params=params)
        elif kind == "abort":
            self.engine.abort_request(command[1])
        else:
            raise RuntimeError(
                f"rank 0 sent the lockstep command {kind!r}, which rank {self.rank} does not know; run the same "
                "cai-infer version on every rank"
            )

    def _keep_alive(self) -> None:
        half = self._keepalive_s / 2
        while not self._stop_keepalive.wait(half):
            with self._lock:
                if self._closed or time.monotonic() - self._last_send < half:
                    continue
                with _on_device(self._device):
                    self._send(_SYNC)

    def _check_leader(self, what: str) -> None:
        if not self.is_leader:
            raise RuntimeError(
                f"{what} on rank {self.rank} of the tp group: requests enter on rank 0 only; call follow() here"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LockstepDriver is closed (its followers have stopped); build a new one")
