"""Regional compilation: each repeated block's forward under ``torch.compile``, the rest of the model eager.

[Note: compiled blocks]
A decoder is one block repeated; compiling the block's forward, not the whole model, gives Inductor everything it
fuses well (residual adds into norms, rotary, the SwiGLU, FP8 quantisation into the ops that produce or read the
operands) while the embedding, the loss and every sharding hook stay eager:
- The blocks share one compiled graph: the block class's ``forward`` function is compiled once and each block is
  its argument (torch's inlined modules make parameters graph inputs), so twenty-two blocks compile as one.
- Only ``forward`` is compiled, not the module call: a block's own forward hooks and activation checkpointing's
  wrappers run eagerly around it. Hooks on the layers inside a block are traced with it: cai-zero has none
  there; cai-gemini hooks every layer that owns parameters, and its hooks break the graph at each of them.
- Only training-mode calls take the graph; evaluation and generation (whose KV cache and one-token steps would
  recompile) run the block's own forward. A KV cache in training would recompile the graph once per block,
  so a Hugging Face model's ``config.use_cache`` is turned off (a training forward never reads it back; ``generate``
  asks for its cache itself).
- cai kernels give way under compilation (``cai.kernels`` takes its torch path while dynamo traces), so Inductor
  fuses their torch forms with their neighbours instead of tracing Triton's launcher and autotuner.
- Shapes start static; a second sequence length makes dynamo recompile with dynamic dimensions (its default).
- Where Inductor cannot build the graph (no C compiler, no Triton), one warning is logged and the blocks run
  eagerly from then on.

`use_fp8=True` under LowLevelZero compiles the blocks by itself on GPUs with FP8 tensor cores. Without it the six
quantisations of each FP8 linear are separate kernels launched from Python, and FP8 was no faster than bf16 (1.01x
on the Llama-3-8B shape with checkpointing); compiled, the quantisations fuse into their neighbours (1.16x there,
1.22x on 1B with the default tensor-wise scales, one H200). A bf16 model gains nothing measurable from it on those
shapes (93.4k against 93.8k tokens/s with cai's kernels on 1B), so it is not on by default there.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from cai.booster._checkpointing import checkpoint_blocks
from cai.booster._offload import with_mixin

__all__ = ["compile_blocks"]

logger = logging.getLogger(__name__)

_failed = False  # Inductor could not build a graph here: every block runs eagerly from then on


@functools.cache
def _compiled(forward):
    return torch.compile(forward)


class _CompiledForward:
    """Mixed into a block's class: a training-mode ``forward`` runs the class's forward through ``torch.compile``."""

    def forward(self, *args, **kwargs):
        global _failed
        eager = super().forward
        if not self.training or _failed:
            return eager(*args, **kwargs)
        try:
            return _compiled(eager.__func__)(self, *args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as exc:
            # raised while building the graph, before it runs: the call can be redone eagerly
            _failed = True
            logger.warning("cai compile_blocks: compiling the blocks failed, running them eagerly (%s)", exc)
            return eager(*args, **kwargs)


def compile_blocks(model: nn.Module) -> int:
    """Compile the forward of each of ``model``'s repeated blocks with ``torch.compile``, in place; returns how many
    blocks (see [Note: compiled blocks]).

    Blocks are found as :func:`activation_checkpointing` finds them: a Hugging Face model's decoder layers, or the
    items of the model's largest ``nn.ModuleList`` of one class. Call it before or after ``boost()``; it composes
    with activation checkpointing, offload, cai kernels, FP8 layers and the plugins' hooks (Gemini's, on every
    layer, break the graph into pieces: correct, but with little to gain).
    Parameters, names and state dicts are unchanged. ``TORCH_COMPILE_DISABLE=1`` turns every compilation off.

    Example:
        >>> compile_blocks(model)   # 22 for a 1B Llama; one graph serves all of them
    """
    blocks = checkpoint_blocks(model)
    for block in blocks:
        if not isinstance(block, _CompiledForward):
            block.__class__ = with_mixin(_CompiledForward, type(block))
    for module in model.modules():  # also under a plugin's wrapper; modules of one model share its config
        config = getattr(module, "config", None)
        if not getattr(config, "use_cache", False):
            continue
        config.use_cache = False
        logger.info(
            "cai compile_blocks: config.use_cache set to False (a training KV cache recompiles per block)"
        )
    return len(blocks)


def compile_fp8_blocks(model: nn.Module, device: torch.device) -> int:
    """What ``use_fp8=True`` adds on a GPU with FP8 tensor cores (compute capability 8.9 or more): the blocks
    compiled (see [Note: compiled blocks]); returns how many. Elsewhere, or in a model without repeated blocks, the
    FP8 layers run eagerly and this returns 0."""
    from cai.kernels import fp8_tensor_cores

    if not fp8_tensor_cores(device):
        return 0
    try:
        return compile_blocks(model)
    except ValueError:  # no repeated blocks to compile
        logger.info(
            "cai use_fp8: %s has no repeated blocks; its FP8 layers run eagerly", type(model).__name__
        )
        return 0
