"""Ring attention over a sequence-parallel group: each rank keeps its queries, the key/value blocks travel
around the ring, and the partial softmaxes are merged exactly by their log-sum-exp. Backward runs a second
ring in which each key/value block travels with the gradient accumulated for it so far.

[Note: zig-zag layout]
With a causal mask, a contiguous split would give the last rank sp times the work of the first (its queries
see the whole sequence, the first rank's see only its own block). The sequence is therefore cut into 2*sp
chunks and rank r holds chunks r and 2*sp-1-r, in that order (`zigzag_indices`). Then, for the key/value block
that comes from rank s:

    s == r   the local causal triangle over [chunk r, chunk 2sp-1-r] is exactly the global mask (r < 2sp-1-r)
    s <  r   every local query sees chunk s and none sees chunk 2sp-1-s:  all queries x first half of kv
    s >  r   only chunk 2sp-1-r sees anything, and it sees both chunks:   second half of q x all kv

so every rank computes one triangle and sp-1 half-size rectangles: the same work on every rank.

[Note: log-sum-exp merge]
A block gives out_b = softmax(s_b) v_b and lse_b = logsumexp(s_b) per query row. Two blocks merge as
lse = logaddexp(lse_a, lse_b), out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse), which is the softmax over
the union of their keys. Backward needs only the final out and lse: P_b = exp(s_b - lse) is the block's share
of the full softmax, so each block's gradients come out of the flash-attention formulas with
delta = rowsum(dout * out) and no per-block state.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["ring_attention", "zigzag_indices"]


def zigzag_indices(seq_len: int, rank: int, world: int, device=None) -> torch.Tensor:
    """The global positions rank `rank` holds under the zig-zag split (see [Note: zig-zag layout])."""
    if seq_len % (2 * world):
        raise ValueError(
            f"ring_attn splits the sequence into 2 * sp = {2 * world} chunks, but the sequence length is {seq_len}; "
            f"pad the batch to a multiple of {2 * world} (labels -100 on the padding)"
        )
    chunk = seq_len // (2 * world)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * world - 1 - rank) * chunk, (2 * world - rank) * chunk, device=device)
    return torch.cat([first, second])


def _block(q, k, v, scale: float, causal: bool):
    """Softmax attention of one block, in fp32. q (B, KV, G, Tq, D); k, v (B, KV, Tk, D) -> out
    (B, KV, G, Tq, D), lse (B, KV, G, Tq)."""
    q, k, v = q.float(), k.float(), v.float()
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale  # (B, KV, G, Tq, Tk)
    if causal:
        s = s.masked_fill(_upper(s.shape[-2], s.shape[-1], s.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.unsqueeze(2))
    return out, lse


def _block_grad(q, k, v, dout, out, lse, scale: float, causal: bool):
    """Gradients of one block given the final out and lse (see [Note: log-sum-exp merge]), in fp32. Shapes as
    `_block`; dk and dv are summed over the G query heads that share each kv head."""
    q, k, v, dout = q.float(), k.float(), v.float(), dout.float()
    delta = (dout * out.float()).sum(-1)  # (B, KV, G, Tq)
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(_upper(s.shape[-2], s.shape[-1], s.device), float("-inf"))
    p = torch.exp(s - lse.unsqueeze(-1))  # (B, KV, G, Tq, Tk)
    dv = torch.matmul(p.transpose(-1, -2), dout).sum(2)
    ds = p * (torch.matmul(dout, v.unsqueeze(2).transpose(-1, -2)) - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k.unsqueeze(2)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q).sum(2) * scale
    return dq, dk, dv


# [Note: flash blocks]
# On CUDA in fp16/bf16 each block runs PyTorch's flash-attention kernels instead of the fp32 matmuls: the
# forward kernel returns the block's output and lse, which merge as above (in fp32), and the backward kernel,
# given the final output and lse of the rows, returns exactly the block's share of dq, dk, dv, since it forms
# P = exp(s - lse) and delta = rowsum(dout * out) itself. The kernels want as many kv heads as query heads, so kv
# heads are repeated G times and their gradients summed back.
def _use_flash(q: torch.Tensor) -> bool:
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 256
    )


def _heads(q, k, v):
    b, nkv, g, tq, d = q.shape
    return q.reshape(b, nkv * g, tq, d), k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)


def _flash_block(q, k, v, scale: float, causal: bool):
    b, nkv, g, tq = q.shape[:4]
    qh, kh, vh = _heads(q, k, v)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        qh, kh, vh, 0.0, causal, False, scale=scale
    )[:2]
    return out.reshape(q.shape).float(), lse[..., :tq].reshape(b, nkv, g, tq)


def _flash_block_grad(q, k, v, dout, out, lse, scale: float, causal: bool):
    b, nkv, g, tq, d = q.shape
    tk = k.shape[2]
    qh, kh, vh = _heads(q, k, v)
    # Dense batches have no cumulative sequence lengths (None, as the forward kernel returns them); dropout is
    # off, so the philox seed and offset are read by nothing.
    seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
    offset = torch.zeros((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.reshape(qh.shape).contiguous(), qh, kh, vh, out.reshape(qh.shape).contiguous(),
        lse.reshape(b, nkv * g, tq).contiguous(), None, None, tq, tk, 0.0, causal, seed, offset, scale=scale,
    )  # fmt: skip
    dk = dk.float().reshape(b, nkv, g, tk, d).sum(2)
    dv = dv.float().reshape(b, nkv, g, tk, d).sum(2)
    return dq.float().reshape(q.shape), dk, dv


def _upper(tq: int, tk: int, device) -> torch.Tensor:
    return torch.ones(tq, tk, dtype=torch.bool, device=device).triu(1)


def _merge(out, lse, out_b, lse_b):
    new = torch.logaddexp(lse, lse_b)
    return out * torch.exp(lse - new).unsqueeze(-1) + out_b * torch.exp(lse_b - new).unsqueeze(-1), new


class _Ring:
    """Send a buffer to the next rank of the group and receive the previous rank's, asynchronously."""

    def __init__(self, group):
        self.group = group
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (rank + 1) % world)
        self.prev = dist.get_global_rank(group, (rank - 1) % world)

    def start(self, buf: torch.Tensor):
        recv = torch.empty_like(buf)
        works = [dist.isend(buf, self.next, group=self.group), dist.irecv(recv, self.prev, group=self.group)]
        return recv, works

    @staticmethod
    def wait(works) -> None:
        for w in works:
            w.wait()


