"""ZeroOptimizer state by parameter name: the pieces of the layout-independent protocol and full state dicts.

Flat optimizer state (same shape as a bucket's master shard: ``exp_avg``, ``momentum_buffer``...) is reported per
parameter as the piece this rank holds, ``ShardSpec(global_shape=param.shape, flat_range=...)``; scalar state
(``step``) is reported whole by every rank for every parameter of the bucket. Keys are ``<param name>.<state key>``.
A stage 0 (``replicated``) bucket reports every parameter whole (``ShardSpec.full``, shaped like the parameter),
the same piece on every rank: replicated state, which cai-ckpt stores once.
These functions see only the buckets and the wrapped optimizer; ``ZeroOptimizer`` orders them with its
communication (waits for gathers before reading, re-gathers after loading masters).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from cai.mesh import FlatPiece, LocalShard, Read, ShardSpec, all_gather_into_tensor, flat_pieces
from cai.zero._bucket import Bucket, Slot


def _is_flat(value: Any, b: Bucket) -> bool:
    return isinstance(value, torch.Tensor) and tuple(value.shape) == (b.shard,)


def _spec(b: Bucket, pc: FlatPiece[Slot]) -> ShardSpec:
    return ShardSpec.full(pc.entry.shape) if b.replicated else pc.spec


def _piece(b: Bucket, flat: torch.Tensor, pc: FlatPiece[Slot]) -> LocalShard:
    """``flat``'s part for ``pc`` (a view): a flat range, or the whole parameter in its shape for stage 0."""
    t = flat[pc.start : pc.stop]
    return LocalShard(t.view(pc.entry.shape) if b.replicated else t, _spec(b, pc))


def ensure_state(optim: torch.optim.Optimizer, buckets: list[Bucket]) -> None:
    """Create the wrapped optimizer's state (so its keys are known) with a zero-gradient, zero-lr step."""
    if all(len(optim.state.get(b.master, {})) for b in buckets):
        return
    saved = []
    for pg in optim.param_groups:
        saved.append(pg["lr"])
        pg["lr"] = pg["lr"] * 0 if isinstance(pg["lr"], torch.Tensor) else 0.0
    grads = [b.master.grad for b in buckets]
    for b in buckets:
        b.master.grad = torch.zeros_like(b.master)
    try:
        optim.step()
    finally:
        for pg, lr in zip(optim.param_groups, saved):
            pg["lr"] = lr
        for b, g in zip(buckets, grads):
            b.master.grad = g


def optimizer_pieces(optim: torch.optim.Optimizer, buckets: list[Bucket]) -> dict[str, LocalShard]:
    """This rank's optimizer state as ``{"<param name>.<key>": LocalShard}`` (views; copy before mutating)."""
    out: dict[str, LocalShard] = {}
    for b in buckets:
        for key, value in optim.state.get(b.master, {}).items():
            if _is_flat(value, b):
                for pc in flat_pieces(b.slots, b.lo, b.hi):
                    out[f"{pc.entry.name}.{key}"] = _piece(b, value, pc)
            elif isinstance(value, torch.Tensor) and value.numel() == 1:
                for s in b.slots:
                    out[f"{s.name}.{key}"] = LocalShard(value.detach(), ShardSpec.full(tuple(value.shape)))
            else:
                raise TypeError(
                    f"ZeroOptimizer: state {key!r} of {type(optim).__name__} is neither elementwise nor a "
                    f"scalar tensor ({type(value).__name__}); only elementwise optimizers can be sharded"
                )
    return out


def load_optimizer_pieces(optim: torch.optim.Optimizer, buckets: list[Bucket], read: Read) -> None:
    """Fill this rank's optimizer state from ``read(name, spec, dtype)``, whatever layout wrote it."""
    ensure_state(optim, buckets)
    for b in buckets:
        for key, value in optim.state[b.master].items():
            if _is_flat(value, b):
                value.zero_()  # the padding, and any gap, stays zero
                for pc in flat_pieces(b.slots, b.lo, b.hi):
                    piece = read(f"{pc.entry.name}.{key}", _spec(b, pc), value.dtype)
                    value[pc.start : pc.stop].copy_(piece.reshape(-1))
            elif isinstance(value, torch.Tensor):
                value.copy_(read(f"{b.slots[0].name}.{key}", ShardSpec.full(tuple(value.shape)), value.dtype))


def master_pieces(buckets: list[Bucket], frozen: dict[str, torch.nn.Parameter]) -> dict[str, LocalShard]:
    """The model's source of truth by parameter name: fp32 master pieces of trainable parameters, frozen ones whole."""
    out = {n: LocalShard(p.detach(), ShardSpec.full(tuple(p.shape))) for n, p in frozen.items()}
    for b in buckets:
        for pc in flat_pieces(b.slots, b.lo, b.hi):
            out[pc.entry.name] = _piece(b, b.master, pc)
    return out


def load_master_pieces(buckets: list[Bucket], frozen: dict[str, torch.nn.Parameter], read: Read) -> None:
    """Load master shards and frozen parameters by name (the caller then refreshes the working parameters)."""
    for n, p in frozen.items():
        with torch.no_grad():
            p.copy_(read(n, ShardSpec.full(tuple(p.shape)), p.dtype))
    for b in buckets:
        b.master.zero_()
        for pc in flat_pieces(b.slots, b.lo, b.hi):
            b.master[pc.start : pc.stop].copy_(read(pc.entry.name, _spec(b, pc), torch.float32).reshape(-1))


def full_state(
    optim: torch.optim.Optimizer,
    buckets: list[Bucket],
    *,
    device: torch.device,
    group: dist.ProcessGroup | None,
) -> dict[str, dict[str, torch.Tensor]]:
    """Full optimizer state ``{param name: {key: tensor}}`` on the CPU, all-gathered on every rank (collective;
    none for buckets that are not split, at world size 1 or stage 0)."""
    state: dict[str, dict[str, torch.Tensor]] = {}
    for b in buckets:
        for key, value in optim.state.get(b.master, {}).items():
            if _is_flat(value, b):
                full = value.to(device)
                if b.world_size > 1:
                    full = torch.empty(b.padded, dtype=value.dtype, device=device)
                    all_gather_into_tensor(full, value.to(device), group=group)
                full = full.cpu()
            for s in b.slots:
                if _is_flat(value, b):
                    t = full[s.offset : s.offset + s.numel].view(s.shape).clone()
                else:
                    t = value.detach().cpu().clone()
                state.setdefault(s.name, {})[key] = t
    return state


def reader(state: dict[str, dict[str, torch.Tensor]]) -> Read:
    """A ``read`` that cuts pieces out of a full state ``{param name: {key: tensor}}``."""

    def read(name: str, spec: ShardSpec, dtype: torch.dtype) -> torch.Tensor:
        pname, key = name.rsplit(".", 1)
        return spec.cut(state[pname][key]).to(dtype)

    return read
