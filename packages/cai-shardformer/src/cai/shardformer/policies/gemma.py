"""Gemma policies (Gemma 1, 2 and 3's text model): the Llama layout, with Gemma's scaled word embedding kept scaled,
the lm_head tied to it by default, and its `1 + weight` RMSNorm left as it is (replicated, outside the tp
regions). Gemma 2 and 3 soft-cap the logits before the loss, so their loss cannot come from the hidden states: their
logits are gathered and the model computes its own loss. Gemma 3 normalises q and k per head (as Qwen3)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from cai.shardformer._embedding import VocabParallelEmbedding1D
from cai.shardformer._policy import ModulePolicyDescription, reduce_param_grads
from cai.shardformer.policies.llama import LlamaForCausalLMPolicy, LlamaPolicy

__all__ = [
    "Gemma2ForCausalLMPolicy",
    "Gemma2ModelPolicy",
    "Gemma3ForCausalLMPolicy",
    "Gemma3TextModelPolicy",
    "GemmaForCausalLMPolicy",
    "GemmaModelPolicy",
    "GemmaPolicy",
    "ScaledVocabParallelEmbedding1D",
]


class ScaledVocabParallelEmbedding1D(VocabParallelEmbedding1D):
    """Gemma's `*TextScaledWordEmbedding` (the lookup times `embed_scale`, sqrt(hidden)) split by vocabulary rows;
    the scale is applied after the all-reduce, as the unsharded module applies it after the lookup."""

    @classmethod
    def from_native_module(cls, module: nn.Embedding, process_group=None, **kw):
        new = super().from_native_module(module, process_group, **kw)
        scale = getattr(module, "embed_scale", None)
        if scale is None:
            raise ValueError(
                f"ScaledVocabParallelEmbedding1D: {type(module).__name__} has no embed_scale; use "
                f"VocabParallelEmbedding1D for an unscaled embedding"
            )
        new.register_buffer("embed_scale", torch.as_tensor(scale).detach().clone(), persistent=False)
        return new

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)


def _gemma(policy: dict, family: str, stack: str, shard_config) -> dict:
    """The Llama policy's dict made Gemma's: the stack's class name, the scaled embedding, Gemma 3's head norms."""
    if not policy:
        return policy
    llama_stack = f"{family}Model"
    desc = policy.pop(llama_stack)
    subs = [
        dataclasses.replace(s, target_module=ScaledVocabParallelEmbedding1D)
        if s.suffix == "embed_tokens"
        else s
        for s in desc.sub_module_replacement or []
    ]
    policy[stack] = dataclasses.replace(desc, sub_module_replacement=subs)
    if family == "Gemma3":
        # One norm weight shared by all heads: each rank's heads give part of its gradient.
        key = "Gemma3DecoderLayer"
        fn = reduce_param_grads(
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
            group=shard_config.tensor_parallel_process_group,
        )
        policy[key] = dataclasses.replace(
            policy[key], param_replacement=[*(policy[key].param_replacement or []), fn]
        )
    return policy


class GemmaPolicy(LlamaPolicy):
    family = "Gemma"
    sequence_parallel_modes = ()  # not tested for Gemma (Gemma 2/3 have norms the Llama split does not list)
    stack = "GemmaModel"  # the class owning embed_tokens and the layers

    def module_policy(self) -> dict[Any, ModulePolicyDescription]:
        return _gemma(super().module_policy(), self.family, self.stack, self.shard_config)


class GemmaModelPolicy(GemmaPolicy):
    pass


class GemmaForCausalLMPolicy(LlamaForCausalLMPolicy):
    family = "Gemma"
    sequence_parallel_modes = ()  # not tested for Gemma (Gemma 2/3 have norms the Llama split does not list)
    stack = "GemmaModel"

    def module_policy(self) -> dict[Any, ModulePolicyDescription]:
        return _gemma(super().module_policy(), self.family, self.stack, self.shard_config)

    def postprocess(self) -> nn.Module:
        if getattr(self.model.config, "final_logit_softcapping", None) is None:
            return super().postprocess()
        # Soft-capped logits: the loss needs them, so they are gathered (lm_head gather_output) and the model's own
        # loss runs on them; only the re-tying of the Llama policy applies.
        return LlamaPolicy.postprocess(self)


class Gemma2ModelPolicy(GemmaPolicy):
    family = "Gemma2"
    stack = "Gemma2Model"


class Gemma2ForCausalLMPolicy(GemmaForCausalLMPolicy):
    family = "Gemma2"
    stack = "Gemma2Model"


class Gemma3TextModelPolicy(GemmaPolicy):
    family = "Gemma3"
    stack = "Gemma3TextModel"


class Gemma3ForCausalLMPolicy(GemmaForCausalLMPolicy):
    family = "Gemma3"
    stack = "Gemma3TextModel"
