"""Jobs that cannot make progress end with a message: group timeouts, the collective guard, the debug check."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cai.mesh import (
    DEFAULT_TIMEOUT,
    CollectiveError,
    ParallelDims,
    _guard,
    advance_step,
    current_step,
    debug_checks_on,
    free_port,
    launch,
)
from cai.mesh.testing import CollectiveCounter, run_distributed

TIMEOUT_S = 5


def _relaunch(port: int, **kwargs) -> None:
    """Replace the pool's process group by one that launch() creates, as a fresh process would."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    _guard._STATE.step = _guard._STATE.issued = 0
    launch(rank, world, "127.0.0.1", port, verbose=False, **kwargs)


def _restore() -> None:
    # The pooled worker runs later tests: put back torch's functions, defaults and debug level.
    _guard.uninstall()
    _guard._STATE.step = 0
    dist.set_debug_level(dist.DebugLevel.OFF)
    os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
    os.environ.pop("CAI_DIST_TIMEOUT", None)


def _timeout_of(group) -> timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def _out_of_step(port: int, debug: bool) -> tuple[str, str, float]:
    """Rank 1 skips step 1's all-reduce; then both ranks meet at the barrier before a save."""
    try:
        _relaunch(port, timeout=TIMEOUT_S, debug_collectives=debug)
        assert debug_checks_on() == debug  # what other packages read for their own debug checks
        t = torch.ones(4)
        dist.all_reduce(t)
        advance_step()
        start = time.monotonic()
        try:
            if dist.get_rank() == 0:
                dist.all_reduce(t)  # the step's gradient all-reduce, which rank 1 skips
            advance_step()
            if dist.get_rank() == 1 and not debug:
                # Rank 1's step takes a moment longer, so rank 0's wait starts first and times out first (with both
                # waits starting together, either rank may time out and close the connection on the other). The
                # debug check finds the mismatch when both collectives are issued: there both ranks go on together.
                time.sleep(1.0)
            dist.barrier()  # every rank waits here before writing a checkpoint
        except CollectiveError as e:
            return type(e).__name__, str(e), time.monotonic() - start
        return "no error", "", time.monotonic() - start
    finally:
        _restore()


def test_rank_out_of_step_times_out_with_rank_op_group_and_step() -> None:
    results = run_distributed(_out_of_step, 2, free_port(), False, timeout=100)
    for rank, (kind, message, elapsed) in enumerate(results):
        assert kind in ("CollectiveTimeoutError", "CollectiveError"), (rank, kind, message)
        op, step = ("all_reduce", 1) if rank == 0 else ("barrier", 2)
        assert f"rank {rank}: {op} on ranks [0, 1] at step {step}" in message, message
        # Both ranks wait in their collective until the timeout, then at most TIMEOUT_S / 2 for the peer's report
        # (the rest is slack for a loaded machine).
        assert elapsed < 1.5 * TIMEOUT_S + 20, elapsed
        assert "CAI_DEBUG_COLLECTIVES=1" in message and "Backend error:" in message
    # Rank 0 waited first and timed out; it reports what rank 1 was doing when it failed too.
    kind, message, elapsed = results[0]
    assert kind == "CollectiveTimeoutError" and f"timed out after {TIMEOUT_S} s" in message, message
    assert elapsed >= TIMEOUT_S - 0.5, elapsed
    assert "rank 1: barrier on ranks [0, 1] at step 2" in message.split("What each rank")[1], message


def test_rank_out_of_step_with_debug_is_a_sequence_mismatch() -> None:
    results = run_distributed(_out_of_step, 2, free_port(), True, timeout=100)
    for rank, (kind, message, elapsed) in enumerate(results):
        assert kind == "CollectiveMismatchError", (rank, kind, message)
        assert "the ranks of the group issued different collectives" in message
        reports = message.split("What each rank")[1]
        # Both ranks' collectives and steps, whichever rank reads them.
        assert "rank 0: all_reduce on ranks [0, 1] at step 1" in reports, message
        assert "rank 1: barrier on ranks [0, 1] at step 2" in reports, message
        assert "torch's check: Detected mismatch between collectives" in message
        # The mismatch is found when the collectives are issued, not after the timeout.
        assert elapsed < TIMEOUT_S + 30, elapsed


def _groups_timeouts(ports: list[int]) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        for label, port, kwargs, env in (
            ("default", ports[0], {}, None),
            ("argument", ports[1], {"timeout": timedelta(seconds=42)}, "17"),
            ("env", ports[2], {}, "17"),
        ):
            if env is not None:
                os.environ["CAI_DIST_TIMEOUT"] = env
            _relaunch(port, **kwargs)
            mesh = ParallelDims(dp=2, tp=1).build_mesh()
            groups = {
                "world": dist.group.WORLD,
                "mesh": mesh.group("dp"),
                "flat": mesh.group(("dp", "tp")),
                "new": dist.new_group([0, 1]),
            }
            for name, group in groups.items():
                out[f"{label}/{name}"] = _timeout_of(group).total_seconds()
            t = torch.ones(1)
            dist.all_reduce(t, group=groups["flat"])  # the groups work
            out[f"{label}/sum"] = t.item()
    finally:
        _restore()
    return out