def _plan(step: int, rank: int, world: int, causal: bool) -> tuple[str, str, bool]:
    """Which local query rows and which rows of the kv block (from rank - step) meet at `step`: ("all", "first"
    or "second" half for each) and whether the block is the causal triangle. See [Note: zig-zag layout]."""
    if not causal:
        return "all", "all", False
    if step == 0:
        return "all", "all", True
    src = (rank - step) % world
    return ("all", "first", False) if src < rank else ("second", "all", False)


def _row_slice(n: int, which: str) -> slice:
    return {"all": slice(0, n), "first": slice(0, n // 2), "second": slice(n // 2, n)}[which]


def _rows(x: torch.Tensor, which: str, dim: int) -> torch.Tensor:
    part = _row_slice(x.shape[dim], which)
    return x.narrow(dim, part.start, part.stop - part.start)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, causal):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        b, h, t, d = q.shape
        nkv = k.shape[1]
        qg = q.reshape(b, nkv, h // nkv, t, d)  # (B, KV, G, T, D): the G query heads of each kv head
        ring = _Ring(group)
        kv = torch.stack([k, v]).contiguous()  # one buffer per hop
        block = _flash_block if _use_flash(q) else _block
        out = torch.zeros(qg.shape, dtype=torch.float32, device=q.device)  # merged in fp32 whatever q's dtype
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        for step in range(world):
            works = None
            if step + 1 < world:
                nxt, works = ring.start(kv)  # overlap the next hop with this block
            qs, ks, tri = _plan(step, rank, world, causal)
            rows = _row_slice(t, qs)
            ob, lb = block(_rows(qg, qs, 3), _rows(kv[0], ks, 2), _rows(kv[1], ks, 2), scale, tri)
            out[..., rows, :], lse[..., rows] = _merge(out[..., rows, :], lse[..., rows], ob, lb)
            if works is not None:
                ring.wait(works)
                kv = nxt
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.causal = group, scale, causal
        return out.reshape(b, h, t, d)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale, causal = ctx.group, ctx.scale, ctx.causal
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        b, h, t, d = q.shape
        nkv = k.shape[1]
        qg = q.reshape(b, nkv, h // nkv, t, d)
        dout = dout.reshape(qg.shape)
        block_grad = _flash_block_grad if _use_flash(q) else _block_grad
        ring = _Ring(group)
        kv = torch.stack([k, v]).contiguous()
        # dkv travels with kv: the gradient of the block it rides with, so far (fp32 whatever kv's dtype).
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        dq = torch.zeros(qg.shape, dtype=torch.float32, device=q.device)
        dkv_works, next_dkv = None, None
        for step in range(world):
            kv_works = None
            if step + 1 < world:
                next_kv, kv_works = ring.start(kv)
            qs, ks, tri = _plan(step, rank, world, causal)
            rows = _row_slice(t, qs)
            gq, gk, gv = block_grad(
                _rows(qg, qs, 3), _rows(kv[0], ks, 2), _rows(kv[1], ks, 2),
                _rows(dout, qs, 3), _rows(out, qs, 3), lse[..., rows], scale, tri,
            )  # fmt: skip
            dq[..., rows, :] += gq
            if dkv_works is not None:  # the accumulator of this step's block, sent during the block's compute
                ring.wait(dkv_works)
                dkv = next_dkv
            kv_rows = _row_slice(t, ks)
            dkv[0][..., kv_rows, :] += gk
            dkv[1][..., kv_rows, :] += gv
            if world > 1:  # the accumulator follows its block; after `world` hops it is back with the owner
                next_dkv, dkv_works = ring.start(dkv)
            if kv_works is not None:
                ring.wait(kv_works)
                kv = next_kv
        if dkv_works is not None:
            ring.wait(dkv_works)
            dkv = next_dkv
        return dq.to(q.dtype).reshape(b, h, t, d), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Exact softmax attention over the sequence held by the ranks of `group`, each holding a shard.

    Args:
        q: (B, H, T, D) this rank's queries; k, v: (B, KV, T, D) with H a multiple of KV (grouped-query).
        causal: with True, the shards are in the zig-zag layout (`zigzag_indices`: rank r holds chunks r and
            2*sp-1-r of 2*sp) and the mask is causal over global positions; with False any split works.
        scale: default 1 / sqrt(D).

    Returns (B, H, T, D), this rank's rows of the output. Differentiable; backward passes dK and dV around
    the ring (see the module's notes). On CUDA in fp16/bf16 the blocks run PyTorch's flash-attention kernels
    (see [Note: flash blocks]); otherwise fp32 matmuls. Partial results merge in fp32 either way.
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"ring_attention: {q.shape[1]} query heads do not group over {k.shape[1]} kv heads; the query heads "
            f"must be a multiple of the kv heads"
        )
    if causal and q.shape[2] % 2:
        raise ValueError(
            f"ring_attention: causal needs an even local length (two zig-zag chunks), got {q.shape[2]}"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, group, scale, causal)
