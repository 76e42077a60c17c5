"""Layer assignment by a cost model: parameters and FLOPs per block, with the embeddings and the head charged to
the first and last slot, so those slots get fewer blocks.

[Note: stage cost]
A piece's cost is its share of the model's forward FLOPs per token plus its share of the model's parameters
(both normalised to 1), so time and memory count equally. FLOPs per token are 2 per weight of every matrix that
multiplies activations (linear layers, a head) and, per block, ``4 * seq_len * hidden`` for attention scores and
the weighted sum (causal masking halves that; the constant does not change the balance between blocks). An
embedding lookup costs parameters but no FLOPs. Blocks are then cut into consecutive slots so that the most
expensive slot is as cheap as possible (exact, by dynamic programming).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from cai.pipeline._layout import PipelineLayout, layout_from_pp_plan

__all__ = ["PieceCost", "balance_layers", "partition_by_cost"]


@dataclass(frozen=True)
class PieceCost:
    """Forward FLOPs per token and parameter count of one piece of the model."""

    flops: float
    params: int


def _matmul_weights(module: nn.Module) -> int:
    """Weights that multiply activations: every parameter of two or more dims outside embedding lookups."""
    total = 0
    for m in module.modules():
        if isinstance(m, nn.Embedding):
            continue
        total += sum(p.numel() for p in m.parameters(recurse=False) if p.dim() >= 2)
    return total


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def piece_costs(
    model: nn.Module, layout: PipelineLayout, *, seq_len: int
) -> tuple[PieceCost, list[PieceCost], PieceCost]:
    """Costs of (embeddings, each block, final modules and head); see [Note: stage cost]."""
    blocks = list(model.get_submodule(layout.layers))
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if hidden is None:
        embeds = [model.get_submodule(p) for p in layout.embeddings]
        hidden = next((getattr(e, "embedding_dim", 0) for e in embeds if hasattr(e, "embedding_dim")), 0)
    attention = 4.0 * seq_len * hidden
    first = PieceCost(0.0, sum(_params(model.get_submodule(p)) for p in layout.embeddings))
    per_block = [PieceCost(2.0 * _matmul_weights(b) + attention, _params(b)) for b in blocks]
    tail = [model.get_submodule(p) for p in (*layout.final, *layout.head)]
    # A tied head shares its weight with the embedding, but the last stage holds a copy of it: count it again.
    last = PieceCost(
        sum(2.0 * _matmul_weights(m) for m in tail),
        sum(sum(p.numel() for _, p in m.named_parameters(remove_duplicate=False)) for m in tail),
    )
    return first, per_block, last


def partition_by_cost(
    costs: Sequence[float], num_slots: int, *, first: float = 0.0, last: float = 0.0
) -> list[int]:
    """Blocks per slot: consecutive ranges, at least one block each, minimising the most expensive slot, where
    slot 0 also pays ``first`` and the last slot ``last``. Ties go to the earliest cut that reaches the optimum."""
    n = len(costs)
    if num_slots < 1 or n < num_slots:
        raise ValueError(
            f"partition_by_cost: {n} blocks cannot fill {num_slots} pipeline slots (stages x chunks); every slot "
            f"needs at least one block: use at most {n} stages x chunks"
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")

    def extra(s: int) -> float:
        return (first if s == 0 else 0.0) + (last if s == num_slots - 1 else 0.0)

    # best[s][i]: the lowest possible maximum over slots 0..s when they hold blocks [0, i).
    best = [[inf] * (n + 1) for _ in range(num_slots)]
    cut = [[0] * (n + 1) for _ in range(num_slots)]
    for i in range(1, n + 1):
        best[0][i] = prefix[i] + extra(0)
    for s in range(1, num_slots):
        for i in range(s + 1, n + 1):
            for j in range(s, i):
                v = max(best[s - 1][j], prefix[i] - prefix[j] + extra(s))
                if v < best[s][i]:
                    best[s][i], cut[s][i] = v, j
    counts, i = [], n
    for s in range(num_slots - 1, 0, -1):
        j = cut[s][i]
        counts.append(i - j)
        i = j
    counts.append(i)
    return counts[::-1]


def balance_layers(
    model: nn.Module, num_slots: int, *, layout: PipelineLayout | None = None, seq_len: int = 2048
) -> list[int]:
    """Blocks per slot for ``model`` by [Note: stage cost] (``seq_len`` sets the attention share).

    Example::

        counts = balance_layers(model, 4)      # fewer blocks on the first and last slot
        stages = build_stages(model, manager, layers_per_stage=counts)
    """
    layout = layout or layout_from_pp_plan(model)
    embed, blocks, tail = piece_costs(model, layout, seq_len=seq_len)
    flops = sum(b.flops for b in blocks) + embed.flops + tail.flops
    params = sum(b.params for b in blocks) + embed.params + tail.params

    def share(c: PieceCost) -> float:
        return (c.flops / flops if flops else 0.0) + (c.params / params if params else 0.0)

    return partition_by_cost([share(b) for b in blocks], num_slots, first=share(embed), last=share(tail))
