"""Which policy shards which Hugging Face model class, imported lazily."""

from __future__ import annotations

import importlib

from torch import nn

from cai.shardformer._policy import Policy

# Hugging Face class name -> (policy module under cai.shardformer.policies, policy class)
_POLICY_LIST: dict[str, tuple[str, str]] = {
    f"{family}{suffix}": (module, f"{family}{policy}")
    for family, module in (("Llama", "llama"), ("Mistral", "mistral"), ("Qwen2", "qwen2"), ("Qwen3", "qwen3"))
    for suffix, policy in (("Model", "ModelPolicy"), ("ForCausalLM", "ForCausalLMPolicy"))
}
# The decoder families with their own layouts (Colossal-AI's policy class names).
_POLICY_LIST.update(
    {
        "GPT2Model": ("gpt2", "GPT2ModelPolicy"),
        "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModelPolicy"),
        "GemmaModel": ("gemma", "GemmaModelPolicy"),
        "GemmaForCausalLM": ("gemma", "GemmaForCausalLMPolicy"),
        "Gemma2Model": ("gemma", "Gemma2ModelPolicy"),
        "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLMPolicy"),
        "Gemma3TextModel": ("gemma", "Gemma3TextModelPolicy"),
        "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLMPolicy"),
        "MixtralModel": ("mixtral", "MixtralModelPolicy"),
        "MixtralForCausalLM": ("mixtral", "MixtralForCausalLMPolicy"),
        "OPTModel": ("opt", "OPTModelPolicy"),
        "OPTForCausalLM": ("opt", "OPTForCausalLMPolicy"),
        "GPTJModel": ("gptj", "GPTJModelPolicy"),
        "GPTJForCausalLM": ("gptj", "GPTJForCausalLMPolicy"),
        "BloomModel": ("bloom", "BloomModelPolicy"),
        "BloomForCausalLM": ("bloom", "BloomForCausalLMPolicy"),
        "FalconModel": ("falcon", "FalconModelPolicy"),
        "FalconForCausalLM": ("falcon", "FalconForCausalLMPolicy"),
    }
)


def get_autopolicy(model: nn.Module) -> Policy:
    """A fresh policy instance for `model`'s class."""
    name = type(model).__name__
    if name not in _POLICY_LIST:
        raise NotImplementedError(
            f"no cai-shardformer policy for {name}; policies exist for {sorted(_POLICY_LIST)}. Pass policy= "
            f"(a Policy subclass instance) to shard it"
        )
    module, cls = _POLICY_LIST[name]
    return getattr(importlib.import_module(f"cai.shardformer.policies.{module}"), cls)()
