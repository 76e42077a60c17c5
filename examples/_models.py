"""Llama configurations used by the examples, built from numbers (nothing is downloaded)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import LlamaConfig

# Benchmark presets. The 1B shape matches the peer figures of BENCHMARKS.md (6N + 12 L h s at 63.9k tok/s
# gives its 42% MFU with these sizes: 0.95B parameters, untied embeddings).
PRESETS: dict[str, dict] = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=1024,
    ),
    "1b": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
    ),
    "3b": dict(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    "8b": dict(  # Llama3-8B shape
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
    ),
}


def preset_config(name: str, *, max_seq: int) -> LlamaConfig:
    """A preset name from ``PRESETS``, or a path to a config.json / model directory."""
    # transformers is imported where a config is built, not with this module: a launcher that only spawns the
    # workers (``python train_llama.py`` without torchrun) does not pay for it before they start
    from transformers import AutoConfig, LlamaConfig

    if name in PRESETS:
        return LlamaConfig(
            **PRESETS[name], max_position_embeddings=max(max_seq, 2048), tie_word_embeddings=False
        )
    if os.path.exists(name):
        return AutoConfig.from_pretrained(name)
    raise ValueError(f"unknown model config {name!r}: use one of {sorted(PRESETS)} or a path to a config")


def digit_llama_config(
    *, hidden: int, layers: int, heads: int, vocab_size: int, max_seq: int, **ids
) -> LlamaConfig:
    """The small Llama of the main job (~0.66M parameters at hidden 128, 4 layers).

    Learns the digit-reversal task in a few hundred steps on two CPU processes.
    """
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_seq,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        **ids,
    )
