"""Qwen3 policies: the Llama policy under Qwen3's class names (same module layout)."""

import dataclasses

from cai.shardformer._policy import reduce_param_grads
from cai.shardformer.policies.llama import LlamaForCausalLMPolicy, LlamaPolicy

__all__ = ["Qwen3ForCausalLMPolicy", "Qwen3ModelPolicy", "Qwen3Policy"]


def _with_head_norms(policy: dict, shard_config) -> dict:
    """Qwen3 normalises q and k per head with one weight shared by all heads: each rank's heads contribute
    part of its gradient, summed over the tp group."""
    key = "Qwen3DecoderLayer"
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
