"""Regional compilation: each repeated block's forward under ``torch.compile``, the rest of the model eager.

[Note: compiled blocks]
A decoder is one block repeated; compiling the block's forward, not the whole model, gives Inductor everything it
fuses well (residual adds into norms, rotary, the SwiGLU, FP8 quantisation into the ops that produce or read the
operands) while the embedding, the loss and every sharding hook stay eager:
- The blocks share one compiled graph: the block class's ``forward`` function is compiled once and each block is
  its argument (torch's inlined modules make parameters graph inputs), so twenty-two blocks compile as one.
- An uncheckpointed block compiles its ``forward``, not the module call: its own forward hooks run eagerly
  around the graph. Hooks on the layers inside a block are traced with it: cai-zero has none there;
  cai-gemini hooks every layer that owns parameters, and its hooks break the graph at each of them.
- A checkpointed block compiles its checkpoint with the module call inside it
  (``_cai_run_checkpoint``, which cai's checkpoint function hands the call to): dynamo traces torch's checkpoint
  as one region, and AOTAutograd's partitioner puts the recompute into the block's backward graph, where it fuses
  with the backward's own kernels. With the checkpoint around the graph instead, the recompute ran the compiled
  forward a second time through checkpoint's saved-tensor hooks before the compiled backward: host work per block
  that bounds a backward whose host is barely ahead of the GPU. It keeps what eager
  checkpointing keeps (the block inputs; ``selective`` applies its policy to the traced ops), and the step's host
  time on a tiny 8-block Llama (``bench_compiled_checkpoint.py``, CPU) falls by a third. Under cai-gemini the
  layer hooks cannot be traced inside the checkpoint: dynamo runs that checkpoint eagerly and compiles the pieces
  between the hooks, as before. Hugging Face's ``gradient_checkpointing_enable()`` (torch's non-reentrant
  checkpoint) is adopted on the block's first call and takes the same path; a reentrant or any other checkpoint
  function keeps the checkpoint around the graph. So do blocks with FP8 layers: on FP8 tensor cores Inductor's
  partitioner kept about four times what eager checkpointing keeps with their checkpoint inside the graph (a
  4-block Llama, h512, 4 x 512 tokens, on an H100: 100.8 MB against 25.2), which the emulation on CPU does not
  show; around the graph they keep the block inputs.
- A checkpointed block with FP8 layers runs its graph inside ``cai.kernels.fp8_weights_ready(block)``: the
  layers that keep their weights in FP8 are brought up to date eagerly, and the graph reads those bytes instead
  of casting each weight again in the recompute ([Note: fp8 kept weights] in cai-kernels). An uncheckpointed
  block casts its weights in its graph, fused there: with one forward a step, keeping them measured 1% slower
  (1B b8 s2048 on one H100, 105.4k against 106.7k tokens/s) for 0.8 GiB more, where checkpointed with 4 micro-
  batches accumulated it measured 1.6% faster (86.2k against 84.8k). Uncheckpointed blocks reading kept weights
  from their second accumulated micro-batch on was built and measured slower (1B b8 s2048 x 4 accumulated, one
  H100: 107.2k and 89.5k against 110.2k tokens/s, 2.6 GiB more), so it is not done.
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

from cai.booster._checkpointing import _Checkpoint, adopt_checkpoint, checkpoint_blocks
from cai.booster._offload import with_mixin

__all__ = ["compile_blocks"]

logger = logging.getLogger(__name__)

_failed = False  # Inductor could not build a graph here: every block runs eagerly from then on


@functools.cache
def _compiled(function):
    return torch.compile(function)


def _run_compiled(function, *args, **kwargs):
    """``function`` through its compiled form; where Inductor cannot build the graph, eagerly from then on."""
    global _failed
    try:
        return _compiled(function)(*args, **kwargs)
    except torch._dynamo.exc.BackendCompilerFailed as exc:
        # raised while building the graph, before it runs: the call can be redone eagerly
        _failed = True
        logger.warning("cai compile_blocks: compiling the blocks failed, running them eagerly (%s)", exc)
        return function(*args, **kwargs)


def _checkpointed(run, fn, *args):
    return run(fn, *args)


class _CompiledForward:
    """Mixed into a block's class: a training-mode ``forward`` runs the class's forward through ``torch.compile``;
    a checkpointed block's call runs with its checkpoint in one graph."""

    def __call__(self, *args, **kwargs):
        # Hugging Face's own non-reentrant checkpoint (gradient_checkpointing_enable) takes the same path as cai's
        fn = self.__dict__.get("_gradient_checkpointing_func")
        if fn is not None and not isinstance(fn, _Checkpoint):
            adopted = adopt_checkpoint(fn)
            if adopted is not None:
                self._gradient_checkpointing_func = adopted
        return super().__call__(*args, **kwargs)

    def forward(self, *args, **kwargs):
        eager = super().forward
        # under compilation this block is being traced inside its checkpoint's graph
        if not self.training or _failed or torch.compiler.is_compiling():
            return eager(*args, **kwargs)
        if _has_fp8(self) and _is_checkpointed(self):
            from cai.kernels import fp8_weights_ready

            # the graph reads the layers' kept FP8 weights, brought up to date (module note)
            with fp8_weights_ready(self):
                return _run_compiled(eager.__func__, self, *args, **kwargs)
        return _run_compiled(eager.__func__, self, *args, **kwargs)

    def _cai_run_checkpoint(self, run, fn, *args):
        """The checkpointed call of this block (``run`` is torch's checkpoint with the block's keywords, ``fn`` the
        module call)."""
        if not self.training or _failed or _has_fp8(self):
            return run(fn, *args)  # FP8 blocks: the checkpoint around the compiled forward (module note)
        return _run_compiled(_checkpointed, run, fn, *args)


def _is_checkpointed(block: nn.Module) -> bool:
    """Whether ``block`` runs under cai's checkpoint or Hugging Face's (a property of the block, the same in its
    forward and its recompute)."""
    return block.__dict__.get("_cai_checkpoint") is not None or bool(
        getattr(block, "gradient_checkpointing", False)
    )


def _has_fp8(block: nn.Module) -> bool:
    found = block.__dict__.get("_cai_has_fp8")
    if found is None:
        from cai.kernels import Fp8Linear

        found = block.__dict__["_cai_has_fp8"] = any(isinstance(m, Fp8Linear) for m in block.modules())
    return found


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
