"""A policy exported as a torch `parallelize_module` plan, for stacks built on torch's own tensor parallel.

Each submodule replacement of the policy becomes the DTensor style that shards the same weight the same way:

    tp_input_regions entry       EnterTPRegion()                          (one input-gradient all-reduce per region)
    Linear1D_Col                 ColwiseParallel()                        (gather_output: output Replicate)
    Linear1D_Row                 RowwiseParallel()                        (input_is_parallel=False: input Replicate)
    VocabParallelEmbedding1D     RowwiseParallel(input_layouts=Replicate())
    Embedding1D                  ColwiseParallel(output_layouts=Replicate())   (gather_output=False: Shard(-1))
    VocabParallelLMHead1D        ColwiseParallel(output_layouts=Replicate())   (the full logits; no vocab-parallel loss)

What torch's styles cannot express is refused with the reason rather than exported wrong: fused projections
(an even split of `[q; k; v]` would cut across the parts), heads that do not divide by tp (cai replicates kv
heads), attribute changes that would alter a value (heads per rank), and parameter hooks (Qwen3's per-head norm
gradients, which a rank's local use leaves partial).
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cai.shardformer._config import ShardConfig
from cai.shardformer._embedding import Embedding1D, VocabParallelEmbedding1D, VocabParallelLMHead1D
from cai.shardformer._linear import FusedLinear1D_Col, Linear1D_Col, Linear1D_Row
from cai.shardformer._policy import Policy, _get_path
from cai.shardformer.policies.auto_policy import get_autopolicy


def _tp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    if mesh.ndim == 1:
        return mesh
    if mesh.mesh_dim_names and "tp" in mesh.mesh_dim_names:
        return mesh["tp"]
    raise ValueError(
        f"tp_plan: a {mesh.ndim}-D DeviceMesh with axes {mesh.mesh_dim_names} has no 'tp' axis; name one axis "
        f"'tp' or pass mesh['<axis>']"
    )


@functools.cache
def _enter_tp_region_style() -> type:
    """`EnterTPRegion`, defined on first use: `import cai.shardformer` does not pay for importing torch's
    tensor-parallel package (seconds on a loaded machine) unless a plan is exported."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import ParallelStyle

    class EnterTPRegion(ParallelStyle):
        """The plan entry of a policy's `tp_input_regions` (see [Note: one all-reduce per region]): the module's input
        (`hidden_states`, or the first positional argument) becomes a replicated DTensor before the column layers
        inside read it, so their input gradients (partial sums) add up as one DTensor and are all-reduced once, where
        it leaves the region, instead of once per column layer. Megatron's two all-reduces per layer backward."""

        def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
            def enter(x):
                return (
                    x
                    if isinstance(x, DTensor)
                    else DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
                )

            def hook(mod, args, kwargs):
                if "hidden_states" in kwargs:
                    return args, {**kwargs, "hidden_states": enter(kwargs["hidden_states"])}
                if args:
                    return (enter(args[0]), *args[1:]), kwargs
                raise TypeError(f"{type(mod).__name__} is a tp input region but was called without an input")

            module.register_forward_pre_hook(hook, with_kwargs=True)
            return module

        def __repr__(self) -> str:
            return "EnterTPRegion()"

    return EnterTPRegion


def _style(target: Any, kwargs: dict[str, Any], tp: int, where: str):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if issubclass(target, FusedLinear1D_Col):
        raise NotImplementedError(
            f"tp_plan: {where} is a fused projection (FusedLinear1D_Col); torch's ColwiseParallel splits its rows "
            f"evenly across the parts. Split the projection, or shard with cai.shardformer.shard_model"
        )
    heads = kwargs.get("num_heads")
    if heads is not None and heads % tp:
        raise NotImplementedError(
            f"tp_plan: {where} has {heads} heads, which do not divide over tp={tp}; cai replicates them, torch's "
            f"styles cannot. Use a tp size that divides {heads}, or shard with cai.shardformer.shard_model"
        )
    if kwargs.get("seq_parallel_mode") is not None:
        raise NotImplementedError(
            f"tp_plan: {where} is sequence-parallel; the export covers tensor parallelism"
        )
    if issubclass(target, Linear1D_Col):
        return (
            ColwiseParallel(output_layouts=Replicate()) if kwargs.get("gather_output") else ColwiseParallel()
        )
    if issubclass(target, Linear1D_Row):
        parallel = kwargs.get("input_is_parallel", kwargs.get("parallel_input", True))
        return RowwiseParallel() if parallel else RowwiseParallel(input_layouts=Replicate())
    if issubclass(target, VocabParallelEmbedding1D):
        return RowwiseParallel(input_layouts=Replicate())
    if issubclass(target, Embedding1D):
        gather = kwargs.get("gather_output", True)
        return ColwiseParallel(output_layouts=Replicate() if gather else Shard(-1))
    if issubclass(target, VocabParallelLMHead1D):
        return ColwiseParallel(output_layouts=Replicate())
    raise NotImplementedError(
        f"tp_plan: {where} becomes {target.__name__}, which has no torch parallel style yet; shard with "
        f"cai.shardformer.shard_model"
    )


