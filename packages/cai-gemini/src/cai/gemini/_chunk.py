"""A chunk: contiguous working-precision storage for a run of parameters, sharded over the group, with its fp32
master shard.

[Note: chunk layout]
A chunk of ``chunk_size`` elements (a multiple of the group size N) holds parameters back to back in registration
order, followed by zero padding. Rank r owns elements ``[r * shard_size, (r + 1) * shard_size)`` of every chunk, in
three forms: the working-precision shard (on the device or the host), the fp32 master shard and its optimizer
state (on the device or the host, updated where they live). While gathered, the whole chunk is one device buffer
and every parameter's ``.data`` is a view into it; when released, the buffer's storage is resized to zero, so the
parameters keep their identity (and autograd's saved references to them) but hold no memory. Gathering is one
all-gather per chunk and gradients leave through one reduce-scatter per chunk.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from cai.gemini._memory import DEVICE, HOST, MemoryTracker
from cai.kernels.optim import accumulate_grad_shard
from cai.mesh import all_gather_into_tensor, fp8_reduce_scatter_tensor, reduce_scatter_tensor

__all__ = ["Chunk", "ChunkFullError", "TensorInfo", "TensorState"]


class TensorState(Enum):
    """Where one parameter of a chunk is in the step. Allowed moves are in ``_TRANSITIONS``."""

    FREE = 0  # its chunk is not gathered: the parameter has no storage and must not be read
    COMPUTE = 1  # its module is running (forward, or recomputation inside backward)
    HOLD = 2  # gathered and idle: may be released unless the chunk is kept gathered
    HOLD_AFTER_BWD = 3  # its gradient of this backward pass has been reduced with the rest of the chunk
    READY_FOR_REDUCE = (
        4  # its gradient is in the chunk's gradient buffer; waiting for the chunk's other tensors
    )


_S = TensorState
_TRANSITIONS: dict[TensorState, frozenset[TensorState]] = {
    _S.FREE: frozenset({_S.HOLD, _S.COMPUTE}),
    _S.HOLD: frozenset({_S.FREE, _S.COMPUTE, _S.READY_FOR_REDUCE}),
    _S.COMPUTE: frozenset({_S.HOLD, _S.READY_FOR_REDUCE}),
    _S.READY_FOR_REDUCE: frozenset({_S.HOLD_AFTER_BWD}),
    _S.HOLD_AFTER_BWD: frozenset({_S.HOLD, _S.FREE, _S.COMPUTE, _S.READY_FOR_REDUCE}),
}


class ChunkFullError(RuntimeError):
    """A tensor does not fit in the remaining space of a chunk."""


@dataclass
class TensorInfo:
    name: str
    param: torch.nn.Parameter
    offset: int  # first element in the chunk
    numel: int
    shape: torch.Size
    state: TensorState = TensorState.FREE

    @property
    def end(self) -> int:
        return self.offset + self.numel


def _alloc(numel: int, dtype: torch.dtype, device: torch.device, pin: bool) -> torch.Tensor:
    if device.type != "cpu" or not pin or numel == 0:
        return torch.empty(numel, dtype=dtype, device=device)
    # Register ordinary host memory instead of torch.empty(pin_memory=True): the caching host allocator rounds
    # every block up to a power of two, which can double the host memory of large chunks.
    # [Note: host registration] cudaHostRegister works on whole pages and fails with
    # cudaErrorHostMemoryAlreadyRegistered when a page is registered already, an error torch then reports from an
    # unrelated later call. So each buffer is an anonymous mapping of its own (page-aligned, so torch sees its
    # storage as pinned, and no page is shared with another allocation), registered for exactly as long as its
    # storage lives: the mapping unregisters itself when the last view of it is freed, before it is unmapped (a
    # registration left on freed memory made the next buffer placed there fail).
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    mapping = _HostMapping(-1, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    if int(torch.cuda.cudart().cudaHostRegister(raw.data_ptr(), len(mapping), 0)) != 0:
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    mapping.registered = raw.data_ptr()
    return raw[:nbytes].view(dtype)


class _HostMapping(mmap.mmap):
    """Anonymous host memory, unregistered from CUDA when freed (see [Note: host registration])."""

    registered = 0  # the registered address, once registered

    def __del__(self) -> None:  # runs before mmap's own deallocation unmaps the memory
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.registered)


_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for gradients going down (the copies up use the optimizer's HostStepper)."""
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


