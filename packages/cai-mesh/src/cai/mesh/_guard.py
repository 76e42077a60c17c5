"""Collectives that cannot make progress end with a message instead of hanging.

Three pieces, installed by ``launch_*``:
- a bounded timeout on every process group (the default group and every group created after it);
- thin wrappers around the ``torch.distributed`` module-level collectives that turn the backend's timeout or
  peer-failure exception into a ``CollectiveTimeoutError`` naming this rank, the collective, its group and the
  training step (``current_step()``, advanced by the booster's ``optimizer.step()``);
- a debug switch (``debug_collectives``) that has torch check, before every collective, that all ranks of the
  group issue the same one (``TORCH_DISTRIBUTED_DEBUG=DETAIL``); a mismatch raises ``CollectiveMismatchError``.

[Note: collective guard]
The wrapper costs one Python call and one integer increment per collective (no group lookup, no argument
inspection): everything else happens only when the backend raises. It replaces ``dist.<op>`` module attributes,
the same attributes ``cai.mesh.testing.CollectiveCounter`` patches, so the two nest: a counter entered after
``launch_*`` wraps the guarded function and puts it back on exit. torch's own code calls its collectives through
its module globals, so only calls written ``dist.<op>(...)`` (the cai convention) are guarded, and an object
collective counts once, not once per tensor collective inside it.
Only synchronous calls are translated: an ``async_op=True`` collective fails later in ``work.wait()``, outside
the wrapper, with the backend's own message (wrapping the work handle would break ``isinstance`` checks in torch).
When a collective fails, this rank posts what it was doing to the default store and reads what the other ranks of
the group posted (a few seconds at most), so one message shows every rank's collective: the rank that skipped or
added a collective shows a different op, step or collective number; a rank that posted nothing is stopped, dead
or busy outside any collective. With the debug checks on, every synchronous collective is posted before it runs
and its post removed when it completes (two store operations a collective, in a mode that already runs a check
collective before each one): torch's sequence check raises first on one rank while another may stay inside the
check until its timeout, and the first rank reads the other's collective from its post.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = [
    "DEFAULT_TIMEOUT",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "advance_step",
    "current_step",
    "debug_checks_on",
]

# A job is stuck when no rank has made progress for this long. Long enough for the longest thing one rank does
# alone while the others wait in a collective (rank 0 downloading a model under priority_execution, writing a
# large checkpoint, compiling kernels); short enough that a hung job gives its nodes back in minutes rather than
# torch's 30 (gloo) or until someone notices. Same as torch's NCCL default, so GPU and CPU jobs agree.
DEFAULT_TIMEOUT = timedelta(minutes=10)
TIMEOUT_ENV = "CAI_DIST_TIMEOUT"
DEBUG_ENV = "CAI_DEBUG_COLLECTIVES"
_PEER_WAIT_S = 10.0  # the most a failing rank waits for the other ranks' reports
_PEER_REPORT_LIMIT = 16  # ranks whose reports are read (the rest of a large group is summarised)

_OPS = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
    "gather", "scatter", "send", "recv", "barrier", "monitored_barrier", "all_gather_object",
    "broadcast_object_list", "gather_object", "scatter_object_list",
)  # fmt: skip
# Reported under one name whatever the torch release calls them (as CollectiveCounter does).
_CANONICAL = {"reduce_scatter_single": "reduce_scatter_tensor", "all_gather_single": "all_gather_into_tensor"}
_REPORT_KEY = "cai/collective_failure/rank{}"


class CollectiveError(dist.DistBackendError):
    """A collective failed because another rank of its group failed or closed its connection."""


class CollectiveTimeoutError(CollectiveError):
    """A collective did not complete within the process group's timeout."""


class CollectiveMismatchError(CollectiveError):
    """With ``debug_collectives``: the ranks of a group issued different collectives."""


class _State:
    # An instance, not class attributes: writing a class attribute invalidates the type's caches on every call.
    __slots__ = ("issued", "posting", "step")

    def __init__(self) -> None:
        self.step = 0  # optimizer.step() calls so far (see current_step)
        self.issued = 0  # guarded collectives this process has issued
        self.posting = False  # debug checks on: each synchronous collective is posted while it runs


_STATE = _State()


def debug_checks_on() -> bool:
    """Whether ``launch_*`` turned the debug checks on (``debug_collectives=True`` or ``$CAI_DEBUG_COLLECTIVES``).

    Other packages read it to run invariant checks too costly for every step of a normal run (cai-zero compares
    the copies of a tied weight after each step)."""
    return _STATE.posting


