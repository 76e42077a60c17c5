"""Colossal-AI's LR schedulers: every step of a short run against the closed form, save/load through the Booster,
the boosted optimizers, and argument errors."""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from cai.booster import Booster
from cai.booster import lr_scheduler as L
from cai.booster.plugin import GeminiPlugin, LowLevelZeroPlugin
from cai.mesh.testing import TinyTransformer, assert_close, make_batch

BASES = (0.8, 0.2)  # two param groups


def _cos(base: float, eta_min: float, t: int, period: int) -> float:
    return eta_min + (base - eta_min) * (1 + math.cos(math.pi * t / period)) / 2


def _one_cycle(b: float, t: int, *, total: int, pct: float, div: float, final: float, linear: bool) -> float:
    initial, low = b / div, b / div / final
    peak = pct * total - 1  # the step at which the rate is max_lr

    def anneal(start: float, end: float, frac: float) -> float:
        return (
            start + (end - start) * frac
            if linear
            else end + (start - end) * (1 + math.cos(math.pi * frac)) / 2
        )

    if t <= peak:
        return anneal(initial, b, t / peak)
    return anneal(b, low, (t - peak) / (total - 1 - peak))


@dataclass(frozen=True, kw_only=True)
class Case:
    """A scheduler built on an optimizer, and the rate it must give a group of base rate ``b`` after ``t`` steps."""

    name: str
    build: Callable[[Any], Any]
    expected: Callable[[float, int], float]
    steps: int


