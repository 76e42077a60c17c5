"""LR scheduler state as a small JSON file (never pickle), written by rank 0."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["load_lr_scheduler", "save_lr_scheduler"]


def _jsonable(value: Any, where: str) -> Any:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, where) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v, f"{where}.{k}") for k, v in value.items()}
    if torch.is_tensor(value) and value.numel() == 1:
        return value.item()
    raise TypeError(f"save_lr_scheduler: {where} is a {type(value).__name__}, which is not JSON-able")


def save_lr_scheduler(lr_scheduler: Any, path: Path) -> None:
    """Write ``lr_scheduler.state_dict()`` to ``path`` (a file) atomically on rank 0; every rank waits for it."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        state = _jsonable(lr_scheduler.state_dict(), "state_dict")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, path)
    if dist.is_initialized():
        dist.barrier()


def _like(loaded: Any, live: Any) -> Any:
    """``loaded`` with the containers ``live`` holds: JSON made int keys strings and tuples lists (torch's
    MultiStepLR keeps its milestones in a ``Counter`` of ints, and would never match a step against string keys)."""
    if isinstance(live, dict) and isinstance(loaded, dict):
        int_keys = bool(live) and all(isinstance(k, int) and not isinstance(k, bool) for k in live)
        out = {}
        for key, value in loaded.items():
            key = int(key) if int_keys and key.lstrip("-").isdigit() else key
            out[key] = _like(value, live.get(key))
        return Counter(out) if isinstance(live, Counter) else out
    if isinstance(live, (list, tuple)) and isinstance(loaded, list) and len(live) == len(loaded):
        items = [_like(v, w) for v, w in zip(loaded, live)]
        return tuple(items) if isinstance(live, tuple) else items
    return loaded


def load_lr_scheduler(lr_scheduler: Any, path: Path) -> None:
    """Load what :func:`save_lr_scheduler` wrote, with int keys and tuples as ``lr_scheduler`` holds them now."""
    if not path.is_file():
        raise FileNotFoundError(f"load_lr_scheduler: no scheduler state at {str(path)!r}")
    lr_scheduler.load_state_dict(_like(json.loads(path.read_text()), lr_scheduler.state_dict()))
