"""MoeHybridParallelPlugin: HybridParallelPlugin with expert parallelism for mixture-of-experts models.

[Note: expert and dense gradients]
The mesh gains the ``ep`` axis (cai.mesh's ParallelDims: ``dp x ep`` ranks are the data-parallel replicas of the
dense weights, Colossal-AI's ``dp_size``; ``dp`` alone is its ``moe_dp_size``). cai-shardformer splits every MoE
block's experts over ep and sends tokens to them by all-to-all; an expert is owned by one ep rank, which already
receives the gradient of every ep rank's tokens, scaled to the mean over the ep ranks' losses ([Note: expert
gradients] in cai-shardformer). So cai-zero averages and shards the dense weights over ``dp x ep`` and the experts
over ``dp`` only (``reduce_groups``). The gradient norm: at ZeRO stages 1 and 2 the shards are summed over
``dp x ep``, where an expert's other ep ranks hold other experts, so each piece counts once; at stage 0 every rank
holds whole gradients, so ep joins the norm groups and every dense weight, copied on each ep rank, counts 1/ep.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from cai.booster.plugin._compat import MOE_HYBRID_ARGS
from cai.booster.plugin._hybrid import HybridParallelConfig, HybridParallelPlugin

__all__ = ["MoeHybridParallelConfig", "MoeHybridParallelPlugin"]


@dataclass(frozen=True, kw_only=True)
class MoeHybridParallelConfig(HybridParallelConfig):
    """``HybridParallelConfig`` plus ``ep_size``, the expert-parallel size (a factor of the world: the dense
    weights' data-parallel size is ``dp x ep``). Sequence parallelism runs over the tp group only
    (``"split_gather"`` or ``"ring"``)."""

    ep_size: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = "MoeHybridParallelPlugin"
        if not isinstance(self.ep_size, int) or isinstance(self.ep_size, bool) or self.ep_size < 1:
            raise ValueError(f"{owner}: ep_size={self.ep_size!r} must be a positive int")
        if self.sp_size > 1:
            raise ValueError(
                f"{owner}: sp_size={self.sp_size} (a sequence-parallel axis of its own) is not supported with "
                "experts; use sequence_parallelism_mode='split_gather' or 'ring' over the tp group (sp_size=1)"
            )

    def dims(self, world_size: int | None = None) -> Any:
        from cai.mesh import ParallelDims

        return ParallelDims(dp=-1, pp=self.pp_size, tp=self.tp_size, ep=self.ep_size, world_size=world_size)


class MoeHybridParallelPlugin(HybridParallelPlugin):
    """HybridParallelPlugin plus expert parallelism (see [Note: expert and dense gradients]).

    Takes ``config=MoeHybridParallelConfig(...)`` or Colossal-AI's keywords: those of HybridParallelPlugin plus
    ``ep_size``; ``moe_dp_outside`` is accepted and ignored (the mesh order is fixed). The experts of each MoE
    block are split over ep (their count must divide by ``ep_size``); routing, the load-balancing loss and the
    shared experts stay the model's own. Checkpoints store every expert under its global index in the Hugging
    Face layout, so they load at any ep size, in one process and with ``from_pretrained``.

    Example::

        plugin = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=4, zero_stage=1, precision="bf16")
    """

    _GROUPS: tuple = ("pp", "dp", "ep", "sp", "tp", ("dp", "ep"))

    _ARGS = MOE_HYBRID_ARGS
    _CONFIG = MoeHybridParallelConfig
    config: MoeHybridParallelConfig

    def configure(self, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self.pp_size > 1 and getattr(getattr(model, "config", None), "output_router_logits", False):
            raise ValueError(
                f"{self.name}: pp_size={self.pp_size} with output_router_logits=True: the auxiliary load-balancing "
                "loss would count only the last stage's routers; use pp_size=1, or output_router_logits=False"
            )
        return super().configure(model, *args, **kwargs)

    @property
    def ep_size(self) -> int:
        return self.config.ep_size

    @property
    def dp_group(self) -> Any:
        """The dense weights' data-parallel group, ``dp x ep`` (what ``prepare_dataloader`` shards over)."""
        return self.mesh.group(("dp", "ep")) if _distributed() else None

    @property
    def moe_dp_group(self) -> Any:
        """The experts' data-parallel group (``dp``)."""
        return self.mesh.group("dp") if _distributed() else None

    @property
    def ep_group(self) -> Any:
        return self.mesh.group("ep") if _distributed() else None

    def _needs_policy(self, model: nn.Module) -> bool:
        # MoE blocks are always replaced, also at ep 1: the experts then run as cai-kernels' grouped GEMM
        return self.ep_size > 1 or _has_moe(model) or super()._needs_policy(model)

    def _policy(self, model: nn.Module) -> Any:
        if self.config.custom_policy is not None or not _has_moe(model):
            return self.config.custom_policy
        from cai.shardformer import ExpertParallelPolicy
        from cai.shardformer.policies import get_autopolicy

        return ExpertParallelPolicy(get_autopolicy(model) if self.tp_size > 1 else None)

    def _shard_config_extra(self) -> dict[str, Any]:
        return {"ep_group": self.ep_group} if self.ep_size > 1 else {}

    def _replica_sets(self, module: nn.Module, rename: Callable) -> list[tuple[Any, list[nn.Parameter]]]:
        experts = _expert_names(module, rename) if self.ep_size > 1 else set()
        named = [(rename(n), p) for n, p in module.named_parameters()]
        return [
            (self.dp_group, [p for n, p in named if n not in experts]),
            (self.moe_dp_group, [p for n, p in named if n in experts]),
        ]

    def _reduction(self, module: nn.Module, named: list, rename: Callable) -> dict[str, Any]:
        out = super()._reduction(module, named, rename)
        experts = _expert_names(module, rename) if self.ep_size > 1 else set()
        if not experts:
            return out
        out["reduce_groups"] = {n: self.moe_dp_group for n in experts}
        if self.config.zero.stage == 0:
            out["norm_groups"] = [*out["norm_groups"], self.ep_group]
            replicas = out["replicas"]
            for n, _ in named:
                if n not in experts:
                    replicas[n] = replicas.get(n, 1) * self.ep_size
        return out


def _expert_names(module: nn.Module, rename: Callable[[str], str]) -> set[str]:
    from cai.shardformer import ExpertParallelExperts

    out = set()
    for mname, m in module.named_modules():
        if isinstance(m, ExpertParallelExperts):
            out.update(rename(f"{mname}.{n}") for n, _ in m.named_parameters(recurse=False))
    return out


def _has_moe(model: nn.Module) -> bool:
    from cai.shardformer.policies.moe import MOE_BLOCKS

    return any(type(m).__name__ in MOE_BLOCKS for m in model.modules())


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
