"""A pool of gloo worker processes kept alive for the whole test session.

Spawning a fresh process costs about 2 s on a small CPU machine (torch import, gloo set-up), which would make a
matrix of distributed tests unaffordable. The pool starts ``world_size`` workers once per world size and sends
each test function to them; every call gets a fresh default process group (its own rendezvous prefix) and freshly seeded RNGs.

[Note: test functions travel by reference]
Only the function's module name, file and qualified name are sent. A worker imports the module from its file
under the same name (creating empty parent modules where pytest's importlib mode invented a dotted name), so
that arguments whose classes live in the test module unpickle too.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import importlib.util
import io
import itertools
import multiprocessing as mp
import os
import pickle
import queue
import sys
import time
import traceback
import types
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

__all__ = ["DistributedTestError", "DistributedTestTimeout", "run_distributed", "shutdown_pools"]

_GRACE_S = 5.0  # how long the other ranks may take to finish after one rank failed
# [Note: rendezvous retry]
# Creating a call's gloo group (its full mesh of TCP connections) failed now and then on a loaded 2-core machine,
# "connectFullMesh failed ... Connection closed by peer", in a test that passed on every rerun. When every rank
# that failed did so there, before the test function ran, the pool is replaced and the call runs once more under
# a new rendezvous prefix, with a line on stderr; failing twice is an error that shows both. A failure in the test
# function is never retried.
# [Note: recycling workers]
# A worker keeps whatever a test left alive. A process group still referenced (a model and its hooks form reference
# cycles, freed only by the collector) keeps its gloo transport, whose event-loop thread wakes up on a timer:
# hundreds of them in each of 30 pooled workers took most of a 2-core machine. So each task ends with a collection;
# and should something still hold groups, after a call in which any rank holds more native threads than this the
# pool is replaced.
_MAX_THREADS = 64
_PARENT_CHECK_S = 5.0  # how often an idle worker checks that its parent is alive (read when its pool starts)


class DistributedTestError(AssertionError):
    """A rank raised; the message holds that rank's traceback and its captured output."""


class DistributedTestTimeout(DistributedTestError):
    """The ranks did not all finish within the timeout; the pool was killed and will be restarted."""


class _RendezvousFailed(DistributedTestError):
    """Every rank that failed did so creating the call's process group, before the test function ran."""


@dataclasses.dataclass(frozen=True)
class _Task:
    module: str
    file: str | None
    qualname: str
    payload: bytes  # pickled (args, kwargs): unpickled only after the test module is imported
    key: str
    seed: int
    timeout: float
    backend: str = "gloo"


def _import_by_reference(module: str, file: str | None) -> types.ModuleType:
    if module in sys.modules:
        return sys.modules[module]
    if file is None:
        return importlib.import_module(module)
    parts = module.split(".")
    for i in range(1, len(parts)):  # parents that pytest's importlib mode may have invented
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    spec = importlib.util.spec_from_file_location(module, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import test module {module!r} from {file!r}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[module]
        raise
    return mod


def _resolve(task: _Task) -> Callable:
    obj: Any = _import_by_reference(task.module, task.file)
    for part in task.qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _worker_main(
    rank: int, world_size: int, port: int, tasks: mp.Queue, results: mp.Queue, parent_check_s: float
) -> None:
    import torch
    import torch.distributed as dist

    from cai.mesh import set_seed

    torch.set_num_threads(1)  # many ranks share a few cores; oversubscription makes gloo tests crawl
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    # The parent hosts the store, so it is listening before any worker connects (no connect-retry back-off),
    # and every task rendezvouses under its own key prefix: a fresh process group without a new server.
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, timeout=timedelta(seconds=60))
    parent = mp.parent_process()
    while True:
        try:
            task: _Task | None = tasks.get(timeout=parent_check_s)
        except queue.Empty:
            # a test process that ends without its atexit handlers (pytest-xdist's workers) never sends the stop:
            # a worker whose parent is gone exits rather than linger with its memory and gloo threads
            if parent is not None and not parent.is_alive():
                return
            continue
        if task is None:
            return
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                fn = _resolve(task)
                args, kwargs = pickle.loads(task.payload)
                store.set_timeout(timedelta(seconds=max(task.timeout, 1.0)))
                if task.backend == "nccl":
                    torch.cuda.set_device(rank)  # one GPU per rank, as torchrun's LOCAL_RANK would give
                try:
                    dist.init_process_group(
                        task.backend,
                        store=dist.PrefixStore(task.key, store),
                        rank=rank,
                        world_size=world_size,
                        timeout=timedelta(seconds=max(task.timeout, 1.0)),
                    )
                except BaseException as e:
                    e._cai_rendezvous = True  # the test function has not run (see [Note: rendezvous retry])
                    raise
                try:
                    set_seed(task.seed)
                    value = fn(*args, **kwargs)
                except BaseException as e:
                    e._cai_failed_at = time.time()  # before tearing down the group, which fails the peers too
                    raise
                finally:
                    dist.destroy_process_group()
                    # what the test built may hold process groups in reference cycles (modules and their hooks):
                    # free them now, or their gloo threads live on (see [Note: recycling workers])
                    gc.collect()
            results.put(("ok", rank, value, "", 0.0, _native_threads()))
        except BaseException as e:
            failed_at = getattr(e, "_cai_failed_at", time.time())
            status = "rdzv" if getattr(e, "_cai_rendezvous", False) else "err"
            results.put((status, rank, traceback.format_exc(), out.getvalue()[-4000:], failed_at, 0))


