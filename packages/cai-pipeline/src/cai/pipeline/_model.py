"""This rank's part of a pipelined model: its chunks, tied weights across the first and last stage, and its state.

[Note: tied embeddings across stages]
A model whose head weight is its embedding weight (``tie_word_embeddings``) keeps one set of values although the
embedding lives on the first slot and the head on the last: the last slot holds a copy of the weight, both start
equal (every rank builds the same model), and ``sync_shared_params()`` sums the two gradients over a group of the
two ranks before each optimizer step, so both copies take the same step. When one rank holds both slots (one
stage, or rank 0 under the V layout) the two chunks share the parameter itself and nothing is exchanged. In a
checkpoint the weight is stored once, under the embedding's name; the last slot loads its copy from there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from cai.mesh import LocalShard, ShardSpec
from cai.pipeline._layout import PipelineLayout, layout_from_pp_plan
from cai.pipeline._manager import PipelineStageManager
from cai.pipeline._split import LocalState, PipelineStage, split_model
from cai.pipeline._stage import Batch, Hidden, StageOutput

__all__ = ["PipelineModel", "build_stages"]


class PipelineModel(nn.Module):
    """The chunks one rank holds (``chunks[c]`` is chunk ``c``, a ``PipelineStage``), with the state protocol and the
    tied-weight gradient sum. Built by ``build_stages``."""

    def __init__(
        self,
        chunks: Sequence[PipelineStage],
        manager: PipelineStageManager,
        tied_group: dist.ProcessGroup | None,
    ) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.stage_manager = manager
        self.config = chunks[0].config
        self._tied_group = tied_group

    def forward(self, hidden: Hidden | None, batch: Batch) -> StageOutput:
        """Run the current chunk (``manager.model_chunk_id``; the only one when there is one)."""
        if len(self.chunks) == 1:
            return self.chunks[0](hidden, batch)
        chunk = self.stage_manager.model_chunk_id
        if chunk is None:
            raise RuntimeError(
                f"PipelineModel: this rank holds {len(self.chunks)} chunks; call chunks[c] directly or run it inside "
                "`with manager.switch_model_chunk_id(c):`"
            )
        return self.chunks[chunk](hidden, batch)

    def shared_params(self) -> list[nn.Parameter]:
        """This rank's copies of tied weights (see [Note: tied embeddings across stages]), each once."""
        out: list[nn.Parameter] = []
        for chunk in self.chunks:
            for p in chunk.shared_params():
                if all(p is not q for q in out):
                    out.append(p)
        return out

    def sync_shared_params(self) -> None:
        """Sum the gradients of tied weights over the first and last stage; call after backward, before the step.

        Every rank may call it (ranks outside the first and last stage, and ranks holding both, do nothing)."""
        if self._tied_group is None:
            return
        for p in self.shared_params():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self._tied_group)

    @property
    def tied_group(self) -> dist.ProcessGroup | None:
        """The group of the first and last stage over which tied weights' gradients are summed (None when no
        weight is tied across stages)."""
        return self._tied_group

    def global_name(self, key: str) -> str:
        """The full model's name for one of this module's own state-dict keys (``chunks.<c>.module.<name>``): the
        global block index, and a tied head weight under the embedding's name (the name a checkpoint stores it
        under). A tensor-parallel state or an optimizer keyed by these names sees every stage as part of one model.
        """
        head, chunk, sub, rest = key.split(".", 3)
        if head != "chunks" or sub != "module":
            raise KeyError(f"PipelineModel.global_name: {key!r} is not a key of this PipelineModel")
        stage = self.chunks[int(chunk)]
        return stage.tied.get(rest) or stage.global_name(rest)

    def global_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Every chunk's parameters under the full model's names, each parameter once (a tied weight shared by two
        chunks of this rank under its first name, the embedding's)."""
        seen: set[int] = set()
        out = []
        for chunk in self.chunks:
            for name, p in chunk.global_named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((name, p))
        return out

    def sharded_state_dict(self) -> dict[str, LocalShard]:
        """Every chunk's parameters and persistent buffers under the full model's names (the state protocol)."""
        out: dict[str, LocalShard] = {}
        for chunk in self.chunks:
            out.update(chunk.sharded_state_dict())
        return out

    def load_sharded_state_dict(self, read: Callable[[str, ShardSpec, torch.dtype], torch.Tensor]) -> None:
        for chunk in self.chunks:
            chunk.load_sharded_state_dict(read)


def build_stages(
    model: nn.Module,
    manager: PipelineStageManager,
    *,
    layout: PipelineLayout | None = None,
    layers_per_stage: Sequence[int] | None = None,
    local_state: LocalState | None = None,
) -> PipelineModel:
    """Split ``model`` into this rank's chunks (collective: every rank of the world calls it).

    Args:
        model: the full model, the same on every rank (its modules move into the chunks; drop it afterwards).
        manager: this rank's ``PipelineStageManager`` (stages, chunks, interleaved or V layout).
        layout: where the embeddings, blocks, final norm and head are (default: the config's
            ``base_model_pp_plan``; see ``PipelineLayout``).
        layers_per_stage: blocks per slot, in slot order (default: ``manager.distribute_layers``, which uses the
            manager's ``num_layers_per_stage`` when given); ``balance_layers(model, manager.num_slots)`` balances
            them by cost.
        local_state: how the stages report their tensors for checkpoints (default: whole tensors; a
            tensor-parallel model passes cai-shardformer's functions, see ``LocalState``).

    Example::

        manager = PipelineStageManager(ParallelDims(pp=2).build_mesh(), "pp")
        stage = build_stages(model, manager)              # one chunk: stage(hidden, batch)
        ... backward ...
        stage.sync_shared_params(); optimizer.step()      # tied embeddings stay one set of values
    """
    layout = layout or layout_from_pp_plan(model)
    num_blocks = len(model.get_submodule(layout.layers))
    counts = list(layers_per_stage) if layers_per_stage is not None else manager.distribute_layers(num_blocks)
    slots = manager.stage_indices
    chunks = [
        split_model(
            model,
            slot=s,
            num_slots=manager.num_slots,
            layers_per_stage=counts,
            layout=layout,
            keep_tied=0 in slots,
            local_state=local_state,
        )
        for s in slots
    ]
    # The pipeline stages holding slot 0 and the last slot sum tied gradients; under V both are stage 0.
    first_stage = 0
    last_stage = 0 if manager.use_zbv else manager.num_stages - 1
    group = None
    if _has_tied(model, layout) and first_stage != last_stage:
        group = manager.init_process_group_by_stages([first_stage, last_stage])
    return PipelineModel(chunks, manager, group)


def _has_tied(model: nn.Module, layout: PipelineLayout) -> bool:
    embed = {id(p) for path in layout.embeddings for p in model.get_submodule(path).parameters()}
    return any(id(p) in embed for path in layout.head for p in model.get_submodule(path).parameters())
