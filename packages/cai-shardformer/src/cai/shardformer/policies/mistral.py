"""Mistral policies: the Llama policy under Mistral's class names (same module layout)."""

from cai.shardformer.policies.llama import LlamaForCausalLMPolicy, LlamaPolicy

__all__ = ["MistralForCausalLMPolicy", "MistralModelPolicy", "MistralPolicy"]


class MistralPolicy(LlamaPolicy):
    family = "Mistral"


class MistralModelPolicy(MistralPolicy):
    pass


class MistralForCausalLMPolicy(LlamaForCausalLMPolicy):
    family = "Mistral"
