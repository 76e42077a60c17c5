"""Expert parallelism: the experts of a mixture-of-experts block split over the ep group, tokens sent to them by
all-to-all and back.

Only the block's `experts` module is replaced (`ExpertParallelExperts.from_native_module`); the router (`gate`), a
shared expert and the block's forward stay the model's own, so router logits, top-k, normalisation and the
auxiliary load-balancing loss are the model's by construction (transformers records the router logits from the
router module).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from cai.kernels import grouped_linear, permute_tokens, unpermute_tokens
from cai.shardformer._layout import Piece
from cai.shardformer._linear import ParallelModule


class _AllToAll(torch.autograd.Function):
    """Rows to ranks by `send` sizes, receiving `recv` sizes; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class ExpertParallelExperts(ParallelModule):
    """The stacked experts of one MoE block (`gate_up_proj` `(E, 2F, H)`, `down_proj` `(E, H, F)`, Hugging Face's
    layout) with expert `e` on ep rank `e // (E / ep)`, called like the module it replaces:
    `forward(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H)`.

    Args (of `from_native_module`):
        experts: the model's experts module (Mixtral, Qwen2-MoE, Qwen3-MoE), whose rank-local slices are kept.
        ep_group: the expert-parallel group; None or one rank keeps all experts and sends nothing.
        capacity_factor: None (default) is dropless. A float caps the rows each rank sends to one expert at
            `ceil(capacity_factor * T * k / E)`; rows past the cap (in token order) are dropped and add nothing.

    See [Note: expert-parallel step] for the data flow and [Note: expert gradients] for the gradient scale.
    """

    split_dims = {"gate_up_proj": 0, "down_proj": 0}

    def __init__(self, gate_up_proj, down_proj, act_fn, num_experts, ep_group, capacity_factor) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.act_fn = act_fn
        self.num_experts = num_experts
        self.process_group = ep_group
        self.ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        self.num_local_experts = num_experts // self.ep_size
        self.capacity_factor = capacity_factor

    @classmethod
    def from_native_module(
        cls, experts: nn.Module, process_group=None, *, ep_group=None, capacity_factor: float | None = None
    ) -> ExpertParallelExperts:
        # process_group is the tp group that every policy replacement receives; experts are not tp-sharded.
        num = experts.gate_up_proj.shape[0]
        ep = 1 if ep_group is None else dist.get_world_size(ep_group)
        if num % ep:
            raise ValueError(
                f"{num} experts do not split evenly over ep_size={ep} ranks; choose an ep size that divides {num} "
                f"(for example {math.gcd(num, ep)})"
            )
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be > 0, or None for dropless routing")
        per = num // ep
        rank = 0 if ep_group is None else dist.get_rank(ep_group)
        local = slice(rank * per, (rank + 1) * per)
        return cls(
            nn.Parameter(experts.gate_up_proj.data[local].clone()),
            nn.Parameter(experts.down_proj.data[local].clone()),
            experts.act_fn,
            num,
            ep_group,
            capacity_factor,
        )

    def pieces(self, name: str, rank: int) -> list[Piece]:
        # Without an ep group (ep 1) the module holds every expert whatever `rank` (the caller's rank in the
        # default group, which the None group means to torch) says.
        rank = rank if self.ep_size > 1 else 0
        return [Piece(0, rank * self.num_local_experts, self.num_local_experts)]

    def full_size(self, name: str) -> int:
        return self.num_experts

    def _mlp(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        gate, up = grouped_linear(rows, self.gate_up_proj, counts).chunk(2, dim=-1)
        return grouped_linear(self.act_fn(gate) * up, self.down_proj, counts)

    # [Note: expert-parallel step]
    # 1. permute: (token, slot) pairs sorted by global expert id, so the rows for ep rank r are one contiguous
    #    block (experts r*E_l .. (r+1)*E_l - 1) in expert order; optional capacity drops rows past the cap.
    # 2. the per-expert counts are exchanged first (an all-to-all of E integers), which gives every rank the
    #    sizes it receives from each source, then the rows go by all-to-all with those split sizes.
    # 3. received rows come grouped (source rank, local expert); a stable sort by local expert makes each expert's
    #    rows contiguous for the grouped GEMM (source order kept inside an expert), and is undone afterwards.
    # 4. the outputs return by the reverse all-to-all and are combined with the router weights at the source.
    def forward(self, hidden_states, top_k_index, top_k_weights):
        rows, order, counts = permute_tokens(hidden_states, top_k_index, self.num_experts)
        keep = None
        if self.capacity_factor is not None:
            cap = math.ceil(self.capacity_factor * top_k_index.numel() / self.num_experts)
            starts = torch.cumsum(counts, 0) - counts
            sorted_expert = top_k_index.reshape(-1)[order]
            keep = (torch.arange(rows.shape[0], device=rows.device) - starts[sorted_expert]) < cap
            rows, counts = rows[keep], counts.clamp(max=cap)
        if self.ep_size == 1:
            out = self._mlp(rows, counts)
        else:
            out = self._exchange(rows, counts)
        if keep is not None:
            full = out.new_zeros(keep.shape[0], out.shape[1])
            out = full.index_copy(0, keep.nonzero().squeeze(1), out)  # dropped rows contribute zero
        return unpermute_tokens(out, order, top_k_weights).to(hidden_states.dtype)

    def _exchange(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, el, group = self.ep_size, self.num_local_experts, self.process_group
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)
        recv_counts = recv_counts.view(ep, el)  # [source rank, local expert]
        send = counts.view(ep, el).sum(1).tolist()
        recv = recv_counts.sum(1).tolist()
        received = _AllToAll.apply(rows, send, recv, group)
        chunk_expert = torch.arange(ep * el, device=rows.device) % el
        row_expert = torch.repeat_interleave(chunk_expert, recv_counts.reshape(-1))
        by_expert = torch.argsort(row_expert, stable=True)
        # [Note: expert gradients]
        # With each ep rank's loss averaged (as the data-parallel reduction over dp x ep does for the dense
        # weights), an expert's weight gradient is the mean, not the sum, of what the ep ranks' tokens give it:
        # the expert output's gradient is scaled by 1/ep and its input's gradient by ep, so only the expert
        # weights see the 1/ep and the gradients returned to each source rank are its own loss's. The experts
        # are owned by one rank, so their gradients need no reduction over ep.
        local_in = _ScaleGrad.apply(received[by_expert], float(ep))
        local_out = _ScaleGrad.apply(self._mlp(local_in, recv_counts.sum(0)), 1.0 / ep)
        back = torch.empty_like(by_expert)
        back[by_expert] = torch.arange(by_expert.numel(), device=by_expert.device)
        return _AllToAll.apply(local_out[back], recv, send, group)
