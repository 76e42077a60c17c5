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
_POLICY_LIST.update(
    {
        f"Bert{suffix}": ("bert", f"Bert{suffix}Policy")
        for suffix in ("Model", "ForSequenceClassification", "ForMaskedLM", "ForPreTraining")
    }
)

_POLICY_LIST.update(
    {
        "T5Model": ("t5", "T5ModelPolicy"),
        "T5ForConditionalGeneration": ("t5", "T5ForConditionalGenerationPolicy"),
        "T5EncoderModel": ("t5", "T5EncoderPolicy"),
        "ViTModel": ("vit", "ViTModelPolicy"),
        "ViTForImageClassification": ("vit", "ViTForImageClassificationPolicy"),
        "WhisperModel": ("whisper", "WhisperModelPolicy"),
        "WhisperForConditionalGeneration": ("whisper", "WhisperForConditionalGenerationPolicy"),
    }
)

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
        "Qwen3MoeModel": ("qwen3", "Qwen3MoeModelPolicy"),
        "Qwen3MoeForCausalLM": ("qwen3", "Qwen3MoeForCausalLMPolicy"),
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
    """A fresh policy instance for `model`'s class; for a class without one, the policy derived from the model's
    tensor-parallel plan (`TpPlanPolicy`)."""
    name = type(model).__name__
    if name not in _POLICY_LIST:
        from cai.shardformer.policies.tp_plan import TpPlanPolicy, model_tp_plan

        if model_tp_plan(model):  # the plan transformers ships with the model, mapped to cai's layers
            return TpPlanPolicy()
        raise NotImplementedError(
            f"no cai-shardformer policy for {name}, and it has no base_model_tp_plan (its config carries none) to "
            f"derive one from; policies exist for {sorted(_POLICY_LIST)}. Write a Policy for {name} and pass it "
            f"as policy= (Colossal-AI's custom_policy)"
        )
    module, cls = _POLICY_LIST[name]
    return getattr(importlib.import_module(f"cai.shardformer.policies.{module}"), cls)()
