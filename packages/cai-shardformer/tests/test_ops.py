"""The autograd collectives: values and gradients on 2 and 4 gloo ranks, and the collectives they issue."""

import pytest
import torch
import torch.distributed as dist

from cai.mesh.testing import CollectiveCounter, assert_close, run_distributed
from cai.shardformer import (
    copy_to_tp_region,
    gather_from_tp_region,
    gather_seq,
    reduce_from_tp_region,
    reduce_grad,
    reduce_scatter_seq,
    scatter_to_tp_region,
)


def _per_rank(shape):
    """A tensor that differs per rank (seeded by rank) and the list of every rank's one."""
    world, rank = dist.get_world_size(), dist.get_rank()
    all_ = [torch.Generator().manual_seed(100 + r) for r in range(world)]
    tensors = [torch.randn(shape, generator=g) for g in all_]
    return tensors[rank], tensors


def _check_ops():
    world, rank = dist.get_world_size(), dist.get_rank()
    x_mine, xs = _per_rank((2, 4 * world, 3))
    g_mine, gs = _per_rank((2, 4 * world, 3))
    total_g = sum(gs)
    results = {}

    def run(name, fn, x, g):
        x = x.clone().requires_grad_()
        with CollectiveCounter() as fwd:
            y = fn(x)
        with CollectiveCounter() as bwd:
            y.backward(g)
        results[name] = (fwd.summary(), bwd.summary())
        return y.detach(), x.grad

    # copy: identity forward; every rank's gradient is the sum of the ranks' upstream gradients.
    y, gx = run("copy", lambda t: copy_to_tp_region(t), x_mine, g_mine)
    assert_close(y, x_mine, name="copy.out")
    assert_close(gx, total_g, rtol=1e-5, atol=1e-6, name="copy.grad")
    # reduce: sum forward, identity backward.
    y, gx = run("reduce", lambda t: reduce_from_tp_region(t), x_mine, g_mine)
    assert_close(y, sum(xs), rtol=1e-5, atol=1e-6, name="reduce.out")
    assert_close(gx, g_mine, name="reduce.grad")
    # gather along the last dim, the gradient split back.
    g_wide = torch.cat(gs, dim=-1)
    y, gx = run("gather", lambda t: gather_from_tp_region(t), x_mine, g_wide)
    assert_close(y, torch.cat(xs, dim=-1), name="gather.out")
    assert_close(gx, g_mine, name="gather.grad")
    # scatter the last dim of a replicated tensor, the gradient all-gathered.
    x_wide = torch.cat(xs, dim=-1)
    y, gx = run("scatter", lambda t: scatter_to_tp_region(t), x_wide, g_mine)
    assert_close(y, xs[rank], name="scatter.out")
    assert_close(gx, torch.cat(gs, dim=-1), name="scatter.grad")
    # sequence gather: all-gather dim 1 forward, reduce-scatter backward.
    g_seq = [torch.cat([gi] * world, dim=1) for gi in gs]
    y, gx = run("gather_seq", lambda t: gather_seq(t, 1), x_mine, g_seq[rank])
    assert_close(y, torch.cat(xs, dim=1), name="gather_seq.out")
    assert_close(gx, sum(g_seq).chunk(world, dim=1)[rank], rtol=1e-5, atol=1e-6, name="gather_seq.grad")
    # sequence reduce-scatter: the sum's slice forward, the gradient all-gathered backward.
    small_g = total_g.chunk(world, dim=1)[rank]
    y, gx = run("reduce_scatter_seq", lambda t: reduce_scatter_seq(t, 1), x_mine, small_g)
    assert_close(y, sum(xs).chunk(world, dim=1)[rank], rtol=1e-5, atol=1e-6, name="reduce_scatter_seq.out")
    assert_close(gx, torch.cat([total_g.chunk(world, dim=1)[r] for r in range(world)], dim=1), name="rs.grad")
    # reduce_grad over a sub-group of ranks {0, 1}: the gradient summed there only.
    sub = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)][rank // 2]
    y, gx = run("reduce_grad", lambda t: reduce_grad(t, sub), x_mine, g_mine)
    pair = gs[rank // 2 * 2] + gs[rank // 2 * 2 + 1]
    assert_close(gx, pair, rtol=1e-5, atol=1e-6, name="reduce_grad.grad")
    return results


@pytest.mark.parametrize("tp", [2, 4])
def test_region_ops_values_gradients_and_collectives(tp):
    results = run_distributed(_check_ops, tp)[0]
    n = 2 * 4 * tp * 3 * 4  # bytes of one (2, 4 tp, 3) fp32 tensor
    assert results["copy"] == ({}, {"all_reduce": (1, n)})
    assert results["reduce"] == ({"all_reduce": (1, n)}, {})
    assert results["gather"] == ({"all_gather_into_tensor": (1, n * tp)}, {})
    assert results["scatter"] == ({}, {"all_gather_into_tensor": (1, n * tp)})
    assert results["gather_seq"] == (
        {"all_gather_into_tensor": (1, n * tp)},
        {"reduce_scatter_tensor": (1, n * tp)},
    )
    assert results["reduce_scatter_seq"] == (
        {"reduce_scatter_tensor": (1, n)},
        {"all_gather_into_tensor": (1, n)},
    )
    assert results["reduce_grad"] == ({}, {"all_reduce": (1, n)})


def _single_rank_is_identity():
    group = dist.new_group([dist.get_rank()])
    x = torch.randn(2, 4, requires_grad=True)
    with CollectiveCounter() as cc:
        for op in (copy_to_tp_region, reduce_from_tp_region, gather_from_tp_region, scatter_to_tp_region):
            assert op(x, group) is x
    return cc.count()


def test_group_of_one_issues_nothing():
    assert run_distributed(_single_rank_is_identity, 1) == [0]


def _indivisible():
    x = torch.randn(2, 3, 5)
    try:
        reduce_scatter_seq(x, 1)
    except ValueError as e:
        return str(e)
    return None


def test_indivisible_sequence_names_sizes():
    msg = run_distributed(_indivisible, 2)[0]
    assert msg is not None and "size 3" in msg and "2 ranks" in msg
