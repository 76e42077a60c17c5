"""Expert parallelism for mixture-of-experts models, as a policy that wraps the dense (attention, MLP) policy of
the model's family: Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3."""

from __future__ import annotations

import dataclasses

from torch import nn

from cai.shardformer._moe import ExpertParallelExperts
from cai.shardformer._policy import ModulePolicyDescription, Policy, SubModuleReplacementDescription

__all__ = ["MOE_BLOCKS", "ExpertParallelPolicy"]

# Sparse MoE block class name -> path of its stacked experts module (the only part replaced).
MOE_BLOCKS: dict[str, str] = {
    "MixtralSparseMoeBlock": "experts",
    "Qwen2MoeSparseMoeBlock": "experts",
    "Qwen3MoeSparseMoeBlock": "experts",
    "DeepseekV3MoE": "experts",
}


class ExpertParallelPolicy(Policy):
    """The experts of every sparse MoE block split over `shard_config.ep_group` (see `ExpertParallelExperts`),
    on top of `base`, the dense policy (None when tensor parallelism is off).

    Args:
        base: the family's tensor-parallel policy, or None.
        capacity_factor: None (dropless, the default) or the per-expert cap factor of `ExpertParallelExperts`.

    Example:
        >>> config = ShardConfig(enable_tensor_parallelism=False, ep_group=mesh.group("ep"))
        >>> model, _ = ShardFormer(config).optimize(model, ExpertParallelPolicy())
    """

    def __init__(self, base: Policy | None = None, *, capacity_factor: float | None = None) -> None:
        super().__init__()
        self.base = base
        self.capacity_factor = capacity_factor

    def set_model(self, model: nn.Module) -> None:
        super().set_model(model)
        if self.base is not None:
            self.base.set_model(model)

    def config_sanity_check(self) -> None:
        cfg = self.shard_config
        if self.base is not None:
            self.base.set_shard_config(cfg)
        elif cfg.tensor_parallel_size > 1:
            raise ValueError(
                f"ExpertParallelPolicy without a base policy cannot shard the dense layers over tp size "
                f"{cfg.tensor_parallel_size}; pass base= (the family's policy) or set enable_tensor_parallelism=False"
            )
        blocks = [(n, m) for n, m in self.model.named_modules() if type(m).__name__ in MOE_BLOCKS]
        ep = cfg.expert_parallel_size
        if ep > 1 and not blocks:
            raise ValueError(
                f"ep_size={ep} but {type(self.model).__name__} has no mixture-of-experts block (looked for "
                f"{sorted(MOE_BLOCKS)}); leave ep_group unset (ep size 1) for a dense model"
            )
        for name, block in blocks:
            num = getattr(block, MOE_BLOCKS[type(block).__name__]).gate_up_proj.shape[0]
            if num % ep:
                raise ValueError(
                    f"{name} has {num} experts, which do not split evenly over ep_size={ep}; use an ep size that "
                    f"divides {num}"
                )

    def preprocess(self) -> nn.Module:
        return self.base.preprocess() if self.base is not None else self.model

    def module_policy(self) -> dict:
        policy = self.base.module_policy() if self.base is not None else {}
        kwargs = {"ep_group": self.shard_config.ep_group, "capacity_factor": self.capacity_factor}
        for block, path in MOE_BLOCKS.items():
            sub = SubModuleReplacementDescription(path, ExpertParallelExperts, kwargs)
            current = policy.get(block, ModulePolicyDescription())
            policy[block] = dataclasses.replace(
                current, sub_module_replacement=[*(current.sub_module_replacement or []), sub]
            )
        return policy

    def postprocess(self) -> nn.Module:
        return self.base.postprocess() if self.base is not None else self.model

    def get_shared_params(self):
        return self.base.get_shared_params() if self.base is not None else []
