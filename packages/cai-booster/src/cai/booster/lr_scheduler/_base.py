"""What every scheduler here shares: finding the torch optimizer behind a boosted one, argument checks, and the base
class of the closed-form schedules."""

from __future__ import annotations

import math
import warnings
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler


def torch_optimizer(optimizer: Any, owner: str) -> Optimizer:
    """The torch optimizer whose ``param_groups`` ``optimizer`` exposes: itself, or the one inside the wrapper that
    ``Booster.boost`` returned (``unwrap()``, then ``.optim``, as cai-zero's optimizer holds it)."""
    inner = optimizer
    for _ in range(4):
        if isinstance(inner, Optimizer):
            # A wrapper whose param_groups are copies would never see the schedule's learning rates.
            if inner.param_groups is not optimizer.param_groups:
                raise TypeError(
                    f"{owner}: {type(optimizer).__name__} does not share its param_groups with the "
                    f"{type(inner).__name__} inside it, so a learning rate set here would not reach the update"
                )
            return inner
        unwrap = getattr(inner, "unwrap", None)
        step_in = unwrap() if callable(unwrap) else getattr(inner, "optim", None)
        if step_in is None or step_in is inner:
            break
        inner = step_in
    raise TypeError(
        f"{owner}: optimizer must be a torch.optim.Optimizer or the optimizer Booster.boost returned, "
        f"got {type(optimizer).__name__}"
    )


def steps(owner: str, name: str, value: Any, *, minimum: int) -> int:
    """An int >= ``minimum``; a float with an integral value (``total * 0.1`` written as ``100.0``) is taken."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{owner}: {name} must be >= {minimum}, got {value}")
    return value


def warmup(owner: str, total_steps: Any, warmup_steps: Any) -> tuple[int, int]:
    """``(total_steps, warmup_steps)`` checked: at least one step is left after the warm-up."""
    total = steps(owner, "total_steps", total_steps, minimum=1)
    warm = steps(owner, "warmup_steps", warmup_steps, minimum=0)
    if warm >= total:
        raise ValueError(
            f"{owner}: warmup_steps ({warm}) must be smaller than total_steps ({total}); the schedule after the "
            "warm-up needs at least one step"
        )
    return total, warm


def non_negative(owner: str, name: str, value: Any) -> float:
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{owner}: {name} must be a finite number >= 0, got {value!r}")
    return value


def positive(owner: str, name: str, value: Any) -> float:
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{owner}: {name} must be a finite number > 0, got {value!r}")
    return value


def fraction(owner: str, name: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{owner}: {name} must be between 0.0 and 1.0, got {value!r}")
    return value


def check_milestones(owner: str, value: Any, *, required: bool) -> list[int]:
    """Milestones as a sorted list (a repeated one applies gamma once per repetition, as in torch's MultiStepLR)."""
    if value is None or (required and len(value) == 0):
        if required:
            raise ValueError(f"{owner}: milestones must be a non-empty list of step indices, got {value!r}")
        return []
    return sorted(steps(owner, "each milestone", m, minimum=0) for m in value)


def ignored(owner: str, kwargs: dict[str, Any]) -> None:
    """Colossal-AI's schedulers take and drop unknown keywords; say so instead of dropping them silently."""
    if kwargs:
        warnings.warn(
            f"{owner} ignores {', '.join(sorted(kwargs))} (Colossal-AI's {owner} takes and ignores them too)",
            UserWarning,
            stacklevel=3,
        )


class ClosedFormLR(LRScheduler):
    """A schedule that is a function of the step and each group's base learning rate alone.

    ``last_epoch`` counts ``step()`` calls (0 after construction). ``warmup_steps`` steps of linear warm-up come
    first: the rate at step ``t < warmup_steps`` is ``base * (t + 1) / warmup_steps``; ``after(base, t)`` gives the
    rest, ``t`` counted from the end of the warm-up. Its state is ints, floats and lists, so it is JSON-able.
    """

    warmup_steps: int = 0

    def __init__(self, optimizer: Any, last_epoch: int) -> None:
        super().__init__(torch_optimizer(optimizer, type(self).__name__), last_epoch)

    def get_lr(self) -> list[Any]:
        t = self.last_epoch
        if t < self.warmup_steps:
            return [base * self.warmup_factor(t) for base in self.base_lrs]
        return [self.after(base, t - self.warmup_steps) for base in self.base_lrs]

    _get_closed_form_lr = get_lr  # what step(epoch) uses: the same values

    def warmup_factor(self, t: int) -> float:
        return (t + 1) / self.warmup_steps

    def after(self, base: Any, t: int) -> Any:
        raise NotImplementedError


def cosine(base: Any, eta_min: float, t: int, period: int) -> Any:
    """Half a cosine from ``base`` (t = 0) to ``eta_min`` (t = period), continuing periodically beyond it (as torch's
    CosineAnnealingLR does)."""
    return eta_min + (base - eta_min) * (1 + math.cos(math.pi * t / period)) / 2
