"""Qwen3 and Qwen3-MoE policies: the Llama policy under their class names (same attention layout, with per-head q/k
norms); Qwen3-MoE's sparse blocks stay replicated as Mixtral's (expert parallelism shards their experts)."""

import dataclasses

from cai.shardformer._policy import reduce_param_grads
from cai.shardformer.policies.llama import LlamaForCausalLMPolicy, LlamaPolicy
from cai.shardformer.policies.mixtral import attention_only

__all__ = [
    "Qwen3ForCausalLMPolicy",
    "Qwen3ModelPolicy",
    "Qwen3MoeForCausalLMPolicy",
    "Qwen3MoeModelPolicy",
    "Qwen3MoePolicy",
    "Qwen3Policy",
]


def _with_head_norms(policy: dict, shard_config, family: str = "Qwen3") -> dict:
    """Qwen3 normalises q and k per head with one weight shared by all heads: each rank's heads contribute
    part of its gradient, summed over the tp group."""
    key = f"{family}DecoderLayer"
    if key in policy:
        fn = reduce_param_grads(
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
            group=shard_config.tensor_parallel_process_group,
        )
        params = [*(policy[key].param_replacement or []), fn]
        policy[key] = dataclasses.replace(policy[key], param_replacement=params)
    return policy


class Qwen3Policy(LlamaPolicy):
    family = "Qwen3"

    def module_policy(self):
        return _with_head_norms(super().module_policy(), self.shard_config)


class Qwen3ModelPolicy(Qwen3Policy):
    pass


class Qwen3ForCausalLMPolicy(LlamaForCausalLMPolicy):
    family = "Qwen3"

    def module_policy(self):
        return _with_head_norms(super().module_policy(), self.shard_config)


class Qwen3MoePolicy(LlamaPolicy):
    family = "Qwen3Moe"
    shards_mlp = False  # sparse blocks (and the dense MLPs of mlp_only_layers) stay replicated
    sequence_parallel_modes = ()  # the MoE block on a sequence slice would route and balance per rank: not built

    def module_policy(self):
        return _with_head_norms(
            attention_only(super().module_policy(), self.family), self.shard_config, self.family
        )


class Qwen3MoeModelPolicy(Qwen3MoePolicy):
    pass


class Qwen3MoeForCausalLMPolicy(LlamaForCausalLMPolicy):
    family = "Qwen3Moe"
    shards_mlp = False
    sequence_parallel_modes = ()

    def module_policy(self):
        return _with_head_norms(
            attention_only(super().module_policy(), self.family), self.shard_config, self.family
        )
