"""Dynamic loss scaler state machine (fp16 only; bf16 and fp32 never scale)."""

from __future__ import annotations

from typing import Any

from cai.zero._config import LossScaleConfig


class DynamicLossScaler:
    """Tracks the loss scale; ``update(overflow)`` is called once per ``step()``."""

    def __init__(self, config: LossScaleConfig) -> None:
        self.config = config
        self.scale = float(config.initial_scale)
        self._clean_steps = 0
        self._hysteresis_left = config.hysteresis
        self.overflow_count = 0

    def update(self, overflow: bool) -> None:
        cfg = self.config
        if overflow:
            self.overflow_count += 1
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * cfg.backoff_factor, cfg.min_scale)
                self._hysteresis_left = cfg.hysteresis
            return
        self._clean_steps += 1
        if self._clean_steps >= cfg.growth_interval:
            self.scale = min(self.scale * cfg.growth_factor, cfg.max_scale)
            self._clean_steps = 0
            self._hysteresis_left = cfg.hysteresis

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "clean_steps": self._clean_steps,
            "hysteresis_left": self._hysteresis_left,
            "overflow_count": self.overflow_count,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self.overflow_count = int(state["overflow_count"])