CASES = [
    Case(
        name="LinearWarmupLR",
        build=lambda o: L.LinearWarmupLR(o, total_steps=8, warmup_steps=3),
        # warm-up over W + 1, then linear to 0 at total_steps, held at 0 after it
        expected=lambda b, t: b * (t + 1) / 4 if t < 3 else b * max(0.0, (8 - t) / 5),
        steps=11,
    ),
    Case(
        name="LinearWarmupLR-no-warmup",
        build=lambda o: L.LinearWarmupLR(o, 4),
        expected=lambda b, t: b * max(0.0, (4 - t) / 4),
        steps=5,
    ),
    Case(
        name="CosineAnnealingWarmupLR",
        build=lambda o: L.CosineAnnealingWarmupLR(o, total_steps=8, warmup_steps=3, eta_min=0.01),
        # base reached at t = W - 1 and held at t = W, then the cosine from step W
        expected=lambda b, t: b * (t + 1) / 3 if t < 3 else _cos(b, 0.01, t - 3, 5),
        steps=10,
    ),
    Case(
        name="CosineAnnealingWarmupLR-no-warmup",
        build=lambda o: L.CosineAnnealingWarmupLR(o, 5),
        expected=lambda b, t: _cos(b, 0.0, t, 5),
        steps=6,
    ),
    Case(
        name="CosineAnnealingLR",
        build=lambda o: L.CosineAnnealingLR(o, 5, eta_min=0.1),
        expected=lambda b, t: _cos(b, 0.1, t, 5),  # periodic past total_steps, as torch's
        steps=12,
    ),
    Case(
        name="FlatAnnealingLR",
        build=lambda o: L.FlatAnnealingLR(o, 10, pct_start=0.5),
        expected=lambda b, t: b if t <= 5 else _cos(b, 0.0, t - 5, 5),
        steps=10,
    ),
    Case(
        name="FlatAnnealingWarmupLR",
        build=lambda o: L.FlatAnnealingWarmupLR(o, 12, warmup_steps=2, pct_start=0.5, eta_min=0.01),
        # flat for int((12 - 2) * 0.5) = 5 steps after the warm-up
        expected=lambda b, t: b * (t + 1) / 2 if t < 2 else b if t <= 7 else _cos(b, 0.01, t - 7, 5),
        steps=12,
    ),
    Case(
        name="PolynomialLR",
        build=lambda o: L.PolynomialLR(o, 6, end_lr=0.01, power=2.0),
        expected=lambda b, t: (b - 0.01) * (1 - min(t, 6) / 6) ** 2 + 0.01,
        steps=8,
    ),
    Case(
        name="PolynomialWarmupLR",
        build=lambda o: L.PolynomialWarmupLR(o, 8, warmup_steps=2, end_lr=0.01, power=0.5),
        expected=lambda b, t: (
            b * (t + 1) / 2 if t < 2 else (b - 0.01) * (1 - min(t - 2, 6) / 6) ** 0.5 + 0.01
        ),
        steps=10,
    ),
    Case(
        name="MultiStepLR",
        build=lambda o: L.MultiStepLR(o, 10, milestones=[6, 0, 3, 3], gamma=0.5),
        expected=lambda b, t: b * 0.5 ** sum(m <= t for m in (0, 3, 3, 6)),
        steps=8,
    ),
    Case(
        name="MultiStepLR-no-milestones",
        build=lambda o: L.MultiStepLR(o, 10),
        expected=lambda b, t: b,
        steps=3,
    ),
    Case(
        name="MultiStepWarmupLR",
        build=lambda o: L.MultiStepWarmupLR(o, 10, warmup_steps=3, milestones=[2, 3, 5, 5], gamma=0.5),
        # milestone 2 falls inside the warm-up and is dropped; 3 applies at the end of the warm-up
        expected=lambda b, t: b * (t + 1) / 3 if t < 3 else b * 0.5 ** sum(3 <= m <= t for m in (2, 3, 5, 5)),
        steps=8,
    ),
    Case(
        name="OneCycleLR",
        build=lambda o: L.OneCycleLR(o, 10),
        expected=lambda b, t: _one_cycle(b, t, total=10, pct=0.3, div=25.0, final=1e4, linear=False),
        steps=10,
    ),
    Case(
        name="OneCycleLR-linear",
        build=lambda o: L.OneCycleLR(
            o, 6, pct_start=0.5, anneal_strategy="linear", div_factor=5.0, final_div_factor=2.0
        ),
        expected=lambda b, t: _one_cycle(b, t, total=6, pct=0.5, div=5.0, final=2.0, linear=True),
        steps=5,
    ),
    Case(
        name="StepLR",
        build=lambda o: L.StepLR(o, 10, step_size=3, gamma=0.5),
        expected=lambda b, t: b * 0.5 ** (t // 3),
        steps=8,
    ),
    Case(
        name="ExponentialLR",
        build=lambda o: L.ExponentialLR(o, 10, gamma=0.9),
        expected=lambda b, t: b * 0.9**t,
        steps=5,
    ),
    Case(
        name="ExponentialLR-default",
        build=lambda o: L.ExponentialLR(o, 10),
        expected=lambda b, t: b,  # Colossal-AI's default gamma is 1.0
        steps=3,
    ),
    Case(
        name="LambdaLR",
        build=lambda o: L.LambdaLR(o, 10, lambda step: 1 / (step + 1)),
        expected=lambda b, t: b / (t + 1),
        steps=5,
    ),
    Case(
        name="MultiplicativeLR",
        build=lambda o: L.MultiplicativeLR(o, 10, lambda step: 0.9),
        expected=lambda b, t: b * 0.9**t,
        steps=5,
    ),
]


def _optimizer() -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": b} for b in BASES]
    return torch.optim.SGD(groups, lr=1.0, momentum=0.9)


def _step(optimizer: Any, scheduler: Any) -> None:
    optimizer.step()
    scheduler.step()


def _rates(optimizer: Any) -> list[float]:
    return [group["lr"] for group in optimizer.param_groups]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_step_follows_the_closed_form(case: Case) -> None:
    optimizer = _optimizer()
    scheduler = case.build(optimizer)
    assert isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler)
    for t in range(case.steps + 1):
        if t:
            _step(optimizer, scheduler)
        want = [case.expected(b, t) for b in BASES]
        assert _rates(optimizer) == pytest.approx(want, rel=1e-12, abs=1e-15), f"step {t}"
        assert scheduler.get_last_lr() == _rates(optimizer)


def test_one_cycle_cycles_momentum_inversely() -> None:
    optimizer = _optimizer()
    scheduler = L.OneCycleLR(optimizer, 10)
    momenta = []
    for t in range(10):
        if t:
            _step(optimizer, scheduler)
        momenta.append(optimizer.param_groups[0]["momentum"])
    # from max_momentum down to base_momentum at the peak (step 2), back up to max_momentum at step 9
    assert momenta[0] == pytest.approx(0.95) and momenta[2] == pytest.approx(0.85)
    assert momenta[9] == pytest.approx(0.95)
    with pytest.raises(ValueError, match="total steps"):
        _step(optimizer, scheduler)
        _step(optimizer, scheduler)  # step 11 of a 10-step cycle


