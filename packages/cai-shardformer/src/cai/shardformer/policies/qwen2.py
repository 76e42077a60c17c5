"""Qwen2 policies: the Llama policy under Qwen2's class names (same module layout)."""

from cai.shardformer.policies.llama import LlamaForCausalLMPolicy, LlamaPolicy

__all__ = ["Qwen2ForCausalLMPolicy", "Qwen2ModelPolicy", "Qwen2Policy"]


class Qwen2Policy(LlamaPolicy):
    family = "Qwen2"


class Qwen2ModelPolicy(Qwen2Policy):
    pass


class Qwen2ForCausalLMPolicy(LlamaForCausalLMPolicy):
    family = "Qwen2"