def current_step() -> int:
    """The training step collectives belong to now: how many times ``optimizer.step()`` has been called.

    The booster's optimizer advances it when its ``step()`` begins, so collectives of the first forward and
    backward report step 0, those inside the first ``optimizer.step()`` and the second forward and backward
    report step 1, and so on. Code with its own loop calls ``advance_step()`` once per step.
    """
    return _STATE.step


def advance_step() -> int:
    """Start the next training step (the booster's ``optimizer.step()`` calls it first); returns the new step."""
    _STATE.step += 1
    return _STATE.step


def resolve_timeout(timeout: float | timedelta | None) -> timedelta:
    """``timeout`` (seconds or a timedelta), else ``$CAI_DIST_TIMEOUT`` seconds, else ``DEFAULT_TIMEOUT``."""
    source = "timeout"
    if timeout is None and os.environ.get(TIMEOUT_ENV):
        source, timeout = TIMEOUT_ENV, os.environ[TIMEOUT_ENV]
        try:
            timeout = float(timeout)
        except ValueError:
            raise ValueError(
                f"launch: {TIMEOUT_ENV}={timeout!r} is not a number of seconds; set e.g. {TIMEOUT_ENV}=600"
            ) from None
    if timeout is None:
        return DEFAULT_TIMEOUT
    value = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    if value.total_seconds() <= 0:
        raise ValueError(f"launch: {source} must be positive, got {timeout!r} (seconds or a timedelta)")
    return value


def debug_enabled(debug_collectives: bool | None) -> bool:
    if debug_collectives is not None:
        return debug_collectives
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def configure(*, timeout: timedelta, debug: bool, backend: str) -> None:
    """Before the default group is created: the timeout every later group inherits, the debug checks, the guard.

    [Note: default timeout of sub-groups]
    ``new_group``, ``split_group`` and DeviceMesh (its dimension and flattened groups) do not inherit the default
    group's timeout: without an explicit one they read the module defaults of ``distributed_c10d`` (30 minutes
    for gloo, 10 for NCCL). Setting those defaults makes every group created after ``launch_*`` use the launch
    timeout, including groups other packages create, without each call site passing it.
    """
    c10d.default_pg_timeout = timeout
    if isinstance(c10d.default_pg_nccl_timeout, timedelta):
        c10d.default_pg_nccl_timeout = timeout
    if debug:
        # DETAIL wraps every gloo/NCCL group in torch's ProcessGroupWrapper, which compares op, shapes and dtypes
        # of each collective across the group before running it. The environment variable reaches subprocesses.
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        dist.set_debug_level(dist.DebugLevel.DETAIL)
        if backend == "nccl":
            # NCCL's flight recorder: the last collectives of every group, dumped to a file when one times out.
            os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
            os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    _STATE.posting = debug
    install()


def install() -> None:
    """Guard the ``torch.distributed`` collectives (idempotent; see [Note: collective guard])."""
    for op in _OPS:
        original = getattr(dist, op, None)
        if original is None or getattr(original, "_cai_guarded", False):
            continue
        setattr(dist, op, _guard(op, original))


def uninstall() -> None:
    """Put back torch's functions and defaults (for tests that launch inside a reused process)."""
    from torch.distributed import constants

    for op in _OPS:
        fn = getattr(dist, op, None)
        original = getattr(fn, "_cai_original", None)
        if original is not None:
            setattr(dist, op, original)
    c10d.default_pg_timeout = constants.default_pg_timeout
    c10d.default_pg_nccl_timeout = constants.default_pg_nccl_timeout
    _STATE.posting = False


def _guard(op: str, original: Any) -> Any:
    name = _CANONICAL.get(op, op)

    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _STATE.issued += 1
        posted = _STATE.posting and not kwargs.get("async_op") and _post(_report(name, args, kwargs))
        try:
            out = original(*args, **kwargs)
        except RuntimeError as e:
            error = _translate(name, args, kwargs, e)
            if error is None:
                raise
            raise error from e
        if posted:
            _unpost()
        return out

    guarded._cai_guarded = True  # type: ignore[attr-defined]
    guarded._cai_original = original  # type: ignore[attr-defined]
    return guarded


@dataclass(frozen=True)
class _Report:
    rank: int
    op: str
    group: list[int]
    step: int
    issued: int

    def describe(self) -> str:
        return f"{self.op} on ranks {self.group} at step {self.step} (collective #{self.issued} of that rank)"


