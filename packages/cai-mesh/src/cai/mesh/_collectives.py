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

__all__ = [
    "all_gather_into_tensor",
    "fp8_all_gather_into_tensor",
    "fp8_all_reduce",
    "fp8_reduce_scatter_tensor",
    "reduce_scatter_tensor",
]


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


# ---- FP8 on the wire --------------------------------------------------------------------------------------------
#
# [Note: fp8 collectives]
# Each rank's payload is its values in float8 e4m3 (one byte each), in blocks of FP8_BLOCK values that each carry
# one fp32 scale (the block's absolute maximum over 448, e4m3's largest value); the scales' bytes follow the values'
# in the same buffer, so one collective moves both (1.6% more than the values alone). A buffer a rank sends is its
# whole input in an all-gather, its slice for each rank in a reduce-scatter. The reduce-scatter is an all-to-all of
# those slices followed by a local fp32 sum, so the sum itself loses nothing. Each value comes back within 2**-4
# of its magnitude plus 2**-9 / 448 of its block's largest (e4m3 has 3 mantissa bits, and is subnormal below 2**-6).
# Blocks rather than one scale a buffer: a ZeRO bucket holds norm weights near 1 beside projections near 0.02, and
# one scale for both left the small ones subnormal.

FP8 = torch.float8_e4m3fn
FP8_BLOCK = 256
_FP8_MAX = 448.0


def _quantize(chunks: torch.Tensor) -> torch.Tensor:
    """(rows, k) values -> (rows, payload) bytes: each row in e4m3 by blocks of ``FP8_BLOCK``, then the scales."""
    rows, k = chunks.shape
    pad = -k % FP8_BLOCK
    x = chunks.float()
    if pad:
        x = torch.cat([x, x.new_zeros(rows, pad)], dim=1)
    x = x.view(rows, -1, FP8_BLOCK)
    scales = (x.abs().amax(dim=2, keepdim=True) / _FP8_MAX).clamp_(min=torch.finfo(torch.float32).tiny)
    q = (x / scales).to(FP8).view(torch.uint8).view(rows, -1)
    return torch.cat([q, scales.view(rows, -1).view(torch.uint8)], dim=1)


def _dequantize(payload: torch.Tensor, k: int) -> torch.Tensor:
    """(rows, payload) bytes from ``_quantize`` of ``k`` values a row -> (rows, k) fp32 values."""
    rows = payload.shape[0]
    blocks = -(-k // FP8_BLOCK)
    q = payload[:, : blocks * FP8_BLOCK].contiguous().view(FP8).float().view(rows, blocks, FP8_BLOCK)
    scales = payload[:, blocks * FP8_BLOCK :].contiguous().view(torch.float32).view(rows, blocks, 1)
    return (q * scales).view(rows, -1)[:, :k]


def fp8_all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group: Any = None) -> None:
    """``all_gather_into_tensor`` with each rank's ``input`` sent as float8 e4m3 with a scale per ``FP8_BLOCK``
    values (see [Note: fp8 collectives]): about a quarter of fp32's bytes, half of bf16's. ``output`` gets the
    dequantized values in its own dtype."""
    world = dist.get_world_size(group)
    payload = _quantize(input.reshape(1, -1))
    received = torch.empty(world * payload.numel(), dtype=torch.uint8, device=input.device)
    all_gather_into_tensor(received, payload.view(-1), group=group)
    values = _dequantize(received.view(world, -1), output.numel() // world)
    output.copy_(values.reshape(-1).view_as(output))


def fp8_reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group: Any = None) -> None:
    """``reduce_scatter_tensor`` (sum) with every rank's slice for every other rank sent as float8 e4m3 with a scale
    per ``FP8_BLOCK`` values (see [Note: fp8 collectives]); the slices are summed in fp32 and written to ``output``
    in its dtype.
    ``input`` holds ``world * output.numel()`` values."""
    world = dist.get_world_size(group)
    if input.numel() != world * output.numel():
        raise ValueError(
            f"fp8_reduce_scatter_tensor: input has {input.numel()} values, not world size {world} x output's "
            f"{output.numel()}"
        )
    payload = _quantize(input.reshape(world, -1))
    received = torch.empty_like(payload)
    dist.all_to_all_single(received, payload, group=group)
    output.copy_(_dequantize(received, output.numel()).sum(dim=0).view_as(output))


def fp8_all_reduce(tensor: torch.Tensor, group: Any = None) -> None:
    """Sum ``tensor`` over the group in place: an FP8 reduce-scatter, then an FP8 all-gather of the summed slices
    (see [Note: fp8 collectives]); any size (padded to the world size on the way)."""
    world = dist.get_world_size(group)
    flat = tensor.reshape(-1)
    pad = -flat.numel() % world
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    shard = torch.empty(flat.numel() // world, dtype=tensor.dtype, device=tensor.device)
    fp8_reduce_scatter_tensor(shard, flat, group=group)
    full = torch.empty_like(flat)
    fp8_all_gather_into_tensor(full, shard, group=group)
    tensor.copy_(full[: tensor.numel()].view_as(tensor))
