"""Exact resume in a fresh process, and a process killed with SIGKILL in the middle of a save."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import cai.ckpt as ck

WORKER = Path(__file__).with_name("resume_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _worker(*args: str, env: dict | None = None) -> None:
    subprocess.run([sys.executable, str(WORKER), *args], check=True, env=env or ENV, timeout=300)


def test_20_straight_equals_10_save_restart_10(tmp_path):
    """Fresh processes; the save is asynchronous and finished by the exit hook."""
    _worker("straight", "20", str(tmp_path / "straight.safetensors"))
    _worker("first", "10", str(tmp_path / "ckpt"), "async")
    assert ck.latest_checkpoint(tmp_path / "ckpt") == tmp_path / "ckpt" / "step-000010"
    _worker("resume", str(tmp_path / "ckpt"), "10", str(tmp_path / "resumed.safetensors"))
    straight = load_file(str(tmp_path / "straight.safetensors"))
    resumed = load_file(str(tmp_path / "resumed.safetensors"))
    assert torch.equal(straight.pop("__losses__")[10:], resumed.pop("__losses__"))
    for k, v in straight.items():
        assert torch.equal(v, resumed[k]), k


def test_save_and_load_in_the_same_process(tmp_path):
    """Synchronous save, then load into freshly built objects in this process (no restart)."""
    worker = _load_worker_module()
    torch.use_deterministic_algorithms(True)
    try:
        ref = worker.build()
        ref_losses = worker.train(ref, 6)
        run = worker.build()
        worker.train(run, 3)
        worker.save(run, str(tmp_path / "ckpt"), 3)
        worker.train(run, 1)  # diverge, then go back
        fresh = worker.build()
        ck.load_state(
            tmp_path / "ckpt",
            model=fresh[0],
            optimizer=fresh[1],
            lr_scheduler=fresh[2],
            grad_scaler=fresh[3],
            dataloader=fresh[4],
        )
        assert worker.train(fresh, 3) == ref_losses[3:]
        for (n, a), b in zip(ref[0].named_parameters(), fresh[0].parameters()):
            assert torch.equal(a, b), n
    finally:
        torch.use_deterministic_algorithms(False)


def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    env = {**ENV, "CAI_CKPT_TEST_WRITE_DELAY": "0.05"}  # ~4 s per save, so the kill lands inside one
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), "loop", str(ckpt), str(tmp_path / "step1.safetensors")],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        lines = []
        deadline = time.monotonic() + 240
        while "saving 2" not in lines and time.monotonic() < deadline:
            lines.append(proc.stdout.readline().strip())
        assert lines[-2:] == ["committed 1", "saving 2"], lines
        time.sleep(1.0)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    partial = list(ckpt.glob(".tmp-step-000002-*"))
    assert partial and any(partial[0].rglob("*.safetensors")), (
        "the kill did not land in the middle of the save"
    )
    assert not (ckpt / "step-000002").exists()
    assert ck.latest_checkpoint(ckpt) == ckpt / "step-000001"

    worker = _load_worker_module()
    parts = worker.build()
    info = ck.load_state(
        ckpt,
        model=parts[0],
        optimizer=parts[1],
        lr_scheduler=parts[2],
        grad_scaler=parts[3],
        dataloader=parts[4],
        verify=True,
    )
    assert info["step"] == 1 and parts[4].pos == worker.BATCH
    step1 = load_file(str(tmp_path / "step1.safetensors"))
    for n, p in parts[0].named_parameters():
        assert torch.equal(p.detach(), step1[n]), n
    with pytest.raises(ck.CheckpointError, match="step-000002 is not a committed checkpoint"):
        ck.load_state(ckpt, model=parts[0], step=2)
    # the next save of the same step replaces the leftovers of the killed one
    worker.save(parts, str(ckpt), 2)
    assert not list(ckpt.glob(".tmp-*")) and ck.latest_checkpoint(ckpt) == ckpt / "step-000002"


def _load_worker_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("resume_worker", WORKER)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["resume_worker"] = mod
    spec.loader.exec_module(mod)
    return mod
