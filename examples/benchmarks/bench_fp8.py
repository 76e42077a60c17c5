#!/usr/bin/env python
"""Where an FP8 linear layer's time goes, against bf16, for the linear shapes of a Llama training step.

For every projection of `benchmark.py`'s 1B preset (16,384 tokens: b8 s2048) and the Llama-3-8B shape (4,096 tokens:
b2 s2048), timed as the median of `triton.testing.do_bench`: the bf16 `F.linear` forward and backward, the same
through `cai.kernels.fp8_linear` with row-wise scales (`recipe="rowwise"`, whose quantiser this dissects), and the
pieces of the FP8 one: the row-wise quantisation of an activation (row-major) and of a gradient operand (a
transposed view), cai-kernels' Triton quantiser beside the same torch expression under `torch.compile`, and the bare
`torch._scaled_mm` against the bare bf16 matmul. The FP8 linear is timed twice: as it runs by default on the GPU
(two compiled bodies, [Note: fp8 host time] in `cai.kernels._fp8`) and on its eager path (one Triton quantiser
launch per operand); "host us" is the issuing time per forward and backward, timed from the host with one
synchronisation after 20 calls: where it exceeds the GPU time, the GPU waits. The FP8 quantisation cache is cleared
before each call, as a training step meets new activations every time.

    python examples/benchmarks/bench_fp8.py              # both models, about a minute
    python examples/benchmarks/bench_fp8.py --model 8b --json fp8.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import time

import torch
import torch.nn.functional as F
import triton.testing

from cai.kernels import _fp8 as fp8_impl
from cai.kernels import fp8_linear, quantize_rowwise

rowwise_linear = functools.partial(fp8_linear, recipe="rowwise")

# (tokens, hidden, kv width, ffn) of a micro-batch
MODELS = {"1b": (16384, 2048, 2048, 5632), "8b": (4096, 4096, 1024, 14336)}


def projections(hidden: int, kv: int, ffn: int) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection of a decoder layer."""
    return {
        "q": (hidden, hidden),
        "k/v": (hidden, kv),
        "o": (hidden, hidden),
        "gate/up": (hidden, ffn),
        "down": (ffn, hidden),
    }


def ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=100)


def host_us(fn, calls: int = 20) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * issued / calls


@contextlib.contextmanager
def eager_path():
    """The FP8 linear on its eager path (Triton quantiser launches, one `_scaled_mm` call at a time)."""
    whole_body = fp8_impl._whole_body
    fp8_impl._whole_body = lambda *args: False
    try:
        yield
    finally:
        fp8_impl._whole_body = whole_body


def fresh(fn):
    def call():
        fp8_impl._cache.clear()
        return fn()

    return call


def row(tokens: int, n_in: int, n_out: int, compiled_quantize) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, n_in, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    w = (
        torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16, generator=g) / n_in**0.5
    ).requires_grad_()
    dy = torch.randn(tokens, n_out, device="cuda", dtype=torch.bfloat16, generator=g)
    flops = 6 * tokens * n_in * n_out  # forward and both backward products

    def step(linear):
        def run():
            x.grad = w.grad = None
            linear(x, w).backward(dy)

        return run

    bf16 = ms(step(F.linear))
    fp8 = ms(fresh(step(rowwise_linear)))
    fp8_host = host_us(fresh(step(rowwise_linear)))
    with eager_path():
        fp8_eager = ms(fresh(step(rowwise_linear)))
        fp8_eager_host = host_us(fresh(step(rowwise_linear)))
    qx, sx = quantize_rowwise(x.detach())
    qw, sw = quantize_rowwise(w.detach())
    return {
        "tokens": tokens,
        "in": n_in,
        "out": n_out,
        "bf16_ms": bf16,
        "fp8_ms": fp8,
        "speedup": bf16 / fp8,
        "bf16_host_us": host_us(step(F.linear)),
        "fp8_host_us": fp8_host,
        "fp8_eager_ms": fp8_eager,
        "fp8_eager_host_us": fp8_eager_host,
        "bf16_tflops": flops / bf16 / 1e9,
        "fp8_tflops": flops / fp8 / 1e9,
        "quant_act_ms": ms(lambda: quantize_rowwise(x.detach())),
        "quant_act_compiled_ms": ms(lambda: compiled_quantize(x.detach(), fp8_impl.E4M3)),
        "quant_grad_t_ms": ms(lambda: quantize_rowwise(dy.t(), fp8_impl.GRAD_DTYPE)),
        "quant_grad_t_compiled_ms": ms(lambda: compiled_quantize(dy.t(), fp8_impl.GRAD_DTYPE)),
        "mm_bf16_ms": ms(lambda: x.detach() @ w.detach().t()),
        "mm_fp8_ms": ms(
            lambda: torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw.t(), out_dtype=torch.bfloat16)
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=[*MODELS, "all"], default="all")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("bench_fp8 needs a CUDA GPU with FP8 tensor cores (compute capability 8.9 or more)")
    compiled = torch.compile(fp8_impl._quantize_rowwise_torch, dynamic=True)
    rows = []
    print(
        f"{'model':<5} {'proj':<8} {'tokens x in x out':<20} {'bf16 ms':>8} {'fp8 ms':>8} {'fp8/bf16':>8} "
        f"{'eager fp8 ms':>12} {'host us bf16/fp8/eager':>23} "
        f"{'q act ms (compiled)':>20} {'q grad^T ms (compiled)':>23} {'mm bf16/fp8 ms':>15}"
    )
    for model in MODELS if args.model == "all" else [args.model]:
        tokens, hidden, kv, ffn = MODELS[model]
        fp8_impl._graph_shapes.clear()  # each model's projections get their graphs, as in training
        for name, (n_in, n_out) in projections(hidden, kv, ffn).items():
            r = {"model": model, "projection": name, **row(tokens, n_in, n_out, compiled)}
            rows.append(r)
            print(
                f"{model:<5} {name:<8} {f'{tokens}x{n_in}x{n_out}':<20} {r['bf16_ms']:8.3f} {r['fp8_ms']:8.3f} "
                f"{r['speedup']:7.2f}x {r['fp8_eager_ms']:12.3f} "
                f"{r['bf16_host_us']:9.0f}/{r['fp8_host_us']:.0f}/{r['fp8_eager_host_us']:.0f} "
                f"{r['quant_act_ms']:9.3f} ({r['quant_act_compiled_ms']:.3f})"
                f"{r['quant_grad_t_ms']:13.3f} ({r['quant_grad_t_compiled_ms']:.3f})"
                f"{r['mm_bf16_ms']:8.3f}/{r['mm_fp8_ms']:.3f}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
