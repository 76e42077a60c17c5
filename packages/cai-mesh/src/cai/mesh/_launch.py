"""Start the default process group from torchrun, SLURM, OpenMPI or explicit arguments, and seed every RNG."""

from __future__ import annotations

import atexit
import gc
import os
import random
import socket
import sys
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from cai.mesh import _guard
from cai.mesh._accelerator import get_accelerator
from cai.mesh._logging import get_dist_logger

__all__ = ["free_port", "launch", "launch_from_openmpi", "launch_from_slurm", "launch_from_torch", "set_seed"]


def set_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy (when installed), torch's CPU generator and every CUDA device."""
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device when CUDA is initialised
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    try:
        import numpy as np
    except ImportError:  # numpy is optional; nothing to seed
        return
    np.random.seed(seed % 2**32)


_LOWEST_FREE_PORT = 20000  # free_port's choices start here, above the ports services usually own


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing is bound to, for a rendezvous that binds it a little later (the
    ``MASTER_PORT`` of processes spawned on one machine).

    It is drawn at random below the kernel's ephemeral range (Linux's ``ip_local_port_range``, 32768 and up by
    default). The usual trick, binding port 0 and reading what the kernel gave, returns a port from that range,
    which any process's next outgoing connection may take before the rendezvous binds it (gloo opens many):
    an "address already in use" seconds later. Below the range a port is only taken by an explicit bind. Where
    the range is unknown or leaves no room below it, the kernel picks. The draw does not use ``random``'s global
    state, which ``set_seed`` makes the same in every process.
    """
    low = _ephemeral_low()
    if low is not None and low - _LOWEST_FREE_PORT >= 1000:
        draw = random.SystemRandom()
        for _ in range(64):
            port = draw.randrange(_LOWEST_FREE_PORT, low)
            if _bindable(host, port):
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int | None:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _env_ints(names: Mapping[str, str], source: str, hint: str) -> dict[str, int]:
    """Read integer environment variables; the error names every missing one."""
    missing = [var for var in names.values() if var not in os.environ]
    if missing:
        raise RuntimeError(f"{source}: environment variables {', '.join(missing)} are not set; {hint}")
    out = {}
    for key, var in names.items():
        try:
            out[key] = int(os.environ[var])
        except ValueError:
            raise RuntimeError(f"{source}: {var}={os.environ[var]!r} is not an integer") from None
    return out


def _tcp(host: str, port: int | str) -> str:
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host  # bracket IPv6 literals
    return f"tcp://{host}:{int(port)}"


def _init(
    *,
    rank: int,
    world_size: int,
    init_method: str,
    backend: str | None,
    local_rank: int | None,
    seed: int,
    verbose: bool,
    timeout: float | timedelta | None,
    debug_collectives: bool | None,
) -> None:
    if not 0 <= rank < world_size:
        raise ValueError(f"launch: rank {rank} must be in [0, world_size={world_size})")
    accelerator = get_accelerator()
    backend = backend or accelerator.communication_backend
    pg_timeout = _guard.resolve_timeout(timeout)
    debug = _guard.debug_enabled(debug_collectives)
    # Kernels and collectives issued on one stream run in issue order only with one hardware queue; tensor
    # parallelism relies on that to overlap communication with compute. Must be set before CUDA initialises.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if accelerator.support_set_device:
        count = accelerator.device_count()
        accelerator.set_device(local_rank if local_rank is not None else rank % max(count, 1))
    logger = get_dist_logger()
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise RuntimeError(
                f"launch: torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, not rank {rank} of {world_size}"
            )
        logger.warning(
            "torch.distributed was already initialised; keeping the existing process group (its timeout and "
            "debug checks stay as they were)",
            ranks=[0],
        )
        _guard.install()
    else:
        _guard.configure(timeout=pg_timeout, debug=debug, backend=backend)
        dist.init_process_group(
            backend=backend, init_method=init_method, rank=rank, world_size=world_size, timeout=pg_timeout
        )
        atexit.unregister(_destroy_at_exit)  # once, however often a process launches
        atexit.register(_destroy_at_exit)
    set_seed(seed)
    if verbose:
        logger.info(
            f"Distributed environment is initialized: world size {world_size}, backend {dist.get_backend()}, "
            f"device {accelerator.get_current_device()}, seed {seed}, collective timeout "
            f"{pg_timeout.total_seconds():g} s{', collective checks on' if debug else ''}",
            ranks=[0],
        )


def _destroy_at_exit() -> None:
    """Destroy the process group a script left alive, while the interpreter is still whole.

    Without it, gloo's worker threads may still hold finished work (tensors with Python references) when the
    interpreter finalises; releasing them then takes the GIL of a dying interpreter and aborts the process
    ("terminate called without an active exception", exit code 134) after a run that succeeded. Destroying the
    group is not enough: objects in reference cycles (a schedule, an autograd graph) can still hold its work and
    tensors until the collector runs, which may first be during finalisation; collecting right after the destroy
    frees them while the interpreter is whole (a 2-rank pipeline script under load aborted 13 times in 160 runs
    without the collection, 0 in 160 with it). After an uncaught exception the group is left alone: destroying it
    could wait on ranks that are still inside a collective.
    """
    if dist.is_initialized() and getattr(sys, "last_value", None) is None:
        dist.destroy_process_group()
        gc.collect()


def launch(
    rank: int,
    world_size: int,
    host: str,
    port: int | str,
    backend: str | None = None,
    local_rank: int | None = None,
    seed: int = 1024,
    verbose: bool = True,
    timeout: float | timedelta | None = None,
    debug_collectives: bool | None = None,
) -> None:
    """Initialise the default process group over TCP at ``host:port``, pick the device and seed every RNG.

    Args:
        rank: this process's global rank; world_size: number of processes.
        host, port: address of rank 0's TCP store (IPv6 literals are accepted).
        backend: "nccl", "gloo", ...; None picks the accelerator's ("nccl" with CUDA, else "gloo").
        local_rank: GPU index on this node; None uses ``rank % device_count``.
        seed: seeds Python, NumPy, torch and CUDA RNGs (see ``set_seed``). verbose: log one line on rank 0.
        timeout: seconds (or a timedelta) a collective may wait for the other ranks before it raises
            ``CollectiveTimeoutError``; applies to the default group and every group created later (mesh axes,
            combined axes). None reads ``$CAI_DIST_TIMEOUT`` (seconds), else ``DEFAULT_TIMEOUT`` (10 minutes).
        debug_collectives: check before every collective that all ranks of its group issue the same one
            (op, shapes, dtypes; torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``), raising ``CollectiveMismatchError``
            otherwise; slow, for debugging. None reads ``$CAI_DEBUG_COLLECTIVES``.

    Calling it when the group is already initialised with the same rank and world size only seeds.
    """
    _init(
        rank=rank,
        world_size=world_size,
        init_method=_tcp(host, port),
        backend=backend,
        local_rank=local_rank,
        seed=seed,
        verbose=verbose,
        timeout=timeout,
        debug_collectives=debug_collectives,
    )


def launch_from_torch(
    backend: str | None = None,
    seed: int = 1024,
    verbose: bool = True,
    timeout: float | timedelta | None = None,
    debug_collectives: bool | None = None,
) -> None:
    """``launch`` for processes started by ``torchrun`` or ``cai run`` (reads RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT).

    Example::

        # cai run --nproc_per_node 8 train.py
        launch_from_torch(seed=42)
    """
    env = _env_ints(
        {"rank": "RANK", "local_rank": "LOCAL_RANK", "world_size": "WORLD_SIZE", "port": "MASTER_PORT"},
        "launch_from_torch",
        "start the script with `cai run --nproc_per_node N script.py` or torchrun",
    )
    if "MASTER_ADDR" not in os.environ:
        raise RuntimeError(
            "launch_from_torch: environment variable MASTER_ADDR is not set; start with cai run or torchrun"
        )
    # env:// lets torchrun hand over its own store (TORCHELASTIC_USE_AGENT_STORE) instead of opening a new port.
    _init(
        rank=env["rank"],
        world_size=env["world_size"],
        init_method="env://",
        backend=backend,
        local_rank=env["local_rank"],
        seed=seed,
        verbose=verbose,
        timeout=timeout,
        debug_collectives=debug_collectives,
    )


def launch_from_slurm(
    host: str,
    port: int | str,
    backend: str | None = None,
    seed: int = 1024,
    verbose: bool = True,
    timeout: float | timedelta | None = None,
    debug_collectives: bool | None = None,
) -> None:
    """``launch`` for processes started by ``srun`` (reads SLURM_PROCID, SLURM_NPROCS, SLURM_LOCALID).

    ``host`` is usually the first node of ``scontrol show hostnames $SLURM_JOB_NODELIST``.
    """
    # Newer SLURM versions set SLURM_NTASKS; older ones SLURM_NPROCS (same value).
    size_var = (
        "SLURM_NPROCS" if "SLURM_NPROCS" in os.environ or "SLURM_NTASKS" not in os.environ else "SLURM_NTASKS"
    )
    env = _env_ints(
        {"rank": "SLURM_PROCID", "world_size": size_var}, "launch_from_slurm", "start the script with srun"
    )
    local = os.environ.get("SLURM_LOCALID")
    _init(
        rank=env["rank"],
        world_size=env["world_size"],
        init_method=_tcp(host, port),
        backend=backend,
        local_rank=int(local) if local is not None else None,
        seed=seed,
        verbose=verbose,
        timeout=timeout,
        debug_collectives=debug_collectives,
    )


def launch_from_openmpi(
    host: str,
    port: int | str,
    backend: str | None = None,
    seed: int = 1024,
    verbose: bool = True,
    timeout: float | timedelta | None = None,
    debug_collectives: bool | None = None,
) -> None:
    """``launch`` for processes started by OpenMPI's ``mpirun`` (reads OMPI_COMM_WORLD_RANK, _LOCAL_RANK, _SIZE)."""
    env = _env_ints(
        {
            "rank": "OMPI_COMM_WORLD_RANK",
            "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK",
            "world_size": "OMPI_COMM_WORLD_SIZE",
        },
        "launch_from_openmpi",
        "start the script with mpirun",
    )
    _init(
        rank=env["rank"],
        world_size=env["world_size"],
        init_method=_tcp(host, port),
        backend=backend,
        local_rank=env["local_rank"],
        seed=seed,
        verbose=verbose,
        timeout=timeout,
        debug_collectives=debug_collectives,
    )
