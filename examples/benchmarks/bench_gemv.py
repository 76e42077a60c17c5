#!/usr/bin/env python
"""cai-kernels' single-row linear kernel (`gemv`) against cuBLAS (`F.linear`), at batch-1 decode shapes.

The matrices of one Llama-3-8B layer and its lm_head (bf16). Each measurement runs the operation over enough distinct
copies of the weight to exceed the L2 cache several times (as a decode step reads one layer's weights after
another), inside one CUDA graph, and reports the time per call and the weight bytes over it. `--sweep` also times
every kernel configuration per shape and prints the best, which is how `_gemv._config` was chosen.

    python examples/benchmarks/bench_gemv.py              # < 1 minute
    python examples/benchmarks/bench_gemv.py --sweep
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton.testing

from cai.kernels._gemv import _config, _launch

HIDDEN, INTER, VOCAB = 4096, 14336, 128256
SHAPES = {  # name: (N, K)
    "qkv": (6144, HIDDEN),
    "o": (HIDDEN, HIDDEN),
    "gate_up": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
    "lm_head": (VOCAB, HIDDEN),
}
L2_SPAN = 512 << 20  # bytes of distinct weights each measurement walks through


def copy_bandwidth_gbps() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    ms = triton.testing.do_bench(lambda: x.clone(), rep=200)
    return 2 * x.numel() / ms / 1e6


def per_call_us(fn, copies: int, rep: int = 300) -> float:
    """Microseconds per call of ``fn(i)`` over ``copies`` weights, replayed from one CUDA graph."""
    for i in range(copies):
        fn(i)  # compiles, and picks nothing up lazily inside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    return triton.testing.do_bench(graph.replay, rep=rep) * 1e3 / copies


def measure(name: str, n: int, k: int, sweep: bool) -> dict:
    """One shape's row: microseconds per call and TB/s for cuBLAS and the kernel (and its best configuration)."""
    dt = torch.bfloat16
    nbytes = n * k * 2
    copies = max(1, L2_SPAN // nbytes)
    ws = [torch.randn(n, k, device="cuda", dtype=dt) / k**0.5 for _ in range(copies)]
    x = torch.randn(1, 1, k, device="cuda", dtype=dt)
    y_ref = F.linear(x, ws[0])
    torch.testing.assert_close(_launch(x, ws[0], None).view_as(y_ref), y_ref, rtol=2e-2, atol=2e-2)
    timings = {
        "cublas": per_call_us(lambda i: F.linear(x, ws[i]), copies),
        "cai": per_call_us(lambda i: _launch(x, ws[i], None), copies),
    }
    if sweep:
        best = None
        for cfg in itertools.product((1, 2, 4, 8), (512, 1024, 2048, 4096), (4, 8, 16)):
            if cfg[1] > k or cfg[0] * cfg[1] > 8192:
                continue
            try:
                us = per_call_us(lambda i, c=cfg: _launch(x, ws[i], None, config=c), copies, rep=100)
            except Exception as exc:  # e.g. too many registers
                print(json.dumps({"shape": name, "config": cfg, "error": type(exc).__name__}))
                continue
            print(json.dumps({"shape": name, "config": cfg, "us": round(us, 2)}), flush=True)
            if best is None or us < best[1]:
                best = (cfg, us)
        timings["best"] = best[1]
        print(json.dumps({"shape": name, "best": best[0], "default": _config(k)}))
    row = {"shape": name, "n": n, "k": k}
    for what, us in timings.items():
        row[what + "_us"] = round(us, 2)
        row[what + "_tbs"] = round(nbytes / us / 1e6, 2)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="time every kernel configuration per shape")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemv.py needs a CUDA GPU")
    torch.manual_seed(0)
    bw = copy_bandwidth_gbps()
    print(json.dumps({"copy_gbps": round(bw)}))
    rows = [measure(name, n, k, args.sweep) for name, (n, k) in SHAPES.items()]
    print(f"\ncopy bandwidth {bw / 1e3:.2f} TB/s; us per call (TB/s of weight bytes)")
    for row in rows:
        cells = [f"{w[:-3]} {row[w]:.1f} ({row[w[:-3] + '_tbs']:.2f})" for w in row if w.endswith("_us")]
        print(f"{row['shape']:>8} {row['n']}x{row['k']}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
