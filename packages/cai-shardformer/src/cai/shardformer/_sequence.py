"""Sequence-parallel plumbing shared by the modes: where a model's sequence is split and gathered again, the
length check, the gradients of weights replicated across the sequence, and the regions in which the
`split_gather` and `ring` modes hand the whole sequence to the tensor-parallel layers.

[Note: where the sequence is split]
A Hugging Face decoder computes its position ids, causal mask and rotary tables in its own forward from the
shape of `inputs_embeds`, then calls each decoder layer with them. The split is therefore made at the input of
the first decoder layer, not at the embedding: the model forward still sees the whole sequence, and every layer
receives position embeddings and mask for the global sequence, while its hidden states are this rank's slice.
The output of the final norm is gathered again (`gather_forward_split_backward`), so the loss, the lm_head and
the model's output see the whole sequence and no Hugging Face forward is copied. Whatever runs on the hidden
states between those two points (norms, residual adds, dropout) runs on the slice; a mode makes attention and the
MLP see what they need (split_gather and ring: the whole sequence inside the tp region; all_to_all: the whole
sequence for a slice of the heads). Rank r holds tokens [r * S / sp, (r + 1) * S / sp).

A sequence length that does not divide by the sp size is refused at the split with the fix (pad the batch); it is
not padded silently, since padding changes what attention and the loss see unless the caller masks it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from cai.shardformer._ops import (
    _gather,
    gather_forward_split_backward,
    gather_seq,
    split_forward_gather_backward,
)
from cai.shardformer._ring import ring_column_linear

__all__ = [
    "RingRegion",
    "check_sequence_length",
    "check_sequence_parallel",
    "saving_only_the_slice",
    "sequence_region",
    "split_sequence",
]


def check_sequence_parallel(config, policy) -> None:
    """Refuse, with the fix, a sequence-parallel `config` that `policy` cannot apply (run by optimize())."""
    mode = config.sequence_parallelism_mode
    name = type(policy).__name__
    if mode not in policy.sequence_parallel_modes:
        raise NotImplementedError(
            f"{name} does not apply sequence_parallelism_mode={mode!r}; it applies "
            f"{list(policy.sequence_parallel_modes) or 'no sequence-parallel mode'} (turn sequence parallelism off "
            f"or choose one of those)"
        )
    if mode not in ("split_gather", "ring"):
        return
    tp = config.tensor_parallel_size
    if tp < 2:
        raise ValueError(
            f"sequence_parallelism_mode={mode!r} splits the sequence over the tensor-parallel group, which has "
            f"{tp} rank here; pass a tensor_parallel_process_group of 2 or more ranks, or use 'all_to_all' with "
            f"a sequence_parallel_process_group"
        )
    sp_group, tp_group = config.sequence_parallel_process_group, config.tensor_parallel_process_group
    if sp_group is not None:
        sp_ranks = dist.get_process_group_ranks(sp_group)
        tp_ranks = dist.get_process_group_ranks(tp_group if tp_group is not None else dist.group.WORLD)
        if sp_ranks != tp_ranks:
            raise ValueError(
                f"sequence_parallelism_mode={mode!r} uses the tensor-parallel group {tp_ranks} as its sequence "
                f"group, but sequence_parallel_process_group holds ranks {sp_ranks}; leave "
                f"sequence_parallel_process_group=None (or pass the tp group), or use 'all_to_all' for a group of "
                f"its own"
            )


def check_sequence_length(length: int, sp: int, mode: str) -> None:
    """Raise with the fix when a sequence of `length` tokens does not split evenly over `sp` ranks."""
    if length % sp:
        raise ValueError(
            f"sequence length {length} does not divide over the {sp} ranks of sequence parallelism "
            f"(sequence_parallelism_mode={mode!r}); pad the batch to a multiple of {sp} tokens (attention_mask 0 "
            f"and labels -100 on the padding) or turn sequence parallelism off for this call"
        )


def _hidden_states(args: tuple, kwargs: dict) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple]]:
    """The hidden states a module was called with, and how to call it with others instead."""
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"], lambda h: (args, {**kwargs, "hidden_states": h})
    if args:
        return args[0], lambda h: ((h, *args[1:]), kwargs)
    raise TypeError("a sequence-parallel hook needs the module's hidden_states (keyword or first positional)")


def split_sequence(
    first: str, gather_after: str, group, *, mode: str, dim: int = 1
) -> Callable[[nn.Module], None]:
    """A `param_replacement` entry for a model's backbone (see [Note: where the sequence is split]): the hidden
    states entering submodule `first` (the first decoder layer) are split along `dim` over `group`, and the
    output of `gather_after` (the final norm) is all-gathered along `dim`."""
    sp = dist.get_world_size(group)

    def split(module, args, kwargs):
        hidden, call = _hidden_states(args, kwargs)
        check_sequence_length(hidden.shape[dim], sp, mode)
        return call(split_forward_gather_backward(hidden, dim, group))

    def gather(module, args, output):
        return gather_forward_split_backward(output, dim, group)

    def apply(backbone: nn.Module) -> None:
        backbone.get_submodule(first).register_forward_pre_hook(split, with_kwargs=True)
        backbone.get_submodule(gather_after).register_forward_hook(gather)

    return apply


# [Note: the gathered sequence is not saved]
# Sequence parallelism saves memory only if the layers inside the tp region do not keep the gathered input for
# their weight gradients: that tensor is as large as the unsplit activation (b x s x h) on every rank. Inside a
# split_gather region the tensors autograd saves are routed through `saved_tensors_hooks`: one that shares the
# gathered tensor's storage (the column layers' inputs, or views of them) is stored as a reference to the
# rank's slice and gathered again the first time backward needs it (Megatron's re-gather), once for all the
# column layers that read it (q, k and v; gate and up), then dropped. Every other tensor goes to the hooks that
# were active outside the region (activation offloading, a memory probe), or is saved as usual without any.
class _Regather:
    def __init__(self, full: torch.Tensor, shard: torch.Tensor, dim: int, group) -> None:
        self.storage, self.device = full.untyped_storage().data_ptr(), full.device
        self.dim, self.group = dim, group
        # Only the innermost pair of hooks runs; the outer pair (if any) gets what this one passes on, the slice
        # included, so an offloading hook also moves the slice.
        self.outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.shard: torch.Tensor | None = shard.detach()
        self.kept = None  # the slice as packed for backward, on the first saved reference
        self.pending = 0  # saved references not yet unpacked in backward
        self.full: torch.Tensor | None = None

    def pack(self, t: torch.Tensor):
        if t.untyped_storage().data_ptr() == self.storage and t.device == self.device:
            if self.kept is None:
                self.kept = self.shard if self.outer is None else self.outer[0](self.shard)
                self.shard = None
            self.pending += 1
            return _Slice(self, t.shape, t.stride(), t.storage_offset())
        if self.outer is not None:
            return _Outer(self.outer[1], self.outer[0](t))
        return t

    @staticmethod
    def unpack(saved):
        if isinstance(saved, _Slice):
            return saved.unpack()
        if isinstance(saved, _Outer):
            return saved.unpack_fn(saved.packed)
        return saved

    def gathered(self) -> torch.Tensor:
        if self.full is None:
            shard = self.kept if self.outer is None else self.outer[1](self.kept)
            with torch.no_grad():
                self.full = _gather(shard, self.dim, self.group)
        full = self.full
        self.pending -= 1
        if self.pending <= 0:
            self.full = None  # the last reader has it; a second backward (retain_graph) gathers again
        return full


@dataclass(frozen=True)
class _Slice:
    """A saved view of the gathered tensor, kept as its geometry and the region's slice."""

    owner: _Regather
    shape: torch.Size
    stride: tuple[int, ...]
    offset: int

    def unpack(self) -> torch.Tensor:
        return self.owner.gathered().as_strided(self.shape, self.stride, self.offset)


