"""Ring sequence parallelism (`sequence_parallelism_mode="ring"`): the all-gather in front of a column layer and
the reduce-scatter after a row layer, cut into one point-to-point step per rank and overlapped with the matmul.

[Note: ring steps]
The sequence is split into `t` chunks, chunk `c` living on rank `c` of the group. Two ring patterns, both moving
`t - 1` chunks per rank to the next rank (`r + 1`) while the matmul of the chunk in hand runs:

    gather   step s: rank r holds chunk (r - s) mod t; it posts the send of that chunk to r + 1 and the receive of
             chunk (r - s - 1) from r - 1, multiplies the chunk it holds, then waits. After t steps it has
             multiplied every chunk: the all-gather of the input is never materialised.
    reduce-scatter   step s: rank r computes its partial result for chunk (r - s - 1) mod t, adds the
             accumulator received from r - 1 (the same chunk's partial sum over ranks r - s .. r - 1) and sends
             it on; after step t - 1 the chunk in hand is chunk r, summed over all ranks.

Column layers: forward = gather ring (output chunk c = x_c @ W.T), one ring for all the column layers that read
the same input (a region's q, k and v; gate and up); backward = one loop running both rings: the input chunks go
round again for the weight gradients (sum over c of g_c.T @ x_c; only the local chunk was saved) and the input
gradient's partial chunks (sum over the layers of g_c @ W) are reduce-scattered. Row layer: forward =
reduce-scatter ring of x_c @ W.T; backward = gather ring of the output gradient's chunks (input gradient chunk
c = g_c @ W, weight gradient summed). Per ring and rank: t - 1 sends of one chunk forward, 2 (t - 1) backward for the column ring and
t - 1 for a row layer. Sends go through `torch.distributed.isend` / `irecv`, so `CollectiveCounter` counts them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["ring_column_linear", "ring_row_linear"]


class _Ring:
    """Send to the next rank of `group`, receive from the previous one; one outstanding exchange at a time."""

    def __init__(self, group, tag: int = 0) -> None:
        self.group, self.tag = group, tag
        self.t, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self._works: list = []

    def chunk_of(self, step: int, ahead: int = 0) -> int:
        return (self.rank - step - ahead) % self.t

    def start(self, send: torch.Tensor) -> torch.Tensor:
        recv = torch.empty_like(send)
        # The receive is posted first so a rank whose neighbour already sent finds it waiting.
        self._works = [
            dist.irecv(recv, group=self.group, tag=self.tag, group_src=(self.rank - 1) % self.t),
            dist.isend(send, group=self.group, tag=self.tag, group_dst=(self.rank + 1) % self.t),
        ]
        return recv

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works = []


def _chunks(x: torch.Tensor, dim: int, t: int) -> list[torch.Tensor]:
    return [c.contiguous() for c in x.chunk(t, dim=dim)]


def _wgrad(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """sum over all leading dims of g.T @ x: (out, in)."""
    return g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


def _ring_reduce_scatter(partial, ring: _Ring) -> torch.Tensor:
    """`partial(c)` is this rank's term of chunk c; returns chunk `ring.rank` summed over the group."""
    acc = partial(ring.chunk_of(0, ahead=1))
    for s in range(1, ring.t):
        incoming = ring.start(acc)
        mine = partial(ring.chunk_of(s, ahead=1))  # overlaps the exchange
        ring.wait()
        acc = incoming + mine
    return acc


class _RingColumn(torch.autograd.Function):
    """One ring for the column layers that read the same input (q, k and v; gate and up): `weights` each."""

    @staticmethod
    def forward(ctx, x, dim, group, *weights):
        ring = _Ring(group)
        held, outs = x.contiguous(), [[None] * ring.t for _ in weights]
        for s in range(ring.t):
            nxt = ring.start(held) if s < ring.t - 1 else None
            for out, weight in zip(outs, weights):  # overlaps the exchange
                out[ring.chunk_of(s)] = F.linear(held, weight)  # (B, S / t, out / tp)
            if nxt is not None:
                ring.wait()
                held = nxt
        ctx.save_for_backward(x, *weights)  # the local chunk only: see [Note: ring steps]
        ctx.dim, ctx.group = dim, group
        return tuple(torch.cat(out, dim=dim) for out in outs)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        gathered, scattered = _Ring(ctx.group), _Ring(ctx.group, tag=1)  # two rings in flight: own tags
        g_chunks = [_chunks(g, ctx.dim, gathered.t) for g in grads]

        def partial(c: int) -> torch.Tensor:  # this rank's term of chunk c of the input gradient
            return sum(g[c] @ w for g, w in zip(g_chunks, weights))

        gws = [torch.zeros_like(w) for w in weights]
        held, acc = x.contiguous(), partial(scattered.chunk_of(0, ahead=1))
        for s in range(gathered.t):
            last = s == gathered.t - 1
            nxt = None if last else gathered.start(held)
            incoming = None if last else scattered.start(acc)
            for gw, g in zip(gws, g_chunks):  # overlaps both exchanges
                gw += _wgrad(g[gathered.chunk_of(s)], held)
            mine = None if last else partial(scattered.chunk_of(s + 1, ahead=1))
            if not last:
                gathered.wait()
                scattered.wait()
                held, acc = nxt, incoming + mine
        return acc, None, None, *gws


class _RingRow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, dim, group):
        ring = _Ring(group)
        x_chunks = _chunks(x, dim, ring.t)
        ctx.save_for_backward(x, weight)
        ctx.dim, ctx.group = dim, group
        return _ring_reduce_scatter(lambda c: F.linear(x_chunks[c], weight), ring)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        ring = _Ring(ctx.group)
        x_chunks = _chunks(x, ctx.dim, ring.t)
        held, gx, gw = g.contiguous(), [None] * ring.t, torch.zeros_like(weight)
        for s in range(ring.t):
            nxt = ring.start(held) if s < ring.t - 1 else None
            c = ring.chunk_of(s)
            gx[c] = held @ weight  # (B, S / t, in / tp), overlaps the exchange
            gw += _wgrad(held, x_chunks[c])
            if nxt is not None:
                ring.wait()
                held = nxt
        return torch.cat(gx, dim=ctx.dim), gw, None, None


def ring_column_linear(x: torch.Tensor, weights: list[torch.Tensor], dim: int, group) -> list[torch.Tensor]:
    """`all_gather(x, dim) @ w.T` for each of `weights`, computed chunk by chunk while the chunks of `x` go round
    the ring once for all of them (no bias)."""
    if dist.get_world_size(group) == 1:
        return [F.linear(x, w) for w in weights]
    return list(_RingColumn.apply(x, dim, group, *weights))


def ring_row_linear(x: torch.Tensor, weight: torch.Tensor, dim: int, group) -> torch.Tensor:
    """`reduce_scatter(x @ weight.T, dim)` computed chunk by chunk while the partial sums go round (no bias)."""
    if dist.get_world_size(group) == 1:
        return F.linear(x, weight)
    return _RingRow.apply(x, weight, dim, group)
