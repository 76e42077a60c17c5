"""Atomic checkpoint directories and asynchronous saves.

[Note: commit protocol]
Every rank writes its files into ``<parent>/.tmp-<name>-<token>/`` and then a marker ``rank-NNNNN.done.json``
listing the files it wrote with their sizes and CRC32. Rank 0 waits for all markers, writes ``manifest.json``
(every file's checksum and the layout it was saved from), renames the directory to ``<parent>/<name>`` and only
then updates ``<parent>/latest``. A process killed at any point leaves either the previous checkpoint or the
new one complete, never a half-written directory under a real name; readers ignore ``.tmp-*`` directories.
Markers go through the (shared) file system rather than a collective so that the commit can run in the
background thread of an asynchronous save without racing the training loop's collectives.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from cai.ckpt._format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    LATEST_NAME,
    MANIFEST_NAME,
    TMP_PREFIX,
    read_json,
    write_json,
)

_COMMIT_TIMEOUT_S = float(os.environ.get("CAI_CKPT_COMMIT_TIMEOUT", "1800"))
# Files a rank writes (or reads) at once: one thread per file, as page-cache copies and NVMe both scale a little.
IO_THREADS = int(os.environ.get("CAI_CKPT_IO_THREADS", "4"))


def dist_info(group: Any = None) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) without an initialised process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def global_rank(group: Any, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


class Transaction:
    """One checkpoint directory being written by all ranks of ``group`` (see [Note: commit protocol])."""

    def __init__(
        self, final: Path, *, group: Any = None, update_latest: bool = False, info: dict | None = None
    ):
        self.final = Path(final)
        self.group = group
        self.rank, self.world = dist_info(group)
        self.update_latest = update_latest
        self.info = dict(info or {})
        self.layout: dict[str, Any] = {"world_size": self.world}
        self.files: dict[str, dict[str, int]] = {}
        self.jobs: list[Callable[[], None]] = []
        self.failed: str | None = None  # this rank's error, reported to the others before raising
        token = [secrets.token_hex(4) if self.rank == 0 else None]
        if self.rank == 0:
            self.final.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = self.final.parent / f"{TMP_PREFIX}{self.final.name}-{token[0]}"
            self.tmp.mkdir()
        if self.world > 1:
            dist.broadcast_object_list(token, src=global_rank(group, 0), group=group)
        self.tmp = self.final.parent / f"{TMP_PREFIX}{self.final.name}-{token[0]}"

    def path(self, rel: str) -> Path:
        p = self.tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def record(self, rel: str, entry: dict[str, int]) -> None:
        self.files[rel] = entry

    def run(self) -> None:
        """Run the queued writes, publish this rank's marker, and (rank 0) commit."""
        with self.guard():
            if self.failed:
                raise RuntimeError(self.failure_message(self.rank, self.failed))
            try:
                run_parallel(self.jobs, IO_THREADS)
            finally:
                self.jobs.clear()
            write_json(self.tmp / f"rank-{self.rank:05d}.done.json", {"files": self.files})
            if self.rank == 0:
                self._commit()

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """On any error, leave a ``failed`` marker so that the other ranks stop waiting for this one."""
        try:
            yield
        except BaseException as e:
            with contextlib.suppress(OSError):
                write_json(self.tmp / f"rank-{self.rank:05d}.failed.json", {"error": repr(e)})
            raise

    def failure_message(self, rank: int, error: str) -> str:
        return f"checkpoint {self.final} was not saved: rank-{rank:05d} failed: {error}; the previous one is untouched"

    def _failure(self) -> str | None:
        try:
            markers = sorted(self.tmp.glob("rank-*.failed.json"))
        except FileNotFoundError:  # rank 0 renamed the directory into place while we listed it: committed
            return None
        for failed in markers:
            rank = int(failed.name.split(".")[0].removeprefix("rank-"))
            error = "unknown error"
            with contextlib.suppress(Exception):
                error = read_json(failed)["error"]
            if error.startswith("RuntimeError('checkpoint "):  # a rank that only relays another's failure
                continue
            return self.failure_message(rank, error)
        return None

    def wait_committed(self) -> None:
        """Return once rank 0 has renamed the directory into place; raise if any rank failed instead.

        Polls the file system rather than using a barrier, so a failed rank cannot leave the others hanging.
        """
        deadline = time.monotonic() + _COMMIT_TIMEOUT_S
        while self.tmp.exists():
            failure = self._failure()
            if failure is not None:
                raise RuntimeError(failure)
            if time.monotonic() > deadline:
                raise TimeoutError(f"checkpoint {self.final}: not committed after {_COMMIT_TIMEOUT_S} s")
            time.sleep(0.005)

    def _commit(self) -> None:
        files: dict[str, dict[str, int]] = {}
        deadline = time.monotonic() + _COMMIT_TIMEOUT_S
        for r in range(self.world):
            marker = self.tmp / f"rank-{r:05d}.done.json"
            while not marker.exists():
                failure = self._failure()
                if failure is not None:
                    raise RuntimeError(failure)
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"checkpoint {self.final}: rank {r} did not finish writing in {_COMMIT_TIMEOUT_S} s"
                    )
                time.sleep(0.005)
            files.update(read_json(marker)["files"])
            marker.unlink()
        manifest = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "layout": self.layout,
            **self.info,
            "files": dict(sorted(files.items())),
        }
        write_json(self.tmp / MANIFEST_NAME, manifest)
        old = None
        if self.final.exists():
            old = self.final.parent / f"{TMP_PREFIX}{self.final.name}-{secrets.token_hex(4)}-old"
            os.replace(self.final, old)
        os.replace(self.tmp, self.final)
        _fsync_dir(self.final.parent)
        if self.update_latest:
            latest = self.final.parent / LATEST_NAME
            partial = latest.with_name(LATEST_NAME + ".partial")
            partial.write_text(self.final.name + "\n")
            os.replace(partial, latest)
            _fsync_dir(self.final.parent)
        # Leftovers of earlier attempts that were killed mid-save, and the replaced directory.
        for stale in self.final.parent.glob(f"{TMP_PREFIX}{self.final.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)


def run_parallel(jobs: list[Callable[[], None]], threads: int) -> None:
    """Run ``jobs`` on up to ``threads`` plain threads (usable at interpreter exit, unlike executors)."""
    if threads <= 1 or len(jobs) <= 1:
        for job in jobs:
            job()
        return
    todo = list(reversed(jobs))
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not todo or errors:
                    return
                job = todo.pop()
            try:
                job()
            except BaseException as e:
                with lock:
                    errors.append(e)

    pool = [threading.Thread(target=worker, name="cai-ckpt-io") for _ in range(min(threads, len(jobs)))]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]


