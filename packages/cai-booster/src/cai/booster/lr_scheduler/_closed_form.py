"""Colossal-AI's schedules with a warm-up or a flat start, each written as one closed form of the step.

[Note: Colossal-AI's schedules in closed form]
Colossal-AI builds these as a torch scheduler handed over to another one after the warm-up (``WarmupScheduler``
and ``DelayerScheduler`` around torch's CosineAnnealingLR, MultiStepLR or its own PolynomialLR). Written out,
with ``base`` a group's learning rate at construction, ``T = total_steps``, ``W = warmup_steps`` and ``t`` the
number of ``step()`` calls so far, the rate at step ``t < W`` is ``base * (t + 1) / W`` (so ``base`` is reached at
``t = W - 1`` and held at ``t = W``), and at ``t >= W`` it is the second schedule at ``t - W``. Colossal-AI's hand-over
relies on torch <= 2.5 (which it requires) returning the current rate when the second scheduler's step count is 0;
from torch 2.6 on, torch's CosineAnnealingLR treats that call as a chained step, so the same Colossal-AI code
overshoots ``base`` at ``t = W`` and runs one step late after it. The values here are those of Colossal-AI on the
torch it supports. A closed form also keeps the state to a few numbers (no nested scheduler), so it is JSON-able.
"""

from __future__ import annotations

import bisect
from typing import Any

from cai.booster.lr_scheduler._base import (
    ClosedFormLR,
    check_milestones,
    cosine,
    fraction,
    ignored,
    non_negative,
    positive,
    warmup,
)


class LinearWarmupLR(ClosedFormLR):
    """Linear warm-up, then linear decay to 0 at ``total_steps``.

    Args:
        optimizer: a torch optimizer, or the optimizer ``Booster.boost`` returned.
        total_steps: number of ``step()`` calls in the schedule (> ``warmup_steps``).
        warmup_steps: steps of warm-up (default 0).
        last_epoch: the step to resume from (default -1: start).

    At step ``t < W`` the rate is ``base * (t + 1) / (W + 1)`` (this warm-up starts at ``base / (W + 1)`` and reaches
    ``base`` only at ``t = W``, unlike the other warm-ups); from ``t = W`` it is ``base * (T - t) / (T - W)``, and 0
    after ``total_steps`` (Colossal-AI's keeps decreasing below 0 there).

    Example::

        scheduler = LinearWarmupLR(optimizer, total_steps=1000, warmup_steps=100)
    """

    def __init__(
        self, optimizer: Any, total_steps: int, warmup_steps: int = 0, last_epoch: int = -1, **kwargs: Any
    ) -> None:
        ignored("LinearWarmupLR", kwargs)
        self.total_steps, self.warmup_steps = warmup("LinearWarmupLR", total_steps, warmup_steps)
        super().__init__(optimizer, last_epoch)

    def warmup_factor(self, t: int) -> float:
        return (t + 1) / (self.warmup_steps + 1)

    def after(self, base: Any, t: int) -> Any:
        left = self.total_steps - self.warmup_steps
        return base * max(0.0, (left - t) / left)


