"""FP8 all-gather and reduce-scatter ([Note: fp8 collectives]) on 2 gloo ranks against the exact collectives: every
value within e4m3's bound of its chunk."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cai.mesh import all_gather_into_tensor, fp8_all_gather_into_tensor, fp8_reduce_scatter_tensor
from cai.mesh._collectives import FP8_BLOCK
from cai.mesh.testing import run_distributed

# e4m3 keeps 3 mantissa bits: a value comes back within 2**-4 of itself, plus 2**-9 / 448 of its block's largest
# below the normal range
REL, SUBNORMAL = 2.0**-4, 2.0**-9 / 448.0


def _bound(x: torch.Tensor) -> torch.Tensor:
    """Per value of a buffer sent as one payload (blocks of FP8_BLOCK from its start)."""
    blocks = torch.nn.functional.pad(x.abs(), (0, -x.numel() % FP8_BLOCK)).view(-1, FP8_BLOCK).amax(dim=1)
    return REL * x.abs() + SUBNORMAL * blocks.repeat_interleave(FP8_BLOCK)[: x.numel()]


def _gather(n: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(n, generator=g) * 10.0 ** (rank - 1)  # ranks' buffers of different magnitude
    x[300:600] *= 1e-4  # and a stretch of small values: scales by block keep them accurate
    x[0] = 0.0
    out = torch.empty(world * n, dtype=torch.bfloat16)
    fp8_all_gather_into_tensor(out, x.to(torch.bfloat16))
    exact = torch.empty(world * n)
    all_gather_into_tensor(exact, x.to(torch.bfloat16).float())
    for r, (got, want) in enumerate(zip(out.float().view(world, n), exact.view(world, n), strict=True)):
        err = (got - want).abs()
        assert torch.all(err <= _bound(want) + 2.0**-8 * want.abs()), (r, err.max())  # and bf16's rounding
    assert out.float().view(world, n)[:, 0].eq(0).all()


def _scatter(n: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(world * n, generator=g)
    x[:n] *= 1e-3  # the slice for rank 0 is small: its own scales keep it accurate
    x[n + 7 : n + 7 + FP8_BLOCK] *= 1e-4  # and so are the blocks of a small stretch beside large ones
    out = torch.empty(n)
    fp8_reduce_scatter_tensor(out, x)
    exact = torch.empty(n)
    dist.reduce_scatter_tensor(exact, x.clone())
    parts = [torch.empty(world * n) for _ in range(world)]
    dist.all_gather(parts, x)
    mine = torch.stack([p.view(world, n)[rank] for p in parts])  # every rank's slice for this rank
    bound = sum(_bound(m) for m in mine)
    assert torch.all((out - exact).abs() <= bound + 1e-6)
    with pytest.raises(ValueError, match="not world size 2"):
        fp8_reduce_scatter_tensor(torch.empty(3), torch.empty(5))


def test_fp8_all_gather_within_e4m3_bound():
    run_distributed(_gather, 2, 1000)


def test_fp8_reduce_scatter_within_e4m3_bound():
    run_distributed(_scatter, 2, 257)
