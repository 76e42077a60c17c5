"""Picking launch parameters by timing them once per shape on the GPU (a tiny autotuner).

The first call for a key (kernel, row width, dtype, ...) on a CUDA device launches each candidate a few
times on the caller's own tensors and keeps the fastest; later calls reuse the choice. Kernels must be
pure functions of their inputs (re-running one only rewrites its outputs). Off the GPU, under
TRITON_INTERPRET, or with `CAI_KERNELS_AUTOTUNE=0`, the first candidate (the static heuristic) is used.
`CAI_KERNELS_TUNE_LOG=1` prints every candidate's time to stderr (how the static choices were made).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Hashable, Sequence

import torch

_CHOICES: dict[Hashable, object] = {}


def pick(key: Hashable, candidates: Sequence, run: Callable[[object], None], device: torch.device):
    if key in _CHOICES:
        return _CHOICES[key]
    if (
        len(candidates) == 1
        or device.type != "cuda"
        or os.environ.get("CAI_KERNELS_AUTOTUNE", "1") == "0"
        or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        or torch.cuda.is_current_stream_capturing()
    ):
        return candidates[0]
    best, best_ms = candidates[0], float("inf")
    for cfg in candidates:
        try:
            run(cfg)  # compiles and warms up
        except Exception:  # e.g. a config that needs more shared memory than the device has
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            run(cfg)
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / 3
        if os.environ.get("CAI_KERNELS_TUNE_LOG", "0") not in ("", "0"):
            print(f"tune {key}: {cfg} {ms * 1e3:.1f} us", file=sys.stderr)
        if ms < best_ms:
            best, best_ms = cfg, ms
    _CHOICES[key] = best
    if os.environ.get("CAI_KERNELS_TUNE_LOG", "0") not in ("", "0"):
        print(f"tune {key}: picked {best}", file=sys.stderr)
    return best
