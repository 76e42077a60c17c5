"""Checking a boosted model against the safetensors checkpoint it was filled from (``Booster.verify_weights``).

Each rank reads, for every piece of the model state it holds, the same region of the checkpoint (a safetensors
slice, as the loader does) and compares the two in the piece's own dtype: a bf16 checkpoint against fp32 master
weights compares exactly, since the cast is exact, and an fp32 checkpoint against bf16 working weights compares
after the one rounding the load did. Nothing is gathered; the ranks exchange only the names that differ.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cai.booster._pretrained import _weight_map, safetensors_reader, unexpected_keys

__all__ = ["verify_against_checkpoint"]

_SHOWN = 8  # names listed in the error


def verify_against_checkpoint(
    state: Any,
    path: str | os.PathLike,
    group: dist.ProcessGroup | None = None,
    *,
    model: nn.Module | None = None,
) -> int:
    """Compare ``state``'s pieces (the state protocol's ``sharded_state_dict``) with the checkpoint directory
    ``path`` on every rank; returns how many pieces this rank compared, or raises ``ValueError`` on every rank
    naming the tensors that differ or are missing there (and the ranks that hold them), and the checkpoint's
    tensors that no rank holds. ``model`` (the user's module) names the unexpected keys Hugging Face skips."""
    read = safetensors_reader(str(path))
    bad: list[str] = []
    compared = 0
    # the memory of pieces already read: a tied weight is listed under each of its names
    seen: set[tuple] = set()
    pieces = state.sharded_state_dict()
    not_here = sorted(set(_weight_map(str(path))) - set(pieces))  # held by another rank, or by none
    for name, entry in pieces.items():
        for piece in entry if isinstance(entry, list) else [entry]:
            mine = piece.tensor.detach()
            where = (mine.device, mine.data_ptr(), mine.shape, mine.stride(), str(piece.spec))
            try:
                want = read(name, piece.spec, mine.dtype)
            except KeyError:
                if where not in seen:  # a checkpoint stores a tied weight once, under one of its names
                    bad.append(f"{name} (not in the checkpoint)")
                continue
            except ValueError as e:  # a shape that differs
                bad.append(f"{name} ({e})")
                continue
            compared += 1
            seen.add(where)
            want, got = want.reshape(mine.shape), mine.cpu()
            if not torch.equal(want, got):
                worst = (want.float() - got.float()).abs().max().item()
                bad.append(f"{name} (max abs difference {worst:.3g})")
    everyone = [(bad, not_here)]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, (bad, not_here), group=group)
    found = [f"rank {r}: {what}" for r, (names, _) in enumerate(everyone) for what in names]
    nowhere = set.intersection(*(set(keys) for _, keys in everyone))
    nowhere = unexpected_keys(model, nowhere) if model is not None else sorted(nowhere)
    if found or nowhere:
        parts = []
        if found:
            more = f" and {len(found) - _SHOWN} more" if len(found) > _SHOWN else ""
            parts.append(
                f"{len(found)} piece(s) of the boosted model differ from it: {'; '.join(found[:_SHOWN])}{more}"
            )
        if nowhere:
            more = f" and {len(nowhere) - _SHOWN} more" if len(nowhere) > _SHOWN else ""
            parts.append(
                f"{len(nowhere)} tensor(s) in it that no rank holds: {', '.join(nowhere[:_SHOWN])}{more}"
            )
        raise ValueError(f"verify_weights: the checkpoint {str(path)!r} does not match: {'. '.join(parts)}")
    return compared