def tp_plan(model: nn.Module, mesh: DeviceMesh, *, policy: Policy | None = None) -> dict[str, Any]:
    """The policy for `model` as a plan for `torch.distributed.tensor.parallel.parallelize_module`: module
    path -> ParallelStyle, one entry per module the policy would replace. The model is not changed.

    Args:
        mesh: a 1-D DeviceMesh, or one with a "tp" axis (the plan is for that axis).
        policy: default the policy registered for the model's class.

    The plan shards what cai's layers shard, with torch's collectives: the policy's input regions (attention,
    MLP) become `EnterTPRegion` entries, so backward all-reduces once per region as cai's layers do; the lm_head
    returns the full logits (cai computes the loss vocab-parallel); there is no vocabulary padding (DTensor shards
    unevenly); dropout draws from the global RNG.

    Example:
        >>> from torch.distributed.tensor.parallel import parallelize_module
        >>> tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        >>> parallelize_module(model, tp, tp_plan(model, tp))
    """
    tp_mesh = _tp_mesh(mesh)
    tp = tp_mesh.size()
    policy = get_autopolicy(model) if policy is None else policy
    policy.set_model(model)
    # Padding to a multiple of 1 (that is, of tp) passes the vocabulary check; DTensor needs no padding.
    policy.set_shard_config(
        ShardConfig(tensor_parallel_process_group=tp_mesh.get_group(), make_vocab_size_divisible_by=1)
    )
    policy.preprocess()
    plan: dict[str, Any] = {}
    owners: dict[int, str] = {}
    descriptions = policy.module_policy()
    for name, module in model.named_modules():
        desc = descriptions.get(type(module)) or descriptions.get(type(module).__name__)
        if desc is None:
            continue
        where = name or type(model).__name__
        hooks = [fn for fn in desc.param_replacement or [] if not getattr(fn, "rng_only", False)]
        if hooks:
            raise NotImplementedError(
                f"tp_plan: the policy adds parameter hooks to {where} ({len(hooks)}, e.g. per-head norm gradients "
                f"summed over tp) that a torch plan cannot carry; shard with cai.shardformer.shard_model"
            )
        for sub in desc.sub_module_replacement or []:
            native = _get_path(module, sub.suffix)
            if native is None:
                if sub.ignore_if_not_exist:
                    continue
                raise AttributeError(f"tp_plan: {where}.{sub.suffix} does not exist")
            fqn = f"{name}.{sub.suffix}" if name else sub.suffix
            for p in native.parameters():
                if id(p) in owners:
                    raise NotImplementedError(
                        f"tp_plan: {fqn} and {owners[id(p)]} share a parameter (tied embeddings); torch's styles "
                        f"would shard it twice. Untie them, or shard with cai.shardformer.shard_model"
                    )
                owners[id(p)] = fqn
            plan[fqn] = _style(sub.target_module, sub.kwargs or {}, tp, fqn)
        for path in desc.tp_input_regions or []:
            plan[f"{name}.{path}" if name else path] = _enter_tp_region_style()()
        # After the layers: a layer that cannot be exported names the cause better than the attribute it needs.
        for path, value in (desc.attribute_replacement or {}).items():
            if _get_path(module, path) != value:
                raise NotImplementedError(
                    f"tp_plan: the policy sets {where}.{path} = {value!r} (now {_get_path(module, path)!r}); a "
                    f"torch plan cannot change attributes. Shard with cai.shardformer.shard_model"
                )
    return plan
