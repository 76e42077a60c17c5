"""Causal attention through torch's SDPA backends, forward and forward + backward, at a training shape.

    python examples/benchmarks/bench_attention.py [-b 8] [--heads 16] [-l 2048] [-d 128]

Medians of ``triton.testing.do_bench``; TFLOP/s count the causal half of the products (forward 2, backward 5
matmuls of b x h x s x s x d / 2 multiply-adds each).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-b", "--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("-l", "--seq", type=int, default=2048)
    p.add_argument("-d", "--head-dim", type=int, default=128)
    args = p.parse_args()
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    half = 2 * args.batch * args.heads * args.seq**2 * args.head_dim / 2  # one causal product, in FLOP
    print(f"causal attention {shape} bf16")
    for name, backend in BACKENDS.items():
        try:
            with sdpa_kernel([backend]):

                def forward():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

                def both():
                    forward().backward(grad)

                fwd, total = triton.testing.do_bench(forward), triton.testing.do_bench(both)
        except RuntimeError as exc:
            print(f"  {name:<10} not available: {str(exc).splitlines()[0][:100]}")
            continue
        print(
            f"  {name:<10} forward {fwd:.3f} ms ({2 * half / fwd / 1e9:.0f} TFLOP/s), "
            f"forward + backward {total:.3f} ms ({7 * half / total / 1e9:.0f} TFLOP/s)"
        )


if __name__ == "__main__":
    main()
