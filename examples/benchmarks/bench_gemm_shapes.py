"""The GEMMs of a Llama layer in each training direction, and their merged and transposed forms, in TFLOP/s.

    python examples/benchmarks/bench_gemm_shapes.py                     # the 1B layer (h2048, ffn 5632), 16384 tokens
    python examples/benchmarks/bench_gemm_shapes.py --hidden 4096 --ffn 14336 --tokens 4096

Forward ``x @ W^T``, input gradient ``dy @ W``, weight gradient ``dy^T @ x`` (and ``x^T @ dy``), for the square
projections, the MLP's, and q/k/v and gate+up merged into one matrix; bf16, ``triton.testing.do_bench`` medians.
Set ``TORCH_BLAS_PREFER_CUBLASLT=1`` to compare cuBLASLt's choices.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--kv", type=int, default=None, help="k/v width (default: hidden, no GQA)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemm_shapes.py needs a CUDA GPU")
    from triton.testing import do_bench

    t, h, f = args.tokens, args.hidden, args.ffn
    kv = args.kv or h
    prefer_lt = os.environ.get("TORCH_BLAS_PREFER_CUBLASLT", "0")
    print(f"{torch.cuda.get_device_name()}, TORCH_BLAS_PREFER_CUBLASLT={prefer_lt}")
    shapes = (("q/o", h, h), ("gate/up", f, h), ("down", h, f), ("gate+up", 2 * f, h), ("qkv", h + 2 * kv, h))
    for tag, n, k in shapes:
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
        flops = 2 * t * n * k
        for name, fn in (
            ("fwd x @ W^T", lambda x=x, w=w: F.linear(x, w)),
            ("dx dy @ W", lambda dy=dy, w=w: dy @ w),
            ("dW dy^T @ x", lambda dy=dy, x=x: dy.t() @ x),
            ("dW^T x^T @ dy", lambda dy=dy, x=x: x.t() @ dy),
        ):
            ms = do_bench(fn, warmup=30, rep=200)
            print(
                f"{tag:<8} {t}x{k}x{n:<6} {name:<14} {ms * 1e3:8.1f} us {flops / ms / 1e9:7.1f} TFLOP/s",
                flush=True,
            )


if __name__ == "__main__":
    main()
