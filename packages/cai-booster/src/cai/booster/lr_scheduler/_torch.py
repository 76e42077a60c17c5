"""torch's schedulers with Colossal-AI's arguments: ``total_steps`` second (used by CosineAnnealingLR and OneCycleLR,
accepted and unused by the others, as in Colossal-AI), the optimizer Booster.boost returned accepted, and checks."""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch.optim import lr_scheduler as torch_lr

from cai.booster.lr_scheduler._base import (
    check_milestones,
    ignored,
    non_negative,
    positive,
    steps,
    torch_optimizer,
)


class CosineAnnealingLR(torch_lr.CosineAnnealingLR):
    """torch's CosineAnnealingLR with ``T_max=total_steps``: from the base rate to ``eta_min`` at ``total_steps``.

    Args:
        optimizer: a torch optimizer, or the optimizer ``Booster.boost`` returned.
        total_steps: steps from the base rate to ``eta_min``.
        eta_min: the lowest rate (default 0).
        last_epoch: the step to resume from (default -1: start).

    The rate is ``eta_min + (base - eta_min) * (1 + cos(pi * t / T)) / 2`` (torch computes it step by step, so
    other schedulers may be chained with it); it rises again after ``total_steps``.
    """

    def __init__(
        self, optimizer: Any, total_steps: int, eta_min: float = 0, last_epoch: int = -1, **kwargs: Any
    ) -> None:
        ignored("CosineAnnealingLR", kwargs)
        total = steps("CosineAnnealingLR", "total_steps", total_steps, minimum=1)
        eta_min = non_negative("CosineAnnealingLR", "eta_min", eta_min)
        super().__init__(
            torch_optimizer(optimizer, "CosineAnnealingLR"), total, eta_min=eta_min, last_epoch=last_epoch
        )


