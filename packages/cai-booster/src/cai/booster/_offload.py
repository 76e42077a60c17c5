"""Activation offload: the tensors a block saves for backward wait in pinned host memory instead of on the device.

[Note: activation offload]
Offloading is the third way to hold a block's activations, beside keeping them and recomputing them
(`_checkpointing.py`). It costs no compute, only PCIe time, and that time hides behind compute when the copies run on
a side stream:

- forward: every tensor autograd saves inside an offloaded block (``saved_tensors_hooks``' pack) is copied to pinned
  host memory on the side stream, after the compute stream's current point. The device storages are released when
  the block returns (held until then, so that no other storage takes an address the block's copies are keyed by);
  ``record_stream`` keeps the allocator from reusing their memory until the copies have read them. Parameters (and
  views of them) stay where they are, as do tensors below ``MIN_BYTES`` (rotary tables, masks, per-row statistics):
  their copies would cost more launches than bytes. Tensors that share a storage (q, k, v sliced from one projection; one
  norm output saved by three matmuls) are copied once, as their storage.
- backward: when the gradient of a block's output arrives (its backward starts), the activations of that block and
  of the ``prefetch`` blocks before it start back to the device on the side stream; unpack waits for its own copy
  only. The copies back for a block whose backward opens the pass (the last block) have nothing to hide behind.
- Each block call records its saved storages separately, so micro-batches whose backwards come later (pipeline
  schedules, gradient accumulation) keep theirs apart; the record of a block links to the record of the block called
  just before it in the same pass, which is how prefetch finds "the blocks before".

The offloaded blocks are the leading ones: their copies to the host have the rest of the forward to finish, and their
copies back the backwards of every later block. Without CUDA the same code runs with synchronous copies into
ordinary host memory (no saving, exact), which is what the CPU tests check.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["MIN_BYTES", "PREFETCH", "Offloader"]

MIN_BYTES = 1 << 16  # smaller saved tensors stay on the device
PREFETCH = 2  # blocks copied back ahead of backward, by default


@dataclass(eq=False)
class _Stored:
    """One storage of saved activations: its host copy, and its device copy while backward needs it."""

    host: torch.Tensor  # uint8, the storage's bytes
    device: torch.device
    uses: int = 0  # packed tensors that view it and are not unpacked yet
    restored: torch.Tensor | None = None  # uint8 on the device, from prefetch or unpack
    ready: torch.cuda.Event | None = None


@dataclass(eq=False)
class _Record:
    """What one call of one block saved, and the record of the block called before it in the same pass."""

    index: int
    prev: weakref.ref | None  # weak: a record lives as long as the hook on its block's output (the graph)
    stores: dict[int, _Stored] = field(
        default_factory=dict
    )  # by storage address, valid while ``sources`` hold them
    sources: list[torch.Tensor] = field(default_factory=list)  # the device storages, until the block returns


@dataclass(eq=False)
class _Packed:
    stored: _Stored
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


def _as_bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


class Offloader:
    """The offload of one model's blocks: the side stream, the byte counts, and the last record of each pass."""

    def __init__(self, *, prefetch: int = PREFETCH, min_bytes: int = MIN_BYTES) -> None:
        if prefetch < 0:
            raise ValueError(
                f"activation offload: prefetch={prefetch} must be >= 0 (blocks copied back ahead)"
            )
        self.prefetch = prefetch
        self.min_bytes = min_bytes
        self.bytes_to_host = 0  # totals since construction, for tests and logs
        self.bytes_to_device = 0
        self._stream: torch.cuda.Stream | None = None
        self._last: weakref.ref | None = None

    # ---- streams ------------------------------------------------------------------------------------------------
    def _side(self, device: torch.device) -> torch.cuda.Stream | None:
        if device.type != "cuda":
            return None
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    # ---- forward ------------------------------------------------------------------------------------------------
    def begin(self, index: int) -> _Record:
        """A block is called: its record follows the previous block's when that was block ``index - 1``."""
        last = self._last() if self._last is not None else None
        record = _Record(index, weakref.ref(last) if last is not None and last.index == index - 1 else None)
        self._last = weakref.ref(record)
        return record

    def pack(self, record: _Record, t: torch.Tensor) -> torch.Tensor | _Packed:
        if t.layout != torch.strided or _is_parameter(t) or t.numel() * t.element_size() < self.min_bytes:
            return t
        storage = t.untyped_storage()
        key = storage.data_ptr()
        stored = record.stores.get(key)
        if stored is None:
            src = _as_bytes(storage, t.device)
            record.sources.append(src)  # no other storage can take this address while the block runs
            stored = record.stores[key] = self._to_host(src)
        stored.uses += 1
        return _Packed(stored, t.dtype, t.size(), t.stride(), t.storage_offset())

    def _to_host(self, src: torch.Tensor) -> _Stored:
        side = self._side(src.device)
        host = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=side is not None)
        if side is None:
            host.copy_(src)
        else:
            side.wait_stream(torch.cuda.current_stream(src.device))
            with torch.cuda.stream(side):
                host.copy_(src, non_blocking=True)
            src.record_stream(side)  # the allocator must not hand this memory out before the copy has read it
        self.bytes_to_host += host.numel()
        return _Stored(host, src.device)

    # ---- backward -----------------------------------------------------------------------------------------------
    def _to_device(self, stored: _Stored) -> None:
        if stored.restored is not None:
            return
        side = self._side(stored.device)
        if side is None:
            stored.restored = stored.host.clone()
        else:
            with torch.cuda.stream(side):
                stored.restored = stored.host.to(stored.device, non_blocking=True)
                stored.ready = side.record_event()
        self.bytes_to_device += stored.host.numel()

    def backward_starts(self, record: _Record) -> None:
        """The gradient of ``record``'s block output arrived: copy back it and the ``prefetch`` records before it."""
        r: _Record | None = record
        for _ in range(self.prefetch + 1):
            if r is None:
                break
            for stored in r.stores.values():
                if stored.uses:
                    self._to_device(stored)
            r = r.prev() if r.prev is not None else None

    def unpack(self, packed: torch.Tensor | _Packed) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        stored = packed.stored
        self._to_device(stored)
        restored = stored.restored
        if stored.ready is not None:
            current = torch.cuda.current_stream(stored.device)
            current.wait_event(stored.ready)
            restored.record_stream(current)  # allocated on the side stream, used and freed on this one
            stored.ready = None
        stored.uses -= 1
        if stored.uses == 0:  # the tensors returned keep the memory alive as long as autograd needs them
            stored.restored = None
        out = torch.empty(0, dtype=packed.dtype, device=stored.device)
        return out.set_(restored.untyped_storage(), packed.offset, packed.size, packed.stride)