@dataclass(frozen=True)
class _Outer:
    unpack_fn: Callable
    packed: object


def saving_only_the_slice(full: torch.Tensor, shard: torch.Tensor, dim: int, group):
    """A `saved_tensors_hooks` context in which autograd keeps `shard` instead of `full`, the all-gather of
    `shard` along `dim` (see [Note: the gathered sequence is not saved])."""
    saving = _Regather(full, shard, dim, group)
    return torch.autograd.graph.saved_tensors_hooks(saving.pack, _Regather.unpack)


def sequence_region(module: nn.Module, group, dim: int = 1) -> None:
    """Make `module` (an attention or MLP block whose column layers read its hidden states) a split_gather
    region: its input, split along `dim`, is all-gathered once on entry (gradient reduce-scattered), and the
    gathered tensor is not kept for backward (see [Note: the gathered sequence is not saved])."""
    contexts: list = []

    def enter(mod, args, kwargs):
        shard, call = _hidden_states(args, kwargs)
        full = gather_seq(shard, dim, group)  # (B, S, H)
        ctx = saving_only_the_slice(full, shard, dim, group)
        ctx.__enter__()
        contexts.append(ctx)
        return call(full)

    def leave(mod, args, kwargs, output):
        contexts.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(leave, with_kwargs=True, always_call=True)


class RingRegion:
    """A ring-mode region (attention or MLP): on entry, one ring (see [Note: ring steps]) multiplies the rank's
    slice of the sequence by the weights of all the column layers inside (q, k and v; gate and up). The block is
    then called with a stand-in of the whole sequence's shape that holds no data (Hugging Face attention reads
    `hidden_states.shape` for its views), and each column layer called with the stand-in returns its product."""

    def __init__(self, dim: int = 1) -> None:
        self.dim = dim
        self.stand_in: torch.Tensor | None = None
        self.outputs: dict[int, torch.Tensor] = {}

    def holds(self, x: torch.Tensor) -> bool:
        return self.stand_in is not None and x is self.stand_in

    def output(self, layer: nn.Module) -> torch.Tensor:
        return self.outputs[id(layer)]

    def install(self, module: nn.Module, group) -> None:
        sp = dist.get_world_size(group)
        layers = [m for m in module.modules() if getattr(m, "seq_parallel_mode", None) == "ring" and hasattr(m, "ring_weight")]  # fmt: skip
        if not layers:
            raise ValueError(
                f"{type(module).__name__} is a ring region without column layers of seq_parallel_mode='ring'; "
                f"build its column layers with that mode, or do not list it in tp_input_regions"
            )
        for layer in layers:
            layer.sp_region = self

        def enter(mod, args, kwargs):
            shard, call = _hidden_states(args, kwargs)
            products = ring_column_linear(shard, [layer.ring_weight() for layer in layers], self.dim, group)
            self.outputs = {id(layer): y for layer, y in zip(layers, products)}  # (B, S, out / tp) each
            shape = list(shard.shape)
            shape[self.dim] *= sp
            self.stand_in = shard.new_zeros(()).expand(shape)  # no storage of that size
            return call(self.stand_in)

        def leave(mod, args, kwargs, output):
            self.stand_in, self.outputs = None, {}

        module.register_forward_pre_hook(enter, with_kwargs=True)
        module.register_forward_hook(leave, with_kwargs=True, always_call=True)
