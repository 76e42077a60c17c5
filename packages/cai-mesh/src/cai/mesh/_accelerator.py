"""One small interface over the device a process computes on (CUDA or CPU), chosen once per process."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "BaseAccelerator",
    "CpuAccelerator",
    "CudaAccelerator",
    "auto_set_accelerator",
    "get_accelerator",
    "get_current_device",
    "set_accelerator",
]


class BaseAccelerator(ABC):
    """What cai needs from a device: its name, its collective backend, the current device, RNG and memory.

    Methods that have no meaning on a device (memory statistics on CPU) return neutral values instead of
    raising, so that code written for GPUs runs unchanged on CPU.
    """

    support_set_device: bool = True

    def __init__(self, name: str, communication_backend: str, is_synchronous: bool) -> None:
        self._name = name
        self._communication_backend = communication_backend
        self._is_synchronous = is_synchronous

    @property
    def name(self) -> str:
        return self._name

    @property
    def communication_backend(self) -> str:
        """The torch.distributed backend for this device ("nccl" for CUDA, "gloo" for CPU)."""
        return self._communication_backend

    @property
    def is_synchronous(self) -> bool:
        return self._is_synchronous

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, backend={self.communication_backend!r})"

    @abstractmethod
    def is_available(self) -> bool: ...

    @abstractmethod
    def device_count(self) -> int: ...

    @abstractmethod
    def get_current_device(self) -> torch.device: ...

    @abstractmethod
    def set_device(self, device: int | torch.device | None = None) -> None: ...

    def current_device(self) -> int:
        """Index of the current device (0 on CPU)."""
        return self.get_current_device().index or 0

    def get_device_name(self, device: int | None = None) -> str:
        return self.name

    def synchronize(self, device: Any = None) -> None:  # noqa: B027 (a no-op is right for synchronous devices)
        """Wait for all queued work (no-op on synchronous devices)."""

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def get_rng_state(self) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)

    def empty_cache(self) -> None:  # noqa: B027
        """Release cached, unused device memory (no-op without a caching allocator)."""

    def memory_allocated(self, device: Any = None) -> int:
        return 0

    def max_memory_allocated(self, device: Any = None) -> int:
        return 0

    def memory_reserved(self, device: Any = None) -> int:
        return 0

    def reset_peak_memory_stats(self, device: Any = None) -> None:  # noqa: B027
        """Reset the peak that ``max_memory_allocated`` reports (no-op without statistics)."""

    def set_to_device(self, models: Any) -> Any:
        """Move a module, a tensor, or a list of them to the current device; returns what it was given."""
        device = self.get_current_device()
        if isinstance(models, list | tuple):
            return type(models)(self.set_to_device(m) for m in models)
        return models.to(device)

    def autocast(
        self, dtype: torch.dtype = torch.bfloat16, enabled: bool = True
    ) -> contextlib.AbstractContextManager:
        return torch.autocast(device_type=self.name, dtype=dtype, enabled=enabled)

    @contextlib.contextmanager
    def stream(self, stream: Any = None) -> Iterator[None]:
        """Run the body on ``stream`` (plain context on devices without streams)."""
        yield


class CudaAccelerator(BaseAccelerator):
    """NVIDIA GPUs through ``torch.cuda``; collectives over NCCL."""

    def __init__(self) -> None:
        super().__init__("cuda", "nccl", is_synchronous=False)

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def get_current_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def set_device(self, device: int | torch.device | None = None) -> None:
        torch.cuda.set_device(0 if device is None else device)

    def get_device_name(self, device: int | None = None) -> str:
        return torch.cuda.get_device_name(device)

    def synchronize(self, device: Any = None) -> None:
        torch.cuda.synchronize(device)

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def get_rng_state(self) -> torch.Tensor:
        return torch.cuda.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.cuda.set_rng_state(state)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device: Any = None) -> int:
        return torch.cuda.memory_allocated(device)

    def max_memory_allocated(self, device: Any = None) -> int:
        return torch.cuda.max_memory_allocated(device)

    def memory_reserved(self, device: Any = None) -> int:
        return torch.cuda.memory_reserved(device)

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    @contextlib.contextmanager
    def stream(self, stream: Any = None) -> Iterator[None]:
        with torch.cuda.stream(stream):
            yield


class CpuAccelerator(BaseAccelerator):
    """The host CPU; collectives over gloo. There is one device, so ``set_device`` is not supported."""

    support_set_device = False

    def __init__(self) -> None:
        super().__init__("cpu", "gloo", is_synchronous=True)

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def get_current_device(self) -> torch.device:
        return torch.device("cpu")

    def set_device(self, device: int | torch.device | None = None) -> None:
        if not (device is None or device == 0 or str(device) in ("cpu", "cpu:0")):
            raise ValueError(f"CpuAccelerator.set_device: the CPU accelerator has one device; got {device!r}")


_KINDS: dict[str, type[BaseAccelerator]] = {"cuda": CudaAccelerator, "cpu": CpuAccelerator}  # detection order
_ACCELERATOR: BaseAccelerator | None = None


def auto_set_accelerator() -> BaseAccelerator:
    """Pick the first available accelerator (cuda, then cpu) and make it the process's accelerator."""
    global _ACCELERATOR
    for kind in _KINDS.values():
        acc = kind()
        if acc.is_available():
            _ACCELERATOR = acc
            return acc
    raise RuntimeError("no accelerator is available")  # unreachable: the CPU always is


def set_accelerator(accelerator: str | BaseAccelerator) -> BaseAccelerator:
    """Use ``accelerator`` ("cuda", "cpu", or an instance) for this process; returns it."""
    global _ACCELERATOR
    if isinstance(accelerator, str):
        if accelerator not in _KINDS:
            raise ValueError(
                f"set_accelerator: unknown accelerator {accelerator!r}; use one of {sorted(_KINDS)}"
            )
        accelerator = _KINDS[accelerator]()
        if not accelerator.is_available():
            raise RuntimeError(f"set_accelerator: {accelerator.name} is not available on this machine")
    elif not isinstance(accelerator, BaseAccelerator):
        raise TypeError(
            f"set_accelerator: expected a name or a BaseAccelerator, got {type(accelerator).__name__}"
        )
    _ACCELERATOR = accelerator
    return accelerator


def get_accelerator() -> BaseAccelerator:
    """The process's accelerator: CUDA when a GPU is visible, else the CPU (detected on first call)."""
    return _ACCELERATOR if _ACCELERATOR is not None else auto_set_accelerator()


def get_current_device() -> torch.device:
    """The device this process computes on (``cuda:<local rank>`` after launch on GPUs, else ``cpu``)."""
    return get_accelerator().get_current_device()
