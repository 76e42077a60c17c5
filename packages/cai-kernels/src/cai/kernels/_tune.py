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


def pick(
    key: Hashable,
    candidates: Callable[[], Sequence] | Sequence,
    run: Callable[[object], None],
    device: torch.device,
):
    """The launch parameters for `key`: the candidates (a sequence, or a function building it, called only on
    the first call for a key, since every microsecond of host time shows on small tensors) are timed once
    through `run(cfg)`; the first (the static choice) is used where no timing is done."""
    if key in _CHOICES:
        return _CHOICES[key]
    cands = candidates() if callable(candidates) else candidates
    if (
        len(cands) == 1
        or device.type != "cuda"
        or os.environ.get("CAI_KERNELS_AUTOTUNE", "1") == "0"
        or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        or torch.cuda.is_current_stream_capturing()
    ):
        return cands[0]
    log = os.environ.get("CAI_KERNELS_TUNE_LOG", "0") not in ("", "0")
    best, best_ms = cands[0], float("inf")
    for cfg in cands:
        try:
            run(cfg)  # compiles and warms up
        except Exception:  # e.g. a config that needs more shared memory than the device has
            continue
        # Ten back-to-back launches: enough to average out clock ramps and launch jitter (a few ms in all).
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            run(cfg)
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / 10
        if log:
            print(f"tune {key}: {cfg} {ms * 1e3:.1f} us", file=sys.stderr)
        if ms < best_ms:
            best, best_ms = cfg, ms
    _CHOICES[key] = best
    if log:
        print(f"tune {key}: picked {best}", file=sys.stderr)
    return best