class MultiStepLR(torch_lr.MultiStepLR):
    """torch's MultiStepLR: the base rate times ``gamma`` once for every milestone reached.

    Args:
        optimizer: a torch optimizer, or the optimizer ``Booster.boost`` returned.
        total_steps: accepted for Colossal-AI's signature; unused.
        milestones: steps at which the rate is multiplied by ``gamma`` (default None: none, a constant rate).
        gamma: the factor (default 0.1).
        last_epoch: the step to resume from (default -1: start).

    The rate at step ``t`` is ``base * gamma ** n(t)``, ``n(t)`` the number of milestones ``<= t``. The state holds
    the milestones as a sorted list (torch's holds a ``Counter``, whose int keys a JSON file turns into strings).
    """

    def __init__(
        self,
        optimizer: Any,
        total_steps: int,
        milestones: list[int] | None = None,
        gamma: float = 0.1,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        ignored("MultiStepLR", kwargs)
        super().__init__(
            torch_optimizer(optimizer, "MultiStepLR"),
            check_milestones("MultiStepLR", milestones, required=False),
            gamma=positive("MultiStepLR", "gamma", gamma),
            last_epoch=last_epoch,
        )

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["milestones"] = sorted(self.milestones.elements())
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        saved = state["milestones"]
        if isinstance(saved, dict):  # torch's own layout, its keys possibly strings after JSON
            state["milestones"] = Counter({int(k): n for k, n in saved.items()})
        else:
            state["milestones"] = Counter(saved)
        super().load_state_dict(state)


class OneCycleLR(torch_lr.OneCycleLR):
    """torch's OneCycleLR with each group's learning rate at construction as its ``max_lr``.

    Args:
        optimizer: a torch optimizer, or the optimizer ``Booster.boost`` returned.
        total_steps: steps in the cycle (``step()`` past it raises, as in torch).
        pct_start: share of the cycle spent increasing the rate (default 0.3).
        anneal_strategy: ``"cos"`` (default) or ``"linear"``.
        cycle_momentum: cycle momentum (or Adam's beta1) inversely to the rate (default True; the optimizer must
            have ``momentum`` or ``betas``).
        base_momentum, max_momentum: the momentum's range (defaults 0.85, 0.95).
        div_factor: the rate starts at ``max_lr / div_factor`` (default 25.0).
        final_div_factor: and ends at ``max_lr / div_factor / final_div_factor`` (default 10000.0).
        last_epoch: the step to resume from (default -1: start).

    Two phases (fastai's): from the initial rate up to ``max_lr`` at step ``pct_start * total_steps - 1``, then down
    to the minimum at ``total_steps - 1``. Other keywords (``three_phase``, ``epochs``, ...) are ignored with a
    warning, as Colossal-AI ignores them.
    """

    def __init__(
        self,
        optimizer: Any,
        total_steps: int,
        pct_start: float = 0.3,
        anneal_strategy: str = "cos",
        cycle_momentum: bool = True,
        base_momentum: float = 0.85,
        max_momentum: float = 0.95,
        div_factor: float = 25.0,
        final_div_factor: float = 10000.0,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        ignored("OneCycleLR", kwargs)
        optim = torch_optimizer(optimizer, "OneCycleLR")
        super().__init__(
            optim,
            [group["lr"] for group in optim.param_groups],
            total_steps=steps("OneCycleLR", "total_steps", total_steps, minimum=1),
            pct_start=pct_start,
            anneal_strategy=anneal_strategy,  # type: ignore[arg-type]
            cycle_momentum=cycle_momentum,
            base_momentum=base_momentum,
            max_momentum=max_momentum,
            div_factor=positive("OneCycleLR", "div_factor", div_factor),
            final_div_factor=positive("OneCycleLR", "final_div_factor", final_div_factor),
            last_epoch=last_epoch,
        )


def _lambda(owner: str, lr_lambda: Any) -> Any:
    if lr_lambda is None:
        raise ValueError(
            f"{owner}: lr_lambda is required: a function of the step (or one per param group) giving the factor"
        )
    return lr_lambda


class LambdaLR(torch_lr.LambdaLR):
    """torch's LambdaLR: the base rate times ``lr_lambda(t)``. ``total_steps`` is accepted and unused."""

    def __init__(self, optimizer: Any, total_steps: int, lr_lambda: Any = None, last_epoch: int = -1) -> None:
        super().__init__(
            torch_optimizer(optimizer, "LambdaLR"), _lambda("LambdaLR", lr_lambda), last_epoch=last_epoch
        )


class MultiplicativeLR(torch_lr.MultiplicativeLR):
    """torch's MultiplicativeLR: each step multiplies the rate by ``lr_lambda(t)``. ``total_steps`` is unused."""

    def __init__(self, optimizer: Any, total_steps: int, lr_lambda: Any = None, last_epoch: int = -1) -> None:
        super().__init__(
            torch_optimizer(optimizer, "MultiplicativeLR"),
            _lambda("MultiplicativeLR", lr_lambda),
            last_epoch=last_epoch,
        )


class StepLR(torch_lr.StepLR):
    """torch's StepLR: ``base * gamma ** (t // step_size)`` (defaults: ``step_size=1``, ``gamma=0.1``).
    ``total_steps`` is accepted and unused."""

    def __init__(
        self, optimizer: Any, total_steps: int, step_size: int = 1, gamma: float = 0.1, last_epoch: int = -1
    ) -> None:
        super().__init__(
            torch_optimizer(optimizer, "StepLR"),
            steps("StepLR", "step_size", step_size, minimum=1),
            gamma=gamma,
            last_epoch=last_epoch,
        )


class ExponentialLR(torch_lr.ExponentialLR):
    """torch's ExponentialLR: ``base * gamma ** t``, with Colossal-AI's default ``gamma=1.0`` (a constant rate).
    ``total_steps`` is accepted and unused."""

    def __init__(self, optimizer: Any, total_steps: int, gamma: float = 1.0, last_epoch: int = -1) -> None:
        super().__init__(torch_optimizer(optimizer, "ExponentialLR"), gamma, last_epoch=last_epoch)


__all__ = [
    "CosineAnnealingLR",
    "ExponentialLR",
    "LambdaLR",
    "MultiStepLR",
    "MultiplicativeLR",
    "OneCycleLR",
    "StepLR",
]
