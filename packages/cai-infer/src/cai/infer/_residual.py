"""Residual adds folded into the RMSNorm kernels that follow them, for serving.

[Note: carried residual]
A pre-norm decoder layer adds its attention output to the residual stream and normalises the sum, then does the
same with its MLP output, and the next layer (or the final norm) starts by normalising that sum again. Each add
is a kernel of its own that reads two activations and writes one, and the norm then reads the sum back: at batch
1 both are launch-bound (Llama-3-8B decode on an H200: 64 adds at 1.4 us and 65 norms at 2.6 us a token).
cai-kernels' RMSNorm takes the residual as a second input and returns the normalised sum and the sum in one
kernel, so each layer here returns its MLP output without adding it and leaves the residual stream in a carry
shared by the model's layers; the next layer's input norm (or the final norm) adds it, rounded to the activation
dtype exactly as the unfused add rounds it, so outputs are unchanged bit for bit.

This rewrites a layer's forward, so it applies only where that forward is known: every layer must pass
``cai.kernels.is_pre_norm_layer`` (the transformers 5 pre-norm form shared by Llama, Mistral, Qwen2/3, Gemma, Olmo,
Starcoder2, GLM, Helium and others, with both norms ``cai.kernels.RMSNorm``, so Gemma's ``1 + weight`` norms, which
cai-kernels leaves alone, and LayerNorm models keep their layers), and the final norm must be
``cai.kernels.RMSNorm``. Anything else keeps its own forward. Training has its own, per-layer form of this fold:
cai-kernels' [Note: residual adds in the norms].
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from cai.kernels import RMSNorm, is_pre_norm_layer

__all__ = ["carry_residuals"]


class _Carry:
    """The residual stream between the layers of one forward."""

    residual: torch.Tensor | None = None


class _CarriedLayer(nn.Module):
    """A pre-norm decoder layer that returns its MLP output without the residual add and leaves the residual stream
    (its input plus its attention output) in the carry (see [Note: carried residual])."""

    _carry: _Carry
    _first: bool

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        if self._first:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:  # hidden_states is the previous layer's MLP output
            hidden_states, residual = self.input_layernorm(hidden_states, self._carry.residual)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        self._carry.residual = residual
        return self.mlp(hidden_states)


class _CarriedFinalNorm(RMSNorm):
    """The model's final norm, adding the last layer's carried residual first."""

    _carry: _Carry

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        carried, self._carry.residual = self._carry.residual, None
        y, _ = super().forward(x, carried)
        return y


@functools.cache
def _carried_class(cls: type) -> type:
    return type(f"Carried{cls.__name__}", (_CarriedLayer, cls), {})


def carry_residuals(model: nn.Module) -> int:
    """Fold ``model``'s residual adds into its RMSNorm kernels where its decoder layers allow (see
    [Note: carried residual]), in place; returns the number of layers changed (0: the model is left as it was)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    final = getattr(decoder, "norm", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0 or type(final) is not RMSNorm:
        return 0
    if not all(is_pre_norm_layer(layer) for layer in layers):
        return 0
    carry = _Carry()
    for i, layer in enumerate(layers):
        layer.__class__ = _carried_class(type(layer))
        layer._carry, layer._first = carry, i == 0
    final.__class__ = _CarriedFinalNorm
    final._carry = carry
    return len(layers)
