"""Colossal-AI's learning-rate schedulers (``colossalai.nn.lr_scheduler``) as torch LR schedulers: the same names,
arguments, defaults and per-step rates; built on a torch optimizer or on the optimizer ``Booster.boost`` returned;
their state is JSON-able, so ``Booster.save_lr_scheduler`` and ``save_state`` store it."""

from cai.booster.lr_scheduler._closed_form import (
    CosineAnnealingWarmupLR,
    FlatAnnealingLR,
    FlatAnnealingWarmupLR,
    LinearWarmupLR,
    MultiStepWarmupLR,
    PolynomialLR,
    PolynomialWarmupLR,
)
from cai.booster.lr_scheduler._torch import (
    CosineAnnealingLR,
    ExponentialLR,
    LambdaLR,
    MultiplicativeLR,
    MultiStepLR,
    OneCycleLR,
    StepLR,
)

__all__ = [
    "CosineAnnealingLR",
    "CosineAnnealingWarmupLR",
    "ExponentialLR",
    "FlatAnnealingLR",
    "FlatAnnealingWarmupLR",
    "LambdaLR",
    "LinearWarmupLR",
    "MultiStepLR",
    "MultiStepWarmupLR",
    "MultiplicativeLR",
    "OneCycleLR",
    "PolynomialLR",
    "PolynomialWarmupLR",
    "StepLR",
]