class Chunk:
    """One chunk (see [Note: chunk layout]). Built by ``ChunkManager``; not constructed by users."""

    def __init__(
        self,
        *,
        index: int,
        chunk_size: int,
        dtype: torch.dtype,
        device: torch.device,
        group: dist.ProcessGroup | None,
        rank: int,
        world_size: int,
        trainable: bool,
        tracker: MemoryTracker,
        pin_memory: bool,
        fp8_communication: bool = False,
    ) -> None:
        self.fp8_communication = fp8_communication
        if chunk_size % world_size:
            raise ValueError(
                f"Chunk: chunk_size {chunk_size} is not divisible by the group size {world_size}"
            )
        self.index = index
        self.chunk_size = chunk_size
        self.shard_size = chunk_size // world_size
        self.dtype = dtype
        self.device = device
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.trainable = trainable
        self.tracker = tracker
        self.pin = pin_memory
        self.tensors: list[TensorInfo] = []
        self.used = 0
        self.keep_gathered = False
        self.full: torch.Tensor | None = None  # device buffer of chunk_size; storage size 0 while released
        self.gathered = False
        self.shard: torch.Tensor | None = (
            None  # working-precision shard (a view of ``full`` if kept gathered)
        )
        self.shard_location = DEVICE
        self.master: torch.Tensor | None = None  # fp32 shard, lives at ``optim_location``
        self.optim_location = DEVICE
        self.grad32: torch.Tensor | None = None  # fp32 accumulated gradient shard, at ``optim_location``
        self.grad32_valid = False
        # device-optimizer chunks: one synchronised micro-batch's reduced gradient stays in the working precision
        # (its values exactly; the update reads it as fp32); fp32 only once a second micro-batch is added
        self.grad_lp: torch.Tensor | None = None
        # host-optimizer chunks: one working-precision host buffer (pinned on CUDA) carries the reduced gradient
        # down and the updated parameters up; the fp32 gradient exists only once a second micro-batch arrives
        self.io: torch.Tensor | None = None
        self.io_has_grad = False
        self._down: torch.cuda.Event | None = None  # gradient copy into ``io`` in flight
        self._up: torch.cuda.Event | None = None  # parameter copy out of ``io`` in flight
        self.grad_buffer: torch.Tensor | None = None  # full-size gradient buffer during backward
        self.unreduced: torch.Tensor | None = None  # fp32 full-size accumulator under no_sync
        self.grads_ready = 0
        self.pending: dist.Work | None = None  # an asynchronous all-gather in flight
        self.prefetched = False

    # ---- building -------------------------------------------------------------------------------------------
    def append(self, name: str, param: torch.nn.Parameter) -> None:
        n = param.numel()
        if self.used + n > self.chunk_size:
            raise ChunkFullError(
                f"Chunk {self.index}: {name} ({n} elements) does not fit ({self.used}/{self.chunk_size} used)"
            )
        self.tensors.append(TensorInfo(name=name, param=param, offset=self.used, numel=n, shape=param.shape))
        self.used += n

    @property
    def shard_range(self) -> tuple[int, int]:
        return self.rank * self.shard_size, (self.rank + 1) * self.shard_size

    @property
    def num_trainable(self) -> int:
        return len(self.tensors) if self.trainable else 0

    def close(self, *, keep_gathered: bool, shard_on_host: bool, optim_on_host: bool, master: bool) -> None:
        """Copy the parameters' values into the chunk, keep this rank's shard, and point the parameters at it."""
        full = torch.zeros(self.chunk_size, dtype=torch.float32)
        for t in self.tensors:
            full[t.offset : t.end].copy_(t.param.detach().reshape(-1))
        lo, hi = self.shard_range
        self.keep_gathered = keep_gathered
        self.full = torch.empty(self.chunk_size, dtype=self.dtype, device=self.device)
        self.tracker.add(DEVICE, "gathered", self.full.numel() * self.full.element_size())
        self.gathered = True
        for t in self.tensors:
            t.param.data = self.full[t.offset : t.end].view(t.shape)
            t.state = TensorState.HOLD
        self.full.copy_(full)
        if keep_gathered:
            self.shard = self.full[lo:hi]
            self.shard_location = DEVICE
        else:
            self.shard_location = HOST if shard_on_host else DEVICE
            dev = self.device if not shard_on_host else torch.device("cpu")
            self.shard = _alloc(self.shard_size, self.dtype, dev, self.pin and shard_on_host)
            self.shard.copy_(full[lo:hi])
            self.tracker.add(self.shard_location, "param_shard", self._bytes(self.shard))
            self.release()
        if master and self.trainable:
            self.optim_location = HOST if optim_on_host else DEVICE
            dev = torch.device("cpu") if optim_on_host else self.device
            self.master = full[lo:hi].to(dev, copy=True)
            self.tracker.add(self.optim_location, "master", self._bytes(self.master))
            self._place_grad_buffers()

    def _place_grad_buffers(self) -> None:
        assert self.master is not None
        if self.optim_location == DEVICE:  # the fp32 gradient is allocated when first needed (``_fold``)
            if self.io is not None:
                self.tracker.add(HOST, "io", -self._bytes(self.io))
                self.io = None
        elif self.io is None:
            self.io = _alloc(self.shard_size, self.dtype, torch.device("cpu"), self.pin)
            self.tracker.add(HOST, "io", self._bytes(self.io))

    @staticmethod
    def _bytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    # ---- states -----------------------------------------------------------------------------------------------
    def set_state(self, t: TensorInfo, new: TensorState) -> None:
        if new is t.state:
            return
        if new not in _TRANSITIONS[t.state]:
            raise RuntimeError(f"Chunk {self.index}: {t.name} cannot go from {t.state.name} to {new.name}")
        t.state = new

    @property
    def in_compute(self) -> bool:
        return any(t.state is TensorState.COMPUTE for t in self.tensors)

    # ---- gather / release ---------------------------------------------------------------------------------
    def gather(self, *, async_op: bool = False) -> None:
        """All-gather the chunk into its device buffer (one collective); a no-op if gathered or in flight."""
        if self.gathered or self.pending is not None:
            return
        assert self.shard is not None
        self.alloc()
        src = self.shard
        if self.shard_location == HOST:
            src = (
                self.shard.to(self.device, non_blocking=True)
                if self.device.type != "cpu"
                else self.shard.clone()
            )
            self.tracker.moved["h2d"] += self._bytes(src)
        if self.world_size == 1:
            self.full.copy_(src)
        else:
            self.pending = all_gather_into_tensor(self.full, src, group=self.group, async_op=async_op)
            if not async_op:
                self.pending = None
        self.gathered = True
        for t in self.tensors:
            if t.state is TensorState.FREE:
                t.state = TensorState.HOLD

    def alloc(self) -> None:
        """Give the gathered buffer its storage again (on the current stream); a no-op if it has it."""
        assert self.full is not None
        storage = self.full.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self._bytes(self.full))
            self.tracker.add(DEVICE, "gathered", self._bytes(self.full))

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None

    def release(self) -> None:
        """Free the gathered buffer (the parameters become storage-less views); kept-gathered chunks stay."""
        if self.keep_gathered or not self.gathered:
            return
        self.wait()
        assert self.full is not None
        self.full.untyped_storage().resize_(0)
        self.tracker.add(DEVICE, "gathered", -self._bytes(self.full))
        self.gathered = False
        self.prefetched = False
        for t in self.tensors:
            t.state = TensorState.FREE

    # ---- gradients --------------------------------------------------------------------------------------------
    def accept_grad(self, t: TensorInfo, grad: torch.Tensor) -> bool:
        """Copy one parameter's gradient into the chunk's buffer; True when every trainable tensor has arrived."""
        if self.grad_buffer is None:
            self.grad_buffer = torch.zeros(self.chunk_size, dtype=self.dtype, device=self.device)
            self.tracker.add(DEVICE, "grad_buffer", self._bytes(self.grad_buffer))
        self.grad_buffer[t.offset : t.end].copy_(grad.reshape(-1))
        if t.state is not TensorState.READY_FOR_REDUCE:
            self.set_state(t, TensorState.READY_FOR_REDUCE)
            self.grads_ready += 1
        return self.grads_ready == self.num_trainable

    def reduce(self, *, sync: bool) -> None:
        """Reduce-scatter the gradient buffer (mean over the group) into the fp32 gradient shard.

        Under ``no_sync`` (``sync=False``) the full buffer is added to a local fp32 accumulator instead, which
        the next synchronised reduce folds in: gradient accumulation without a collective per micro-batch.
        """
        buf = self.grad_buffer
        if buf is None:
            return
        self.grad_buffer = None
        self.tracker.add(DEVICE, "grad_buffer", -self._bytes(buf))
        for t in self.tensors:
            if t.state is TensorState.READY_FOR_REDUCE:
                t.state = TensorState.HOLD_AFTER_BWD
        self.grads_ready = 0
        if not sync:
            if self.unreduced is None:
                self.unreduced = torch.zeros(self.chunk_size, dtype=torch.float32, device=self.device)
                self.tracker.add(DEVICE, "unreduced", self._bytes(self.unreduced))
            self.unreduced.add_(buf)
            return
        if self.unreduced is not None:
            # fold earlier micro-batches in fp32, then reduce in fp32 so accumulation loses nothing
            self.unreduced.add_(buf)
            buf = self.unreduced
            self.unreduced = None
            self.tracker.add(DEVICE, "unreduced", -self._bytes(buf))
        if self.world_size > 1:
            out = torch.empty(self.shard_size, dtype=buf.dtype, device=self.device)
            scatter = fp8_reduce_scatter_tensor if self.fp8_communication else reduce_scatter_tensor
            scatter(out, buf, group=self.group)
            out.div_(self.world_size)
        else:
            out = buf
        self._accumulate(out)

    def _accumulate(self, shard_grad: torch.Tensor) -> None:
        if self.optim_location == DEVICE:
            g = shard_grad.to(self.master.device)  # type: ignore[union-attr]
            acc = self.grad_lp if self.grad_lp is not None else (self.grad32 if self.grad32_valid else None)
            # see [Note: working-precision gradient shard] in cai-kernels
            if accumulate_grad_shard(acc, g, fp32=self._grad32_buffer) is g:
                self.grad_lp = g  # one process: the gradient buffer itself, no copy
                self.tracker.add(DEVICE, "grad_lp", self._bytes(g))
                return
            if self.grad_lp is not None:
                self.tracker.add(DEVICE, "grad_lp", -self._bytes(self.grad_lp))
                self.grad_lp = None
            self.grad32_valid = True
            return
        assert self.io is not None
        if self.io_has_grad or shard_grad.dtype != self.io.dtype:
            # a second micro-batch (or an fp32 no_sync sum): accumulate in fp32 on the host
            self._io_to_grad32()
            self._fold(shard_grad.to("cpu"))
            return
        self.wait_up()
        self.io_has_grad = True
        self.tracker.moved["d2h"] += self._bytes(self.io)
        if shard_grad.device.type != "cuda":
            self.io.copy_(shard_grad)
            return
        # device-to-host on a copy stream (asynchronous into pinned memory), so backward does not wait for it
        side = _copy_stream(shard_grad.device)
        side.wait_stream(torch.cuda.current_stream(shard_grad.device))
        with torch.cuda.stream(side):
            self.io.copy_(shard_grad, non_blocking=True)
            self._down = torch.cuda.Event()
            self._down.record(side)
        shard_grad.record_stream(side)  # its memory is not reused before the copy has read it

    def join_up(self) -> None:
        """Order the current stream after the copy up of the parameters (no host wait)."""
        if self._up is not None:
            torch.cuda.current_stream(self.device).wait_event(self._up)

    def wait_up(self) -> None:
        """Wait until the copy of the parameters out of ``io`` has finished (before ``io`` is written again)."""
        if self._up is not None:
            self._up.synchronize()
            self._up = None

    def _grad32_buffer(self) -> torch.Tensor:
        """The fp32 gradient shard, allocated when first needed and kept across steps, at ``optim_location``."""
        if self.grad32 is None:
            assert self.master is not None
            self.grad32 = torch.zeros_like(self.master)
            self.tracker.add(self.optim_location, "grad32", self._bytes(self.grad32))
        return self.grad32

    def _fold(self, g: torch.Tensor) -> None:
        if self.grad32_valid:
            self._grad32_buffer().add_(g)
        else:
            self._grad32_buffer().copy_(g)
            self.grad32_valid = True

    def _lp_to_grad32(self) -> None:
        if self.grad_lp is not None:
            g, self.grad_lp = self.grad_lp, None
            self._fold(g)
            self.tracker.add(DEVICE, "grad_lp", -self._bytes(g))

    def _io_to_grad32(self) -> None:
        if self.io_has_grad:
            self.flush_staging()
            self.io_has_grad = False
            self._fold(self.io)  # type: ignore[arg-type]

    def flush_staging(self) -> None:
        """Wait for the gradient copy to the host, if one is in flight."""
        if self._down is not None:
            self._down.synchronize()
            self._down = None

    def step_grad(self, *, fp32: bool = False) -> torch.Tensor | None:
        """The accumulated gradient shard for the update (the host buffer itself when one micro-batch
        produced it), or None when no gradient arrived; ``fp32`` forces the fp32 copy."""
        self.flush_staging()
        if self.io_has_grad and (fp32 or self.grad32_valid):
            self._io_to_grad32()
        if self.io_has_grad:
            return self.io
        if self.grad_lp is not None and (fp32 or self.grad32_valid):
            self._lp_to_grad32()
        if self.grad_lp is not None:
            return self.grad_lp
        return self.grad32 if self.grad32_valid else None

    def zero_grad(self) -> None:
        self.flush_staging()
        if self.grad_lp is not None:
            self.tracker.add(DEVICE, "grad_lp", -self._bytes(self.grad_lp))
            self.grad_lp = None
        self.grad32_valid = False
        self.io_has_grad = False
        self.grads_ready = 0

    # ---- after the optimizer step --------------------------------------------------------------------------
    def mark_shard_reads(self) -> torch.cuda.Event | None:
        """An event after every read of the device shard queued so far on the current stream (None off CUDA)."""
        if self.shard is None or self.shard.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def write_back(self, *, written: bool = False, copy_up: Callable[..., Any] | None = None) -> None:
        """Copy the updated fp32 master shard into the working shard; re-gather a kept-gathered chunk.

        ``written``: the optimizer already wrote the new working-precision values, into ``io`` (host-resident
        optimizer) or into the shard itself (device-resident).
        ``copy_up(io, into=shard)``: copy up through a ``HostStepper`` (from its worker, during backward) instead of
        on the current stream; the compute stream must then ``join_up()`` before it reads the shard.
        """
        assert self.master is not None and self.shard is not None
        if self.io is not None:
            # cast on the host into the pinned buffer, then one asynchronous host-to-device copy
            self.wait_up()
            self.io_has_grad = False
            if not written:
                self.io.copy_(self.master)
            if self.shard.device.type != "cuda":
                self.shard.copy_(self.io)
                return
            if copy_up is not None:
                _, self._up = copy_up(self.io, into=self.shard)
            else:
                self.shard.copy_(self.io, non_blocking=True)
                self._up = torch.cuda.Event()
                self._up.record()
        elif not written:
            self.shard.copy_(self.master, non_blocking=True)
        if self.keep_gathered and self.world_size > 1:
            assert self.full is not None
            all_gather_into_tensor(self.full, self.shard.clone(), group=self.group)

    # ---- moves between device and host ----------------------------------------------------------------------
    def move_shard(self, to: str) -> None:
        """Move the working-precision shard between device and host (not for kept-gathered chunks)."""
        if self.keep_gathered or self.shard_location == to:
            return
        assert self.shard is not None
        if to == DEVICE:
            # the host buffer (pinned once) stays as the landing place of later evictions: no pinning per move
            self._host_shard = self.shard
            new = torch.empty(self.shard_size, dtype=self.dtype, device=self.device)
        else:
            new = getattr(self, "_host_shard", None)
            if new is None:
                new = _alloc(self.shard_size, self.dtype, torch.device("cpu"), self.pin)
        new.copy_(self.shard, non_blocking=True)  # stream-ordered before any later use of either buffer
        self.tracker.move("param_shard", self._bytes(new), to=to)
        self.shard = new
        self.shard_location = to

    def move_optim(self, to: str, states: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Move the master shard, its gradient and the given optimizer states; returns the moved states."""
        if self.optim_location == to or self.master is None:
            return states
        self._io_to_grad32()
        self._lp_to_grad32()
        self.wait_up()
        dev = self.device if to == DEVICE else torch.device("cpu")
        self.master = self.master.to(dev, copy=True)
        self.tracker.move("master", self._bytes(self.master), to=to)
        if self.grad32 is not None:
            self.grad32 = self.grad32.to(dev, copy=True)
            self.tracker.move("grad32", self._bytes(self.grad32), to=to)
        moved = {k: (v.to(dev, copy=True) if v.numel() > 1 else v) for k, v in states.items()}
        opt_bytes = sum(self._bytes(v) for v in states.values() if v.numel() > 1)
        if opt_bytes:
            self.tracker.move("optim", opt_bytes, to=to)
        self.optim_location = to
        self._place_grad_buffers()
        return moved
