"""Count the collectives a piece of code issues, with their groups and sizes."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CollectiveCounter", "CollectiveEvent"]

# [Note: bytes of a collective]
# ``nbytes`` is the size of the whole buffer the collective works on: the tensor of an all-reduce or broadcast,
# the full input of a reduce-scatter, the full output of an all-gather, the sent or received tensor of a P2P op.
# So "one reduce-scatter and one all-gather of the padded parameters" reads as two events whose nbytes are the
# padded parameter bytes each.
_OPS: dict[str, str] = {
    # op name -> how to find the buffer whose size is reported
    "all_reduce": "arg0",
    "broadcast": "arg0",
    "reduce": "arg0",
    "reduce_scatter_tensor": "arg1",
    "reduce_scatter_single": "arg1",  # torch >= 2.13's name for reduce_scatter_tensor
    "all_gather_single": "arg0",  # torch >= 2.13's name for all_gather_into_tensor
    "reduce_scatter": "list1",
    "all_gather_into_tensor": "arg0",
    "all_gather": "list0",
    "all_to_all_single": "arg0",
    "all_to_all": "list0",
    "gather": "arg0_times_world",
    "scatter": "arg0_times_world",
    "send": "arg0",
    "recv": "arg0",
    "isend": "arg0",
    "irecv": "arg0",
    "barrier": "none",
    "all_gather_object": "none",
    "broadcast_object_list": "none",
}


# Ops recorded under one name whatever the torch release calls them, so tests read the same on every version.
_CANONICAL = {"reduce_scatter_single": "reduce_scatter_tensor", "all_gather_single": "all_gather_into_tensor"}


@dataclass(frozen=True)
class CollectiveEvent:
    op: str
    group_ranks: tuple[int, ...]
    nbytes: int


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _group_ranks(args: tuple, kwargs: dict) -> tuple[int, ...]:
    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    if group is None:
        group = dist.group.WORLD
    return tuple(dist.get_process_group_ranks(group))


def _size(how: str, args: tuple, kwargs: dict, world: int) -> int:
    if how == "none" or not args:
        return 0
    if how == "arg0":
        return _nbytes(args[0])
    if how == "arg1":
        return _nbytes(args[1]) if len(args) > 1 else _nbytes(kwargs.get("input"))
    if how == "list0":
        return sum(_nbytes(t) for t in args[0])
    if how == "list1":
        return sum(_nbytes(t) for t in (args[1] if len(args) > 1 else kwargs.get("input_list", [])))
    if how == "arg0_times_world":
        return _nbytes(args[0]) * world
    raise AssertionError(how)


class CollectiveCounter(contextlib.ContextDecorator):
    """Record every collective issued through ``torch.distributed.<op>`` while active.

    Example::

        with CollectiveCounter() as cc:
            optimizer.step()
        assert cc.count("all_gather_into_tensor") <= n_buckets
        assert cc.bytes("reduce_scatter_tensor") == padded_param_bytes

    See [Note: bytes of a collective] for what ``nbytes`` measures.
    """

    def __init__(self) -> None:
        self.events: list[CollectiveEvent] = []
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> CollectiveCounter:
        for op, how in _OPS.items():
            original = getattr(dist, op, None)
            if original is None:
                continue
            self._saved[op] = original
            setattr(dist, op, self._wrap(op, how, original))
        return self

    def __exit__(self, *exc: Any) -> None:
        for op, original in self._saved.items():
            setattr(dist, op, original)
        self._saved.clear()

    def _wrap(self, op: str, how: str, original: Any) -> Any:
        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            ranks = _group_ranks(args, kwargs)
            name = _CANONICAL.get(op, op)
            self.events.append(CollectiveEvent(name, ranks, _size(how, args, kwargs, len(ranks))))
            return original(*args, **kwargs)

        return counted

    def count(self, op: str | None = None) -> int:
        return sum(1 for e in self.events if op is None or e.op == op)

    def bytes(self, op: str | None = None) -> int:
        return sum(e.nbytes for e in self.events if op is None or e.op == op)

    def summary(self) -> dict[str, tuple[int, int]]:
        """op -> (count, bytes)."""
        out: dict[str, tuple[int, int]] = {}
        for e in self.events:
            c, b = out.get(e.op, (0, 0))
            out[e.op] = (c + 1, b + e.nbytes)
        return out
