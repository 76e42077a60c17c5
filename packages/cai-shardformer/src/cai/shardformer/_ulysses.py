"""Ulysses (DeepSpeed-Ulysses) sequence parallelism: around attention, an all-to-all trades the sequence shard
for a head shard, attention runs over the whole sequence for H/sp heads, and a second all-to-all trades back.

[Note: kv heads under Ulysses]
The query heads must divide by sp (each rank takes H/sp of them). Key/value heads that do not divide by sp
(grouped-query attention with fewer kv heads than sp, or a count that is not a multiple) are repeated in place,
each kv head `lcm(KV, sp) / KV` times, before the all-to-all; repeat_interleave keeps each query head's kv head
the same (query head h still reads kv head h * KV / H), and lcm(KV, sp) divides H because KV and sp both do.
Autograd sums the replicas' gradients back into the original head.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["all_to_all", "ulysses_attention"]


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    if x.shape[scatter_dim] % world:
        raise ValueError(
            f"all_to_all: dim {scatter_dim} of size {x.shape[scatter_dim]} does not split over {world} ranks"
        )
    send = torch.stack(x.chunk(world, dim=scatter_dim)).contiguous()  # (world, ...): piece j goes to rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)  # piece j came from rank j


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, g):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(g, gather_dim, scatter_dim, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """Split `x` along `scatter_dim` into one piece per rank of `group`, send piece j to rank j, and concatenate
    the received pieces along `gather_dim` in rank order. Backward is the all-to-all the other way round."""
    if dist.get_world_size(group) == 1:
        return x
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    causal: bool = True,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Attention over a sequence split contiguously over `group` (rank r holds positions [r*T, (r+1)*T)).

    q: (B, H, T, D), k and v: (B, KV, T, D); H must divide by the group size (kv heads: see
    [Note: kv heads under Ulysses]). Returns (B, H, T, D), this rank's rows. Four all-to-alls forward (q, k, v
    in, the output back) and four backward.
    """
    sp = dist.get_world_size(group)
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % sp:
        raise ValueError(
            f"all_to_all sequence parallelism gives each of the {sp} ranks heads / sp query heads, but there are "
            f"{heads} (per tp rank); use an sp size that divides {heads}"
        )
    if kv_heads % sp:
        repeat = math.lcm(kv_heads, sp) // kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    q, k, v = (all_to_all(t, 1, 2, group) for t in (q, k, v))  # (B, heads / sp, sp * T, D)
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=causal, scale=scale, dropout_p=dropout_p, enable_gqa=k.shape[1] != q.shape[1]
    )
    return all_to_all(out, 2, 1, group)  # (B, H, T, D)
