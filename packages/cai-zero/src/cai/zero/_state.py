"""ZeroOptimizer state by parameter name: the layout-independent protocol and full (gathered) state dicts.

Flat optimizer state (same shape as a bucket's master shard: ``exp_avg``, ``momentum_buffer``...) is reported per
parameter as the piece this rank holds, ``ShardSpec(global_shape=param.shape, flat_range=...)``; scalar state
(``step``) is reported whole by every rank for every parameter of the bucket. Keys are ``<param name>.<state key>``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from cai.mesh import LocalShard, ShardSpec, all_gather_into_tensor

if TYPE_CHECKING:
    from cai.zero._bucket import Bucket
    from cai.zero._optimizer import ZeroOptimizer

Read = Callable[[str, ShardSpec, torch.dtype], torch.Tensor]


def _is_flat(value: Any, b: Bucket) -> bool:
    return isinstance(value, torch.Tensor) and tuple(value.shape) == (b.shard,)


def ensure_state(zo: ZeroOptimizer) -> None:
    """Create the wrapped optimizer's state (so its keys are known) with a zero-gradient, zero-lr step."""
    if all(len(zo.optim.state.get(b.master, {})) for b in zo.buckets):
        return
    saved = []
    for pg in zo.optim.param_groups:
        saved.append(pg["lr"])
        pg["lr"] = pg["lr"] * 0 if isinstance(pg["lr"], torch.Tensor) else 0.0
    grads = [b.master.grad for b in zo.buckets]
    for b in zo.buckets:
        b.master.grad = torch.zeros_like(b.master)
    try:
        zo.optim.step()
    finally:
        for pg, lr in zip(zo.optim.param_groups, saved):
            pg["lr"] = lr
        for b, g in zip(zo.buckets, grads):
            b.master.grad = g


def sharded_state_dict(zo: ZeroOptimizer) -> dict[str, LocalShard]:
    """This rank's optimizer state as ``{"<param name>.<key>": LocalShard}`` (views; copy before mutating)."""
    zo._wait_gather(zo.buckets)
    out: dict[str, LocalShard] = {}
    for b in zo.buckets:
        for key, value in zo.optim.state.get(b.master, {}).items():
            for s in b.slots:
                name = f"{s.name}.{key}"
                if _is_flat(value, b):
                    spec = s.spec(b.lo, b.hi)
                    if spec is not None:
                        a, c = spec.flat_range
                        out[name] = LocalShard(value[s.offset + a - b.lo : s.offset + c - b.lo], spec)
                elif isinstance(value, torch.Tensor) and value.numel() == 1:
                    out[name] = LocalShard(value.detach(), ShardSpec.full(tuple(value.shape)))
                else:
                    raise TypeError(
                        f"ZeroOptimizer: state {key!r} of {type(zo.optim).__name__} is neither elementwise nor a "
                        f"scalar tensor ({type(value).__name__}); only elementwise optimizers can be sharded"
                    )
    return out


def load_sharded_state_dict(zo: ZeroOptimizer, read: Read) -> None:
    """Fill this rank's optimizer state from ``read(name, spec, dtype)``, whatever layout wrote it."""
    ensure_state(zo)
    for b in zo.buckets:
        for key, value in zo.optim.state[b.master].items():
            if _is_flat(value, b):
                value.zero_()  # the padding, and any gap, stays zero
                for s in b.slots:
                    spec = s.spec(b.lo, b.hi)
                    if spec is not None:
                        a, c = spec.flat_range
                        piece = read(f"{s.name}.{key}", spec, value.dtype)
                        value[s.offset + a - b.lo : s.offset + c - b.lo].copy_(piece.reshape(-1))
            elif isinstance(value, torch.Tensor):
                value.copy_(read(f"{b.slots[0].name}.{key}", ShardSpec.full(tuple(value.shape)), value.dtype))


def model_sharded_state_dict(zo: ZeroOptimizer) -> dict[str, LocalShard]:
    """The model's source of truth by parameter name: fp32 master pieces of trainable parameters, frozen ones whole."""
    out = {n: LocalShard(p.detach(), ShardSpec.full(tuple(p.shape))) for n, p in zo._frozen.items()}
    for b in zo.buckets:
        for s in b.slots:
            spec = s.spec(b.lo, b.hi)
            if spec is not None:
                a, c = spec.flat_range
                out[s.name] = LocalShard(b.master[s.offset + a - b.lo : s.offset + c - b.lo], spec)
    return out