def _boosted(booster: Booster) -> tuple[Any, Any]:
    model = torch.nn.Linear(3, 2)
    groups = [{"params": [model.weight], "lr": BASES[0]}, {"params": [model.bias], "lr": BASES[1]}]
    optimizer = torch.optim.SGD(groups, lr=1.0, momentum=0.9)
    model, optimizer, *_ = booster.boost(model, optimizer)
    return model, optimizer


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_booster_round_trip_continues_the_schedule(case: Case, tmp_path) -> None:
    booster = Booster(device="cpu")
    _, optimizer = _boosted(booster)
    scheduler = case.build(optimizer)  # on the boosted optimizer
    half = case.steps // 2
    for _ in range(half):
        _step(optimizer, scheduler)
    booster.save_optimizer(optimizer, tmp_path / "optim")
    booster.save_lr_scheduler(scheduler, tmp_path / "sched.json")
    json.loads((tmp_path / "sched.json").read_text())  # plain JSON

    other_booster = Booster(device="cpu")
    _, resumed_optimizer = _boosted(other_booster)
    resumed = case.build(resumed_optimizer)
    other_booster.load_optimizer(resumed_optimizer, tmp_path / "optim")
    other_booster.load_lr_scheduler(resumed, tmp_path / "sched.json")
    assert resumed.last_epoch == scheduler.last_epoch
    for _ in range(half, case.steps):
        _step(optimizer, scheduler)
        _step(resumed_optimizer, resumed)
        assert _rates(resumed_optimizer) == _rates(optimizer)


def test_torch_multistep_state_loads_with_int_milestones(tmp_path) -> None:
    # torch's own MultiStepLR keeps its milestones in a Counter; JSON turns the keys into strings
    booster = Booster(device="cpu")
    _, optimizer = _boosted(booster)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer.unwrap(), [2, 4], gamma=0.5)
    _step(optimizer, scheduler)
    booster.save_lr_scheduler(scheduler, tmp_path / "sched.json")
    _, other = _boosted(Booster(device="cpu"))
    resumed = torch.optim.lr_scheduler.MultiStepLR(other.unwrap(), [2, 4], gamma=0.5)
    booster.load_lr_scheduler(resumed, tmp_path / "sched.json")
    assert resumed.milestones == scheduler.milestones
    for _ in range(4):
        _step(optimizer, scheduler)
        _step(other, resumed)
        assert resumed.get_last_lr() == scheduler.get_last_lr()


PLUGINS = {
    "LowLevelZero": lambda: LowLevelZeroPlugin(stage=2, precision="fp32"),
    "Gemini": lambda: GeminiPlugin(precision="fp32"),
}


@pytest.mark.parametrize("built_on", ["user-optimizer", "boosted-optimizer"])
@pytest.mark.parametrize("plugin", list(PLUGINS))
def test_schedule_drives_the_boosted_optimizer(plugin: str, built_on: str) -> None:
    # The schedule's rates reach the sharded update: the boosted run equals plain AdamW under the same schedule.
    # eps=1.0 keeps Adam's update proportional to the gradient: near-zero gradients (an attention key's bias) are
    # otherwise normalised into updates of size lr whose sign is rounding noise.
    def schedule(optimizer: Any) -> Any:
        return L.CosineAnnealingWarmupLR(optimizer, total_steps=4, warmup_steps=2, eta_min=1e-4)

    ids, labels = make_batch()
    reference = TinyTransformer(seed=0)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-2, eps=1.0)
    ref_sched = schedule(ref_opt)

    booster = Booster(device="cpu", plugin=PLUGINS[plugin]())
    model = TinyTransformer(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2, eps=1.0)
    scheduler = schedule(optimizer) if built_on == "user-optimizer" else None
    model, optimizer, _, _, returned = booster.boost(model, optimizer, lr_scheduler=scheduler)
    assert returned is scheduler
    if scheduler is None:
        scheduler = schedule(optimizer)
    for _ in range(4):
        TinyTransformer.loss(reference(ids), labels).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
        booster.backward(TinyTransformer.loss(model(ids), labels), optimizer)
        optimizer.step()
        optimizer.zero_grad()
        with warnings.catch_warnings(
            record=True
        ) as caught:  # torch's "lr_scheduler.step() before optimizer.step()"
            warnings.simplefilter("always")
            scheduler.step()
        assert [str(w.message) for w in caught] == []
        assert _rates(optimizer) == _rates(ref_opt)
    state = model.unwrap().state_dict() if plugin == "LowLevelZero" else model.state_dict(only_rank_0=False)
    assert_close(dict(state), dict(reference.state_dict()), rtol=1e-5)