class CosineAnnealingWarmupLR(ClosedFormLR):
    """Linear warm-up, then cosine annealing from the base rate to ``eta_min`` at ``total_steps``.

    Args:
        optimizer: a torch optimizer, or the optimizer ``Booster.boost`` returned.
        total_steps: number of ``step()`` calls in the schedule (> ``warmup_steps``).
        warmup_steps: steps of warm-up (default 0).
        eta_min: the rate at ``total_steps`` (default 0.0).
        last_epoch: the step to resume from (default -1: start).

    At ``t < W``: ``base * (t + 1) / W``; from ``t = W``:
    ``eta_min + (base - eta_min) * (1 + cos(pi * (t - W) / (T - W))) / 2``, which rises again after ``total_steps``
    (the cosine is periodic, as torch's CosineAnnealingLR).

    Example::

        scheduler = CosineAnnealingWarmupLR(optimizer, total_steps=1000, warmup_steps=100, eta_min=1e-5)
    """

    def __init__(
        self,
        optimizer: Any,
        total_steps: int,
        warmup_steps: int = 0,
        eta_min: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        self.total_steps, self.warmup_steps = warmup("CosineAnnealingWarmupLR", total_steps, warmup_steps)
        self.eta_min = non_negative("CosineAnnealingWarmupLR", "eta_min", eta_min)
        super().__init__(optimizer, last_epoch)

    def after(self, base: Any, t: int) -> Any:
        return cosine(base, self.eta_min, t, self.total_steps - self.warmup_steps)


class FlatAnnealingWarmupLR(ClosedFormLR):
    """Linear warm-up, a flat stretch at the base rate, then cosine annealing to ``eta_min`` at ``total_steps``.

    Args:
        optimizer: a torch optimizer, or the optimizer ``Booster.boost`` returned.
        total_steps: number of ``step()`` calls in the schedule (> ``warmup_steps``).
        warmup_steps: steps of warm-up (default 0).
        pct_start: the flat stretch's share of the steps after the warm-up,
            ``F = int((total_steps - warmup_steps) * pct_start)`` steps (default 0.72); at least one step must be
            left to anneal.
        eta_min: the rate at ``total_steps`` (default 0).
        last_epoch: the step to resume from (default -1: start).

    At ``t < W``: ``base * (t + 1) / W``; for ``W <= t <= W + F``: ``base``; then
    ``eta_min + (base - eta_min) * (1 + cos(pi * (t - W - F) / (T - W - F))) / 2``.

    Example::

        scheduler = FlatAnnealingWarmupLR(optimizer, total_steps=1000, warmup_steps=50, pct_start=0.5)
    """

    def __init__(
        self,
        optimizer: Any,
        total_steps: int,
        warmup_steps: int = 0,
        pct_start: float = 0.72,
        eta_min: float = 0.0,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        ignored(owner, kwargs)
        self.total_steps, self.warmup_steps = warmup(owner, total_steps, warmup_steps)
        self.pct_start = fraction(owner, "pct_start", pct_start)
        self.eta_min = non_negative(owner, "eta_min", eta_min)
        after_warmup = self.total_steps - self.warmup_steps
        self.flat_steps = int(after_warmup * self.pct_start)
        if self.flat_steps >= after_warmup:
            raise ValueError(
                f"{owner}: pct_start={pct_start} keeps all {after_warmup} steps"
                f"{' after the warm-up' if self.warmup_steps else ''} flat and leaves none to anneal; use a smaller "
                "pct_start"
            )
        super().__init__(optimizer, last_epoch)

    def after(self, base: Any, t: int) -> Any:
        if t <= self.flat_steps:
            return base
        anneal = self.total_steps - self.warmup_steps - self.flat_steps
        return cosine(base, self.eta_min, t - self.flat_steps, anneal)


class FlatAnnealingLR(FlatAnnealingWarmupLR):
    """The base rate for ``F = int(total_steps * pct_start)`` steps, then cosine annealing to 0 at ``total_steps``.

    Args:
        optimizer: a torch optimizer, or the optimizer ``Booster.boost`` returned.
        total_steps: number of ``step()`` calls in the schedule.
        pct_start: the flat stretch's share of the steps (default 0.72); at least one step must be left to anneal.
        last_epoch: the step to resume from (default -1: start).

    For ``t <= F``: ``base``; then ``base * (1 + cos(pi * (t - F) / (T - F))) / 2``. There is no ``eta_min``: as in
    Colossal-AI, it anneals to 0 (use FlatAnnealingWarmupLR with ``warmup_steps=0`` for another floor).

    Example::

        scheduler = FlatAnnealingLR(optimizer, total_steps=1000, pct_start=0.72)
    """

    def __init__(
        self, optimizer: Any, total_steps: int, pct_start: float = 0.72, last_epoch: int = -1, **kwargs: Any
    ) -> None:
        ignored(type(self).__name__, kwargs)
        super().__init__(optimizer, total_steps, 0, pct_start, 0.0, last_epoch)


class PolynomialWarmupLR(ClosedFormLR):
    """Linear warm-up, then polynomial decay from the base rate to ``end_lr`` at ``total_steps``, held after it.

    Args:
        optimizer: a torch optimizer, or the optimizer ``Booster.boost`` returned.
        total_steps: number of ``step()`` calls in the schedule (> ``warmup_steps``).
        warmup_steps: steps of warm-up (default 0).
        end_lr: the rate at and after ``total_steps`` (default 0.0001).
        power: the polynomial's power (default 1.0, linear).
        last_epoch: the step to resume from (default -1: start).

    At ``t < W``: ``base * (t + 1) / W``; from ``t = W``:
    ``(base - end_lr) * (1 - min(t - W, T - W) / (T - W)) ** power + end_lr``.

    Example::

        scheduler = PolynomialWarmupLR(optimizer, total_steps=1000, warmup_steps=100, end_lr=1e-5, power=2.0)
    """

    def __init__(
        self,
        optimizer: Any,
        total_steps: int,
        warmup_steps: int = 0,
        end_lr: float = 0.0001,
        power: float = 1.0,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        ignored(owner, kwargs)
        self.total_steps, self.warmup_steps = warmup(owner, total_steps, warmup_steps)
        self.end_lr = non_negative(owner, "end_lr", end_lr)
        self.power = positive(owner, "power", power)
        super().__init__(optimizer, last_epoch)

    def after(self, base: Any, t: int) -> Any:
        decay = self.total_steps - self.warmup_steps
        return (base - self.end_lr) * (1 - min(t, decay) / decay) ** self.power + self.end_lr


class PolynomialLR(PolynomialWarmupLR):
    """Polynomial decay from the base rate to ``end_lr`` at ``total_steps``, held after it.

    Colossal-AI's PolynomialLR (not torch's, which takes ``total_iters`` and decays to 0).

    Args:
        optimizer: a torch optimizer, or the optimizer ``Booster.boost`` returned.
        total_steps: number of ``step()`` calls in the schedule.
        end_lr: the rate at and after ``total_steps`` (default 0.0001).
        power: the polynomial's power (default 1.0, linear).
        last_epoch: the step to resume from (default -1: start).

    The rate is ``(base - end_lr) * (1 - min(t, T) / T) ** power + end_lr``.

    Example::

        scheduler = PolynomialLR(optimizer, total_steps=1000, end_lr=1e-5)
    """

    def __init__(
        self,
        optimizer: Any,
        total_steps: int,
        end_lr: float = 0.0001,
        power: float = 1.0,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        ignored(type(self).__name__, kwargs)
        super().__init__(optimizer, total_steps, 0, end_lr, power, last_epoch)


class MultiStepWarmupLR(ClosedFormLR):
    """Linear warm-up, then the base rate times ``gamma`` once for every milestone reached.

    Args:
        optimizer: a torch optimizer, or the optimizer ``Booster.boost`` returned.
        total_steps: number of ``step()`` calls in the schedule (> ``warmup_steps``).
        warmup_steps: steps of warm-up (default 0).
        milestones: steps at which the rate is multiplied by ``gamma``, counted from the start of the schedule;
            required, as in Colossal-AI (a repeated milestone applies ``gamma`` once per repetition; milestones
            inside the warm-up are dropped).
        gamma: the factor (default 0.1).
        last_epoch: the step to resume from (default -1: start).

    At ``t < W``: ``base * (t + 1) / W``; from ``t = W``: ``base * gamma ** n(t)``, ``n(t)`` the number of
    milestones ``m`` with ``W <= m <= t``. (Colossal-AI applies a milestone at step 0 twice when
    ``warmup_steps=0``; here it counts once.)

    Example::

        scheduler = MultiStepWarmupLR(optimizer, total_steps=1000, warmup_steps=100, milestones=[500, 800])
    """

    def __init__(
        self,
        optimizer: Any,
        total_steps: int,
        warmup_steps: int = 0,
        milestones: list[int] | None = None,
        gamma: float = 0.1,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        ignored(owner, kwargs)
        self.total_steps, self.warmup_steps = warmup(owner, total_steps, warmup_steps)
        self.milestones = [
            m for m in check_milestones(owner, milestones, required=True) if m >= self.warmup_steps
        ]
        self.gamma = positive(owner, "gamma", gamma)
        super().__init__(optimizer, last_epoch)

    def after(self, base: Any, t: int) -> Any:
        return base * self.gamma ** bisect.bisect_right(self.milestones, t + self.warmup_steps)


__all__ = [
    "CosineAnnealingWarmupLR",
    "FlatAnnealingLR",
    "FlatAnnealingWarmupLR",
    "LinearWarmupLR",
    "MultiStepWarmupLR",
    "PolynomialLR",
    "PolynomialWarmupLR",
]