class _Offloaded:
    """Mixed into a block's class: in training with grad enabled, ``__call__`` records the call, saves through the
    offloader when the block is offloaded, and reports when its backward starts."""

    def __call__(self, *args, **kwargs):
        spec = self.__dict__.get("_cai_offload")
        if spec is None or not (self.training and torch.is_grad_enabled()):
            return super().__call__(*args, **kwargs)
        offloader, index, offloaded = spec
        record = offloader.begin(index)
        if offloaded:
            with torch.autograd.graph.saved_tensors_hooks(
                functools.partial(offloader.pack, record), offloader.unpack
            ):
                out = super().__call__(*args, **kwargs)
            record.sources.clear()  # the device storages go as soon as their copies have read them
        else:
            out = super().__call__(*args, **kwargs)
        first = out[0] if isinstance(out, tuple) else out
        if isinstance(first, torch.Tensor) and first.requires_grad:
            first.register_hook(functools.partial(_backward_starts, offloader, record))
        return out


def _backward_starts(offloader: Offloader, record: _Record, grad: torch.Tensor) -> None:
    offloader.backward_starts(record)


@functools.cache
def with_mixin(mixin: type, cls: type) -> type:
    """``cls`` with ``mixin`` first in its bases, under ``cls``'s own names (so a swapped ``__class__`` reads the same)."""
    return type(cls.__name__, (mixin, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})


def set_offload(blocks: list[nn.Module], chosen: int, offloader: Offloader) -> None:
    """Offload the first ``chosen`` blocks through ``offloader``; every block reports when its backward starts."""
    for i, block in enumerate(blocks):
        if not isinstance(block, _Offloaded):
            block.__class__ = with_mixin(_Offloaded, type(block))
        block.__dict__["_cai_offload"] = (offloader, i, i < chosen)


def clear_offload(blocks: list[nn.Module]) -> None:
    for block in blocks:
        block.__dict__.pop("_cai_offload", None)
