"""``cai check``: what this machine has (torch, CUDA, NCCL, Triton, compilers, kernels) and whether collectives work."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import platform
import shutil
import subprocess
import sys
import time
from datetime import timedelta

__all__ = ["add_check_parser", "check_command"]


def add_check_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check",
        help="print versions, available kernels, and run a quick all-reduce across local ranks",
        description="Report torch, CUDA, NCCL, Triton and compiler versions, which cai kernels are in use and why, "
        "and run an all-reduce across local processes (one per GPU with nccl, else 2 with gloo).",
    )
    p.add_argument(
        "-i", "--installation", action="store_true", help="accepted for compatibility; always reported"
    )
    p.add_argument(
        "--nproc", type=int, default=None, help="local ranks for the all-reduce (default: GPUs, else 2)"
    )
    p.add_argument("--no_allreduce", "--no-allreduce", action="store_true", help="skip the all-reduce")
    p.add_argument(
        "--timeout", type=float, default=120.0, help="seconds before the all-reduce is declared hung"
    )
    p.set_defaults(func=check_command)


def _version(dist_name: str) -> str | None:
    try:
        return md.version(dist_name)
    except md.PackageNotFoundError:
        return None


def _tool_version(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        return "not found"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{path} (version unknown: {e})"
    lines = [line for line in (out.stdout or out.stderr).splitlines() if line.strip()]
    # nvcc prints its release on the last line; gcc and ninja on the first.
    line = lines[-1] if tool == "nvcc" and lines else (lines[0] if lines else "?")
    return f"{line.strip()} ({path})"


def _row(name: str, value: object) -> None:
    print(f"  {name:<22} {value}")


def _report_versions() -> None:
    import torch

    print("Environment")
    _row("python", f"{platform.python_version()} ({sys.executable})")
    _row("platform", platform.platform())
    _row("torch", torch.__version__)
    _row("torch built for CUDA", torch.version.cuda or "no (CPU build)")
    if torch.cuda.is_available():
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        _row("CUDA devices", f"{torch.cuda.device_count()} x {', '.join(names)}")
    else:
        _row("CUDA devices", "none visible")
    import torch.distributed as dist

    if dist.is_available() and dist.is_nccl_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as e:  # NCCL present in the build but not loadable
            nccl = f"unavailable ({e})"
    else:
        nccl = "not in this torch build"
    _row("NCCL", nccl)
    _row("gloo", "available" if dist.is_available() and dist.is_gloo_available() else "not available")
    _row("triton", _version("triton") or "not installed")
    _row("CUDA_HOME", os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "not set")
    for tool in ("nvcc", "gcc", "g++", "ninja"):
        _row(tool, _tool_version(tool))
    cai = sorted(
        (d.metadata["Name"], d.version)
        for d in md.distributions()
        if (d.metadata["Name"] or "").startswith("cai-")
    )
    _row("cai packages", ", ".join(f"{n} {v}" for n, v in cai) or "none")


def _report_kernels() -> None:
    print("Kernels")
    try:
        import cai.kernels as kernels
    except ImportError:
        _row("cai-kernels", "cai-kernels not installed")
        return
    report = getattr(kernels, "kernel_report", None)
    if report is None:
        _row("cai-kernels", "installed, but this version has no kernel_report()")
        return
    try:
        rows = list(report())
    except Exception as e:  # a broken kernel probe must not hide the rest of the report
        _row("cai-kernels", f"kernel_report() failed: {type(e).__name__}: {e}")
        return
    if not rows:
        _row("cai-kernels", "no kernels reported")
    for kernel, impl, reason in rows:
        _row(str(kernel), f"{impl}: {reason}" if reason else str(impl))


def _allreduce_worker(rank: int, world_size: int, port: int, backend: str, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        t = torch.full((1 << 20,), float(rank + 1), device=device)  # 4 MiB
        dist.all_reduce(t)
        expected = world_size * (world_size + 1) / 2
        ok = bool((t == expected).all())
        repeats = 5
        start = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(t)
        if device.type == "cuda":
            torch.cuda.synchronize()
        results.put((rank, ok, (time.perf_counter() - start) / repeats))
    finally:
        dist.destroy_process_group()


def _run_allreduce(nproc: int | None, timeout: float) -> bool:
    import torch
    import torch.multiprocessing as mp

    from cai.mesh._launch import free_port

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = "nccl" if gpus > 0 and torch.distributed.is_nccl_available() else "gloo"
    world = nproc or (gpus if backend == "nccl" else 2)
    if backend == "nccl" and world > gpus:
        backend = "gloo"  # more ranks than GPUs: NCCL needs one GPU per rank
    print(f"All-reduce ({world} local ranks, {backend}, 4 MiB)")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = mp.start_processes(
        _allreduce_worker,
        args=(world, free_port(), backend, results),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    try:
        while not procs.join(timeout=0.5):
            if time.monotonic() > deadline:
                for p in procs.processes:
                    p.kill()
                _row("result", f"FAILED: no result after {timeout:.0f} s (hung collective?)")
                return False
    except Exception as e:  # a rank raised: torch reports which and why
        _row("result", f"FAILED: {e}")
        return False
    got = sorted(results.get(timeout=10) for _ in range(world))
    bad = [rank for rank, ok, _ in got if not ok]
    if bad:
        _row("result", f"FAILED: wrong sum on ranks {bad}")
        return False
    worst = max(t for _, _, t in got)
    _row("result", f"ok, {worst * 1e3:.2f} ms per all-reduce (slowest rank)")
    return True


def check_command(args: argparse.Namespace) -> int:
    _report_versions()
    _report_kernels()
    if args.no_allreduce:
        return 0
    sys.stdout.flush()
    return 0 if _run_allreduce(args.nproc, args.timeout) else 1
