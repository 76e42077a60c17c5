"""Tiny random Hugging Face causal LMs for the engine tests, and the block-accounting check after every test."""

from __future__ import annotations

import pytest
import torch
import transformers

VOCAB = 251

_FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),  # q/k/v biases
    # a sliding window shorter than the longest sequence, so the window mask is exercised
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 12}),
    # scaled embeddings, GeGLU
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, {"head_dim": 8}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 8}),  # per-head q/k norms
    # sliding-window and full layers alternating, attention-logit soft-capping
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        {"head_dim": 8, "sliding_window": 6, "attn_logit_softcapping": 5.0},
    ),
}


def tiny_model(family: str = "llama", seed: int = 0) -> torch.nn.Module:
    """A 2-layer, hidden-32 model with 4 query heads over 2 kv heads (GQA), fp32, eval mode."""
    config_cls, model_cls, extra = _FAMILIES[family]
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        **extra,
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # Random init puts every logit near zero; a larger output scale makes the greedy choices well separated,
    # so token-for-token comparisons test the engine rather than rounding.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


@pytest.fixture
def make_model():
    return tiny_model


@pytest.fixture(autouse=True)
def _all_blocks_free_after_test(request):
    """Every engine a test builds (registered through ``engines``) ends with all its blocks free."""
    engines = []
    request.node.engines = engines
    yield
    for engine in engines:
        assert not engine.has_unfinished_requests(), "the test left requests queued or running"
        engine.scheduler.check()
        assert engine.blocks.num_free == engine.blocks.num_blocks, (
            f"{engine.blocks.num_blocks - engine.blocks.num_free} blocks still in use after the test"
        )


@pytest.fixture
def engines(request):
    return request.node.engines
