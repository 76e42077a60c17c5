"""Full training state: model, optimizer, scheduler, grad scaler, every rank's RNG and data position."""

from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from cai.ckpt._api import (
    prepare_model_load,
    prepare_optimizer_load,
    read_json_tensors,
    unwrap,
    write_json_tensors,
    write_model,
    write_optimizer,
)
from cai.ckpt._format import LATEST_NAME, MANIFEST_NAME, CheckpointError, read_json
from cai.ckpt._load import check_file
from cai.ckpt._txn import Transaction, dist_info, finish, wait

__all__ = ["Stateful", "latest_checkpoint", "load_state", "save_state"]


@runtime_checkable
class Stateful(Protocol):
    """What ``save_state`` needs from a data loader or sampler: JSON-able state, restorable.

    ``state_dict()`` returns JSON-able values (and tensors); ``load_state_dict(state)`` continues from there,
    e.g. ``{"epoch": 3, "seed": 42, "consumed": 1280}`` for a sampler that skips what it already yielded.
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _stateful(obj: Any, what: str) -> Any:
    if isinstance(obj, Stateful):
        return obj
    for attr in ("batch_sampler", "sampler"):
        inner = getattr(obj, attr, None)
        if isinstance(inner, Stateful):
            return inner
    raise TypeError(
        f"{what} {type(obj).__name__} has no state_dict()/load_state_dict() (nor does its sampler)"
    )


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = (kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached))
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            torch.cuda.set_rng_state(cuda[torch.cuda.current_device() % len(cuda)])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def save_state(
    path: str | Path,
    *,
    model: Any,
    step: int,
    optimizer: Any = None,
    lr_scheduler: Any = None,
    grad_scaler: Any = None,
    dataloader: Any = None,
    rng_states: Mapping[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    size_per_shard: float = 1024,
    use_async: bool = False,
    dtype: torch.dtype | None = None,
    group: Any = None,
) -> Path:
    """Save everything needed to continue training bitwise-identically, as ``path/step-NNNNNN`` + ``path/latest``.

    Args:
        path: the run's checkpoint folder (other files in it are left alone; ``step-NNNNNN`` may replace only
            an earlier cai-ckpt checkpoint, see ``save_model``).
        model: as for ``save_model`` (written under ``model/``, Hugging Face-loadable).
        step: the training step; names the directory.
        optimizer: as for ``save_optimizer`` (named through ``model``), under ``optimizer/``.
        lr_scheduler, grad_scaler: anything with a JSON-able ``state_dict()`` (tensors allowed).
        dataloader: a ``Stateful`` loader or one whose ``batch_sampler``/``sampler`` is; saved per rank.
        rng_states: this rank's random generators beside torch's, python's and numpy's global ones (name ->
            object with a JSON-able ``state_dict()``, tensors allowed; a tensor-parallel dropout tracker), saved per
            rank.
        extra: JSON-able values returned by ``load_state``.
        use_async: write in the background (see ``save_model``); ``latest`` moves only after the commit.

    ``training_state/`` holds ``state.json`` (step, scheduler, scaler, extra) and ``rank-NNNNN.json`` per rank
    (python, numpy, torch and CUDA RNG states; data position), tensors beside them in safetensors.
    Returns the checkpoint directory.
    """
    wait()
    final = Path(path) / step_dir_name(step)
    txn = Transaction(
        final, group=group, update_latest=True, info={"kind": "training_state", "step": int(step)}
    )
    with txn.guard():
        write_model(
            txn, "model", model, size_per_shard=size_per_shard, dtype=dtype, config=None, use_async=use_async
        )
        if optimizer is not None:
            write_optimizer(
                txn, "optimizer", optimizer, unwrap(model), size_per_shard=size_per_shard, use_async=use_async
            )
        if txn.rank == 0:
            shared = {
                "step": int(step),
                "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
                "grad_scaler": grad_scaler.state_dict() if grad_scaler is not None else None,
                "extra": extra or {},
            }
            write_json_tensors(txn, "training_state/state", shared)
        per_rank = {
            "rng": _rng_state(),
            "rng_states": {name: obj.state_dict() for name, obj in (rng_states or {}).items()},
            "dataloader": _stateful(dataloader, "dataloader").state_dict()
            if dataloader is not None
            else None,
        }
        write_json_tensors(txn, f"training_state/rank-{txn.rank:05d}", per_rank)
    finish(txn, use_async=use_async)
    return final


def latest_checkpoint(path: str | Path) -> Path | None:
    """The committed checkpoint ``path/latest`` points to (None if there is none yet)."""
    pointer = Path(path) / LATEST_NAME
    if not pointer.exists():
        return None
    return Path(path) / pointer.read_text().strip()


def _resolve(path: Path, step: int | None) -> Path:
    if step is not None:
        d = path / step_dir_name(step)
    elif (path / MANIFEST_NAME).exists():
        d = path
    else:
        d = latest_checkpoint(path)
        if d is None:
            raise CheckpointError(
                f"no checkpoint in {path}: no '{LATEST_NAME}' pointer and no {MANIFEST_NAME}"
            )
    if not (d / MANIFEST_NAME).exists():
        raise CheckpointError(f"{d} is not a committed checkpoint (no {MANIFEST_NAME})")
    return d


def load_state(
    path: str | Path,
    *,
    model: Any,
    optimizer: Any = None,
    lr_scheduler: Any = None,
    grad_scaler: Any = None,
    dataloader: Any = None,
    rng_states: Mapping[str, Any] | None = None,
    step: int | None = None,
    strict: bool = True,
    verify: bool = True,
    group: Any = None,
) -> dict[str, Any]:
    """Restore what ``save_state`` wrote (the ``latest`` checkpoint, or ``step``), under any layout.

    Every component is checked (keys, shapes, files) before any is changed. ``verify`` (default) checks the bytes
    read against the manifest's checksums as they are read (see ``load_model``); ``verify=False`` skips it.
    Each rank restores its own RNG (and ``rng_states``, those the checkpoint has) and data position (rank
    ``r % saved_world_size`` when the world size changed). Returns
    ``{"step": int, "extra": dict, "path": Path}``.
    """
    wait()
    root = _resolve(Path(path), step)
    manifest = read_json(root / MANIFEST_NAME)
    loads = [prepare_model_load(model, root / "model", strict=strict, verify=verify, group=group)]
    if optimizer is not None:
        loads.append(
            prepare_optimizer_load(
                optimizer, root / "optimizer", unwrap(model), strict=strict, verify=verify, group=group
            )
        )
    listed = {"root": root, **manifest}

    def check(path: Path) -> None:
        check_file(listed, path, verify=verify)

    shared = read_json_tensors(root / "training_state" / "state", check)
    rank, _ = dist_info(group)
    saved_world = int(manifest.get("layout", {}).get("world_size", 1))
    mine = read_json_tensors(root / "training_state" / f"rank-{rank % saved_world:05d}", check)
    for what, obj in (("lr_scheduler", lr_scheduler), ("grad_scaler", grad_scaler)):
        if obj is not None and shared.get(what) is None:
            raise CheckpointError(f"{root} has no {what} state, but a {what} was passed to load_state")
    if dataloader is not None and mine.get("dataloader") is None:
        raise CheckpointError(f"{root} has no dataloader state, but a dataloader was passed to load_state")
    loader = _stateful(dataloader, "dataloader") if dataloader is not None else None

    for load in loads:
        load()
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(shared["lr_scheduler"])
    if grad_scaler is not None:
        grad_scaler.load_state_dict(shared["grad_scaler"])
    if loader is not None:
        loader.load_state_dict(mine["dataloader"])
    _set_rng_state(mine["rng"])
    saved_rngs = mine.get("rng_states") or {}  # absent from checkpoints written before it was saved
    for name, obj in (rng_states or {}).items():
        if name in saved_rngs:
            obj.load_state_dict(saved_rngs[name])
    return {"step": shared["step"], "extra": shared["extra"], "path": root}
