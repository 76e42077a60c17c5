"""The one dynamic loss scaler and its config (used by cai-zero, cai-gemini and cai-booster)."""

from __future__ import annotations

import dataclasses

import pytest

from cai.kernels.optim import DynamicLossScaler, LossScaleConfig


def test_defaults_are_colossal_ai_plugin_defaults() -> None:
    assert dataclasses.asdict(LossScaleConfig()) == {
        "initial_scale": 2.0**16,
        "min_scale": 1.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 1000,
        "hysteresis": 2,
        "max_scale": 2.0**32,
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(initial_scale=0.5), "min_scale=1.0, initial_scale=0.5"),
        (dict(max_scale=2.0**10), "initial_scale=65536.0, max_scale=1024.0"),
        (dict(growth_factor=1.0), "growth_factor 1.0 must be > 1"),
        (dict(backoff_factor=1.0), r"backoff_factor 1.0 must be in \(0, 1\)"),
        (dict(hysteresis=0), "hysteresis 0 must both be >= 1"),
    ],
)
def test_config_names_the_bad_value(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        LossScaleConfig(**kwargs)


def test_hysteresis_backoff_growth_bounds_and_resume() -> None:
    s = DynamicLossScaler(
        LossScaleConfig(initial_scale=8, growth_interval=3, hysteresis=2, min_scale=2, max_scale=16)
    )
    s.update(True)
    assert s.scale == 8  # absorbed by hysteresis
    s.update(True)
    assert s.scale == 4
    for _ in range(4):
        s.update(True)
    assert s.scale == 2 and s.skipped_steps == 6 and s.overflow_count == 6  # never below min_scale
    s.update(False), s.update(False)
    state = s.state_dict()
    resumed = DynamicLossScaler(s.config)
    resumed.load_state_dict(state)
    for scaler in (s, resumed):
        scaler.update(False)  # the third clean step in a row: only a scaler that kept the count grows
    assert s.scale == resumed.scale == 4 and resumed.state_dict() == s.state_dict()
    for _ in range(9):
        s.update(False)
    assert s.scale == 16  # never above max_scale


def test_loads_the_earlier_cai_zero_keys() -> None:
    s = DynamicLossScaler()
    s.load_state_dict({"scale": 512.0, "clean_steps": 7, "hysteresis_left": 1, "overflow_count": 3})
    assert s.state_dict() == {"scale": 512.0, "good_steps": 7, "hysteresis_left": 1, "skipped_steps": 3}
