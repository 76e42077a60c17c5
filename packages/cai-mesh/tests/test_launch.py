"""launch, launch_from_torch/slurm/openmpi on 2 gloo ranks, seeding, and their errors."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from cai.mesh import free_port, launch, launch_from_openmpi, launch_from_slurm, launch_from_torch, set_seed
from cai.mesh._launch import _tcp
from cai.mesh.testing import run_distributed

try:  # numpy is optional for cai-mesh: set_seed seeds it when it is installed
    import numpy as np
except ImportError:
    np = None

SEED = 7


@dataclass(frozen=True, kw_only=True)
class LaunchCase:
    name: str


CASES = [LaunchCase(name=n) for n in ("launch", "torch", "slurm", "slurm-ntasks", "openmpi")]


def _env_for(mode: str, rank: int, world: int, port: int) -> dict[str, str]:
    if mode == "torch":
        return dict(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    if mode == "slurm":
        return dict(SLURM_PROCID=str(rank), SLURM_NPROCS=str(world), SLURM_LOCALID=str(rank))
    if mode == "slurm-ntasks":
        return dict(SLURM_PROCID=str(rank), SLURM_NTASKS=str(world))
    if mode == "openmpi":
        return dict(
            OMPI_COMM_WORLD_RANK=str(rank),
            OMPI_COMM_WORLD_LOCAL_RANK=str(rank),
            OMPI_COMM_WORLD_SIZE=str(world),
        )
    return {}


def _launch_case(mode: str, port: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()  # start from nothing, as a fresh process would
    saved = dict(os.environ)
    try:
        for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(var, None)
        os.environ.update(_env_for(mode, rank, world, port))
        if mode == "launch":
            launch(rank, world, "127.0.0.1", port, seed=SEED, verbose=False)
        elif mode == "torch":
            launch_from_torch(seed=SEED, verbose=False)
        elif mode.startswith("slurm"):
            launch_from_slurm("127.0.0.1", port, seed=SEED, verbose=False)
        else:
            launch_from_openmpi("127.0.0.1", str(port), seed=SEED, verbose=False)
        draws = {
            "torch": torch.rand(3),
            "python": random.random(),
            "numpy": float(np.random.rand()) if np else None,
        }
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        # Launching again with the same rank and world keeps the group and only reseeds.
        launch(rank, world, "127.0.0.1", port, seed=SEED, verbose=False)
        again = torch.rand(3)
        try:
            launch(0 if rank else 1, world, "127.0.0.1", port, verbose=False)
            mismatch = ""
        except RuntimeError as e:
            mismatch = str(e)
        return dict(
            rank=dist.get_rank(),
            world=dist.get_world_size(),
            backend=dist.get_backend(),
            sum=t.item(),
            again=again,
            mismatch=mismatch,
            **draws,
        )
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_launch_paths_on_2_ranks(case: LaunchCase) -> None:
    results = run_distributed(_launch_case, 2, case.name, free_port())
    set_seed(SEED)
    expected = {
        "torch": torch.rand(3),
        "python": random.random(),
        "numpy": float(np.random.rand()) if np else None,
    }
    for rank, got in enumerate(results):
        assert (got["rank"], got["world"], got["backend"], got["sum"]) == (rank, 2, "gloo", 3.0)
        assert torch.equal(got["torch"], expected["torch"]) and torch.equal(got["again"], expected["torch"])
        assert got["python"] == expected["python"] and got["numpy"] == expected["numpy"]
        assert f"already initialised as rank {rank} of 2, not rank {1 - rank} of 2" in got["mismatch"]


def _draw() -> tuple:
    return (torch.rand(2), random.random(), float(np.random.rand()) if np else None)


def test_set_seed_seeds_every_rng() -> None:
    set_seed(3)
    first = _draw()
    _draw()
    set_seed(3)
    second = _draw()
    assert torch.equal(first[0], second[0]) and first[1:] == second[1:]
    assert _draw()[1] != second[1]


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (
            lambda: launch_from_torch(),
            "launch_from_torch: environment variables RANK, LOCAL_RANK, WORLD_SIZE, MASTER_PORT are not set",
        ),
        (
            lambda: launch_from_slurm("h", 1),
            "launch_from_slurm: environment variables SLURM_PROCID, SLURM_NPROCS are not set",
        ),
        (
            lambda: launch_from_openmpi("h", 1),
            "launch_from_openmpi: environment variables OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_LOCAL_RANK, "
            "OMPI_COMM_WORLD_SIZE are not set",
        ),
    ],
    ids=["torch", "slurm", "openmpi"],
)
def test_launch_names_missing_environment(monkeypatch: pytest.MonkeyPatch, fn, message: str) -> None:
    for var in list(os.environ):
        if var.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "SLURM_", "OMPI_")):
            monkeypatch.delenv(var)
    with pytest.raises(RuntimeError) as err:
        fn()
    assert message in str(err.value)


def test_launch_rejects_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"rank 2 must be in \[0, world_size=2\)"):
        launch(2, 2, "127.0.0.1", 1)
    monkeypatch.setenv("RANK", "zero")
    for var, value in dict(LOCAL_RANK="0", WORLD_SIZE="1", MASTER_PORT="1", MASTER_ADDR="x").items():
        monkeypatch.setenv(var, value)
    with pytest.raises(RuntimeError, match="RANK='zero' is not an integer"):
        launch_from_torch()


def test_free_port_is_below_the_ephemeral_range_and_skips_taken_ports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import socket

    from cai.mesh import _launch

    set_seed(0)  # the same global random state in every process must not mean the same port
    low = _launch._ephemeral_low()
    if low is not None and low - _launch._LOWEST_FREE_PORT >= 1000:
        ports = {free_port() for _ in range(8)}
        assert all(_launch._LOWEST_FREE_PORT <= p < low for p in ports) and len(ports) > 1
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        spare = [p for p in range(24680, 24700) if _launch._bindable("127.0.0.1", p)]
        draws = iter([busy, busy, *range(24680, 24700)])
        monkeypatch.setattr(_launch, "_ephemeral_low", lambda: 32768)
        monkeypatch.setattr(_launch.random.SystemRandom, "randrange", lambda self, a, b: next(draws))
        assert free_port() == spare[0]  # the taken port is drawn and passed over
        monkeypatch.setattr(_launch, "_ephemeral_low", lambda: None)  # unknown range: the kernel's pick
        port = free_port()
        assert port != busy and _launch._bindable("127.0.0.1", port)


def test_tcp_address_brackets_ipv6() -> None:
    assert _tcp("::1", 29500) == "tcp://[::1]:29500"
    assert _tcp("10.0.0.1", "29500") == "tcp://10.0.0.1:29500"


_EXIT_SCRIPT = """
import atexit, sys
import torch.distributed as dist
from cai.mesh import launch

# registered before launch, so it runs after launch's handler (atexit is last in, first out)
atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
launch(0, 1, "127.0.0.1", int(sys.argv[1]), verbose=False)
if sys.argv[2] == "raise":
    raise RuntimeError("the script failed")
"""


@pytest.mark.parametrize("how", ["return", "raise"])
def test_launch_destroys_a_group_left_alive_at_a_clean_exit(tmp_path, how: str) -> None:
    # gloo aborts at interpreter finalisation, now and then, when a live group still holds finished work; a clean
    # exit destroys the group before that, an uncaught exception leaves it (other ranks may be in a collective)
    script = tmp_path / "exit.py"
    script.write_text(_EXIT_SCRIPT)
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    proc = subprocess.run(
        [sys.executable, str(script), str(free_port()), how],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == (0 if how == "return" else 1), proc.stderr[-3000:]
    assert f"initialized at exit: {how == 'raise'}" in proc.stdout
