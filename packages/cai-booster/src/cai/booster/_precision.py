"""Mixed precision: typed configs, the dynamic loss scaler, and autocast for plugins that leave precision to
the Booster.

[Note: where precision lives]
A plugin either *controls* precision (FSDP2 through ``MixedPrecisionPolicy``, ZeRO and Gemini through their
fp32 master weights) or leaves it to the Booster (TorchDDP, no plugin). In the second case the model keeps fp32
parameters, which are the master weights, and its forward runs under ``torch.autocast``; fp16 adds a dynamic
loss scaler in the optimizer wrapper. bf16 never uses a loss scaler.

[Note: fp32 master weights whatever the load dtype]
Where the parameters are the master weights (TorchDDP, no plugin, FSDP2's sharded parameters), a model loaded in
bf16 or fp16 would take its optimizer steps in that dtype: an update below half a unit in the last place of a
weight is lost, so training drifts from what the same run does with fp32 weights, with no error. ``boost()``
therefore turns those parameters into fp32 ones, in place (the same Parameter objects, so the optimizer keeps
them; optimizer state already made is cast with them). Compute keeps the dtype asked for, and where none was
asked for, the dtype the model came in: TorchDDP then runs its forward under autocast in that dtype, so a bf16
model computes in bf16 as before and steps fp32 weights. Memory: 4 bytes a weight for the weight and 4 for its
gradient, as for a model built in fp32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from cai.kernels.optim import DynamicLossScaler, LossScaleConfig
from cai.mesh import get_dist_logger

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


# One loss scaler for every plugin (cai.kernels'); ``LossScalerConfig`` is this package's name for its config.
LossScalerConfig = LossScaleConfig


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


def fp32_master_weights(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *, frozen: bool, owner: str
) -> torch.dtype | None:
    """Make ``model``'s bf16/fp16 parameters fp32 in place ([Note: fp32 master weights whatever the load dtype]):
    the trainable ones, and with ``frozen`` the frozen ones too. Returns the low-precision dtype the trainable
    parameters came in (bf16 where both occur), or None when none did (nothing is changed then)."""
    low = (torch.bfloat16, torch.float16)
    params = list({id(p): p for p in model.parameters()}.values())
    came_in = {p.dtype for p in params if p.requires_grad and p.dtype in low}
    if not came_in:
        return None
    changed = 0
    for p in params:
        if p.dtype not in low or not (frozen or p.requires_grad):
            continue
        old = p.dtype
        p.data = p.data.float()
        state = optimizer.state.get(p) if optimizer is not None else None
        for key, value in (state or {}).items():
            if isinstance(value, torch.Tensor) and value.dtype == old:
                state[key] = value.float()
        changed += p.numel()
    loaded = torch.bfloat16 if torch.bfloat16 in came_in else torch.float16
    get_dist_logger().info(
        f"{owner}: the model's parameters came in {loaded}; {changed / 1e6:.1f}M of them are fp32 now, so the "
        "optimizer steps fp32 master weights (see [Note: fp32 master weights whatever the load dtype])",
        ranks=[0],
    )
    return loaded


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