def test_default_timeout_applies_to_every_group_launch_creates() -> None:
    ports = [free_port() for _ in range(3)]
    results = run_distributed(_groups_timeouts, 2, ports, timeout=100)
    assert timedelta(minutes=10) == DEFAULT_TIMEOUT
    for got in results:
        for group in ("world", "mesh", "flat", "new"):
            assert got[f"default/{group}"] == 600.0, got
            assert got[f"argument/{group}"] == 42.0, got  # the argument wins over the environment
            assert got[f"env/{group}"] == 17.0, got
        assert got["default/sum"] == got["env/sum"] == 2.0


def _guard_and_counter(port: int) -> dict:
    try:
        _relaunch(port, timeout=30)
        guarded = dist.all_reduce
        with CollectiveCounter() as cc:
            t = torch.ones(2)
            dist.all_reduce(t)
            dist.barrier()
        return dict(
            counted=cc.summary(),
            guarded=getattr(guarded, "_cai_guarded", False),
            restored=dist.all_reduce is guarded,
            value=t.tolist(),
        )
    finally:
        _restore()


def test_guard_coexists_with_collective_counter() -> None:
    for got in run_distributed(_guard_and_counter, 2, free_port(), timeout=100):
        assert got["guarded"] and got["restored"], got
        assert got["counted"] == {"all_reduce": (1, 8), "barrier": (1, 0)} and got["value"] == [2.0, 2.0]


def test_timeout_and_debug_settings_are_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CAI_DIST_TIMEOUT", raising=False)
    assert _guard.resolve_timeout(None) == DEFAULT_TIMEOUT
    monkeypatch.setenv("CAI_DIST_TIMEOUT", "90")
    assert _guard.resolve_timeout(None) == timedelta(seconds=90)
    assert _guard.resolve_timeout(2.5) == timedelta(seconds=2.5)
    monkeypatch.setenv("CAI_DIST_TIMEOUT", "ten")
    with pytest.raises(ValueError, match="CAI_DIST_TIMEOUT='ten' is not a number of seconds"):
        _guard.resolve_timeout(None)
    with pytest.raises(ValueError, match=r"timeout must be positive, got -1"):
        _guard.resolve_timeout(-1)
    monkeypatch.setenv("CAI_DEBUG_COLLECTIVES", "1")
    assert _guard.debug_enabled(None) and not _guard.debug_enabled(False)
    monkeypatch.setenv("CAI_DEBUG_COLLECTIVES", "0")
    assert not _guard.debug_enabled(None)


def test_step_counter() -> None:
    before = current_step()
    assert advance_step() == before + 1 and current_step() == before + 1
    _guard._STATE.step = before


# A 2-rank job whose rank 1 stops itself (SIGSTOP) before the second all-reduce.
STOPPED_WORKER = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch
    import torch.distributed as dist
    from cai.mesh import CollectiveError, launch_from_torch

    torch.set_num_threads(1)
    launch_from_torch(verbose=False, timeout=float(sys.argv[1]))
    t = torch.ones(2)
    dist.all_reduce(t)
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    start = time.monotonic()
    try:
        dist.all_reduce(t)
    except CollectiveError as e:
        print(f"{type(e).__name__} after {time.monotonic() - start:.1f} s", flush=True)
        print(e, flush=True)
        sys.exit(7)
    """
)


def test_stopped_rank_makes_its_peer_end_with_the_message(tmp_path: Path) -> None:
    script = tmp_path / "stopped.py"
    script.write_text(STOPPED_WORKER)
    port = str(free_port())
    procs = []
    try:
        for rank in (0, 1):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank),
                   "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}  # fmt: skip
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), str(TIMEOUT_S)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        out, _ = procs[0].communicate(timeout=100)
        assert procs[0].returncode == 7, out
        # torch may log socket warnings first; the script prints the error's type and its wait, then the message.
        first = next(
            (line for line in out.splitlines() if line.startswith("CollectiveTimeoutError after ")), ""
        )
        assert first, out
        # The timeout, then half of it waiting for rank 1's report, which never comes (plus slack for a loaded machine).
        assert 1.5 * TIMEOUT_S - 0.5 <= float(first.split()[2]) < 1.5 * TIMEOUT_S + 20, out
        assert (
            f"rank 0: all_reduce on ranks [0, 1] at step 0 (collective #2 of that rank): timed out after {TIMEOUT_S} s"
            in out
        )
        assert "rank 1: no report (stopped, dead, or not in a collective)" in out
        # Rank 1 is still stopped: it never got past SIGSTOP.
        assert procs[1].poll() is None
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)  # a stopped process still dies from SIGKILL
            p.wait(timeout=30)
            if p.stdout:
                p.stdout.close()
