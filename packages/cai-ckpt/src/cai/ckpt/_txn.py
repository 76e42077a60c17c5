"""Atomic checkpoint directories and asynchronous saves.

[Note: commit protocol]
Rank 0 first decides whether the save may replace what is at ``<parent>/<name>`` (nothing, an empty directory
or a checkpoint cai-ckpt wrote, every file listed in its manifest; never a file or a directory of other files)
and creates ``<parent>/.tmp-<name>-<token>/`` with a ``.cai-ckpt-partial`` marker; it broadcasts the token or
the refusal, so every rank raises the same error before any rank writes. Every rank then writes its files
there and reports through the process group's c10d store: it pushes ``{"files": ...}`` (or the failure, with
the rank it came from) to the transaction's queue and sets its ``done`` key. Rank 0 pops one report per rank,
writes ``manifest.json`` (every file's size and checksums, the layout it was saved from), removes the marker,
renames the directory to ``<parent>/<name>``, updates ``<parent>/latest``, and only then sets the ``commit``
key, for which the other ranks wait. A failure reported by any rank is set as the commit result instead, so
every rank raises the error of the rank where it started. Every wait is bounded by the process group's
timeout; on timeout the error names the ranks that never reported.

The store rather than a collective, so that the commit can run in the background thread of an asynchronous
save without racing the training loop's collectives; each transaction uses its own clone of the store (its
own connection), so that a blocking wait never holds the connection the process group uses. A process
killed at any point leaves either the previous checkpoint or the new one complete, never a half-written
directory under a real name; readers ignore ``.tmp-*`` directories, and the next save of that name removes
the ones that carry the marker (and only those).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cai.ckpt._format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    LATEST_NAME,
    MANIFEST_NAME,
    TMP_PREFIX,
    write_json,
)

# Files a rank writes (or reads) at once: one thread per file, as page-cache copies and NVMe both scale a little.
IO_THREADS = int(os.environ.get("CAI_CKPT_IO_THREADS", "4"))
PARTIAL_MARKER = ".cai-ckpt-partial"  # in a temporary directory this code created; removed at the commit


def dist_info(group: Any = None) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) without an initialised process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def everyone(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` (small, picklable), by rank in ``group``; ``[obj]`` in one process."""
    _, world = dist_info(group)
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def global_rank(group: Any, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


class SaveFailed(RuntimeError):
    """A checkpoint was not saved because a rank failed; every rank raises it, naming that rank and its error."""

    def __init__(self, final: Path, rank: int, error: str):
        self.final, self.rank, self.error = Path(final), rank, error
        super().__init__(
            f"checkpoint {final} was not saved: rank-{rank:05d} failed: {error}; the previous one is untouched"
        )


def _fmt(names: list[str], limit: int = 10) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _cai_manifest(directory: Path) -> dict | None:
    try:
        manifest = json.loads((directory / MANIFEST_NAME).read_bytes())
    except (OSError, ValueError):
        return None
    if (
        isinstance(manifest, dict)
        and manifest.get("format") == FORMAT_NAME
        and isinstance(manifest.get("files"), dict)
    ):
        return manifest
    return None


def replace_refusal(final: Path) -> str | None:
    """Why a save must not replace what is at ``final``; None when it may (nothing there, an empty directory, or a
    cai-ckpt checkpoint whose every file its manifest lists)."""
    fix = "save to a new or empty directory, or move it away first"
    if final.is_symlink() and not final.exists():
        return f"cannot save a checkpoint to {final}: it is a symbolic link to {os.readlink(final)}, which does not exist; {fix}"
    for parent in final.parents:
        if parent.exists() and not parent.is_dir():
            return f"cannot save a checkpoint to {final}: {parent} is a file, not a directory; {fix}"
    if not final.exists():
        return None
    what = f"{final} (a symbolic link to {final.resolve()})" if final.is_symlink() else str(final)
    if not final.is_dir():
        kind = f"a file of {final.stat().st_size} bytes" if final.is_file() else "not a directory"
        return f"cannot save a checkpoint to {what}: it is {kind}, which the save would replace; {fix}"
    names = sorted(
        p.relative_to(final).as_posix() for p in final.rglob("*") if p.is_symlink() or not p.is_dir()
    )
    if not names:
        return None
    manifest = _cai_manifest(final)
    if manifest is None:
        return (
            f"cannot save a checkpoint to {what}: it is a directory of files cai-ckpt did not write "
            f"({_fmt(names)}; no cai-ckpt {MANIFEST_NAME}), and a save replaces the whole directory; {fix}"
        )
    foreign = [n for n in names if n != MANIFEST_NAME and n not in manifest["files"]]
    if foreign:
        return (
            f"cannot save a checkpoint to {what}: it is a cai-ckpt checkpoint that also holds files its manifest "
            f"does not list ({_fmt(foreign)}), and a save replaces the whole directory; move those files away, "
            "or save to another path"
        )
    return None


def _latest_refusal(parent: Path) -> str | None:
    latest = parent / LATEST_NAME
    if not (latest.exists() or latest.is_symlink()):
        return None
    if latest.is_symlink() or not latest.is_file() or latest.stat().st_size > 256:
        return (
            f"cannot save a checkpoint in {parent}: {latest} is not a cai-ckpt 'latest' pointer (a small file), "
            "and the save would replace it; move it away first"
        )
    return None


def _group_timeout(group: Any) -> datetime.timedelta:
    """The process group's collective timeout (what ``init_process_group(timeout=...)`` or ``new_group`` set)."""
    from torch.distributed import distributed_c10d as c10d

    pg = group if group is not None else c10d._get_default_group()
    for device in ("cpu", "cuda"):
        with contextlib.suppress(Exception):
            return pg._get_backend(torch.device(device)).options._timeout
    return c10d._get_process_group_store(pg).timeout


def _store(group: Any) -> Any:
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_process_group_store(group if group is not None else c10d._get_default_group())
    try:
        return store.clone()
    except Exception:  # a store type without clone(): share the group's (waits then hold its connection)
        return store


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
        self.files: dict[str, dict[str, Any]] = {}
        self.jobs: list[Callable[[], None]] = []
        self.failed: str | None = None  # this rank's error, reported to the others before raising
        decision: list[Any] = [None]
        cause: BaseException | None = None
        if self.rank == 0:
            try:
                decision[0] = self._prepare()
            except Exception as e:
                cause = e
                decision[0] = ("error", f"checkpoint {self.final} cannot be saved: {e!r}")
        if self.world > 1:
            dist.broadcast_object_list(decision, src=global_rank(group, 0), group=group)
        kind, value = decision[0]
        if kind == "refuse":
            raise FileExistsError(value)
        if kind == "error":
            raise RuntimeError(value) from cause
        self.tmp = self.final.parent / f"{TMP_PREFIX}{self.final.name}-{value}"
        self.timeout = _group_timeout(group) if self.world > 1 else None
        self._store = _store(group) if self.world > 1 else None
        self._key = f"cai-ckpt/{self.tmp.name}"

    def _prepare(self) -> tuple[str, str]:
        """Rank 0: refuse to replace what is not a cai checkpoint, else create the temporary directory."""
        refusal = replace_refusal(self.final)
        if refusal is None and self.update_latest:
            refusal = _latest_refusal(self.final.parent)
        if refusal is not None:
            return "refuse", refusal
        self.final.parent.mkdir(parents=True, exist_ok=True)
        token = secrets.token_hex(4)
        tmp = self.final.parent / f"{TMP_PREFIX}{self.final.name}-{token}"
        tmp.mkdir()
        (tmp / PARTIAL_MARKER).write_text(f"a cai-ckpt save of {self.final.name} in progress, or killed\n")
        return "ok", token

    def path(self, rel: str) -> Path:
        p = self.tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def record(self, rel: str, entry: dict[str, Any]) -> None:
        self.files[rel] = entry

    def run(self) -> None:
        """Run the queued writes, report to rank 0, and (rank 0) commit."""
        with self.guard():
            if self.failed:
                raise SaveFailed(self.final, self.rank, self.failed)
            try:
                run_parallel(self.jobs, IO_THREADS)
            finally:
                self.jobs.clear()
            if self.rank == 0:
                self._commit()
            else:
                self._report({"rank": self.rank, "files": self.files})

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """On any error, report it (with the rank it started on) so that no rank waits for this one."""
        try:
            yield
        except BaseException as e:
            if isinstance(e, SaveFailed):
                origin, error = e.rank, e.error  # relayed from another rank, or this rank's own
            else:
                origin, error = self.rank, repr(e)
            with contextlib.suppress(Exception):
                if self.rank == 0:
                    self._publish_commit({"rank": origin, "error": error})
                else:
                    self._report({"rank": self.rank, "failed_rank": origin, "error": error})
            raise

    # ---- the store side of the protocol ------------------------------------------------------------------
    def _report(self, payload: dict[str, Any]) -> None:
        if self._store is None or getattr(self, "_reported", False):
            return
        self._reported = True
        self._store.queue_push(f"{self._key}/reports", json.dumps(payload))
        self._store.set(f"{self._key}/done/{self.rank}", b"1")

    def _publish_commit(self, result: dict[str, Any]) -> None:
        if self._store is None or getattr(self, "_published", False):
            return
        self._published = True
        self._store.set(f"{self._key}/commit", json.dumps(result))

    def _unreported(self) -> list[int]:
        return [r for r in range(1, self.world) if not self._store.check([f"{self._key}/done/{r}"])]

    def _timed_out(self, waiting_for: str) -> TimeoutError:
        missing = self._unreported()
        who = (
            f"ranks {missing} never finished writing"
            if missing
            else "every rank finished writing, but rank 0 did not commit (it may have died)"
        )
        return TimeoutError(
            f"checkpoint {self.final} was not saved: {waiting_for} did not arrive within the process group's "
            f"timeout ({self.timeout.total_seconds():.0f} s): {who}; the previous checkpoint is untouched "
            f"(the partial files are in {self.tmp})"
        )

    def _gather_reports(self) -> dict[str, dict[str, Any]]:
        """Rank 0: every other rank's files; raises the first failure any of them reports."""
        files: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + self.timeout.total_seconds()
        for _ in range(1, self.world):
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise dist.DistStoreError("deadline passed")
                self._store.set_timeout(datetime.timedelta(seconds=left))
                report = json.loads(self._store.queue_pop(f"{self._key}/reports"))
            except dist.DistStoreError:
                raise self._timed_out("the reports of the other ranks") from None
            if "error" in report:
                raise SaveFailed(self.final, report["failed_rank"], report["error"])
            files.update(report["files"])
        return files

    def wait_committed(self) -> None:
        """Return once rank 0 has committed; raise the failure it reports instead (ranks other than 0)."""
        if self._store is None or self.rank == 0:
            return
        key = f"{self._key}/commit"
        try:
            self._store.wait([key], self.timeout)
        except dist.DistStoreError:
            raise self._timed_out("rank 0's commit") from None
        result = json.loads(self._store.get(key))
        if self._store.add(f"{self._key}/read", 1) == self.world - 1:  # the last reader tidies up
            for done in range(1, self.world):
                self._store.delete_key(f"{self._key}/done/{done}")
            self._store.delete_key(key)
            self._store.delete_key(f"{self._key}/read")
        if "error" in result:
            raise SaveFailed(self.final, result["rank"], result["error"])

    # ---- rank 0 ------------------------------------------------------------------------------------------
    def _commit(self) -> None:
        files = dict(self.files)
        if self.world > 1:
            files.update(self._gather_reports())
        manifest = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "layout": self.layout,
            **self.info,
            "files": dict(sorted(files.items())),
        }
        write_json(self.tmp / MANIFEST_NAME, manifest)
        # Checked again: an asynchronous save commits long after it started, and the user may have put files there.
        refusal = replace_refusal(self.final)
        if refusal is not None:
            raise FileExistsError(f"{refusal} (the checkpoint written is left in {self.tmp})")
        (self.tmp / PARTIAL_MARKER).unlink()
        old = None
        if self.final.exists() or self.final.is_symlink():
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
        self._publish_commit({"ok": True})
        # The replaced checkpoint (checked above to hold only its own files; a symbolic link goes, not its
        # target), then leftovers of earlier saves of this name that were killed: only directories this code
        # created, recognised by their marker.
        if old is not None:
            if old.is_symlink():
                old.unlink()
            else:
                shutil.rmtree(old, ignore_errors=True)
        pattern = re.compile(re.escape(f"{TMP_PREFIX}{self.final.name}-") + r"[0-9a-f]{8}")
        for stale in self.final.parent.iterdir():
            if (
                pattern.fullmatch(stale.name)
                and not stale.is_symlink()
                and (stale / PARTIAL_MARKER).is_file()
            ):
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
        raise RuntimeError(
            f"asynchronous checkpoint save failed: {type(errors[0]).__name__}: {errors[0]}"
        ) from errors[0]


atexit.register(wait, commit=False)
