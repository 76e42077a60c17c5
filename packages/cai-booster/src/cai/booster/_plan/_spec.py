"""What the planner knows of a model: a decoder-only transformer's sizes and its parameter tensors, read from a
preset, a Hugging Face config (a path, a ``config.json`` or a config object) or a built model."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from torch import nn

from cai.gemini import TransformerShape

__all__ = ["PRESETS", "ModelSpec"]

# Llama-family shapes by name (untied embeddings): what `cai plan --model 8b` means.
PRESETS: dict[str, dict[str, int]] = {
    "1b": dict(hidden=2048, layers=16, ffn=5632, vocab=32000, heads=16, kv_heads=16),
    "3b": dict(hidden=3072, layers=28, ffn=8192, vocab=128256, heads=24, kv_heads=8),
    "8b": dict(hidden=4096, layers=32, ffn=14336, vocab=128256, heads=32, kv_heads=8),
    "13b": dict(hidden=5120, layers=40, ffn=13824, vocab=32000, heads=40, kv_heads=40),
    "70b": dict(hidden=8192, layers=80, ffn=28672, vocab=128256, heads=64, kv_heads=8),
}


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer as the planner sees it.

    Attributes:
        name: what the user called it.
        shape: the sizes (``cai.gemini.TransformerShape``).
        numels: elements of every parameter tensor, in registration order (tied weights once).
        tied: whether the output head shares the input embedding.
    """

    name: str
    shape: TransformerShape
    numels: tuple[int, ...]
    tied: bool = False

    @property
    def params(self) -> int:
        return sum(self.numels)

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token: all but the input embedding (a lookup), unless the
        head shares it."""
        s = self.shape
        return self.params - (0 if self.tied else s.vocab * s.hidden)

    @property
    def root_params(self) -> int:
        """The embeddings and the output head (one tensor when tied): the parameters outside the decoder layers
        but for the final norm."""
        s = self.shape
        return (1 if self.tied else 2) * s.vocab * s.hidden

    @property
    def layer_params(self) -> float:
        """Parameters of one decoder layer (the final norm spread over the layers)."""
        return (self.params - self.root_params) / self.shape.layers

    @classmethod
    def from_shape(cls, shape: TransformerShape, *, name: str = "custom", tied: bool = False) -> ModelSpec:
        """The parameter tensors of a Llama-style model of this shape (attention without biases, SwiGLU MLP), in
        Hugging Face's registration order (which decides how Gemini packs them into chunks)."""
        h, kv = shape.hidden, shape.hidden * shape.kv_heads // shape.heads
        # q, k, v, o; gate, up, down; the two norms
        layer = [h * h, kv * h, kv * h, h * h, shape.ffn * h, shape.ffn * h, h * shape.ffn, h, h]
        numels = [shape.vocab * h] + layer * shape.layers + [h] + ([] if tied else [shape.vocab * h])
        return cls(name=name, shape=shape, numels=tuple(numels), tied=tied)

    @classmethod
    def from_config(cls, config: Any, *, name: str = "custom") -> ModelSpec:
        """From a Hugging Face config object (``LlamaConfig``, ``Qwen2Config`` ...) or its ``to_dict()``."""
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        missing = [
            k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if not get(k)
        ]
        if missing:
            raise ValueError(
                f"ModelSpec: the config of {name!r} has no {', '.join(missing)}; the planner covers decoder-only "
                "transformers with Hugging Face's field names"
            )
        heads = get("num_attention_heads")
        shape = TransformerShape(
            hidden=get("hidden_size"),
            layers=get("num_hidden_layers"),
            ffn=get("intermediate_size") or 4 * get("hidden_size"),
            vocab=get("vocab_size"),
            heads=heads,
            kv_heads=get("num_key_value_heads") or heads,
        )
        return cls.from_shape(shape, name=name, tied=bool(get("tie_word_embeddings", False)))

    @classmethod
    def from_model(cls, model: nn.Module) -> ModelSpec:
        """From a built model (meta, lazy or real): its own parameter tensors and its config's sizes."""
        shape = TransformerShape.from_model(model)
        params = list(model.parameters())  # tied tensors once
        tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
        name = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
        return cls(name=name, shape=shape, numels=tuple(p.numel() for p in params), tied=tied)

    @classmethod
    def resolve(cls, model: str | nn.Module | ModelSpec) -> ModelSpec:
        """A preset name (``1b``, ``3b``, ``8b``, ``13b``, ``70b``), a path to a ``config.json`` or a model
        directory, a Hugging Face hub name (needs transformers and the config in its cache), or a model."""
        if isinstance(model, ModelSpec):
            return model
        if isinstance(model, nn.Module):
            return cls.from_model(model)
        key = model.lower()
        if key in PRESETS:
            return cls.from_shape(TransformerShape(**PRESETS[key]), name=key)
        path = os.path.join(model, "config.json") if os.path.isdir(model) else model
        if os.path.isfile(path):
            with open(path) as f:
                return cls.from_config(json.load(f), name=model)
        try:
            from transformers import AutoConfig
        except ImportError:
            raise ValueError(
                f"ModelSpec: {model!r} is no preset ({', '.join(PRESETS)}) and no config file; a hub name needs "
                "transformers (pip install 'cai-booster[hf]')"
            ) from None
        try:
            return cls.from_config(AutoConfig.from_pretrained(model), name=model)
        except OSError as e:
            raise ValueError(
                f"ModelSpec: {model!r} is no preset ({', '.join(PRESETS)}), no config file, and its Hugging Face "
                f"config could not be read ({str(e).splitlines()[0]})"
            ) from None
