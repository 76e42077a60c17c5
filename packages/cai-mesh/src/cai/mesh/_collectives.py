"""Flat-tensor collectives under one name across torch versions.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single`` /
``reduce_scatter_single`` (same arguments) and warns on the old names; older releases have only the old ones.
These wrappers call whichever exists, through the ``torch.distributed`` module attribute so that
``cai.mesh.testing.CollectiveCounter`` sees the call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_into_tensor", "reduce_scatter_tensor"]


def all_gather_into_tensor(
    output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    """Concatenate every rank's ``input`` into ``output`` (rank order); returns a work handle if ``async_op``."""
    if hasattr(dist, "all_gather_single"):
        return dist.all_gather_single(output, input, group=group, async_op=async_op)
    return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)


def reduce_scatter_tensor(
    output: torch.Tensor, input: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False
) -> Any:
    """Reduce ``input`` over the group (sum by default) and keep this rank's equal slice in ``output``."""
    op = dist.ReduceOp.SUM if op is None else op
    if hasattr(dist, "reduce_scatter_single"):
        return dist.reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)
    return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)