def load_model_sharded_state_dict(zo: ZeroOptimizer, read: Read) -> None:
    """Load master shards (and frozen parameters) by name, then refresh the working parameters from them."""
    zo._wait_gather(zo.buckets)
    for n, p in zo._frozen.items():
        with torch.no_grad():
            p.copy_(read(n, ShardSpec.full(tuple(p.shape)), p.dtype))
    for b in zo.buckets:
        b.master.zero_()
        for s in b.slots:
            spec = s.spec(b.lo, b.hi)
            if spec is not None:
                a, c = spec.flat_range
                b.master[s.offset + a - b.lo : s.offset + c - b.lo].copy_(
                    read(s.name, spec, torch.float32).reshape(-1)
                )
    for b in zo.buckets:
        zo._gather(b, async_op=False)


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, tuple):
        return list(value)
    json.dumps(value)  # raises for what a JSON writer could not store
    return value


def param_groups_state(zo: ZeroOptimizer) -> list[dict[str, Any]]:
    """Hyperparameters of each param group (JSON-able), with ``params`` as the list of parameter names."""
    groups = []
    for pg, names in zip(zo.optim.param_groups, zo._group_names):
        d = {k: _jsonable(v) for k, v in pg.items() if k != "params"}
        d["params"] = list(names)
        groups.append(d)
    return groups


def load_param_groups_state(zo: ZeroOptimizer, groups: list[dict[str, Any]]) -> None:
    """Restore hyperparameters saved by :func:`param_groups_state`; groups must hold the same parameter names."""
    if len(groups) != len(zo.optim.param_groups):
        raise ValueError(
            f"ZeroOptimizer: {len(groups)} saved param groups, but the optimizer has {len(zo.optim.param_groups)}"
        )
    for i, (pg, names, saved) in enumerate(zip(zo.optim.param_groups, zo._group_names, groups)):
        if set(saved["params"]) != set(names):
            diff = sorted(set(saved["params"]) ^ set(names))[:5]
            raise ValueError(
                f"ZeroOptimizer: param group {i} holds different parameters than saved (e.g. {diff})"
            )
        for k, v in saved.items():
            if k == "params":
                continue
            cur = pg.get(k)
            if isinstance(cur, torch.Tensor):
                cur.fill_(v)
            elif isinstance(cur, tuple):
                pg[k] = tuple(v)
            else:
                pg[k] = v


def state_dict(zo: ZeroOptimizer) -> dict[str, Any]:
    """Full optimizer state by parameter name (all-gathered on every rank, on the CPU), for plain users.

    ``{"state": {name: {key: tensor}}, "param_groups": [...], "loss_scaler": {...} | None}``; a collective call.
    """
    zo._wait_gather(zo.buckets)
    state: dict[str, dict[str, torch.Tensor]] = {}
    for b in zo.buckets:
        for key, value in zo.optim.state.get(b.master, {}).items():
            if _is_flat(value, b):
                full = value.to(zo.device)
                if zo.world_size > 1:
                    full = torch.empty(b.padded, dtype=value.dtype, device=zo.device)
                    all_gather_into_tensor(full, value.to(zo.device), group=zo.group)
                full = full.cpu()
            for s in b.slots:
                if _is_flat(value, b):
                    t = full[s.offset : s.offset + s.numel].view(s.shape).clone()
                else:
                    t = value.detach().cpu().clone()
                state.setdefault(s.name, {})[key] = t
    return {
        "state": state,
        "param_groups": param_groups_state(zo),
        "loss_scaler": zo.scaler.state_dict() if zo.scaler else None,
    }


def load_state_dict(zo: ZeroOptimizer, sd: dict[str, Any]) -> None:
    """Load a dict from :func:`state_dict` (written under any data-parallel size)."""
    state = sd["state"]

    def read(name: str, spec: ShardSpec, dtype: torch.dtype) -> torch.Tensor:
        pname, key = name.rsplit(".", 1)
        return spec.cut(state[pname][key]).to(dtype)

    load_sharded_state_dict(zo, read)
    load_param_groups_state(zo, sd["param_groups"])
    if zo.scaler is not None and sd.get("loss_scaler"):
        zo.scaler.load_state_dict(sd["loss_scaler"])
