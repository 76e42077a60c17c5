"""Policies as data: for each module class (by class or class name), which submodules become which parallel
layer, which attributes change (heads per rank), and where activations enter the tp region.

Names follow Colossal-AI (`Policy`, `ModulePolicyDescription`, `SubModuleReplacementDescription`) so a policy
written for it reads the same here; `tp_input_regions` is cai's addition (see [Note: one all-reduce per region]).
"""

from __future__ import annotations

import dataclasses
import types
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from cai.shardformer._config import ShardConfig
from cai.shardformer._ops import copy_to_tp_region
from cai.shardformer._sequence import RingRegion, sequence_region


@dataclass(frozen=True)
class SubModuleReplacementDescription:
    """Replace the submodule at `suffix` (relative to the matched module) by
    `target_module.from_native_module(submodule, process_group=tp_group, **kwargs)`."""

    suffix: str
    target_module: Any
    kwargs: dict[str, Any] | None = None
    ignore_if_not_exist: bool = False


@dataclass(frozen=True)
class ModulePolicyDescription:
    """What happens to every module of one class.

    attribute_replacement: dotted attribute path (relative) -> new value, e.g. heads per rank.
    param_replacement: callables `fn(module)` run on the module.
    sub_module_replacement: submodules swapped for parallel layers.
    method_replacement: method name -> function bound to the module instance.
    tp_input_regions: relative paths of submodules whose input (`hidden_states`, or the first positional
        argument) enters the tp region once for all the column layers inside them. Under split_gather the
        region all-gathers the sequence on entry; under ring its column layers ring it themselves.
    """

    attribute_replacement: dict[str, Any] | None = None
    param_replacement: list[Callable] | None = None
    sub_module_replacement: list[SubModuleReplacementDescription] | None = None
    method_replacement: dict[str, Callable] | None = None
    tp_input_regions: list[str] | None = None


# [Note: one all-reduce per region]
# The input of q, k and v (and of gate and up) is one tensor. If each column layer put it into the tp region
# itself, backward would all-reduce three (two) partial input gradients; entering the region once at the
# attention (MLP) input sums the branches locally first and all-reduces once: Megatron's two all-reduces per
# transformer layer backward. The column layers are then built with `reduce_input_grad=False`.
def _enter_tp_region(group):
    def hook(module, args, kwargs):
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": copy_to_tp_region(kwargs["hidden_states"], group)}
        if args:
            return (copy_to_tp_region(args[0], group), *args[1:]), kwargs
        raise TypeError(
            f"{type(module).__name__} is a tp input region but was called without hidden_states or a "
            f"positional input; list it in tp_input_regions only if its forward takes one"
        )

    return hook


