"""CPU Adam step with the bf16 copy-out that offloaded training needs, cai vs torch.

Each row updates the same fp32 parameters (a few large tensors) and leaves the updated values, cast to bf16, in
a pinned host buffer (the buffer an offloaded trainer copies back to the GPU):
  cai CPUAdam            : cai.kernels.optim.adam_update per tensor, writing bf16 into the buffer in the same pass
  torch AdamW fused      : torch.optim.AdamW(fused=True).step() then buffer.copy_(param)
  torch AdamW foreach    : torch.optim.AdamW(foreach=True).step() then buffer.copy_(param)
With bf16 gradients, torch's optimizers need fp32 .grad tensors, so their rows include the upcast
(param.grad.copy_(bf16 grad)); cai reads the bf16 gradient directly.

GB/s counts the bytes the update must move at minimum (param, exp_avg, exp_avg_sq read and written, the
gradient read, the bf16 copy written) for every row, so the column compares like with like.

Run: python examples/benchmarks/bench_cpu_adam.py [--numel 1e8] [--grad-dtype both]
Writes $OUT/bench_cpu_adam.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from cai.kernels.optim import adam_update, cpu_adam_status

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _pinned_empty(n: int, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    try:
        return torch.empty(n, dtype=dtype, pin_memory=True), True
    except RuntimeError:  # no CUDA driver here: plain host memory
        return torch.empty(n, dtype=dtype), False


def _median_ms(step, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(numel: int, tensors: int, grad_dtype: torch.dtype, warmup: int, steps: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    sizes = [numel // tensors + (1 if i < numel % tensors else 0) for i in range(tensors)]
    params = [torch.randn(n, generator=gen) for n in sizes]
    grads = [(torch.randn(n, generator=gen) * 1e-2).to(grad_dtype) for n in sizes]
    out, pinned = _pinned_empty(numel, torch.bfloat16)
    outs = list(out.split(sizes))
    rows = []

    # cai: one fused pass per tensor (threads inside the kernel).
    cai_state = [(torch.zeros(n), torch.zeros(n)) for n in sizes]
    cai_step = [0]

    def cai() -> None:
        cai_step[0] += 1
        for p, g, (m, v), o in zip(params, grads, cai_state, outs):
            adam_update(p, g, m, v, step=cai_step[0], lr=HYPER["lr"], beta1=0.9, beta2=0.999, eps=HYPER["eps"],
                        weight_decay=HYPER["weight_decay"], adamw_mode=True, out=o)  # fmt: skip

    rows.append(("cai CPUAdam (fused bf16 copy-out)", _median_ms(cai, warmup, steps)))
    cai_state.clear()  # free the moments before the peers allocate theirs

    for label, kwargs in (
        ("torch AdamW fused + copy", dict(fused=True)),
        ("torch AdamW foreach + copy", dict(foreach=True)),
    ):
        tparams = [torch.nn.Parameter(p.clone()) for p in params]
        for tp in tparams:
            tp.grad = torch.zeros_like(tp)
        opt = torch.optim.AdamW(tparams, **HYPER, **kwargs)

        def peer(tparams=tparams, opt=opt) -> None:
            for tp, g in zip(tparams, grads):
                if g.dtype != tp.dtype:
                    tp.grad.copy_(g)  # the upcast torch's optimizers need
                elif tp.grad is not g:
                    tp.grad = g
            opt.step()
            for tp, o in zip(tparams, outs):
                o.copy_(tp.detach())

        rows.append((label, _median_ms(peer, warmup, steps)))
        del opt, tparams

    grad_bytes = torch.tensor([], dtype=grad_dtype).element_size()
    bytes_per_step = numel * (3 * 4 * 2 + grad_bytes + 2)
    base = rows[0][1]
    return [
        dict(
            impl=label,
            grad_dtype=str(grad_dtype).replace("torch.", ""),
            numel=numel,
            ms=ms,
            gbps=bytes_per_step / (ms * 1e-3) / 1e9,
            speedup_of_cai=ms / base,
            pinned=pinned,
        )
        for label, ms in rows
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=float, default=1e8, help="total fp32 parameters (default 1e8)")
    ap.add_argument("--tensors", type=int, default=4, help="split into this many tensors (default 4)")
    ap.add_argument("--grad-dtype", choices=["bf16", "fp32", "both"], default="both")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: leave as is)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    impl, reason = cpu_adam_status()
    dtypes = {"bf16": [torch.bfloat16], "fp32": [torch.float32], "both": [torch.bfloat16, torch.float32]}[
        args.grad_dtype
    ]
    results = []
    for dt in dtypes:
        results += run(int(args.numel), args.tensors, dt, args.warmup, args.steps)

    print(f"CPU Adam step + bf16 copy-out: {int(args.numel):.2e} fp32 params in {args.tensors} tensors, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, cai kernel: {impl} ({reason}); "
          f"pinned out buffer: {results[0]['pinned']}; median of {args.steps} steps after {args.warmup} warm-up")  # fmt: skip
    print()
    print("| impl | grad | ms/step | GB/s | ratio (peer ms / cai ms) |")
    print("|---|---|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['impl']} | {r['grad_dtype']} | {r['ms']:.1f} | {r['gbps']:.1f} | {r['speedup_of_cai']:.2f}x |"
        )
    if os.environ.get("OUT"):
        meta = dict(
            threads=torch.get_num_threads(), torch=torch.__version__, kernel=impl, kernel_reason=reason
        )
        with open(os.path.join(os.environ["OUT"], "bench_cpu_adam.json"), "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=2)


if __name__ == "__main__":
    main()
