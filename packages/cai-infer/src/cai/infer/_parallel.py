"""Tensor-parallel inference: the model sharded by cai-shardformer, one engine per rank running in lockstep.

[Note: tensor-parallel engine]
With ``InferenceConfig(tp_size=n)`` every rank of the default process group (which must hold exactly ``n`` ranks)
builds its own engine on the same model and receives the same requests in the same order. cai-shardformer splits
attention by heads and the MLP by columns/rows; the vocab-parallel lm_head gathers the logits over the real
vocabulary in an eval forward, so every rank samples from the same logits. The scheduler, block manager and
sampler are plain deterministic Python on each rank, so all ranks make the same decisions without exchanging
them; the only agreement that needs a message is the seed of a sampled request that brings none (drawn on rank 0
and broadcast), since each rank's global RNG may differ. Each rank's paged cache holds its own kv heads
(``local_kv_heads``), and the attention function sees the rank's heads only.

Someone has to give every rank those requests. Offline, each rank's script calls ``generate`` with the same prompts.
Online, requests arrive on one process: ``LockstepDriver`` (_lockstep.py [Note: lockstep driver]) wraps rank 0's
engine, runs each ``add_request`` / ``abort_request`` there first and sends the commands, with the request's token
ids, id and seed resolved on rank 0, to the other ranks in one broadcast per step; those run ``follow()``, which
applies them in order and steps. ``AsyncInferenceEngine`` on rank 0 goes through a driver (it builds one for a
tp engine), and ``cai serve --tp-size N`` under torchrun serves HTTP on rank 0 while the other ranks follow.
The driver gives each unseeded sampled request its seed on rank 0 before adding it, so the engine's broadcast of
the seed above (a collective only rank 0 would join) never runs under the driver.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def local_kv_heads(kv_heads: int, tp_size: int) -> int:
    """The kv heads one rank holds: ``kv_heads / tp``, or one (replicated) when there are fewer kv heads than
    ranks, as cai-shardformer's attention policies split them."""
    return max(kv_heads // tp_size, 1)


def shard_for_inference(model: nn.Module, tp_size: int) -> tuple[nn.Module, dist.ProcessGroup]:
    """Shard ``model`` over the default process group (``tp_size`` ranks) with cai-shardformer; returns the
    sharded model and the group."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"InferenceConfig.tp_size={tp_size} needs torch.distributed initialized with {tp_size} ranks (one "
            "engine per rank, e.g. under torchrun); call torch.distributed.init_process_group first or set "
            "tp_size=1"
        )
    world = dist.get_world_size()
    if world != tp_size:
        raise ValueError(
            f"InferenceConfig.tp_size={tp_size} but the default process group has {world} ranks; the engine "
            f"shards over the whole group, so launch {tp_size} processes or set tp_size={world}"
        )
    from cai.shardformer import ShardConfig, ShardFormer

    # parallel_output=False: the engine never passes labels, and wants the logits gathered over the vocabulary.
    shard_config = ShardConfig(tensor_parallel_process_group=dist.group.WORLD, parallel_output=False)
    model, _ = ShardFormer(shard_config).optimize(model)
    return model, dist.group.WORLD


def shared_seed(group: dist.ProcessGroup | None, device: torch.device) -> int:
    """A seed drawn from rank 0's global generator and broadcast over ``group`` (the local draw without one);
    ``device`` is where the group's backend communicates (the model's device)."""
    seed = torch.randint(0, 2**62, (1,), dtype=torch.long)
    if group is not None:
        seed = seed.to(device)
        dist.broadcast(seed, src=dist.get_global_rank(group, 0), group=group)
    return int(seed)
