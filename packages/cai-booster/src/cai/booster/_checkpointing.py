"""Activation checkpointing of a model's repeated blocks: full (keep only each block's input) or selective (keep the
matmul and attention outputs, recompute the elementwise rest), on all blocks or a leading fraction of them; and
activation offload of a leading fraction of the blocks to pinned host memory ([Note: activation offload]).

[Note: selective checkpointing]
A decoder block's activations are mostly the outputs of cheap elementwise ops (norms, rotary, SiLU, products,
residual adds, dtype casts) around a few expensive ones (the projections and attention). Full checkpointing drops
all of them and runs the whole forward again in backward (a third more compute); selective checkpointing keeps the
expensive outputs (`SAVED_OPS`, through torch's `create_selective_checkpoint_contexts`) and recomputes only the
elementwise ops, whose recompute costs memory bandwidth, not matmul time. `ratio` applies the policy to the first
``int(ratio * blocks)`` blocks and leaves the others as they are (Colossal-AI's ``gradient_checkpointing_ratio``),
so memory can be traded for compute a block at a time.

Blocks are Hugging Face's ``GradientCheckpointingLayer``s where the model has them (their own switch and checkpoint
function are set, per block), otherwise the items of the model's largest ``nn.ModuleList`` of one class. A block
that is not an HF layer gets a subclass whose ``__call__`` checkpoints (module hooks run inside, so a sharding
wrapper's gather hooks run again in the recompute); its class name and state-dict names are unchanged.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from cai.booster._offload import PREFETCH, Offloader, clear_offload, set_offload, with_mixin

__all__ = ["SAVED_OPS", "activation_checkpointing"]

Policy = Literal["full", "selective", "none"]

_aten = torch.ops.aten
# Outputs selective checkpointing keeps: the matmuls (nn.Linear and matmul dispatch to these; FP8 linears to
# _scaled_mm on GPUs with FP8 tensor cores; grouped expert GEMMs to _grouped_mm) and attention.
_SAVED_NAMES = (
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_grouped_mm", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
    "_efficient_attention_forward",
)  # fmt: skip
SAVED_OPS = frozenset(getattr(_aten, name).default for name in _SAVED_NAMES if hasattr(_aten, name))


def _keep_expensive(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_keep_expensive)


class _Checkpoint:
    """A checkpoint function shared by every block that has it (``run``: torch's non-reentrant checkpoint with its
    keywords). Hugging Face layers and ``_Checkpointed`` call it as ``fn(partial(super().__call__, **kwargs),
    *args)``; a block that defines ``_cai_run_checkpoint`` (a compiled block, [Note: compiled blocks]) is handed
    the call, so the checkpoint runs inside its graph."""

    def __init__(self, run) -> None:
        self.run = run

    def __call__(self, fn, *args):
        block = getattr(getattr(fn, "func", None), "__self__", None)
        through = getattr(block, "_cai_run_checkpoint", None)
        return self.run(fn, *args) if through is None else through(self.run, fn, *args)


@functools.cache
def _checkpoint_fn(policy: Policy) -> _Checkpoint:
    context = {"context_fn": _selective_context} if policy == "selective" else {}
    return _Checkpoint(functools.partial(checkpoint, use_reentrant=False, **context))


@functools.cache
def adopt_checkpoint(fn) -> _Checkpoint | None:
    """``fn`` as a ``_Checkpoint`` where it is torch's non-reentrant checkpoint with keywords only (what Hugging
    Face's ``gradient_checkpointing_enable()`` sets on every layer), else None; one per ``fn``, so the blocks that
    share a function share its graph."""
    plain = isinstance(fn, functools.partial) and fn.func is checkpoint and not fn.args
    return _Checkpoint(fn) if plain and fn.keywords.get("use_reentrant") is False else None


def _hf_layer_type() -> type | None:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return None
    return GradientCheckpointingLayer


def checkpoint_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model``, in order (see [Note: selective checkpointing]); raises if there are none."""
    hf = _hf_layer_type()
    if hf is not None:
        found = [m for m in model.modules() if isinstance(m, hf)]
        if found:
            return found
    best: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > len(best) and len({type(c) for c in m}) == 1:
            best = list(m)
    if not best:
        raise ValueError(
            f"activation_checkpointing: {type(model).__name__} has no Hugging Face GradientCheckpointingLayer and "
            "no nn.ModuleList of repeated blocks to checkpoint"
        )
    return best


