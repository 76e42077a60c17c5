"""Replicas agree before a plugin touches them: at ``boost()`` every data-parallel rank's model is checked against
the others' (names, shapes, dtypes) and then given rank 0's values.

[Note: replicas agree at boost]
Every plugin assumes that its ranks hold the same model: DDP averages gradients of tensors it pairs up by
position, ZeRO and Gemini flatten the parameters into buckets and chunks whose sizes must match on every rank,
FSDP shards each parameter over the ranks. Ranks whose models differ in shape reach gloo or NCCL with buffers of
different sizes (a C++ abort or a hang), and ranks whose models merely start from different random weights
train silently as different models. So ``Booster.boost`` runs, before the plugin shards or wraps anything:

1. one ``all_gather_object`` of each rank's (name, shape, dtype, lazy) list of parameters and persistent buffers;
   every rank compares the same gathered lists and so raises the same error, naming the first difference;
2. a broadcast from the group's first rank of every allocated parameter and persistent buffer, coalesced into
   one flat buffer per (device, dtype) and at most ``_BUCKET_BYTES`` per collective.

Parameters still on the meta device (``LazyInitContext``) are compared but not broadcast; the plugin makes them
agree when it materialises them (replicated plugins broadcast after initialising, FSDP initialises each shard
once on the rank that owns it). Non-persistent buffers are neither compared nor sent: they are computed in
``__init__`` (rotary frequencies) and are not part of the model's state.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from cai.mesh import get_dist_logger

__all__ = ["broadcast_tensors", "first_difference", "sync_replicas"]

_BUCKET_BYTES = 256 * 2**20  # bounds the extra memory of the flat copies on large models


@dataclass(frozen=True)
class _Entry:
    kind: str  # "parameter" or "buffer"
    name: str
    shape: tuple[int, ...]
    dtype: str
    lazy: bool

    def describe(self) -> str:
        return f"shape {list(self.shape)} {self.dtype.removeprefix('torch.')}" + (
            " (lazy, on the meta device)" if self.lazy else ""
        )


def _state_tensors(model: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """(kind, name, tensor) for every parameter (tied ones once) and persistent buffer, in registration order."""
    out = [("parameter", n, p) for n, p in model.named_parameters()]
    for mod_name, mod in model.named_modules():
        for b_name, buf in mod._buffers.items():
            if buf is not None and b_name not in mod._non_persistent_buffers_set:
                out.append(("buffer", f"{mod_name}.{b_name}" if mod_name else b_name, buf))
    return out


def _entries(model: nn.Module) -> list[_Entry]:
    return [
        _Entry(kind, name, tuple(t.shape), str(t.dtype), t.device.type == "meta")
        for kind, name, t in _state_tensors(model)
    ]


def first_difference(per_rank: list[list[_Entry]], ranks: list[int]) -> tuple[str, int] | None:
    """The first disagreement between the ranks' entry lists, as (message, number of differing names)."""
    by_rank = [{e.name: e for e in entries} for entries in per_rank]
    order = list(dict.fromkeys(e.name for entries in per_rank for e in entries))
    messages = []
    for name in order:
        holders = [i for i, d in enumerate(by_rank) if name in d]
        ref = by_rank[holders[0]][name]
        if len(holders) < len(by_rank):
            missing = [ranks[i] for i, d in enumerate(by_rank) if name not in d]
            messages.append(
                f"{ref.kind} {name!r} exists on ranks {[ranks[i] for i in holders]} but not on ranks {missing}"
            )
            continue
        for i in holders[1:]:
            other = by_rank[i][name]
            if other != ref:  # same name: kind, shape, dtype or laziness differ
                messages.append(
                    f"{ref.kind} {name!r} has {ref.describe()} on rank {ranks[holders[0]]} but "
                    f"{other.describe()} on rank {ranks[i]}"
                )
                break
    return (messages[0], len(messages)) if messages else None


def broadcast_tensors(tensors: Iterable[torch.Tensor], *, src: int, group: dist.ProcessGroup | None) -> int:
    """Overwrite ``tensors`` with rank ``src``'s values, one flat collective per (device, dtype) bucket; returns
    the number of bytes sent."""
    buckets: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
    filled: dict[tuple[torch.device, torch.dtype], int] = {}
    for t in tensors:
        key = (t.device, t.dtype)
        lists = buckets.setdefault(key, [[]])
        if filled.get(key, 0) >= _BUCKET_BYTES:
            lists.append([])
            filled[key] = 0
        lists[-1].append(t)
        filled[key] = filled.get(key, 0) + t.numel() * t.element_size()
    comm_device = _comm_device(group)
    sent = 0
    with torch.no_grad():
        for (_, dtype), lists in buckets.items():
            for ts in lists:
                flat = torch.cat([t.detach().reshape(-1) for t in ts])
                if comm_device is not None:
                    flat = flat.to(comm_device)
                # gloo has no bool broadcast; the bytes are the same as uint8
                wire = flat.view(torch.uint8) if dtype == torch.bool else flat
                dist.broadcast(wire, src=src, group=group)
                sent += wire.numel() * wire.element_size()
                offset = 0
                for t in ts:
                    t.copy_(flat[offset : offset + t.numel()].view(t.shape))
                    offset += t.numel()
    return sent


def _comm_device(group: dist.ProcessGroup | None) -> torch.device | None:
    # NCCL only moves device memory; a model still on the host before boost() goes through the current GPU.
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def sync_replicas(model: nn.Module, group: dist.ProcessGroup | None, *, owner: str) -> None:
    """Check that every rank of ``group`` built the same model, then give all of them rank 0's weights.

    See [Note: replicas agree at boost]. Raises ``ValueError`` on every rank, with the same message, when the
    ranks disagree on a name, shape, dtype or on whether a parameter is lazy. Does nothing without a process group
    or on one rank.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    world = dist.get_world_size(group)
    ranks = [dist.get_global_rank(group, i) if group is not None else i for i in range(world)]
    gathered: list[list[_Entry] | None] = [None] * world
    dist.all_gather_object(gathered, _entries(model), group=group)
    diff = first_difference(gathered, ranks)  # type: ignore[arg-type]
    if diff is not None:
        message, count = diff
        more = f" (and {count - 1} more differing names)" if count > 1 else ""
        raise ValueError(
            f"{owner}: the data-parallel ranks {ranks} built different models: {message}{more}. Every rank must "
            "build the same model (same class, config and code) before boost(); check for rank-dependent "
            "arguments or a config read from a different file on some ranks"
        )
    tensors = [t for _, _, t in _state_tensors(model) if t.device.type != "meta"]
    sent = broadcast_tensors(tensors, src=ranks[0], group=group)
    get_dist_logger().info(
        f"{owner}: {world} replicas agree on {len(gathered[0])} parameter and buffer names, shapes and "
        f"dtypes; broadcast {len(tensors)} tensors ({sent / 2**20:.1f} MiB) from rank {ranks[0]} so that every "
        "replica starts from the same weights",
        ranks=[ranks[0]],
    )