def _classify(e: RuntimeError) -> tuple[type[CollectiveError], str] | None:
    text = str(e)
    low = text.lower()
    if "mismatch between collectives" in low:
        return CollectiveMismatchError, "the ranks of the group issued different collectives"
    if "timed out" in low or "timeout" in low or "failed to pass monitoredbarrier" in low:
        return CollectiveTimeoutError, "timed out"
    if (
        isinstance(e, dist.DistNetworkError)
        or "connection closed by peer" in low
        or "connection reset" in low
    ):
        return (
            CollectiveError,
            "failed: another rank of the group closed its connection (it failed or exited)",
        )
    return None


def _group_of(args: tuple, kwargs: dict) -> Any:
    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    return group if group is not None else dist.group.WORLD


def _report(op: str, args: tuple, kwargs: dict) -> _Report:
    try:
        ranks = [int(r) for r in dist.get_process_group_ranks(_group_of(args, kwargs))]
    except Exception:  # the failure may have torn the group down; report what is known
        ranks = []
    return _Report(rank=dist.get_rank(), op=op, group=ranks, step=_STATE.step, issued=_STATE.issued)


def _post(report: _Report) -> bool:
    """Put ``report`` where the other ranks read it; whether it is there."""
    try:
        c10d._get_default_store().set(_REPORT_KEY.format(report.rank), json.dumps(report.__dict__))
    except Exception:
        return False
    return True


def _unpost() -> None:
    with contextlib.suppress(Exception):  # a store without delete: the next post overwrites the key
        c10d._get_default_store().delete_key(_REPORT_KEY.format(dist.get_rank()))


def _translate(op: str, args: tuple, kwargs: dict, e: RuntimeError) -> CollectiveError | None:
    kind = _classify(e)
    if kind is None or not dist.is_initialized():
        return None
    cls, what = kind
    rank = dist.get_rank()
    me = _report(op, args, kwargs)
    try:
        timeout = _group_timeout(_group_of(args, kwargs))
    except Exception:
        timeout = None
    if cls is CollectiveTimeoutError and timeout is not None:
        what = f"timed out after {timeout.total_seconds():g} s"
    lines = [f"rank {rank}: {me.describe()}: {what}."]
    reports: dict[int, _Report | None] = {rank: me, **_exchange_reports(me)}
    if len(reports) > 1:
        lines.append("What each rank of the group was doing when it failed:")
        lines += [f"  rank {r}: {reports[r].describe() if reports[r] else 'no report (stopped, dead, or not in a collective)'}"
                  for r in sorted(reports)]  # fmt: skip
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    if cls is CollectiveMismatchError:
        lines.append(f"torch's check: {first[:400]}")
        lines.append(
            "Fix: every rank must issue the same collectives in the same order; look for a collective under a "
            "condition that depends on the rank or on local data (a skipped step, an extra save or log)."
        )
    else:
        lines.append(
            "Fix: a rank that skips or adds a collective, or a stopped or crashed rank, leaves the others waiting; "
            f"rerun with {DEBUG_ENV}=1 (or launch_*(debug_collectives=True)) to check that all ranks issue the "
            f"same collectives. If the wait is legitimate (one rank saving or downloading), raise the timeout "
            f"with launch_*(timeout=seconds) or {TIMEOUT_ENV}."
        )
        lines.append(f"Backend error: {first[:300]}")
    return cls("\n".join(lines))


def _group_timeout(group: Any) -> timedelta | None:
    try:
        return group._get_backend(group._device_types[0]).options._timeout
    except Exception:  # a backend without options, or torch moved the attribute: the message omits the value
        return None


def _exchange_reports(me: _Report) -> dict[int, _Report | None]:
    """Post this rank's report and read the other ranks' (see [Note: collective guard]); {} if no store."""
    if not _post(me):
        return {}
    store = c10d._get_default_store()
    others = [r for r in me.group if r != me.rank][:_PEER_REPORT_LIMIT]
    keys = {r: _REPORT_KEY.format(r) for r in others}
    # Polled with check() rather than store.wait(), which logs a socket warning for every key that never comes.
    # Ranks that wait on each other time out at about the same moment; a stopped rank never reports, so the wait is
    # bounded: a failing rank ends at most min(timeout / 2, 10 s) after its timeout. With the debug checks each rank
    # posted its collective before running it, so a rank still inside torch's check is read at once.
    deadline = time.monotonic() + min(_PEER_WAIT_S, _timeout_s() / 2)
    pending = set(others)
    try:
        while pending and time.monotonic() < deadline:
            pending = {r for r in pending if not store.check([keys[r]])}
            if pending:
                time.sleep(0.1)
        return {r: None if r in pending else _Report(**json.loads(store.get(keys[r]))) for r in others}
    except Exception:  # the store went away with its host rank
        return {r: None for r in others}


def _timeout_s() -> float:
    return c10d.default_pg_timeout.total_seconds()
