"""Memory accounting: what model data lives where, and the device budget the auto policy must respect."""

from __future__ import annotations

from collections import defaultdict

import torch

__all__ = ["CudaMemoryTracker", "MemoryTracker"]

DEVICE, HOST = "device", "host"


class MemoryTracker:
    """Bytes of model data per location, by kind, with the device peak.

    cai-gemini reports every chunk buffer it allocates, frees or moves here. The base class is also the simulated
    tracker used on machines without a GPU: ``device_capacity`` is the budget the auto policy must stay under and
    ``non_model_bytes`` stands for activations and workspace (a constant, since CPU tensors cannot be measured
    apart from model data). ``peak_device`` is the largest ``device model data + non_model_bytes`` seen.

    Example::

        tracker = MemoryTracker(device_capacity=2 << 20, non_model_bytes=256 << 10)
        model, optim = gemini.shard(model, optim, config=GeminiConfig(placement_policy="auto"), memory=tracker)
        ...
        assert tracker.peak_device <= tracker.device_capacity
    """

    def __init__(self, device_capacity: int | None = None, non_model_bytes: int = 0) -> None:
        self._capacity = device_capacity
        self._non_model = int(non_model_bytes)
        self.bytes: dict[str, dict[str, int]] = {DEVICE: defaultdict(int), HOST: defaultdict(int)}
        self.peak_model_device = 0
        self.peak_device = 0
        self.peak_host = 0
        self.moved = {"h2d": 0, "d2h": 0}
        self.evictions = 0

    # ---- accounting -----------------------------------------------------------------------------------------
    def add(self, location: str, kind: str, nbytes: int) -> None:
        self.bytes[location][kind] += int(nbytes)
        if location == DEVICE:
            model = self.model_bytes(DEVICE)
            self.peak_model_device = max(self.peak_model_device, model)
            self.peak_device = max(self.peak_device, model + self.non_model_bytes())
        else:
            self.peak_host = max(self.peak_host, self.model_bytes(HOST))

    def move(self, kind: str, nbytes: int, *, to: str) -> None:
        src = HOST if to == DEVICE else DEVICE
        # add to the destination first: during a copy both buffers exist
        self.add(to, kind, nbytes)
        self.add(src, kind, -nbytes)
        self.moved["h2d" if to == DEVICE else "d2h"] += int(nbytes)

    def model_bytes(self, location: str, kind: str | None = None) -> int:
        b = self.bytes[location]
        return b[kind] if kind is not None else sum(b.values())

    # ---- budget ---------------------------------------------------------------------------------------------
    def device_capacity(self) -> int | None:
        """The device budget in bytes, or None when unlimited."""
        return self._capacity

    def non_model_bytes(self) -> int:
        """Device bytes that are not model data (activations, workspace), as currently known."""
        return self._non_model

    def begin_warmup(self) -> None:
        """Called before the first forward; a real tracker starts measuring here."""

    def end_warmup(self) -> None:
        """Called after the first optimizer step; a real tracker fixes ``non_model_bytes`` here."""

    def report(self) -> dict[str, int]:
        return {
            "device_model": self.model_bytes(DEVICE),
            "host_model": self.model_bytes(HOST),
            "peak_device": self.peak_device,
            "peak_host": self.peak_host,
            "h2d": self.moved["h2d"],
            "d2h": self.moved["d2h"],
            "evictions": self.evictions,
        }


class CudaMemoryTracker(MemoryTracker):
    """Tracker for a CUDA device: the capacity is the device memory (times the per-process fraction) and
    non-model data is measured in the warm-up step as the allocator's peak minus the model data at that peak."""

    def __init__(self, device: torch.device, capacity: int | None = None) -> None:
        if capacity is None:
            # pass ``capacity`` when torch.cuda.set_per_process_memory_fraction limits the process
            capacity = torch.cuda.get_device_properties(device).total_memory
        super().__init__(device_capacity=capacity)
        self.device = device
        self._measuring = False

    def begin_warmup(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._measuring = True

    def end_warmup(self) -> None:
        if not self._measuring:
            return
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        # model data at the peak is at most its own peak; what is left is activations and workspace
        self._non_model = max(0, peak - self.peak_model_device)
        self._measuring = False
