"""Mixtral policies: attention, embedding, lm_head and the vocab-parallel loss as Llama's; the sparse MoE block
(router and experts) stays replicated and untouched, so each rank routes the same tokens to the same experts and
the router's auxiliary loss is the unsharded one. Expert parallelism shards the experts (a separate layout)."""

from __future__ import annotations

import dataclasses
from typing import Any

from cai.shardformer._policy import ModulePolicyDescription
from cai.shardformer.policies.llama import LlamaForCausalLMPolicy, LlamaPolicy

__all__ = ["MixtralForCausalLMPolicy", "MixtralModelPolicy", "MixtralPolicy", "attention_only"]


def attention_only(policy: dict, family: str = "Mixtral") -> dict:
    """Drop the Llama policy's dense-MLP entries: a MoE model's `mlp` is the MoE block, whose input stays replicated
    (it is no tp region) and whose gradient is therefore whole on every rank."""
    key = f"{family}DecoderLayer"
    if key in policy:
        desc = policy[key]
        subs = [s for s in desc.sub_module_replacement or [] if not s.suffix.startswith("mlp.")]
        regions = [r for r in desc.tp_input_regions or [] if r != "mlp"]
        policy[key] = dataclasses.replace(desc, sub_module_replacement=subs, tp_input_regions=regions)
    return policy


class MixtralPolicy(LlamaPolicy):
    family = "Mixtral"
    shards_mlp = False
    sequence_parallel_modes = ()  # the MoE block on a sequence slice would route and balance per rank: not built

    def module_policy(self) -> dict[Any, ModulePolicyDescription]:
        return attention_only(super().module_policy())


class MixtralModelPolicy(MixtralPolicy):
    pass


class MixtralForCausalLMPolicy(LlamaForCausalLMPolicy):
    family = "Mixtral"
    shards_mlp = False
    sequence_parallel_modes = ()  # the MoE block on a sequence slice would route and balance per rank: not built

    def module_policy(self) -> dict[Any, ModulePolicyDescription]:
        return attention_only(super().module_policy())
