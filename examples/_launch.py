"""Start the examples' worker processes.

Under ``torchrun`` or ``cai run`` the environment already describes the job (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ...), and the program runs once in this process. Run plainly (``python train_llama.py``), it
spawns ``nproc`` workers on this machine with the same variables set, so that the worker code is identical in
both cases and reads its rank from the environment only.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

from cai.mesh import free_port

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_externally() -> bool:
    """True when a launcher (torchrun, ``cai run``, SLURM through torchrun) set the rank variables."""
    return all(v in os.environ for v in _LAUNCHER_VARS)


def default_nproc(device: str) -> int:
    """One process per GPU on a GPU machine, two gloo processes on CPU."""
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return max(torch.cuda.device_count(), 1)
    return 2


def resolve_device(device: str) -> torch.device:
    """``auto`` picks this rank's GPU when there is one, else the CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for but torch sees no CUDA device; use --device cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device(device)


def run(main: Callable, args, *, nproc: int) -> None:
    """Call ``main(args)`` once per rank: in this process under a launcher, else in ``nproc`` spawned ones."""
    if launched_externally():
        main(args)
        return
    if nproc == 1:
        _set_env(rank=0, world_size=1, port=free_port())
        main(args)
        return
    # spawn (not fork): each worker starts a clean interpreter, as under torchrun.
    mp.start_processes(_worker, args=(main, args, nproc, free_port()), nprocs=nproc, start_method="spawn")


def _worker(rank: int, main: Callable, args, world_size: int, port: int) -> None:
    _set_env(rank=rank, world_size=world_size, port=port)
    main(args)


def _set_env(*, rank: int, world_size: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
