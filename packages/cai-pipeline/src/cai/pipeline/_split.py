"""Cutting a model into pipeline stages without copying its forward code.

[Note: a stage is the model with other stages' modules removed]
A stage is the user's model itself, copied as a shell that shares its modules (no parameter is copied):
the block list holds only this stage's blocks, the embeddings exist only on the first stage, the final norm and
the head only on the last; elsewhere they are parameterless stand-ins. The model's own forward then runs
unchanged, so it still computes the rotary embeddings, the causal and sliding-window masks and the positions:

- the first stage calls the model with ``input_ids``;
- a later stage calls it with ``inputs_embeds=<the received hidden states>`` (only for the shape, dtype and
  device the masks need) and feeds the received tensor itself to its first block (see ``_TakeIncoming``). What a
  model does between the embedding and the first block (Gemma's scaling by sqrt(hidden), GPT-2's position
  embeddings, embedding dropout) already happened on the first stage and must not happen twice;
- stages other than the last call the base model and send its last hidden state (the final norm is a stand-in);
  the last stage calls the whole model, so the head and the loss (with ``labels``) are the model's own.

Each block keeps its own attributes (``layer_idx``, ``attention_type``); the shell's config lists only the
stage's entries of ``layer_types``, since some models index it by the position in the block list.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cai.mesh import LocalShard, Read, ShardSpec
from cai.pipeline._layout import PipelineLayout, layout_from_pp_plan
from cai.pipeline._manager import check_layers_per_stage, distribute_layers
from cai.pipeline._stage import Batch, Hidden, StageOutput

__all__ = ["LocalState", "PipelineStage", "split_model"]


class _AbsentEmbedding(nn.Module):
    """Stands for an embedding another stage owns: zeros of the right shape, without memory or parameters."""

    def __init__(self, dim: int, like: torch.Tensor) -> None:
        super().__init__()
        self.dim = dim
        # A 0-d buffer that follows .to(); not persistent, so it never reaches a checkpoint.
        # On a lazy (meta) model the buffer is made on the CPU, so that materialising the stage can move it.
        device = like.device if like.device.type != "meta" else torch.device("cpu")
        self.register_buffer("zero", torch.zeros((), dtype=like.dtype, device=device), persistent=False)

    def forward(self, ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.zero.expand(*ids.shape, self.dim)


class _Absent(nn.Identity):
    """Stands for a module another stage owns (final norm, head): returns its input."""


class _TakeIncoming:
    """The first block of a later stage, called with the received hidden states instead of whatever the model
    computed from its placeholder input (see [Note: a stage is the model with other stages' modules removed]).

    It is created while the model iterates its block list, outside any activation checkpoint, so a recomputation
    sees the same input."""

    def __init__(self, block: nn.Module, hidden: torch.Tensor) -> None:
        self.block = block
        self.hidden = hidden

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            args = (self.hidden, *args[1:])
        else:
            kwargs["hidden_states"] = self.hidden
        return self.block(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.block, name)


class _StageBlocks(nn.ModuleList):
    """This stage's blocks. While ``incoming`` is set, iteration yields the first block as ``_TakeIncoming``."""

    incoming: torch.Tensor | None = None

    def __getitem__(self, idx: int | slice) -> Any:
        if not isinstance(idx, slice):
            return super().__getitem__(idx)
        blocks = list(self._modules.values())[idx]
        if self.incoming is not None and blocks and idx.indices(len(self))[0] == 0:
            blocks[0] = _TakeIncoming(blocks[0], self.incoming)
        return blocks

    def __iter__(self):  # type: ignore[override]
        return iter(self[:])


def _is_embedding(module: nn.Module) -> bool:
    return isinstance(module, nn.Embedding) or (
        hasattr(module, "embedding_dim") and isinstance(getattr(module, "weight", None), torch.Tensor)
    )


def _stand_in(module: nn.Module) -> nn.Module:
    if _is_embedding(module):
        return _AbsentEmbedding(module.embedding_dim, module.weight)
    return _Absent()


@contextlib.contextmanager
def _process_groups_by_reference() -> Iterator[None]:
    """Inside the block, deepcopy returns a ProcessGroup itself: a group is a handle to a communicator that the
    copy must share (a tensor-parallel model's hooks and loss hold theirs), and deepcopy cannot pickle it."""
    cls = dist.ProcessGroup
    had = "__deepcopy__" in vars(cls)
    old = vars(cls).get("__deepcopy__")
    cls.__deepcopy__ = lambda self, memo: self
    try:
        yield
    finally:
        if had:
            cls.__deepcopy__ = old
        else:
            del cls.__deepcopy__


def _check_covered(model: nn.Module, layout: PipelineLayout) -> None:
    """Every parameter must belong to a piece of the layout: anything else would be replicated on every stage."""
    pieces = [layout.layers, *layout.embeddings, *layout.final, *layout.head]
    loose = [
        n for n, _ in model.named_parameters() if not any(n == p or n.startswith(p + ".") for p in pieces)
    ]
    if loose:
        raise ValueError(
            f"{type(model).__name__}: parameters {loose[:5]} belong to no piece of {layout}; every parameter must "
            "sit in the embeddings, the blocks, the final modules or the head: add their module to the layout"
        )


def _whole_tensors(module: nn.Module) -> dict[str, LocalShard]:
    return {
        n: LocalShard(t.detach(), ShardSpec.full(t.shape))
        for n, t in module.state_dict(keep_vars=True).items()
    }


def _load_whole_tensors(module: nn.Module, read: Read) -> None:
    with torch.no_grad():
        for n, t in module.state_dict(keep_vars=True).items():
            t.copy_(read(n, ShardSpec.full(t.shape), t.dtype))


@dataclass(frozen=True)
class LocalState:
    """How a stage's model reports and loads its own tensors under its own names (the state protocol as two
    functions of the module); the stage renames them to the full model's names.

    The default holds whole tensors. A tensor-parallel model passes cai-shardformer's functions, so each tensor is
    this rank's tp block::

        from cai.shardformer import load_sharded_state_dict, sharded_state_dict
        build_stages(model, manager, local_state=LocalState(sharded_state_dict, load_sharded_state_dict))
    """

    save: Callable[[nn.Module], dict[str, LocalShard]] = _whole_tensors
    load: Callable[[nn.Module, Read], None] = _load_whole_tensors


class PipelineStage(nn.Module):
    """One model chunk of a pipeline (see [Note: stage contract] and [Note: a stage is the model with other
    stages' modules removed]); built by ``split_model`` or ``build_stages``.

    ``stage(hidden, batch)`` runs it; ``sharded_state_dict()`` / ``load_sharded_state_dict(read)`` report its
    parameters under the full model's names (global block indices), which is what cai-ckpt writes and reads.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        layout: PipelineLayout,
        slot: int,
        num_slots: int,
        layer_range: tuple[int, int],
        tied: dict[str, str],
        config: Any,
        local_state: LocalState | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        self.layout = layout
        self.slot = slot
        self.num_slots = num_slots
        self.layer_range = layer_range
        self.is_first = slot == 0
        self.is_last = slot == num_slots - 1
        # Head parameter name -> the embedding name it is tied to. The head's copy is never reported; it is loaded
        # from the embedding's entry (a tied weight is stored once, under the embedding's name).
        self.tied = dict(tied)
        self.config = config
        self.local_state = local_state or LocalState()

    @property
    def blocks(self) -> _StageBlocks:
        return self.module.get_submodule(self.layout.layers)  # type: ignore[return-value]

    def shared_params(self) -> list[nn.Parameter]:
        """This stage's halves of tied weights: the embedding on the first stage, the head on the last."""
        out = []
        for head, embed in self.tied.items():
            if self.is_first:
                out.append(self.module.get_parameter(embed))
            if self.is_last:
                p = self.module.get_parameter(head)
                if all(p is not q for q in out):
                    out.append(p)
        return out

    def forward(self, hidden: Hidden | None, batch: Batch) -> StageOutput:
        kwargs = {k: v for k, v in batch.items() if k not in ("input_ids", "inputs_embeds", "labels")}
        kwargs["use_cache"] = False
        if self.is_first:
            if hidden is not None:
                raise ValueError(
                    "PipelineStage: the first stage takes hidden=None and reads batch['input_ids']"
                )
            for key in ("input_ids", "inputs_embeds"):
                if key in batch:
                    kwargs[key] = batch[key]
        else:
            if not hidden or "hidden_states" not in hidden:
                raise ValueError(
                    f"PipelineStage (slot {self.slot}): expected the previous stage's {{'hidden_states': ...}}, "
                    f"got {None if hidden is None else list(hidden)}"
                )
            h = hidden["hidden_states"]
            kwargs["inputs_embeds"] = h.detach()  # shape, dtype and device only; the blocks get `h` itself
            self.blocks.incoming = h
        try:
            if not self.is_last:
                base = self.module.get_submodule(self.layout.base) if self.layout.base else self.module
                return {"hidden_states": base(**kwargs).last_hidden_state}
            if "labels" in batch and self.layout.head:
                kwargs["labels"] = batch["labels"]
            out = self.module(**kwargs)
            if not self.layout.head:
                return {"hidden_states": out.last_hidden_state}
            return {k: v for k, v in out.items() if v is not None and k != "past_key_values"}
        finally:
            self.blocks.incoming = None

    # ---- the state protocol ---------------------------------------------------------------------------------
    def global_name(self, name: str) -> str:
        """The full model's name of one of this chunk's own parameter or buffer names (the global block index)."""
        prefix = self.layout.layers + "."
        if name.startswith(prefix):
            index, rest = name[len(prefix) :].split(".", 1)
            return f"{prefix}{int(index) + self.layer_range[0]}.{rest}"
        return name

    def global_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This stage's parameters under the full model's names (for optimizers' checkpoints and comparisons)."""
        return [(self.global_name(n), p) for n, p in self.module.named_parameters()]

    def sharded_state_dict(self) -> dict[str, LocalShard]:
        """Full-model name -> this rank's piece, for what this stage holds (its ``local_state``, renamed); tied head
        weights are left out (the first stage reports them under the embedding's name)."""
        local = self.local_state.save(self.module)
        return {self.global_name(n): piece for n, piece in local.items() if n not in self.tied}

    def load_sharded_state_dict(self, read: Read) -> None:
        """Fill every tensor from ``read(name, spec, dtype)`` under its full-model name (a tied head weight from the
        embedding's entry)."""

        def local_read(name: str, spec: ShardSpec, dtype: torch.dtype) -> torch.Tensor:
            return read(self.tied.get(name) or self.global_name(name), spec, dtype)

        self.local_state.load(self.module, local_read)

    def extra_repr(self) -> str:
        return f"slot={self.slot}/{self.num_slots}, layers=[{self.layer_range[0]}, {self.layer_range[1]})"


def split_model(
    model: nn.Module,
    *,
    slot: int,
    num_slots: int,
    layers_per_stage: Sequence[int] | None = None,
    layout: PipelineLayout | None = None,
    keep_tied: bool = False,
    local_state: LocalState | None = None,
) -> PipelineStage:
    """The stage for virtual stage ``slot`` of ``num_slots`` of ``model`` (a Hugging Face model or any model
    with a ``layout``).

    Args:
        model: the full model. Its modules are shared with the stage, not copied, so build every stage of one
            model on one rank from the same object and drop the model afterwards (each stage keeps what it owns).
        slot: the virtual stage (see [Note: virtual stages]); 0 holds the embeddings, ``num_slots - 1`` the head.
        num_slots: pipeline stages times chunks per stage.
        layers_per_stage: blocks per slot (default: ``distribute_layers``' even split).
        layout: where the pieces are (default: ``layout_from_pp_plan(model)``, the model's ``base_model_pp_plan``).
        keep_tied: on the last slot, share a tied head weight with the model's embedding instead of copying it
            (right when the same rank also holds the first slot, as rank 0 does under the V layout).
        local_state: how the stage's model reports its tensors (default: whole tensors; see ``LocalState``).

    Example::

        stages = [split_model(copy.deepcopy(model), slot=s, num_slots=2) for s in range(2)]
        out = stages[1](stages[0](None, batch), batch)     # == model(**batch) as a dict
    """
    layout = layout or layout_from_pp_plan(model)
    _check_covered(model, layout)
    blocks = model.get_submodule(layout.layers)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(
            f"{layout.layers} is a {type(blocks).__name__}; the layout's layers must be an nn.ModuleList"
        )
    if not 0 <= slot < num_slots:
        raise ValueError(f"split_model: slot {slot} is outside [0, {num_slots})")
    counts = (
        check_layers_per_stage(layers_per_stage, len(blocks), num_slots)
        if layers_per_stage is not None
        else distribute_layers(len(blocks), num_slots)
    )
    start = sum(counts[:slot])
    end = start + counts[slot]
    first, last = slot == 0, slot == num_slots - 1

    params = dict(model.named_parameters(remove_duplicate=False))
    embed_params = {
        n
        for p in layout.embeddings
        for n, _ in model.get_submodule(p).named_parameters(prefix=p, remove_duplicate=False)
    }
    tied = {
        n: e
        for h in layout.head
        for n, _ in model.get_submodule(h).named_parameters(prefix=h, remove_duplicate=False)
        for e in embed_params
        if params[n] is params[e]
    }

    # deepcopy's memo maps each piece to what the stage holds instead: itself (shared), a stand-in, or a copy.
    memo: dict[int, Any] = {id(blocks): _StageBlocks(list(blocks)[start:end])}
    for path in layout.embeddings:
        m = model.get_submodule(path)
        memo[id(m)] = m if first else _stand_in(m)
    for path in layout.final:
        m = model.get_submodule(path)
        memo[id(m)] = m if last else _stand_in(m)
    for path in layout.head:
        m = model.get_submodule(path)
        untie = last and not first and not keep_tied and any(n.startswith(path + ".") for n in tied)
        if untie:
            with _process_groups_by_reference():
                memo[id(m)] = copy.deepcopy(m)
        else:
            memo[id(m)] = m if last else _stand_in(m)
    with _process_groups_by_reference():
        shell = copy.deepcopy(model, memo)

    config = getattr(model, "config", None)
    stage_config = getattr(shell, "config", None)
    if (
        stage_config is not None
        and stage_config is not config
        and isinstance(getattr(config, "layer_types", None), list)
    ):
        stage_config.layer_types = list(config.layer_types)[start:end]
    if config is not None and not getattr(config, "architectures", None) and hasattr(config, "to_dict"):
        config = copy.deepcopy(config)
        config.architectures = [type(model).__name__]
    return PipelineStage(
        shell,
        layout=layout,
        slot=slot,
        num_slots=num_slots,
        layer_range=(start, end),
        tied=tied,
        config=config,
        local_state=local_state,
    )
