"""Finds, builds (once, cached) and loads the native CPU Adam library, or says why it cannot."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

FALLBACK_ENV = "CAI_KERNELS_FALLBACK"
CACHE_ENV = "CAI_KERNELS_CACHE"
_SOURCE_NAME = "cpu_adam.cpp"
_STALE_LOCK_S = 300  # the build takes seconds; a lock this old belongs to a dead process


@dataclass(frozen=True, kw_only=True)
class NativeAdam:
    """The loaded library: `step` is the C entry point, `isa` the vector body it was built with."""

    step: ctypes._CFuncPtr
    isa: str
    path: str


_lock = threading.Lock()
_native: NativeAdam | None = None
_failure: str | None = None
_warned = False


def find_source_dir() -> Path | None:
    """The cpu_adam sources: `cai/kernels/optim/_csrc/cpu_adam` in the installed package (in the checkout that
    folder is a symlink to kernels/cpu_adam, which the wheel and sdist builds copy as files), else the
    repository's kernels/cpu_adam above this file."""
    here = Path(__file__).absolute()
    packaged = here.parent / "_csrc" / "cpu_adam"
    if (packaged / _SOURCE_NAME).is_file():
        return packaged
    for parent in here.resolve().parents:
        candidate = parent / "kernels" / "cpu_adam"
        if (candidate / _SOURCE_NAME).is_file():
            return candidate
    return None


def _cpu_signature() -> str:
    # -march=native code must not be reused on a different CPU (a home directory shared by several nodes).
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compile_flags() -> list[str]:
    return ["-O3", "-std=c++17", "-fopenmp", "-march=native", "-ffp-contract=off", "-w"]


def cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cai" / "kernels"


def _build_key(source: bytes, flags: list[str]) -> str:
    h = hashlib.sha256()
    for part in (source, torch.__version__.encode(), sys.version.encode(), " ".join(flags).encode()):
        h.update(part)
        h.update(b"\0")
    h.update(_cpu_signature().encode())
    return h.hexdigest()[:16]


def _build(flags: list[str] | None = None) -> NativeAdam:
    """Compile (or reuse the cached build) and load. `flags` replaces the default compiler flags (tests use it
    to build the portable scalar body)."""
    from torch.utils import cpp_extension

    src_dir = find_source_dir()
    if src_dir is None:
        raise RuntimeError(
            "cpu_adam.cpp not found (neither in cai/kernels/optim/_csrc nor in a checkout's kernels/)"
        )
    source = src_dir / _SOURCE_NAME
    flags = _compile_flags() if flags is None else flags
    key = _build_key(source.read_bytes(), flags)
    build_dir = cache_root() / "cpu_adam" / key
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home directory: build in the temporary directory instead
        build_dir = Path(tempfile.gettempdir()) / f"cai-kernels-{os.getuid()}" / "cpu_adam" / key
        build_dir.mkdir(parents=True, exist_ok=True)
    name = f"cai_cpu_adam_{key}"
    cached = build_dir / f"{name}.so"
    lock = build_dir / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
        # A build killed half-way leaves torch's lock behind, and every later load would wait on it forever.
        lock.unlink(missing_ok=True)
    if cached.is_file() and not lock.exists():  # built and complete (torch holds the lock while it builds)
        path = cached
    elif cpp_extension.is_ninja_available():
        path = cpp_extension.load(
            name=name,
            sources=[str(source)],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    else:
        path = _build_without_ninja(source, build_dir / f"{name}.so", flags)
    lib = ctypes.CDLL(str(path))
    isa_fn = lib.cai_cpu_adam_isa
    isa_fn.restype = ctypes.c_char_p
    fn = lib.cai_cpu_adam_step
    f32, ptr = ctypes.c_float, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, ctypes.c_int, ptr, ptr, ptr, ctypes.c_int, ctypes.c_int64]
    fn.argtypes += [f32] * 7 + [ctypes.c_int] + [f32] * 3 + [ctypes.c_int]
    fn.restype = ctypes.c_int
    return NativeAdam(step=fn, isa=isa_fn().decode(), path=str(path))


def _build_without_ninja(source: Path, target: Path, flags: list[str]) -> Path:
    """The library includes no torch headers, so one compiler call builds it where ninja is missing."""
    if target.is_file():
        return target
    cxx = os.environ.get("CXX", "c++")
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    cmd = [cxx, *flags, "-shared", "-fPIC", str(source), "-o", str(tmp)]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except FileNotFoundError as e:
        raise RuntimeError(f"no C++ compiler ({cxx}) and no ninja") from e
    if result.returncode != 0:
        tail = (result.stderr.strip().splitlines() or ["?"])[-1]
        raise RuntimeError(f"{cxx} failed: {tail}")
    os.replace(tmp, target)  # atomic: concurrent ranks building the same key never load a partial file
    return target


def native_adam() -> NativeAdam | None:
    """The native library, building it on first use; None (after one warning) when it cannot be built."""
    global _native, _failure, _warned
    if os.environ.get(FALLBACK_ENV, "") not in ("", "0"):
        return None
    if _native is not None or _failure is not None:
        return _native
    with _lock:
        if _native is None and _failure is None:
            try:
                _native = _build()
            except Exception as e:  # no compiler, no ninja, a failed compile: all mean "use the fallback"
                _failure = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    if _failure is not None and not _warned:
        _warned = True
        warnings.warn(
            f"cai.kernels.optim: native CPU Adam unavailable ({_failure}); using torch's fused CPU Adam plus a copy",
            RuntimeWarning,
            stacklevel=3,
        )
    return _native


def cpu_adam_status() -> tuple[str, str]:
    """(implementation, reason) for CPU parameters: ("native-avx512" | "native-avx2" | "native-scalar" |
    "torch-fused", why). Builds the native library if it was not built yet."""
    if os.environ.get(FALLBACK_ENV, "") not in ("", "0"):
        return "torch-fused", f"{FALLBACK_ENV}={os.environ[FALLBACK_ENV]} forces the fallback"
    native = native_adam()
    if native is not None:
        return f"native-{native.isa}", f"built from source, cached at {native.path}"
    return "torch-fused", f"native build failed: {_failure}"
