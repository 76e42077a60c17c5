"""A pre-norm decoder layer whose residual adds happen inside its RMSNorm kernels, forward and backward.

[Note: residual adds in the norms]
A pre-norm layer (``h = x + attn(norm1(x)); out = h + mlp(norm2(h))``) costs three passes of its own over a
tokens x hidden tensor besides the norms: the forward add ``x + attn``, and in backward the two adds with which
autograd sums the gradients reaching ``x`` and ``h`` from their two uses each (the norm and the residual branch).
:func:`fuse_residuals` gives each such layer a ``forward`` (an instance attribute; the module keeps its class, so
state dicts, FP8 conversion, checkpointing and hooks see what they saw) that computes the same values with
cai-kernels' norm doing those three:
- ``norm1(x, return_input=True)`` hands back ``x`` for the residual branch, and its backward kernel adds the
  branch's gradient into the input gradient it writes;
- ``norm2(attn, residual=x)`` adds in its forward kernel (rounded to the activation dtype, as the unfused add) and
  its backward kernel adds the gradient of the sum's other use, as above.
The last add (``h + mlp``) stays: the next layer begins from its output, and carrying the residual across layers
(as cai-infer's [Note: carried residual] does for serving) would break checkpointing, which reruns one layer alone.

The forward is replaced only where it is known: the layer class's ``forward`` source, without comments and blank
lines, must hash to ``PRE_NORM_FORWARD`` (see :func:`is_pre_norm_layer`), and both norms must be
``cai.kernels.RMSNorm`` when the layer runs; otherwise (a norm replaced, the layer's class changed), and for
positional arguments after the hidden states, the class's own forward runs.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import textwrap

import torch
from torch import nn

from cai.kernels._norm import RMSNorm

__all__ = ["PRE_NORM_FORWARD", "forward_digest", "fuse_residuals", "is_pre_norm_layer"]

# sha256 (first 16 hex digits, see forward_digest) of the pre-norm layer forward as transformers 5.x writes it for
# Llama, Mistral, Qwen2/3, Gemma, Olmo, Starcoder2, GLM, Helium and others:
#     residual = x; x = input_layernorm(x); x, _ = self_attn(hidden_states=x, <its keyword arguments>)
#     x = residual + x; residual = x; x = post_attention_layernorm(x); x = mlp(x); return residual + x
PRE_NORM_FORWARD = "93c89966bc06085a"


@functools.cache
def forward_digest(cls: type) -> str | None:
    """The first 16 hex digits of sha256 over ``cls.forward``'s source without comments and blank lines, or None
    where the source cannot be read."""
    try:
        src = textwrap.dedent(inspect.getsource(cls.forward))
    except (OSError, TypeError):
        return None
    lines = (line.split("#")[0].rstrip() for line in src.splitlines())
    return hashlib.sha256("\n".join(line for line in lines if line.strip()).encode()).hexdigest()[:16]


def is_pre_norm_layer(layer: nn.Module) -> bool:
    """Whether ``layer``'s class has the pre-norm forward above and both its norms are ``cai.kernels.RMSNorm``."""
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    return all(type(n) is RMSNorm for n in norms) and forward_digest(type(layer)) == PRE_NORM_FORWARD


class _FusedResidualForward:
    """The ``forward`` of one pre-norm layer (see the module note)."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer
        self.cls = type(layer)  # a class changed since (cai-infer's carried layers) runs its own forward

    def __call__(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        layer = self.layer
        norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
        if args or type(layer) is not self.cls or type(norm1) is not RMSNorm or type(norm2) is not RMSNorm:
            return type(layer).forward(layer, hidden_states, *args, **kwargs)
        x, residual = norm1(hidden_states, return_input=True)
        x = layer.self_attn(hidden_states=x, **kwargs)[0]
        x, residual = norm2(x, residual)
        return residual + layer.mlp(x)


def fuse_residuals(model: nn.Module) -> int:
    """Give every pre-norm decoder layer of ``model`` (:func:`is_pre_norm_layer`) the forward of
    [Note: residual adds in the norms], in place; returns how many layers have it now."""
    count = 0
    for mod in model.modules():
        if isinstance(mod.__dict__.get("forward"), _FusedResidualForward):
            count += 1
        elif "forward" not in mod.__dict__ and is_pre_norm_layer(mod):
            mod.forward = _FusedResidualForward(mod)
            count += 1
    return count