class _Checkpointed:
    """Mixed into a block's class: ``__call__`` (hooks and forward) runs under ``_cai_checkpoint`` in training."""

    def __call__(self, *args, **kwargs):
        fn = self.__dict__.get("_cai_checkpoint")
        if fn is None or not self.training:
            return super().__call__(*args, **kwargs)
        return fn(functools.partial(super().__call__, **kwargs), *args)


def _set(block: nn.Module, policy: Policy) -> None:
    hf = _hf_layer_type()
    if hf is not None and isinstance(block, hf):
        block.gradient_checkpointing = policy != "none"
        block._gradient_checkpointing_func = _checkpoint_fn(policy)
        return
    if policy == "none":
        block.__dict__.pop("_cai_checkpoint", None)
        return
    if not isinstance(block, _Checkpointed):
        block.__class__ = with_mixin(_Checkpointed, type(block))
    block.__dict__["_cai_checkpoint"] = _checkpoint_fn(policy)


def activation_checkpointing(
    model: nn.Module,
    policy: Policy = "full",
    *,
    ratio: float = 1.0,
    offload: float = 0.0,
    prefetch: int = PREFETCH,
) -> int:
    """Recompute activations of ``model``'s blocks in backward, or keep them in host memory, in place; returns the
    number of blocks recomputed.

    Args:
        model: a Hugging Face model (its ``GradientCheckpointingLayer`` blocks) or any module with an
            ``nn.ModuleList`` of repeated blocks.
        policy: ``"full"`` keeps only each block's input; ``"selective"`` keeps the matmul and attention outputs
            (``SAVED_OPS``) and recomputes the elementwise ops (see [Note: selective checkpointing]); ``"none"``
            turns checkpointing off.
        ratio: the leading fraction of blocks that get ``policy`` (the first ``int(ratio * blocks)``); the rest keep
            all their activations.
        offload: the leading fraction of blocks (the first ``int(offload * blocks)``) whose saved activations wait
            for backward in pinned host memory, copied there and back on a side stream while other blocks compute
            (see [Note: activation offload]); ``policy`` then applies to the blocks after them, at most
            ``int(ratio * blocks)``, so ``activation_checkpointing(model, "full", offload=0.25)`` offloads a
            quarter and recomputes the rest.
        prefetch: how many blocks ahead of backward the offloaded activations are copied back (device memory for
            that many blocks' activations, traded for time to hide the copies).

    Calling it again replaces the previous setting. Gradients are the same as without checkpointing (the recompute
    runs the same ops; dropout draws the same numbers, as torch's checkpoint restores the RNG state), and the same
    with offload (the bytes go to the host and back unchanged).

    Example:
        >>> activation_checkpointing(model, "selective")       # every block: keep matmuls, recompute the rest
        >>> activation_checkpointing(model, "full", ratio=0.5)  # the first half of the blocks recomputed fully
        >>> activation_checkpointing(model, "selective", offload=0.25)  # a quarter on the host, the rest selective
    """
    if policy not in ("full", "selective", "none"):
        raise ValueError(f"activation_checkpointing: policy={policy!r}; use 'full', 'selective' or 'none'")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(
            f"activation_checkpointing: ratio={ratio} must be in [0, 1] (the fraction of blocks)"
        )
    if not 0.0 <= offload <= 1.0:
        raise ValueError(
            f"activation_checkpointing: offload={offload} must be in [0, 1] (the fraction of blocks)"
        )
    blocks = checkpoint_blocks(model)
    offloaded = int(offload * len(blocks))
    recomputed = min(int(ratio * len(blocks)), len(blocks) - offloaded) if policy != "none" else 0
    for i, block in enumerate(blocks):
        _set(block, policy if offloaded <= i < offloaded + recomputed else "none")
    if offloaded:
        set_offload(blocks, offloaded, Offloader(prefetch=prefetch))
    else:
        clear_offload(blocks)
    return recomputed
