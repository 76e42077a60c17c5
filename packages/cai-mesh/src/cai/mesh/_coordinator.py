"""Who does what across ranks: the master rank, node masters, ordered execution, barriers."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = ["DistCoordinator"]

F = TypeVar("F", bound=Callable[..., Any])


class DistCoordinator:
    """Rank queries and coordination helpers over the default process group (or a given group ``pg``).

    Every property reads the live process group, so a coordinator stays correct if the group is re-created;
    all instances behave the same (``DistCoordinator()`` is cheap to call anywhere).

    Example::

        coordinator = DistCoordinator()
        coordinator.print_on_master(f"world size {coordinator.world_size}")
        with coordinator.priority_execution():       # rank 0 downloads first, the others then read the cache
            model = AutoModelForCausalLM.from_pretrained(name)

        @coordinator.on_master_only()
        def save_config(): ...
    """

    def __init__(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "DistCoordinator: torch.distributed is not initialised; call launch_from_torch() first"
            )

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def local_rank(self) -> int:
        """Rank within the node: LOCAL_RANK as set by torchrun, else -1 (unknown)."""
        return int(os.environ.get("LOCAL_RANK", "-1"))

    @staticmethod
    def _rank_in(pg: dist.ProcessGroup | None) -> int:
        return dist.get_rank(pg) if pg is not None else dist.get_rank()

    def is_master(self, pg: dist.ProcessGroup | None = None) -> bool:
        """True on rank 0 of ``pg`` (default: the world)."""
        return self._rank_in(pg) == 0

    def is_node_master(self) -> bool:
        """True on local rank 0 of each node (on the global master when LOCAL_RANK is unknown)."""
        local = self.local_rank
        return local == 0 if local >= 0 else self.rank == 0

    def is_last_process(self, pg: dist.ProcessGroup | None = None) -> bool:
        """True on the last rank of ``pg`` (default: the world)."""
        size = dist.get_world_size(pg) if pg is not None else self.world_size
        return self._rank_in(pg) == size - 1

    def print_on_master(self, msg: str, pg: dist.ProcessGroup | None = None) -> None:
        if self.is_master(pg):
            print(msg, flush=True)

    def print_on_node_master(self, msg: str) -> None:
        if self.is_node_master():
            print(msg, flush=True)

    def block_all(self, pg: dist.ProcessGroup | None = None) -> None:
        """Barrier over ``pg`` (default: the world)."""
        dist.barrier(group=pg)

    @contextlib.contextmanager
    def priority_execution(
        self, executor_rank: int = 0, pg: dist.ProcessGroup | None = None
    ) -> Iterator[bool]:
        """Run the body on ``executor_rank`` (a rank of ``pg``) first; the other ranks run it after it finished.

        Yields True on the executor. Typical use: one rank downloads or preprocesses into a cache, the rest read it.
        """
        is_executor = self._rank_in(pg) == executor_rank
        if not is_executor:
            self.block_all(pg)
        try:
            yield is_executor
        finally:
            # The executor joins the barrier even if the body raised, so the others are not left waiting forever.
            if is_executor:
                self.block_all(pg)

    def on_master_only(self, pg: dist.ProcessGroup | None = None) -> Callable[[F], F]:
        """Decorator: the function runs on rank 0 of ``pg`` only and returns None elsewhere."""

        def decorator(fn: F) -> F:
            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                return fn(*args, **kwargs) if self.is_master(pg) else None

            return wrapper  # type: ignore[return-value]

        return decorator

    def destroy(self, pg: dist.ProcessGroup | None = None) -> None:
        """Destroy ``pg`` (default: the default process group and every group made from it)."""
        dist.destroy_process_group(pg)
