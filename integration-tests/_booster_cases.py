"""What the Booster integration tests share: the tiny Llama, the plugins by name, full parameters from shards."""

from __future__ import annotations

import torch
import torch.distributed as dist
import transformers

from cai.mesh import LocalShard, assemble

VOCAB = 64
PLUGINS = ("ddp", "fsdp", "zero1", "zero2", "gemini")


def tiny_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).float()


def make_plugin(name: str):
    from cai.booster.plugin import GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin, TorchFSDPPlugin

    if name == "ddp":
        return TorchDDPPlugin()
    if name == "fsdp":
        return TorchFSDPPlugin(precision="fp32")
    if name in ("zero1", "zero2"):
        return LowLevelZeroPlugin(stage=int(name[-1]), precision="fp32")
    if name == "gemini":
        return GeminiPlugin(precision="fp32")
    raise ValueError(name)


def gathered_params(booster, model) -> dict[str, torch.Tensor]:
    """Every parameter assembled from all ranks' pieces of the plugin's state (the checkpoint's source of truth)."""
    pieces = {
        n: (s.tensor.detach().float().cpu().clone(), s.spec)
        for n, s in booster.plugin.model_state(model).sharded_state_dict().items()
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, pieces)
    names = {n for n, _ in model.unwrap().named_parameters()}
    return {n: assemble([LocalShard(*r[n]) for r in everyone if n in r]) for n in names}