BAD = [
    (
        lambda o: L.CosineAnnealingWarmupLR(o, 10, warmup_steps=10),
        ValueError,
        "warmup_steps .10. must be smaller",
    ),
    (lambda o: L.LinearWarmupLR(o, 10, warmup_steps=12), ValueError, "must be smaller than total_steps"),
    (lambda o: L.PolynomialWarmupLR(o, 0), ValueError, "total_steps must be >= 1"),
    (lambda o: L.CosineAnnealingLR(o, -3), ValueError, "total_steps must be >= 1"),
    (
        lambda o: L.MultiStepWarmupLR(o, 10, warmup_steps=-1, milestones=[5]),
        ValueError,
        "warmup_steps must be >= 0",
    ),
    (lambda o: L.CosineAnnealingWarmupLR(o, 10, warmup_steps=2.5), TypeError, "warmup_steps must be an int"),
    (lambda o: L.CosineAnnealingWarmupLR(o, 10, eta_min=-0.1), ValueError, "eta_min must be"),
    (lambda o: L.FlatAnnealingLR(o, 10, pct_start=1.5), ValueError, "pct_start must be between"),
    (lambda o: L.FlatAnnealingLR(o, 10, pct_start=1.0), ValueError, "none to anneal"),
    (lambda o: L.FlatAnnealingWarmupLR(o, 10, 2, pct_start=1.0), ValueError, "after the warm-up flat"),
    (lambda o: L.PolynomialLR(o, 10, end_lr=-1.0), ValueError, "end_lr must be"),
    (lambda o: L.PolynomialLR(o, 10, power=0), ValueError, "power must be"),
    (lambda o: L.MultiStepWarmupLR(o, 10, warmup_steps=2), ValueError, "milestones must be a non-empty"),
    (lambda o: L.MultiStepWarmupLR(o, 10, milestones=[]), ValueError, "milestones must be a non-empty"),
    (lambda o: L.MultiStepLR(o, 10, milestones=[3, -1]), ValueError, "each milestone must be >= 0"),
    (lambda o: L.MultiStepLR(o, 10, milestones=[3], gamma=0), ValueError, "gamma must be"),
    (lambda o: L.OneCycleLR(o, 0), ValueError, "total_steps must be >= 1"),
    (lambda o: L.OneCycleLR(o, 10, anneal_strategy="exp"), ValueError, "anneal_strategy"),
    (lambda o: L.StepLR(o, 10, step_size=0), ValueError, "step_size must be >= 1"),
    (lambda o: L.LambdaLR(o, 10), ValueError, "lr_lambda is required"),
    (lambda o: L.MultiplicativeLR(o, 10), ValueError, "lr_lambda is required"),
    (lambda o: L.LinearWarmupLR(object(), 10), TypeError, "must be a torch.optim.Optimizer"),
]


@pytest.mark.parametrize(("build", "error", "match"), BAD, ids=[f"bad-{i}" for i in range(len(BAD))])
def test_bad_arguments_raise(build: Callable[[Any], Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        build(_optimizer())


def test_integral_float_steps_are_taken() -> None:
    scheduler = L.CosineAnnealingWarmupLR(_optimizer(), 10.0, warmup_steps=2.0)
    assert (scheduler.total_steps, scheduler.warmup_steps) == (10, 2)


def test_ignored_keywords_warn() -> None:
    # Colossal-AI's FlatAnnealingLR takes eta_min into **kwargs and drops it
    with pytest.warns(UserWarning, match="FlatAnnealingLR ignores eta_min"):
        L.FlatAnnealingLR(_optimizer(), 10, eta_min=0.1)
    with pytest.warns(UserWarning, match="OneCycleLR ignores three_phase"):
        L.OneCycleLR(_optimizer(), 10, three_phase=True)


def test_wrapper_with_copied_param_groups_is_refused() -> None:
    class Copying:
        def __init__(self, optim: torch.optim.Optimizer) -> None:
            self.optim = optim

        @property
        def param_groups(self) -> list[dict[str, Any]]:
            return [dict(g) for g in self.optim.param_groups]

    with pytest.raises(TypeError, match="does not share its param_groups"):
        L.LinearWarmupLR(Copying(_optimizer()), 10)
