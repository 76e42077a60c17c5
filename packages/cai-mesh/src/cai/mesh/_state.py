"""The layout-independent state protocol as types, and the param-groups helpers every optimizer uses.

[Note: state protocol]
A sharded object describes its state as this rank's pieces of global tensors, by name (see ``ShardSpec``):
``sharded_state_dict()`` returns ``{name: LocalShard}`` and ``load_sharded_state_dict(read)`` asks
``read(name, spec, dtype)`` for exactly the pieces the current layout needs, so any layout loads what any other
wrote. A rank holding several disjoint pieces of one tensor (a fused projection's row blocks) gives that name a
list of ``LocalShard``s. Optimizers add their param groups' hyperparameters as JSON-able dicts whose ``params`` are parameter names.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from cai.mesh._shard_spec import LocalShard, ShardSpec

__all__ = ["Read", "ShardedOptimizerState", "ShardedState", "load_param_groups_state", "param_groups_state"]

Read = Callable[[str, ShardSpec, torch.dtype], torch.Tensor]
"""``read(name, spec, dtype)``: this rank's piece ``spec`` of the saved tensor ``name``, in ``dtype``."""


@runtime_checkable
class ShardedState(Protocol):
    """An object whose state is pieces of named global tensors (see [Note: state protocol])."""

    def sharded_state_dict(self) -> dict[str, LocalShard | list[LocalShard]]: ...

    def load_sharded_state_dict(self, read: Read) -> None: ...


@runtime_checkable
class ShardedOptimizerState(ShardedState, Protocol):
    """A sharded optimizer: keys are ``<param name>.<state key>``, plus its param groups by parameter name."""

    def param_groups_state(self) -> list[dict[str, Any]]: ...

    def load_param_groups_state(self, groups: list[dict[str, Any]]) -> None: ...


def _jsonable(value: Any) -> tuple[bool, Any]:
    if isinstance(value, torch.Tensor):
        return (True, value.item()) if value.numel() == 1 else (False, None)
    if isinstance(value, tuple | list):
        items = [_jsonable(v) for v in value]
        return (all(ok for ok, _ in items), [v for _, v in items])
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False, None
    return True, value


def param_groups_state(
    param_groups: Sequence[dict[str, Any]], names: Sequence[Sequence[str]]
) -> list[dict[str, Any]]:
    """Each group's hyperparameters, JSON-able, with ``params`` as the names in ``names[i]``.

    One-element tensors (a tensor ``lr``) become numbers and tuples become lists; a value JSON cannot hold (a
    callable, a tensor of several elements) is left out, since no checkpoint could restore it.
    """
    out = []
    for group, group_names in zip(param_groups, names, strict=True):
        d: dict[str, Any] = {}
        for k, v in group.items():
            if k != "params":
                ok, value = _jsonable(v)
                if ok:
                    d[k] = value
        d["params"] = list(group_names)
        out.append(d)
    return out


def load_param_groups_state(
    param_groups: Sequence[dict[str, Any]],
    names: Sequence[Sequence[str]],
    saved: Sequence[dict[str, Any]],
    *,
    owner: str,
) -> None:
    """Restore hyperparameters written by :func:`param_groups_state` into ``param_groups`` in place.

    Saved group i must hold the same parameter names as ``names[i]`` (in any order); ``owner`` names the caller in
    the error. A value goes back in the type the group holds now: a tensor is filled, a tuple stays a tuple.
    """
    if len(saved) != len(param_groups):
        raise ValueError(
            f"{owner}: the checkpoint has {len(saved)} param groups but the optimizer has {len(param_groups)}; "
            "build the optimizer with the same param groups as the one that was saved"
        )
    for i, (group_names, s) in enumerate(zip(names, saved)):
        mine, theirs = set(group_names), set(s["params"])
        if mine != theirs:
            raise ValueError(
                f"{owner}: param group {i} holds other parameters than the saved one: not in the checkpoint "
                f"{sorted(mine - theirs)[:5]}, not in the optimizer {sorted(theirs - mine)[:5]}; build the "
                "optimizer's param groups from the same parameters as the one that was saved"
            )
    for group, s in zip(param_groups, saved):
        for k, v in s.items():
            if k == "params":
                continue
            cur = group.get(k)
            if isinstance(cur, torch.Tensor):
                cur.fill_(v)
            elif isinstance(cur, tuple):
                group[k] = tuple(v)
            else:
                group[k] = v
