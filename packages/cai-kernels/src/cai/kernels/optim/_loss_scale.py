"""The dynamic loss scaler for fp16 training, shared by cai-zero, cai-gemini and cai-booster's precision."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DynamicLossScaler", "LossScaleConfig"]


@dataclass(frozen=True, kw_only=True)
class LossScaleConfig:
    """Dynamic loss scaling for fp16 working parameters (Colossal-AI's names and plugin defaults).

    The loss is multiplied by the scale before backward. A step whose gradients hold an inf or NaN on any rank is
    skipped; after ``hysteresis`` overflowing steps the scale is multiplied by ``backoff_factor`` (never below
    ``min_scale``). After ``growth_interval`` clean steps in a row it is multiplied by ``growth_factor`` (never
    above ``max_scale``). bf16 and fp32 are never scaled.
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
                f"LossScaleConfig: need 0 < min_scale <= initial_scale <= max_scale, got min_scale={self.min_scale}, "
                f"initial_scale={self.initial_scale}, max_scale={self.max_scale}"
            )
        if not self.growth_factor > 1:
            raise ValueError(
                f"LossScaleConfig: growth_factor {self.growth_factor} must be > 1 (2.0 is usual)"
            )
        if not 0 < self.backoff_factor < 1:
            raise ValueError(
                f"LossScaleConfig: backoff_factor {self.backoff_factor} must be in (0, 1) (0.5 is usual)"
            )
        if self.growth_interval < 1 or self.hysteresis < 1:
            raise ValueError(
                f"LossScaleConfig: growth_interval {self.growth_interval} and hysteresis {self.hysteresis} "
                "must both be >= 1"
            )


class DynamicLossScaler:
    """The loss scale state machine; ``update(found_inf)`` once per optimizer step.

    ``state_dict``/``load_state_dict`` make it part of a resumable checkpoint (JSON-able numbers only).
    """

    def __init__(self, config: LossScaleConfig | None = None) -> None:
        self.config = config or LossScaleConfig()
        self.scale = float(self.config.initial_scale)
        self._good_steps = 0  # clean steps since the scale last changed or overflowed
        self._hysteresis_left = self.config.hysteresis
        self.skipped_steps = 0

    @property
    def overflow_count(self) -> int:
        """Overflowing (skipped) steps so far; cai-zero's name for ``skipped_steps``."""
        return self.skipped_steps

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
        # cai-zero's scaler wrote ``clean_steps``/``overflow_count``: its checkpoints still load
        self.scale = float(state["scale"])
        self._good_steps = int(state.get("good_steps", state.get("clean_steps", 0)))
        self._hysteresis_left = int(state["hysteresis_left"])
        self.skipped_steps = int(state.get("skipped_steps", state.get("overflow_count", 0)))
