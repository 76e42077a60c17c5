"""PipelineP2P on gloo: pytrees with None and plain values, metadata sent once per stream and again on a change."""

from __future__ import annotations

import torch
import torch.distributed as dist

from cai.mesh.testing import run_distributed
from cai.pipeline import PipelineP2P


def _messages():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 3, generator=g, requires_grad=True)
    same = {"h": a, "none": None, "tag": "x", "ids": [torch.arange(4)]}
    return [
        ("fwd", same),
        ("fwd", {**same, "h": a * 2}),  # same metadata: cached
        ("bwd", [torch.ones(5)]),  # another stream between the same ranks: its own metadata
        ("fwd", {**same, "h": torch.randn(4, 3, generator=g)}),  # new shape, no grad: re-sent
        ("fwd", {**same, "h": torch.randn(4, 3, generator=g), "tag": "y"}),  # new plain value: re-sent
        ("fwd", {**same, "h": torch.randn(4, 3, generator=g), "tag": "y"}),  # cached again
        ("bwd", [torch.zeros(5)]),
    ]


def _exchange(cache: bool):
    p2p = PipelineP2P(enable_metadata_cache=cache)
    msgs = _messages()
    if dist.get_rank() == 0:
        for direction, tree in msgs:
            p2p.send(tree, 1, direction)
        p2p.wait_sends()
        return p2p.metadata_sent, {k: v for k, v in p2p.bytes_sent.items()}
    for direction, want in msgs:
        got = p2p.recv(0, direction)
        flat_got, flat_want = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
        assert torch.utils._pytree.tree_structure(got) == torch.utils._pytree.tree_structure(want)
        for x, y in zip(flat_got, flat_want, strict=True):
            if isinstance(y, torch.Tensor):
                assert (
                    x.dtype == y.dtype and x.requires_grad == y.requires_grad and torch.equal(x, y.detach())
                )
            else:
                assert x == y
    return None


def test_pytrees_round_trip_and_metadata_is_sent_once_per_stream():
    sent, volume = run_distributed(_exchange, 2, True)[0]
    assert sent == 4  # fwd first, bwd first, fwd new shape, fwd new value
    # payload bytes only: five fwd messages (h: two of 2x3, three of 4x3 fp32; ids: 4 int64 each), two bwd of 5 fp32
    assert volume == {(1, "fwd"): 2 * 24 + 3 * 48 + 5 * 32, (1, "bwd"): 2 * 20}
    sent, _ = run_distributed(_exchange, 2, False)[0]
    assert sent == 7
