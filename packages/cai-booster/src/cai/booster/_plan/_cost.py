"""Seconds of one training micro-batch's forward and backward on one GPU, from the model's work and the
machine's measured rates (a roofline of the matmuls, the attention and the memory-bound elementwise work)."""

from __future__ import annotations

from cai.booster._plan._hardware import Hardware
from cai.booster._plan._spec import ModelSpec

__all__ = ["step_seconds"]

# Bytes an element of the hidden size moves per token and layer in the elementwise work of forward plus backward
# (norms, rotary, SwiGLU, residual adds, casts), in units of the working precision's size: with cai-kernels'
# fused kernels, and with torch's separate ops. Elementwise kernels reach about 60% of the copy bandwidth.
_ELEMENTWISE_FUSED = 40
_ELEMENTWISE_EAGER = 110
_BANDWIDTH_SHARE = 0.6
# Selective checkpointing decides per aten op in Python (torch's selective checkpoint dispatch mode), forward and
# recompute: host time per layer and micro-batch that the GPU waits for, measured on the H200's host (1B, 16
# layers: +45 ms a micro-batch of 8 and +77 ms for two of 4).
_SELECTIVE_LAYER_S = 2.6e-3


def step_seconds(
    spec: ModelSpec,
    hw: Hardware,
    *,
    tokens: int,
    seq: int,
    wbytes: int,
    recompute: str,
    kernels: bool = True,
    tp: int = 1,
    overhead: float | None = None,
) -> float:
    """Forward plus backward of ``tokens`` tokens (sequences of ``seq``) on one GPU, recomputation included;
    with ``tp > 1`` this rank's share of the layers' work. ``overhead`` defaults to ``hw.step_overhead``."""
    s = spec.shape
    layer_params = spec.matmul_params - s.vocab * s.hidden  # all matmul weights but the output head
    # 2 FLOPs per weight and token forward, 4 backward; causal attention: 6 * seq * hidden per token and layer
    mm = 6 * spec.matmul_params * tokens / tp
    attn = 6 * s.layers * seq * s.hidden * tokens / tp
    elem_bytes = (
        tokens * s.layers * s.hidden * wbytes * (_ELEMENTWISE_FUSED if kernels else _ELEMENTWISE_EAGER)
    )
    if recompute == "full":  # each layer's forward again in backward
        mm += 2 * layer_params * tokens / tp
        attn += attn / 3
        elem_bytes += elem_bytes / 3
    elif recompute == "selective":  # the elementwise forward again
        elem_bytes += elem_bytes / 3
    # the loss over the vocabulary: fused, a few passes over one chunk of logits at a time; else full logits
    loss_bytes = tokens * s.vocab * (6 * wbytes if kernels else 2 * wbytes + 16) / tp
    seconds = (
        mm / hw.matmul_rate(tokens)
        + attn / (hw.attention_tflops * 1e12)
        + (elem_bytes / tp + loss_bytes) / (_BANDWIDTH_SHARE * hw.copy_gbs * 1e9)
    )
    seconds *= hw.step_overhead if overhead is None else overhead
    if recompute == "selective":
        seconds += _SELECTIVE_LAYER_S * s.layers
    return seconds
