"""TorchDDPPlugin: torch DistributedDataParallel, with Booster-level mixed precision."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from cai.booster._lazy import is_lazy, materialize
from cai.booster._precision import DynamicLossScaler, autocast_forward, fp32_master_weights
from cai.booster._pretrained import load_pretrained_into
from cai.booster._replicas import broadcast_tensors
from cai.booster._state import ModuleState
from cai.booster._wrappers import ModelWrapper, OptimizerWrapper
from cai.booster.plugin._base import (
    BoostContext,
    Boosted,
    Capabilities,
    DPPluginBase,
    param_names,
    rebind_optimizer,
)

__all__ = ["DDPConfig", "TorchDDPPlugin"]


@dataclass(frozen=True, kw_only=True)
class DDPConfig:
    """Arguments passed to ``torch.nn.parallel.DistributedDataParallel`` (same names)."""

    broadcast_buffers: bool = True
    bucket_cap_mb: float = 25
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False

    def __post_init__(self) -> None:
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"TorchDDPPlugin: bucket_cap_mb {self.bucket_cap_mb} must be > 0 (default 25)")


class TorchDDPPlugin(DPPluginBase):
    """Data parallelism with torch DDP; precision comes from ``Booster(mixed_precision=...)``.

    Args (Colossal-AI names): ``broadcast_buffers=True``, ``bucket_cap_mb=25``, ``find_unused_parameters=False``,
    ``check_reduction=False`` (ignored by torch), ``gradient_as_bucket_view=False``, ``static_graph=False``,
    ``fp8_communication=False`` (not supported: raises).

    Example::

        booster = Booster(plugin=TorchDDPPlugin(), mixed_precision="bf16")
    """

    LORA = True
    NO_SYNC = True
    CONTROLS_PRECISION = False

    def __init__(
        self,
        broadcast_buffers: bool = True,
        bucket_cap_mb: float = 25,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        fp8_communication: bool = False,
    ) -> None:
        if fp8_communication:
            raise ValueError(
                "TorchDDPPlugin: fp8_communication=True is not supported; use fp8_communication=False"
            )
        self.config = DDPConfig(
            broadcast_buffers=broadcast_buffers,
            bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
        )

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            precisions=("fp32", "fp16", "bf16"), control_precision=False, no_sync=True, lora=self.LORA
        )

    def configure(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        criterion: Callable | None,
        dataloader: Any,
        lr_scheduler: Any,
        ctx: BoostContext,
    ) -> Boosted:
        names = param_names(model)
        place_replicated(model, ctx)
        if optimizer is not None:
            rebind_optimizer(optimizer, names, dict(model.named_parameters(remove_duplicate=False)))
        mp = ctx.mixed_precision
        # fp32 weights for the optimizer; compute in the dtype asked for, else in the one the model came in. Asked
        # for fp32, the frozen parameters become fp32 too (nothing casts them then).
        asked_fp32 = mp is not None and mp.precision == "fp32"
        loaded = fp32_master_weights(model, optimizer, frozen=asked_fp32, owner=self.name)
        if mp is None:
            compute = loaded
        else:
            compute = None if asked_fp32 else mp.dtype
        if compute is not None:
            autocast_forward(model, compute)
        wrapped: nn.Module = model
        if dist.is_initialized() and dist.get_world_size() > 1:
            if ctx.device.type == "cuda":
                model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
            c = self.config
            kwargs = (
                {} if c.broadcast_buffers else {"broadcast_buffers": False}
            )  # torch deprecates the True default
            wrapped = DDP(
                model,
                device_ids=[ctx.device] if ctx.device.type == "cuda" else None,
                bucket_cap_mb=c.bucket_cap_mb,
                find_unused_parameters=c.find_unused_parameters,
                gradient_as_bucket_view=c.gradient_as_bucket_view,
                static_graph=c.static_graph,
                **kwargs,
            )
        boosted_model = ModelWrapper(wrapped, unwrapped=model)
        boosted_opt = None
        if optimizer is not None:
            scaler = DynamicLossScaler(mp.scaler) if mp is not None and mp.uses_scaler else None
            boosted_opt = OptimizerWrapper(optimizer, scaler=scaler)
            boosted_opt.boosted_model = boosted_model
        return boosted_model, boosted_opt, criterion, dataloader, lr_scheduler

    @contextlib.contextmanager
    def no_sync(self, model: ModelWrapper, optimizer: OptimizerWrapper | None = None) -> Iterator[None]:
        inner = model.module
        with inner.no_sync() if isinstance(inner, DDP) else contextlib.nullcontext():
            yield


def place_replicated(model: nn.Module, ctx: BoostContext, device: torch.device | None = None) -> None:
    """Put a whole (replicated) model on ``device`` (default ``ctx.device``): materialise it if lazy, then load
    pretrained weights."""
    device = device or ctx.device
    random_init = is_lazy(model) and ctx.pretrained is None
    if is_lazy(model):
        materialize(model, device, init=ctx.pretrained is None)
    model.to(device)
    if random_init and dist.is_initialized() and dist.get_world_size() > 1:
        # Replicas must start equal even if the ranks' RNGs differ; once, at boost time (the check before
        # configure() skipped these parameters while they were lazy: [Note: replicas agree at boost]).
        broadcast_tensors([*model.parameters(), *model.buffers()], src=0, group=None)
    if ctx.pretrained is not None:
        load_pretrained_into(ModuleState(model), ctx.pretrained)
