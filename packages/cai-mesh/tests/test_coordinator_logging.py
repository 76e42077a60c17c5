"""DistCoordinator and the rank-aware logger on 2 gloo ranks; the accelerator in one process."""

from __future__ import annotations

import contextlib
import io
import logging
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import cai.mesh._accelerator as acc_mod
from cai.mesh import (
    CpuAccelerator,
    CudaAccelerator,
    DistCoordinator,
    disable_existing_loggers,
    get_accelerator,
    get_current_device,
    get_dist_logger,
    set_accelerator,
)
from cai.mesh.testing import CollectiveCounter, run_distributed


def _coordinator_case(tmp: str) -> dict:
    c = DistCoordinator()
    out: dict = dict(
        rank=c.rank,
        world=c.world_size,
        local=c.local_rank,
        master=c.is_master(),
        node_master=c.is_node_master(),
        last=c.is_last_process(),
    )

    @c.on_master_only()
    def work() -> str:
        return "ran"

    out["on_master"] = work()
    # The executor (rank 1) is slow; the other rank must only enter after it has written the file.
    flag = Path(tmp) / "flag"
    with c.priority_execution(executor_rank=1) as is_executor:
        if is_executor:
            time.sleep(0.5)
            flag.write_text("done")
        else:
            out["saw_flag"] = flag.exists()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        c.print_on_master("hello from master")
        c.print_on_node_master("hello from node master")
    out["printed"] = buf.getvalue()
    with CollectiveCounter() as cc:
        c.block_all()
    out["barriers"] = cc.count("barrier")
    # Per-group queries: in a group of one, every rank is both master and last.
    solo = [dist.new_group([r]) for r in range(c.world_size)]
    mine = solo[c.rank]
    out["group_master"] = c.is_master(mine) and c.is_last_process(mine)
    return out


def test_coordinator_on_2_ranks(tmp_path: Path) -> None:
    r0, r1 = run_distributed(_coordinator_case, 2, str(tmp_path))
    assert (r0["rank"], r0["world"], r1["rank"]) == (0, 2, 1)
    assert (r0["local"], r1["local"]) == (0, 1)  # LOCAL_RANK as the launcher sets it
    assert r0["master"] and not r1["master"] and r0["node_master"] and not r1["node_master"]
    assert r1["last"] and not r0["last"]
    assert (r0["on_master"], r1["on_master"]) == ("ran", None)
    assert r0["saw_flag"], "priority_execution let a waiting rank in before the executor finished"
    assert r0["printed"] == "hello from master\nhello from node master\n" and r1["printed"] == ""
    assert r0["barriers"] == r1["barriers"] == 1
    assert r0["group_master"] and r1["group_master"]


def _logger_case(tmp: str) -> dict:
    logger = get_dist_logger("cai.test")
    logger.set_level("INFO")
    path = logger.log_to_file(tmp, suffix="x")
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        logger.info("only on rank 0", ranks=[0])
        logger.warning("on every rank")
        logger.debug("hidden at INFO")
        logger.set_level("DEBUG")
        logger.debug("debug on rank 1", ranks=[1])
        logger.error("error on both", ranks=[0, 1])
    logger.set_level("INFO")
    for h in list(logger.logger.handlers):
        if isinstance(h, logging.FileHandler):
            h.close()
            logger.logger.removeHandler(h)
    return {"stderr": buf.getvalue(), "file": Path(path).read_text(), "path": str(path)}


def test_logger_on_2_ranks(tmp_path: Path) -> None:
    r0, r1 = run_distributed(_logger_case, 2, str(tmp_path))
    assert "only on rank 0" in r0["stderr"] and "only on rank 0" not in r1["stderr"]
    assert "on every rank" in r0["stderr"] and "on every rank" in r1["stderr"]
    assert "hidden" not in r0["stderr"] + r1["stderr"]
    assert "debug on rank 1" in r1["stderr"] and "debug on rank 1" not in r0["stderr"]
    assert "[rank 1]" in r1["stderr"] and "[rank 0]" in r0["stderr"]
    # The record names the caller (this file and function), not the logger's own helpers.
    assert "test_coordinator_logging.py" in r0["stderr"] and "_logger_case" in r0["stderr"]
    assert r1["path"].endswith("rank_1_x.log") and "error on both" in r1["file"]
    assert "only on rank 0" in r0["file"] and "only on rank 0" not in r1["file"]


