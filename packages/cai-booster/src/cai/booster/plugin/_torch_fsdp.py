"""TorchFSDPPlugin on FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters sharded on dim 0 as DTensors."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cai.booster._lazy import initialise, is_lazy
from cai.booster._precision import DynamicLossScaler, check_precision, fp32_master_weights, precision_dtype
from cai.booster._pretrained import load_pretrained_into
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

__all__ = ["FSDPConfig", "TorchFSDPPlugin"]

_PRECISIONS = ("fp32", "fp16", "bf16")
_STRATEGIES = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}


@dataclass(frozen=True, kw_only=True)
class FSDPConfig:
    """How the plugin applies ``fully_shard``.

    Attributes:
        precision: compute dtype of the gathered parameters; master weights stay fp32.
        reduce_precision: dtype gradients are reduce-scattered in (default fp32, whatever ``precision`` is).
        reshard_after_forward: free gathered parameters after forward (ZeRO-3) or keep them until backward.
        cpu_offload: keep sharded parameters, gradients and optimizer state on the CPU (``CPUOffloadPolicy``).
        wrap_module_names: class names of the submodules sharded as their own unit (one all-gather each); None
            means the model's ``_no_split_modules`` (Hugging Face decoder layers), else every ``nn.ModuleList`` item.
    """

    precision: str = "fp32"
    reduce_precision: str = "fp32"
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    wrap_module_names: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        check_precision(self.precision, _PRECISIONS, owner="TorchFSDPPlugin")
        check_precision(self.reduce_precision, _PRECISIONS, owner="TorchFSDPPlugin (reduce_precision)")


class TorchFSDPPlugin(DPPluginBase):
    """Fully sharded data parallelism with FSDP2; the plugin controls precision.

    Args: ``precision="fp32"`` (or ``"bf16"``/``"fp16"``: compute dtype; fp16 adds a loss scaler),
    ``reshard_after_forward=True``, ``wrap_module_names=None`` (see ``FSDPConfig``), and Colossal-AI's names:
    ``sharding_strategy`` (``"FULL_SHARD"``/``"SHARD_GRAD_OP"`` or the torch enum), ``cpu_offload`` (bool or
    ``CPUOffload``; needs CUDA), ``mixed_precision`` (a torch FSDP ``MixedPrecision``; its ``param_dtype`` sets
    ``precision`` and its ``reduce_dtype`` the gradients' reduction dtype, fp32 unless given; ``buffer_dtype`` and
    ``keep_low_precision_grads`` raise), ``backward_prefetch`` (FSDP2 always prefetches; ignored with a warning),
    ``sync_module_states`` (accepted: ``boost()`` always gives every rank rank 0's weights), ``auto_wrap_policy``
    (a ``ModuleWrapPolicy`` or a ``transformer_auto_wrap_policy`` partial: its classes become
    ``wrap_module_names``; other policies raise).
    ``process_group``, ``ignored_modules``, ``param_init_fn`` and ``fp8_communication`` are FSDP1 features and raise.
    """

    LORA = False
    NO_SYNC = True

    def __init__(
        self,
        process_group: Any = None,
        sharding_strategy: Any = None,
        cpu_offload: Any = None,
        auto_wrap_policy: Any = None,
        backward_prefetch: Any = None,
        mixed_precision: Any = None,
        ignored_modules: Any = None,
        param_init_fn: Any = None,
        sync_module_states: bool = False,
        fp8_communication: bool = False,
        *,
        precision: str | None = None,
        reshard_after_forward: bool | None = None,
        wrap_module_names: tuple[str, ...] | list[str] | None = None,
    ) -> None:
        if auto_wrap_policy is not None:
            from_policy = _wrap_classes(auto_wrap_policy)
            if wrap_module_names is not None and tuple(wrap_module_names) != from_policy:
                raise ValueError(
                    f"TorchFSDPPlugin: auto_wrap_policy wraps {list(from_policy)}, wrap_module_names="
                    f"{list(wrap_module_names)}; give one of them"
                )
            wrap_module_names = from_policy
        unsupported = {
            "process_group": process_group,
            "ignored_modules": ignored_modules,
            "param_init_fn": param_init_fn,
        }
        for key, value in unsupported.items():
            if value is not None:
                raise ValueError(
                    f"TorchFSDPPlugin: {key}={value!r} is an FSDP1 option that FSDP2 does not have; leave it None "
                    "(use wrap_module_names=(...) to choose the sharded submodules, and LazyInitContext for init)"
                )
        # sync_module_states=True is what boost() always does (rank 0's weights go to every rank), so it is accepted.
        if fp8_communication:
            raise ValueError("TorchFSDPPlugin: fp8_communication=True is not supported; leave it False")
        if backward_prefetch is not None:
            warnings.warn(
                "TorchFSDPPlugin: backward_prefetch is ignored; FSDP2 prefetches by default", stacklevel=2
            )
        strategy = getattr(sharding_strategy, "name", sharding_strategy)
        if strategy is not None and strategy not in _STRATEGIES:
            raise ValueError(
                f"TorchFSDPPlugin: sharding_strategy {strategy!r} is not supported; use one of {list(_STRATEGIES)} "
                "(NO_SHARD: use TorchDDPPlugin)"
            )
        if reshard_after_forward is None:
            reshard_after_forward = _STRATEGIES.get(strategy, True)
        elif strategy is not None and _STRATEGIES[strategy] != reshard_after_forward:
            raise ValueError(
                f"TorchFSDPPlugin: sharding_strategy={strategy!r} conflicts with reshard_after_forward="
                f"{reshard_after_forward}; give one of them"
            )
        reduce_precision = "fp32"
        if mixed_precision is not None:
            names = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", None: "fp32"}
            mp_name = names.get(getattr(mixed_precision, "param_dtype", None))
            # reduce_dtype=None reduces in fp32 (FSDP1 took param_dtype): an explicit one is what a user asked for
            reduce_precision = names.get(getattr(mixed_precision, "reduce_dtype", None))
            if mp_name is None or reduce_precision is None:
                raise ValueError(
                    f"TorchFSDPPlugin: mixed_precision={mixed_precision!r}: param_dtype and reduce_dtype must be "
                    "torch.float32, torch.bfloat16, torch.float16 or None"
                )
            if getattr(mixed_precision, "buffer_dtype", None) is not None:
                raise ValueError(
                    "TorchFSDPPlugin: mixed_precision.buffer_dtype is an FSDP1 option; FSDP2 keeps buffers in the "
                    "model's dtype: leave it None and cast the buffers before boost()"
                )
            if getattr(mixed_precision, "keep_low_precision_grads", False):
                raise ValueError(
                    "TorchFSDPPlugin: mixed_precision.keep_low_precision_grads=True is not supported; gradients "
                    "land on the fp32 sharded parameters"
                )
            if precision is not None and precision != mp_name:
                raise ValueError(
                    f"TorchFSDPPlugin: precision={precision!r} conflicts with mixed_precision.param_dtype "
                    f"({mp_name}); give one of them"
                )
            precision = mp_name
        offload = bool(getattr(cpu_offload, "offload_params", cpu_offload))
        self.config = FSDPConfig(
            precision=precision or "fp32",
            reduce_precision=reduce_precision,
            reshard_after_forward=reshard_after_forward,
            cpu_offload=offload,
            wrap_module_names=tuple(wrap_module_names) if wrap_module_names is not None else None,
        )

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(precisions=_PRECISIONS, control_precision=True, no_sync=True, lora=self.LORA)

    @property
    def precision(self) -> str:
        return self.config.precision

    def check_device(self, device: torch.device) -> None:
        # FSDP2's CPUOffloadPolicy moves shards between the host and an accelerator (pinned copies, streams); with
        # the model on the CPU there is nothing to offload and torch fails or hangs inside the first collective.
        if self.config.cpu_offload and device.type != "cuda":
            raise ValueError(
                f"TorchFSDPPlugin: cpu_offload=True needs CUDA (it keeps the shards on the host and computes on the "
                f"GPU), but the Booster's device is {device.type!r}"
                + ("" if torch.cuda.is_available() else " and CUDA is not available")
                + "; use cpu_offload=False (on the CPU the parameters are on the host already)"
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
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        if not dist.is_initialized():
            raise RuntimeError(
                "TorchFSDPPlugin needs torch.distributed initialised (cai.mesh.launch_from_torch)"
            )
        c = self.config
        names = param_names(model)
        lazy = is_lazy(model)
        if not lazy:
            model.to(ctx.device)
            # the sharded parameters are the master weights (compute takes c.precision's copies); frozen ones too,
            # so that each unit holds one dtype
            fp32_master_weights(model, optimizer, frozen=True, owner=self.name)
        mesh = init_device_mesh(ctx.device.type, (dist.get_world_size(),))
        dtype = precision_dtype(c.precision)
        kwargs = {
            "mesh": mesh,
            "reshard_after_forward": c.reshard_after_forward,
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=dtype, reduce_dtype=precision_dtype(c.reduce_precision)
            ),
            "offload_policy": CPUOffloadPolicy() if c.cpu_offload else OffloadPolicy(),
        }
        # Inner units first, then the root: each unit is one all-gather in forward and one reduce-scatter in
        # backward; the root holds what is left (embeddings, final norm, a tied lm_head).
        for unit in _wrap_units(model, c.wrap_module_names):
            fully_shard(unit, **kwargs)
        fully_shard(model, **kwargs)
        if lazy:
            _materialise_shards(model, ctx)
        elif ctx.pretrained is not None:
            load_pretrained_into(ModuleState(model), ctx.pretrained)
        if optimizer is not None:
            rebind_optimizer(optimizer, names, dict(model.named_parameters(remove_duplicate=False)))
        boosted_model = ModelWrapper(model)
        boosted_opt = None
        if optimizer is not None:
            scaler = DynamicLossScaler() if c.precision == "fp16" else None
            boosted_opt = OptimizerWrapper(optimizer, scaler=scaler)
            boosted_opt.boosted_model = boosted_model
        return boosted_model, boosted_opt, criterion, dataloader, lr_scheduler

    @contextlib.contextmanager
    def no_sync(self, model: ModelWrapper, optimizer: OptimizerWrapper | None = None) -> Iterator[None]:
        # Gradients of unsynchronised micro-batches stay unsharded and local; the next synchronised backward
        # reduce-scatters their sum.
        module = model.unwrap()
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)

    @contextlib.contextmanager
    def gathered(self, model: ModelWrapper) -> Iterator[None]:
        # Every unit all-gathers once and stays unsharded: its forwards find it so and gather nothing. On exit
        # the units reshard and take back the plugin's setting (the root's is False, as FSDP sets it itself).
        from torch.distributed.fsdp import FSDPModule

        root = model.unwrap()
        units = [m for m in root.modules() if isinstance(m, FSDPModule)]
        root.set_reshard_after_forward(False, recurse=True)
        try:
            for unit in units:
                unit.unshard()
            yield
        finally:
            for unit in units:
                keep = unit is root or not self.config.reshard_after_forward
                unit.set_reshard_after_forward(not keep, recurse=False)
                unit.reshard()


def _wrap_classes(policy: Any) -> tuple[str, ...]:
    """The class names an FSDP1 wrap policy wraps: ``ModuleWrapPolicy(classes)`` or
    ``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=classes)``."""
    classes = getattr(policy, "_module_classes", None)
    if (
        classes is None
        and getattr(getattr(policy, "func", None), "__name__", "") == "transformer_auto_wrap_policy"
    ):
        classes = policy.keywords.get("transformer_layer_cls")
    if not classes:
        raise ValueError(
            f"TorchFSDPPlugin: auto_wrap_policy={policy!r} is not supported; FSDP2 shards whole submodules: pass "
            "ModuleWrapPolicy({LayerClass}), functools.partial(transformer_auto_wrap_policy, "
            "transformer_layer_cls={LayerClass}), or wrap_module_names=('LayerClass',)"
        )
    return tuple(sorted(c.__name__ for c in classes))


def _wrap_units(model: nn.Module, class_names: tuple[str, ...] | None) -> list[nn.Module]:
    if class_names is None:
        class_names = tuple(getattr(model, "_no_split_modules", None) or ())
    if class_names:
        units = [m for m in model.modules() if type(m).__name__ in class_names and m is not model]
        if not units:
            raise ValueError(
                f"TorchFSDPPlugin: no submodule of {type(model).__name__} has a class in wrap_module_names="
                f"{list(class_names)}; give class names that occur in the model"
            )
        return units
    return [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]


def _materialise_shards(model: nn.Module, ctx: BoostContext) -> None:
    """Allocate only this rank's shards of a meta model, then fill them from pretrained files or initialisers."""
    buffers = {n: b for n, b in model.named_buffers()}
    model.to_empty(device=ctx.device)
    # to_empty also emptied the (real) buffers; they were computed in __init__, so put them back.
    for name, buf in buffers.items():
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        owner._buffers[attr] = buf.to(ctx.device)
    if ctx.pretrained is not None:
        load_pretrained_into(ModuleState(model), ctx.pretrained)
    else:
        initialise(model, [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))])
