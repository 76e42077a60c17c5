"""LowLevelZeroPlugin: ZeRO-1/2 from cai-zero (sharded fp32 master weights, optimizer state, and at stage 2
gradients); the model stays whole on every rank in the working precision."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from cai.booster._compile import compile_fp8_blocks
from cai.booster._precision import check_precision, precision_dtype
from cai.booster._state import ModuleState, local_tensor
from cai.booster._wrappers import ModelWrapper, OptimizerWrapper
from cai.booster.plugin._base import (
    BoostContext,
    Boosted,
    Capabilities,
    DPPluginBase,
    param_names,
    rebind_optimizer,
)
from cai.booster.plugin._compat import LOW_LEVEL_ZERO_ARGS, config_from_kwargs
from cai.booster.plugin._torch_ddp import place_replicated
from cai.mesh import LocalShard, ShardSpec, advance_step

if TYPE_CHECKING:
    from cai.zero import LossScaleConfig, ZeroConfig

__all__ = ["LowLevelZeroConfig", "LowLevelZeroPlugin"]

_PRECISIONS = ("fp32", "fp16", "bf16")


# cai.zero is imported when a config is built, not when cai.booster is.
def _zero_config() -> ZeroConfig:
    from cai.zero import ZeroConfig

    return ZeroConfig()


def _loss_scale_config() -> LossScaleConfig:
    from cai.zero import LossScaleConfig

    return LossScaleConfig()


@dataclass(frozen=True, kw_only=True)
class LowLevelZeroConfig:
    """Everything ``LowLevelZeroPlugin`` needs: cai-zero's ``ZeroConfig`` plus what the plugin owns.

    Args:
        zero: sharding stage, buckets, communication, clipping and offload (``cai.zero.ZeroConfig``).
        precision: working precision of the model, ``"bf16"`` (default), ``"fp16"`` or ``"fp32"``; fp32 master
            weights are kept in the optimizer whatever this is.
        loss_scale: dynamic loss scaling, used with ``"fp16"`` only (``cai.zero.LossScaleConfig``).
        cast_inputs: cast floating-point forward inputs to the working precision.
        use_fp8: run the model's linear layers (not the output head) in FP8 with dynamic scales
            (``cai.kernels.convert_to_fp8``, at ``boost()``; tensor-wise, or what an earlier
            ``convert_to_fp8(model, recipe=...)`` chose); the fp32 masters are unchanged. The converted layers
            keep their weights in FP8 between optimizer steps where a weight is read more than once a step
            (checkpointed compiled blocks, eager layers; one byte a weight element; ``keep_weights`` in
            ``convert_to_fp8``). On GPUs with FP8 tensor cores the decoder blocks are compiled too
            (``cai.booster.compile_blocks``).

    Example::

        LowLevelZeroPlugin(config=LowLevelZeroConfig(zero=ZeroConfig(stage=2, cpu_offload=True), precision="bf16"))
    """

    zero: ZeroConfig = field(default_factory=_zero_config)
    precision: str = "bf16"
    loss_scale: LossScaleConfig = field(default_factory=_loss_scale_config)
    cast_inputs: bool = True
    use_fp8: bool = False

    def __post_init__(self) -> None:
        from cai.zero import LossScaleConfig, ZeroConfig

        check_precision(self.precision, _PRECISIONS, owner="LowLevelZeroPlugin")
        for name, cls in (("zero", ZeroConfig), ("loss_scale", LossScaleConfig)):
            value = getattr(self, name)
            if not isinstance(value, cls):
                raise TypeError(
                    f"LowLevelZeroConfig: {name}={value!r} is not a cai.zero.{cls.__name__}; pass "
                    f"{name}={cls.__name__}(...)"
                )
        # ZeroConfig also takes stage 0 (no sharding), which exists for the hybrid parallel plugin; Colossal-AI's
        # LowLevelZeroPlugin takes 1 or 2 only.
        if self.zero.stage not in (1, 2):
            raise ValueError(
                f"LowLevelZeroConfig: zero.stage={self.zero.stage!r} is not supported; use 1 or 2 (stage 0, no "
                "sharding, is for the hybrid parallel plugin)"
            )


class LowLevelZeroPlugin(DPPluginBase):
    """ZeRO stage 1 or 2 over the whole world (cai-zero's ``ZeroOptimizer``); the plugin controls precision.

    Takes either ``config=LowLevelZeroConfig(...)`` or Colossal-AI's keyword arguments, with its defaults:
    ``stage=1``, ``precision="fp16"``, the loss scaler (``initial_scale=2**32, min_scale=1, growth_factor=2,
    backoff_factor=0.5, growth_interval=1000, hysteresis=2, max_scale=2**32``), ``max_norm=0.0`` (global gradient
    clipping inside ``step``), ``reduce_bucket_size_in_m=12``, ``communication_dtype=None``,
    ``overlap_communication=True``, ``overlap_allgather=False``, ``cpu_offload=False``, ``cast_inputs=True``.
    ``use_fp8=True`` runs the linear layers in FP8; ``fp8_communication=True`` reduces gradients in FP8 (the post-step
    parameter all-gathers stay in the working dtype; ``ZeroConfig.fp8_communication``). ``verbose`` is ignored; ``norm_type`` other
    than 2.0, ``master_weights=False`` and ``extra_dp_size > 1`` raise. The tables are in ``cai/booster/plugin/_compat.py``; a keyword that disagrees with ``config=`` raises.

    Example::

        booster = Booster(plugin=LowLevelZeroPlugin(stage=2, precision="bf16", max_norm=1.0))
    """

    LORA = True
    NO_SYNC = True

    def __init__(self, *args: Any, config: LowLevelZeroConfig | None = None, **kwargs: Any) -> None:
        self.config: LowLevelZeroConfig = config_from_kwargs(
            LOW_LEVEL_ZERO_ARGS, LowLevelZeroConfig, config, LOW_LEVEL_ZERO_ARGS.by_name(args, kwargs)
        )

    @property
    def zero_config(self) -> ZeroConfig:
        return self.config.zero

    @property
    def stage(self) -> int:
        return self.config.zero.stage

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(precisions=_PRECISIONS, control_precision=True, no_sync=True, lora=self.LORA)

    @property
    def precision(self) -> str:
        return self.config.precision

    def configure(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        criterion: Callable | None,
        dataloader: Any,
        lr_scheduler: Any,
        ctx: BoostContext,
    ) -> Boosted:
        from cai.zero import ZeroOptimizer

        if self.config.use_fp8:
            from cai.kernels import convert_to_fp8

            # the bf16 weights are whole on every rank: one more byte an element keeps them in FP8 between steps
            convert_to_fp8(model, keep_weights=True)
            compile_fp8_blocks(model, ctx.device)
        names = param_names(model)
        place_replicated(model, ctx)
        dtype = precision_dtype(self.precision)
        model.to(dtype)
        if self.config.cast_inputs and dtype != torch.float32:
            _cast_floating_inputs(model, dtype)
        boosted_model = ModelWrapper(model)
        if optimizer is None:
            return boosted_model, None, criterion, dataloader, lr_scheduler
        rebind_optimizer(optimizer, names, dict(model.named_parameters(remove_duplicate=False)))
        loss_scale = self.config.loss_scale if self.precision == "fp16" else None
        zo = ZeroOptimizer(optimizer, model=model, config=self.config.zero, loss_scale=loss_scale)
        boosted_opt = ZeroOptimizerWrapper(zo)
        boosted_opt.boosted_model = boosted_model
        return boosted_model, boosted_opt, criterion, dataloader, lr_scheduler

    @contextlib.contextmanager
    def no_sync(self, model: ModelWrapper, optimizer: OptimizerWrapper | None = None) -> Iterator[None]:
        if optimizer is None:
            raise ValueError("LowLevelZeroPlugin.no_sync: pass the boosted optimizer (gradients live in it)")
        with optimizer.no_sync():
            yield

    def model_state(self, model: ModelWrapper) -> Any:
        optimizer = getattr(model, "_cai_zero", None)
        if optimizer is None:
            return ModuleState(model.unwrap())
        return ZeroModelState(optimizer, model.unwrap())

    def optimizer_state(self, optimizer: OptimizerWrapper, model: ModelWrapper) -> Any:
        return optimizer.unwrap()

    def prepare_optimizer_load(self, optimizer: OptimizerWrapper) -> None:
        # cai-zero creates its state lazily; its loader does the same, but only after the key check.
        optimizer.unwrap().ensure_state()


class ZeroOptimizerWrapper(OptimizerWrapper):
    """The boosted optimizer over a ``ZeroOptimizer``: gradients live in its buckets, not in ``param.grad``."""

    def __init__(self, zo: Any) -> None:
        super().__init__(zo.optim)
        self.zo = zo
        self.boosted_model: ModelWrapper | None = None

    def __setattr__(self, key: str, value: Any) -> None:
        super().__setattr__(key, value)
        if key == "boosted_model" and value is not None:
            object.__setattr__(value, "_cai_zero", self.zo)

    @property
    def scaler(self) -> Any:  # type: ignore[override]
        return self.zo.scaler

    @scaler.setter
    def scaler(self, value: Any) -> None:
        pass  # the ZeroOptimizer owns its loss scaler

    def backward(self, loss: torch.Tensor, inputs: Any = None, retain_graph: bool = False) -> None:
        self.zo.backward(loss, inputs=inputs, retain_graph=retain_graph)

    def step(self, *args: Any, **kwargs: Any) -> None:
        advance_step()  # the step that collective timeouts report
        self.zo.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zo.zero_grad(set_to_none=set_to_none)

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0, **_: Any) -> torch.Tensor:
        if norm_type != 2.0:
            raise ValueError(f"clip_grad_by_norm: norm_type={norm_type} is not supported under ZeRO; use 2.0")
        return self.zo.clip_grad_norm(max_norm)

    def get_grad_norm(self, norm_type: float = 2.0, **_: Any) -> float:
        if norm_type != 2.0:
            raise ValueError(f"get_grad_norm: norm_type={norm_type} is not supported under ZeRO; use 2.0")
        return float(self.zo.grad_norm())

    def clip_grad_by_value(self, clip_value: float, *args: Any, **kwargs: Any) -> None:
        raise ValueError("clip_grad_by_value is not supported under ZeRO; use clip_grad_by_norm or max_norm=")

    def state_dict(self) -> dict[str, Any]:
        return self.zo.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.zo.load_state_dict(state)

    def unwrap(self) -> Any:
        return self.zo

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.zo.no_sync():
            yield


class ZeroModelState:
    """The model's state under ZeRO: fp32 master pieces from the optimizer, plus persistent buffers."""

    def __init__(self, zo: Any, module: nn.Module) -> None:
        self.zo = zo
        self.module = module

    def _buffers(self) -> dict[str, torch.Tensor]:
        params = set(dict(self.module.named_parameters()))
        return {n: t for n, t in ModuleState(self.module).tensors().items() if n not in params}

    def sharded_state_dict(self) -> dict[str, LocalShard]:
        out = dict(self.zo.model_sharded_state_dict())
        for n, b in self._buffers().items():
            out[n] = LocalShard(local_tensor(b).detach(), ShardSpec.full(tuple(b.shape)))
        return out

    def load_sharded_state_dict(self, read: Any) -> None:
        self.zo.load_model_sharded_state_dict(read)
        with torch.no_grad():
            for n, b in self._buffers().items():
                b.copy_(read(n, ShardSpec.full(tuple(b.shape)), b.dtype))


def _cast_floating_inputs(module: nn.Module, dtype: torch.dtype) -> None:
    forward = module.forward

    def cast(x: Any) -> Any:
        return x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x

    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return forward(*(cast(a) for a in args), **{k: cast(v) for k, v in kwargs.items()})

    module.forward = wrapped  # type: ignore[method-assign]