def test_child_loggers_go_through_the_rank_format(capsys: pytest.CaptureFixture[str]) -> None:
    get_dist_logger("cai")
    logging.getLogger("cai.some.module").warning("from a plain child logger")
    err = capsys.readouterr().err
    assert "[rank 0]" in err and "from a plain child logger" in err and "Logging error" not in err


def test_logger_is_one_per_name_and_checks_levels(monkeypatch: pytest.MonkeyPatch) -> None:
    assert get_dist_logger("a.b") is get_dist_logger("a.b") and get_dist_logger() is not get_dist_logger(
        "a.b"
    )
    with pytest.raises(ValueError, match="unknown log level 'LOUD'; use one of DEBUG, INFO, WARNING, ERROR"):
        get_dist_logger().set_level("LOUD")
    logging.getLogger("noisy.lib").setLevel(logging.DEBUG)
    logging.getLogger("cai.keep").setLevel(logging.DEBUG)
    disable_existing_loggers(include=["noisy.lib", "cai.keep"])
    assert logging.getLogger("noisy.lib").level == logging.WARNING
    assert logging.getLogger("cai.keep").level == logging.DEBUG


def test_coordinator_needs_distributed() -> None:
    with pytest.raises(RuntimeError, match="call launch_from_torch"):
        DistCoordinator()


# ---- accelerator -------------------------------------------------------------------------------------------


@pytest.fixture
def fresh_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(acc_mod, "_ACCELERATOR", None)


def test_accelerator_is_detected(fresh_accelerator: None) -> None:
    acc = get_accelerator()
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert acc.name == expected and get_accelerator() is acc
    assert acc.communication_backend == {"cuda": "nccl", "cpu": "gloo"}[expected]
    assert get_current_device().type == expected


def test_cpu_accelerator(fresh_accelerator: None) -> None:
    acc = set_accelerator("cpu")
    assert isinstance(acc, CpuAccelerator) and get_accelerator() is acc
    assert not acc.support_set_device and acc.is_synchronous and acc.device_count() == 1
    acc.set_device(0)
    with pytest.raises(ValueError, match="the CPU accelerator has one device; got 1"):
        acc.set_device(1)
    m = torch.nn.Linear(2, 2)
    moved = acc.set_to_device([m, torch.zeros(1)])
    assert isinstance(moved, list) and moved[0] is m
    assert acc.memory_allocated() == 0 and acc.max_memory_allocated() == 0
    acc.manual_seed(5)
    a = torch.rand(2)
    acc.set_rng_state(acc.get_rng_state())
    acc.manual_seed_all(5)
    assert torch.equal(torch.rand(2), a)
    with acc.stream(None), acc.autocast(enabled=False):
        acc.synchronize()


def test_set_accelerator_errors(fresh_accelerator: None) -> None:
    with pytest.raises(ValueError, match=r"unknown accelerator 'tpu'; use one of \['cpu', 'cuda'\]"):
        set_accelerator("tpu")
    with pytest.raises(TypeError, match="expected a name or a BaseAccelerator, got int"):
        set_accelerator(3)  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="cuda is not available on this machine"):
            set_accelerator("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_accelerator(fresh_accelerator: None) -> None:
    acc = set_accelerator("cuda")
    assert isinstance(acc, CudaAccelerator) and acc.communication_backend == "nccl"
    acc.set_device(0)
    assert acc.get_current_device() == torch.device("cuda", 0)
    x = acc.set_to_device(torch.ones(1024))
    acc.synchronize()
    assert x.is_cuda and acc.memory_allocated() > 0