def reduce_param_grads(*paths: str, group=None) -> Callable[[nn.Module], None]:
    """A `param_replacement` entry: the parameters at `paths` (relative) are replicated on the tp ranks but each
    rank's use sees only its own heads (Qwen3's per-head q/k norms), so their gradients are all-reduced over
    `group` as they are produced."""

    def hook(grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    def apply(module: nn.Module) -> None:
        for path in paths:
            param = _get_path(module, path)
            if param is None:
                raise AttributeError(f"reduce_param_grads: {type(module).__name__} has no parameter {path}")
            param.register_hook(hook)

    return apply


class Policy(ABC):
    """A model family's sharding plan. Subclasses implement `config_sanity_check`, `preprocess`,
    `module_policy` (a dict from module class or class name to `ModulePolicyDescription`) and `postprocess`."""

    # The sequence-parallel modes this policy applies; optimize() refuses the others, naming these.
    sequence_parallel_modes: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.shard_config: ShardConfig | None = None
        self.model: nn.Module | None = None
        self.is_causal: bool | None = None

    def set_model(self, model: nn.Module) -> None:
        self.model = model

    def set_shard_config(self, shard_config: ShardConfig) -> None:
        self.shard_config = shard_config
        self.config_sanity_check()

    @property
    def pipeline_stage_manager(self):
        return self.shard_config.pipeline_stage_manager if self.shard_config else None

    @abstractmethod
    def config_sanity_check(self) -> None: ...

    @abstractmethod
    def preprocess(self) -> nn.Module: ...

    @abstractmethod
    def module_policy(self) -> dict[Any, ModulePolicyDescription]: ...

    @abstractmethod
    def postprocess(self) -> nn.Module: ...

    def sequence_parallel_attention(self) -> dict[str, str] | None:
        """For the all_to_all and ring_attn sequence-parallel modes: decoder-layer class name -> path of its
        attention submodule, which must call transformers' attention interface. None: not supported."""
        return None

    def get_shared_params(self) -> list[dict[int, nn.Parameter]]:
        """Parameters shared across pipeline stages; none without pipeline parallelism."""
        return []

    def append_or_create_submodule_replacement(
        self,
        description: SubModuleReplacementDescription | list[SubModuleReplacementDescription],
        policy: dict[Any, ModulePolicyDescription],
        target_key: Any,
    ) -> dict[Any, ModulePolicyDescription]:
        extra = description if isinstance(description, list) else [description]
        current = policy.get(target_key, ModulePolicyDescription())
        subs = [*(current.sub_module_replacement or []), *extra]
        policy[target_key] = dataclasses.replace(current, sub_module_replacement=subs)
        return policy

    def append_or_create_method_replacement(
        self, description: dict[str, Callable], policy: dict[Any, ModulePolicyDescription], target_key: Any
    ) -> dict[Any, ModulePolicyDescription]:
        current = policy.get(target_key, ModulePolicyDescription())
        methods = {**(current.method_replacement or {}), **description}
        policy[target_key] = dataclasses.replace(current, method_replacement=methods)
        return policy


def _set_path(root: nn.Module, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    obj = root
    for p in parents:
        obj = getattr(obj, p)
    setattr(obj, last, value)


def _keep_frozen(native: nn.Module, new: nn.Module) -> None:
    """A replaced layer's parameters train as the native layer's of the same names did: frozen stays frozen."""
    old = dict(native.named_parameters())
    for name, p in new.named_parameters():
        if name in old:
            p.requires_grad_(old[name].requires_grad)


def _get_path(root: nn.Module, path: str) -> Any:
    obj = root
    for p in path.split("."):
        obj = getattr(obj, p, None)
        if obj is None:
            return None
    return obj


def apply_module_policy(
    model: nn.Module, policy: dict[Any, ModulePolicyDescription], shard_config: ShardConfig
) -> None:
    """Apply a policy's descriptions to every module of `model` whose class (or class name) is a key."""
    group = shard_config.tensor_parallel_process_group
    sp_mode = shard_config.sequence_parallelism_mode if shard_config.enable_sequence_parallelism else None
    for name, module in list(model.named_modules()):
        desc = policy.get(type(module)) or policy.get(type(module).__name__)
        if desc is None:
            continue
        where = name or type(model).__name__
        for path, value in (desc.attribute_replacement or {}).items():
            _set_path(module, path, value)
        for fn in desc.param_replacement or []:
            fn(module)
        for method, fn in (desc.method_replacement or {}).items():
            setattr(module, method, types.MethodType(fn, module))
        for sub in desc.sub_module_replacement or []:
            native = _get_path(module, sub.suffix)
            if native is None:
                if sub.ignore_if_not_exist:
                    continue
                raise AttributeError(
                    f"policy for {type(module).__name__}: {where}.{sub.suffix} does not exist; fix the suffix "
                    f"or set ignore_if_not_exist=True"
                )
            new = sub.target_module.from_native_module(native, process_group=group, **(sub.kwargs or {}))
            _keep_frozen(native, new)
            _set_path(module, sub.suffix, new)
        for path in desc.tp_input_regions or []:
            region = _get_path(module, path)
            if region is None:
                raise AttributeError(f"policy for {type(module).__name__}: no submodule {where}.{path}")
            if sp_mode == "split_gather":  # the sequence is gathered once per region
                sequence_region(region, group)
            elif sp_mode == "ring":  # the region's column layers ring the sequence themselves
                RingRegion().install(region, group)
            else:
                region.register_forward_pre_hook(_enter_tp_region(group), with_kwargs=True)
