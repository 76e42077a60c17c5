"""Mixed precision: typed configs, the dynamic loss scaler, and autocast for plugins that leave precision to
the Booster.

[Note: where precision lives]
A plugin either *controls* precision (FSDP2 through ``MixedPrecisionPolicy``, ZeRO and Gemini through their
fp32 master weights) or leaves it to the Booster (TorchDDP, no plugin). In the second case the model keeps fp32
parameters, which are the master weights, and its forward runs under ``torch.autocast``; fp16 adds a dynamic
loss scaler in the optimizer wrapper. bf16 never uses a loss scaler.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "PRECISIONS",
    "DynamicLossScaler",
    "LossScalerConfig",
    "MixedPrecision",
    "mixed_precision_factory",
    "precision_dtype",
]

PRECISIONS = ("fp32", "fp16", "bf16")
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def precision_dtype(precision: str) -> torch.dtype:
    """The compute dtype of a precision name (``"fp16"`` -> ``torch.float16``)."""
    check_precision(precision, PRECISIONS, owner="precision")
    return _DTYPES[precision]


def check_precision(precision: Any, allowed: tuple[str, ...], *, owner: str) -> None:
    if precision not in allowed:
        raise ValueError(f"{owner}: precision {precision!r} is not supported; use one of {list(allowed)}")


@dataclass(frozen=True, kw_only=True)
class LossScalerConfig:
    """Dynamic loss scaling for fp16 (the Colossal-AI names and defaults).

    The scale is multiplied by ``growth_factor`` after ``growth_interval`` steps without overflow and by
    ``backoff_factor`` after ``hysteresis`` overflowing steps; it stays within ``[min_scale, max_scale]``.
    """

    initial_scale: float = 2.0**16
    min_scale: float = 1.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    max_scale: float = 2.0**32

    def __post_init__(self) -> None:
        if not 0 < self.min_scale <= self.initial_scale <= self.max_scale:
            raise ValueError(
                f"LossScalerConfig: need 0 < min_scale <= initial_scale <= max_scale, got min_scale={self.min_scale}, "
                f"initial_scale={self.initial_scale}, max_scale={self.max_scale}"
            )
        if self.growth_factor <= 1:
            raise ValueError(f"LossScalerConfig: growth_factor {self.growth_factor} must be > 1 (e.g. 2)")
        if not 0 < self.backoff_factor < 1:
            raise ValueError(
                f"LossScalerConfig: backoff_factor {self.backoff_factor} must be in (0, 1) (e.g. 0.5)"
            )
        if self.growth_interval < 1 or self.hysteresis < 1:
            raise ValueError(
                f"LossScalerConfig: growth_interval {self.growth_interval} and hysteresis {self.hysteresis} must be >= 1"
            )


class DynamicLossScaler:
    """Loss scale state machine for fp16; ``state_dict`` makes it part of a resumable checkpoint."""

    def __init__(self, config: LossScalerConfig | None = None) -> None:
        self.config = config or LossScalerConfig()
        self.scale = float(self.config.initial_scale)
        self._good_steps = 0
        self._hysteresis_left = self.config.hysteresis
        self.skipped_steps = 0

    def update(self, found_inf: bool) -> None:
        c = self.config
        if found_inf:
            self.skipped_steps += 1
            self._good_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * c.backoff_factor, c.min_scale)
                self._hysteresis_left = c.hysteresis
            return
        self._good_steps += 1
        if self._good_steps >= c.growth_interval:
            self.scale = min(self.scale * c.growth_factor, c.max_scale)
            self._good_steps = 0
            self._hysteresis_left = c.hysteresis

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "good_steps": self._good_steps,
            "hysteresis_left": self._hysteresis_left,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self.skipped_steps = int(state["skipped_steps"])


def grads_have_inf(params: list[torch.nn.Parameter], group: dist.ProcessGroup | None = None) -> bool:
    """True if any local gradient is inf/nan on any rank of ``group`` (one all-reduce when distributed)."""
    flag = torch.zeros(1)
    for p in params:
        if p.grad is not None:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            if not torch.isfinite(g).all():
                flag.fill_(1.0)
                break
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        device = params[0].device if params and params[0].device.type != "meta" else torch.device("cpu")
        flag = flag.to(device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item() > 0)


@dataclass(frozen=True, kw_only=True)
class MixedPrecision:
    """Booster-level mixed precision for plugins that do not control precision (see [Note: where precision lives]).

    Args:
        precision: ``"fp32"``, ``"fp16"`` (autocast + dynamic loss scaler) or ``"bf16"`` (autocast, no scaler).
        scaler: loss scaler settings, used only with ``"fp16"``.
    """

    precision: str = "fp16"
    scaler: LossScalerConfig = field(default_factory=LossScalerConfig)

    def __post_init__(self) -> None:
        check_precision(self.precision, PRECISIONS, owner="MixedPrecision")

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.precision]

    @property
    def uses_scaler(self) -> bool:
        return self.precision == "fp16"


def mixed_precision_factory(mixed_precision: str | MixedPrecision | None) -> MixedPrecision | None:
    """Accepts a name (``"fp16"``, ``"bf16"``, ``"fp32"``; Colossal-AI's ``"fp16_naive"`` means ``"fp16"``)."""
    if mixed_precision is None or isinstance(mixed_precision, MixedPrecision):
        return mixed_precision
    if mixed_precision == "fp16_naive":
        mixed_precision = "fp16"
    if mixed_precision in ("fp16_apex", "fp8"):
        raise ValueError(
            f"Booster: mixed_precision={mixed_precision!r} is not supported; use one of {list(PRECISIONS)} "
            "(fp8 compute is not implemented yet)"
        )
    return MixedPrecision(precision=mixed_precision)


def autocast_forward(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Make ``module.forward`` run under ``torch.autocast`` with ``dtype`` and return fp32 floating outputs."""
    forward = module.forward
    device_type = _module_device_type(module)

    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type=device_type, dtype=dtype):
            return forward(*args, **kwargs)

    module.forward = wrapped  # type: ignore[method-assign]


def _module_device_type(module: torch.nn.Module) -> str:
    for p in module.parameters():
        return p.device.type
    return "cpu"