def _fsync_dir(path: Path) -> None:
    """Make a rename durable (POSIX: the directory entry lives in the parent directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _Pending:
    def __init__(self, txn: Transaction):
        self.txn = txn
        self.error: BaseException | None = None
        self.thread = threading.Thread(
            target=self._main, name=f"cai-ckpt-save-{txn.final.name}", daemon=False
        )
        self.thread.start()

    def _main(self) -> None:
        try:
            self.txn.run()
        except BaseException as e:  # re-raised in wait()
            self.error = e


_pending: list[_Pending] = []
_lock = threading.Lock()


def finish(txn: Transaction, *, use_async: bool) -> None:
    """Write (now, or in a background thread) and commit ``txn``."""
    if use_async:
        with _lock:
            _pending.append(_Pending(txn))
        return
    txn.run()
    txn.wait_committed()


def wait(*, commit: bool = True) -> None:
    """Block until every asynchronous save of this process is written and committed; re-raise its error.

    When it returns on any rank the checkpoint is committed (renamed into place by rank 0). Every save and
    load calls it first, and it runs at interpreter exit (with ``commit=False``: only this rank's writes).
    """
    with _lock:
        pending = list(_pending)
        _pending.clear()
    errors = []
    for p in pending:
        p.thread.join()
        if p.error is not None:
            errors.append(p.error)
        elif commit:
            try:
                p.txn.wait_committed()
            except BaseException as e:
                errors.append(e)
    if errors:
        raise RuntimeError(f"asynchronous checkpoint save failed: {errors[0]!r}") from errors[0]


atexit.register(wait, commit=False)
