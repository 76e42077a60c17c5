"""Gradient hooks on parameters that hold their owner (an optimizer or a sharded model) weakly.

[Note: hooks hold their owner weakly]
A post-accumulate-grad hook that referenced its owner would keep the owner (master shards, optimizer state, chunks)
alive as long as the parameters live: autograd holds the hooks through C++ references that the garbage collector
cannot see through, so a cycle through a tensor hook is never collected (12 GiB per dropped optimizer at 1B
parameters). The hooks reach the owner through a weak reference instead, do nothing once it is gone, and are
removed when it is collected.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["register_grad_hooks_weakly"]

_T = TypeVar("_T")


def _call(ref: weakref.ref, fn: Callable[..., None], key: tuple, param: torch.Tensor) -> None:
    owner = ref()
    if owner is not None:
        fn(owner, param, *key)


def _remove(handles: list[RemovableHandle]) -> None:
    for h in handles:
        h.remove()


def register_grad_hooks_weakly(
    owner: _T, fn: Callable[..., None], params: Iterable[tuple[torch.Tensor, tuple[Any, ...]]]
) -> list[RemovableHandle]:
    """Run ``fn(owner, param, *key)`` after each ``param``'s gradient is accumulated, holding ``owner`` weakly.

    ``params`` yields ``(param, key)``; ``key`` (indices, say) must not reference the owner or anything it should
    not keep alive, and ``fn`` must be a plain function (an unbound method), not a bound one. The hooks are removed
    when ``owner`` is collected (see [Note: hooks hold their owner weakly]). The returned list of handles is the one
    removed then: other handles appended to it go with them.

    Example::

        self._hooks = register_grad_hooks_weakly(self, Optimizer._on_grad, ((p, (i,)) for i, p in enumerate(ps)))
    """
    ref = weakref.ref(owner)
    handles = [
        p.register_post_accumulate_grad_hook(functools.partial(_call, ref, fn, key)) for p, key in params
    ]
    weakref.finalize(owner, _remove, handles)
    return handles