def _native_threads() -> int:
    """This process's threads, native ones included (0 where /proc is not there)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


class _Pool:
    def __init__(self, world_size: int) -> None:
        import torch.distributed as dist

        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
        self.results: mp.Queue = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.threads = 0  # the most native threads a rank held after a call (see [Note: recycling workers])
        self.procs = [
            ctx.Process(
                target=_worker_main,
                args=(r, world_size, self.store.port, self.tasks[r], self.results, _PARENT_CHECK_S),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, task: _Task) -> list[Any]:
        for q in self.tasks:
            q.put(task)
        values: dict[int, Any] = {}
        errors: dict[int, tuple[str, str, float]] = {}
        rendezvous: set[int] = set()  # ranks that failed creating the process group
        deadline = time.monotonic() + task.timeout
        while len(values) + len(errors) < self.world_size:
            now = time.monotonic()
            if errors:
                deadline = min(deadline, now + _GRACE_S)
            try:
                status, rank, payload, output, failed_at, threads = self.results.get(
                    timeout=max(0.05, min(1.0, deadline - now))
                )
                self.threads = max(self.threads, threads)
            except queue.Empty:
                if not self.alive() or time.monotonic() >= deadline:
                    self.kill()
                    missing = sorted(set(range(self.world_size)) - values.keys() - errors.keys())
                    if errors:
                        raise self._error(task, errors, missing, rendezvous) from None
                    dead = [r for r, p in enumerate(self.procs) if p.exitcode not in (None, -9)]
                    why = (
                        f"worker processes died: ranks {dead}"
                        if dead
                        else f"timed out after {task.timeout:.0f} s"
                    )
                    raise DistributedTestTimeout(
                        f"{task.qualname} on {self.world_size} ranks {why}; ranks {missing} did not finish "
                        "(a collective that not every rank joined, or a deadlock). The pool was restarted."
                    ) from None
                continue
            if status == "ok":
                values[rank] = payload
            else:
                errors[rank] = (payload, output, failed_at)
                if status == "rdzv":
                    rendezvous.add(rank)
        if errors:
            raise self._error(task, errors, [], rendezvous)
        return [values[r] for r in range(self.world_size)]

    def _error(
        self,
        task: _Task,
        errors: dict[int, tuple[str, str, float]],
        missing: list[int],
        rendezvous: set[int],
    ) -> DistributedTestError:
        rank = min(
            errors, key=lambda r: errors[r][2]
        )  # the first to fail; the others usually fail because of it
        tb, output, _ = errors[rank]
        lines = [
            f"{task.qualname} failed on rank {rank} of {self.world_size} (failing ranks: {sorted(errors)})"
        ]
        if missing:
            lines.append(f"ranks {missing} were still running and were killed")
        lines.append(f"--- traceback of rank {rank} ---\n{tb}")
        if output.strip():
            lines.append(f"--- output of rank {rank} ---\n{output}")
        failed = _RendezvousFailed if rendezvous == errors.keys() else DistributedTestError
        return failed("\n".join(lines))

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)

    def close(self) -> None:
        for q in self.tasks:
            with contextlib.suppress(Exception):
                q.put(None)
        for p in self.procs:
            p.join(timeout=2)
        self.kill()


_POOLS: dict[int, _Pool] = {}
_TASK_IDS = itertools.count()


def shutdown_pools() -> None:
    """Stop every pooled worker (registered with atexit; tests rarely need to call it)."""
    while _POOLS:
        _POOLS.popitem()[1].close()


atexit.register(shutdown_pools)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the body with one intra-op thread, as the pooled workers do: a reference computed in the test process
    then rounds as theirs do (a multi-threaded reduction may round differently)."""
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def run_distributed(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    seed: int = 1234,
    backend: str = "gloo",
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks and return each rank's result, by rank.

    ``backend="nccl"`` runs the ranks on GPUs instead, rank r on ``cuda:r`` (the same pooled workers; the machine
    needs ``world_size`` GPUs).

    ``fn`` must be a module-level function (see [Note: test functions travel by reference]); arguments and
    results must pickle. Each call gets a fresh default process group and RNGs seeded with ``seed`` on every
    rank. A failing rank raises ``DistributedTestError`` with its traceback; ranks that do not finish within
    ``timeout`` seconds raise ``DistributedTestTimeout`` and the pool is restarted for the next call.

    Example::

        def _allreduce(value):
            t = torch.tensor([value + dist.get_rank()])
            dist.all_reduce(t)
            return t.item()

        def test_allreduce():
            assert run_distributed(_allreduce, 4, 1.0) == [10.0] * 4
    """
    if world_size < 1:
        raise ValueError(f"run_distributed: world_size must be >= 1, got {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(
            f"run_distributed: backend {backend!r}; use 'gloo' (CPU) or 'nccl' (one GPU per rank)"
        )
    if backend == "nccl":
        import torch

        if torch.cuda.device_count() < world_size:
            raise ValueError(
                f"run_distributed: backend='nccl' on {world_size} ranks needs {world_size} GPUs; "
                f"this machine has {torch.cuda.device_count()}"
            )
    module = sys.modules.get(fn.__module__)
    task = _Task(
        module=fn.__module__,
        file=getattr(module, "__file__", None),
        qualname=fn.__qualname__,
        payload=pickle.dumps((args, kwargs)),
        key=f"task{next(_TASK_IDS)}/",
        seed=seed,
        timeout=timeout,
        backend=backend,
    )
    try:
        return _run_on_pool(task, world_size)
    except _RendezvousFailed as e:  # see [Note: rendezvous retry]
        _drop_pool(world_size)
        sys.stderr.write(
            f"run_distributed: {task.qualname}'s ranks failed to connect; retried on a new pool\n"
        )
        try:
            return _run_on_pool(dataclasses.replace(task, key=f"task{next(_TASK_IDS)}/"), world_size)
        except _RendezvousFailed as again:
            _drop_pool(world_size)
            raise DistributedTestError(
                f"{again}\n(the ranks failed to create the process group twice, the second time on a new pool; "
                f"the first time:\n{e})"
            ) from None


def _drop_pool(world_size: int) -> None:
    pool = _POOLS.pop(world_size, None)
    if pool is not None:
        pool.kill()


def _run_on_pool(task: _Task, world_size: int) -> list[Any]:
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.kill()
        pool = _POOLS[world_size] = _Pool(world_size)
    try:
        return pool.run(task)
    except DistributedTestError:
        if not pool.alive():
            _POOLS.pop(world_size, None)
        raise
    finally:
        if pool.threads > _MAX_THREADS and _POOLS.get(world_size) is pool:
            _POOLS.pop(world_size).close()
