#!/usr/bin/env python
"""The grouped GEMM of mixture-of-experts layers: cai.kernels.grouped_linear on each of its paths against a
per-expert loop of torch matmuls, transformers' Mixtral experts module and a dense matmul (the ceiling), forward +
backward, side by side on one GPU.

Workload (defaults: Mixtral-8x7B's experts): T tokens routed top-k of E experts by a random router with a random
per-expert bias (so the rows per expert vary, as with a real router), hidden H, expert FFN F, bf16. Each expert is
SwiGLU: `down(silu(gate) * up)` with `gate_up_proj` `(E, 2F, H)` and `down_proj` `(E, H, F)`, Hugging Face's
layout. Every row is timed forward + backward (`torch.autograd.grad` of the output with a random cotangent, all
inputs and weights as leaves) with `triton.testing.do_bench` (median, after a warm-up that also compiles and
autotunes) on random data, never zeros. TFLOP/s count the GEMMs only: `18 R H F` for `R = T k` routed rows.

Section "rows": the expert MLP on rows already sorted by expert (the grouped GEMM alone).
  dense matmul      one `(R, H) @ (H, 2F)` forward matmul: the bf16 GEMM rate of this GPU (the 60% target's base)
  dense MLP         the same MLP with one expert holding all R rows, fwd+bwd: the same FLOPs with no grouping
  torch loop        the peer: per expert `x_e @ W1[e]^T`, SwiGLU, `@ W2[e]^T`, concatenated (counts read each call)
  cai <path>        `grouped_linear(..., backend=<path>)` for each path this machine has: grouped_mm
                    (torch._grouped_mm), triton (autotuned Triton kernels), checked against the torch loop
Section "module": the whole experts step, routing weights, permutation and combine included; the router itself
is not timed (every row gets the same top_k_index and top_k_weights).
  transformers eager       MixtralExperts.forward (its per-expert loop), `config._experts_implementation="eager"`
  transformers grouped_mm  the same module with `_experts_implementation="grouped_mm"` (torch._grouped_mm)
  cai experts              permute_tokens + grouped_linear (auto) + SwiGLU + grouped_linear + unpermute_tokens,
                           what cai.shardformer's ExpertParallelExperts runs with one ep rank
The module rows share the weights of the rows section and are checked against the same step with
`backend="loop"`. A check prints PASS when the output and every gradient are finite and within `--tol` relative
L2 error of the reference.

    python examples/benchmarks/bench_moe.py                                             # one H200, < 3 minutes
    python examples/benchmarks/bench_moe.py --device cpu --tokens 64 --hidden 32 --ffn 64   # CPU smoke test

Progress goes to stderr; the table, the targets and the command line to stdout; `$OUT/bench_moe.json` when `OUT`
is set. `TRITON_PRINT_AUTOTUNING=1` prints every autotuned config's timing.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

GiB = 2**30
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
START = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f}s] {msg}", file=sys.stderr, flush=True)


@dataclass(kw_only=True)
class Row:
    section: str
    name: str
    flops: float
    ms: float | None = None
    tflops: float | None = None
    pct_dense: float | None = None  # of the dense matmul rate
    vs_loop: float | None = None  # the section's per-expert loop ms / this row's ms
    vs_best_peer: float | None = None  # the fastest peer's ms / this row's ms
    peak_gib: float | None = None  # allocated above the inputs during one fwd+bwd
    warmup_s: float | None = None  # first call: compile and autotune included
    check: str = "-"
    note: str = ""
    peer: bool = False


def timed(fn: Callable[[], object], device: torch.device, args) -> float:
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median")
    times = []
    for _ in range(args.cpu_reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def peak_gib(fn: Callable[[], object], device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / GiB


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def fwd_bwd(forward: Callable[[], torch.Tensor], leaves: list[torch.Tensor], dy: torch.Tensor):
    def step():
        out = forward()
        return (out.detach(), *torch.autograd.grad(out, leaves, dy))

    return step


def compare(got: tuple, want: tuple, names: list[str], tol: float) -> str:
    worst, parts = 0.0, []
    for name, a, b in zip(names, got, want, strict=True):
        a, b = a.float(), b.float()
        if not torch.isfinite(a).all():
            return f"FAIL {name} not finite"
        err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        worst = max(worst, err)
        parts.append(f"{name} {err:.1e}")
    return f"{'PASS' if worst <= tol else 'FAIL'} rel L2 " + ", ".join(parts)


def measure(row: Row, step, device, args, reference=None, names=None, keep=False) -> tuple | None:
    """Warm up (compiles, autotunes), check against `reference`, then peak memory and the median time. Returns the
    first call's output and gradients when `keep` (the reference of the rows that follow)."""
    log(f"{row.section} / {row.name}: warm-up")
    result = None
    try:
        start = time.perf_counter()
        result = step()
        sync(device)
        row.warmup_s = time.perf_counter() - start
        if reference is not None:
            row.check = compare(result, reference, names, args.tol)
        if not keep:
            result = None
        row.peak_gib = peak_gib(step, device)
        row.ms = timed(step, device, args)
        row.tflops = row.flops / row.ms / 1e9
    except Exception as exc:  # one failing row must not lose the others
        row.note = f"error: {type(exc).__name__}: {' '.join(str(exc).split())[:120]}"
        traceback.print_exc(file=sys.stderr)
    log(
        f"{row.section} / {row.name}: {row.ms and f'{row.ms:.2f} ms, {row.tflops:.4g} TFLOP/s'} {row.check} {row.note}"
    )
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def mixtral_experts(w1, w2, args):
    # transformers' own module, built on the meta device and given the benchmark's weights (shared, not copied).
    from transformers.models.mixtral.configuration_mixtral import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = MixtralConfig(hidden_size=args.hidden, intermediate_size=args.ffn, num_local_experts=args.experts,
                        num_experts_per_tok=args.top_k, hidden_act="silu")  # fmt: skip
    with torch.device("meta"):
        experts = MixtralExperts(cfg)
    experts.gate_up_proj, experts.down_proj = w1, w2
    return experts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--tokens", type=int, default=8192, help="T tokens")
    p.add_argument("--experts", type=int, default=8, help="E experts")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--hidden", type=int, default=4096, help="H")
    p.add_argument("--ffn", type=int, default=14336, help="F, each expert's intermediate size")
    p.add_argument("--imbalance", type=float, default=0.5, help="std of the router's per-expert logit bias")
    p.add_argument("--tol", type=float, default=1e-2, help="largest relative L2 error a check passes")
    p.add_argument("--warmup-ms", type=int, default=200, help="do_bench warm-up per row")
    p.add_argument("--rep-ms", type=int, default=800, help="do_bench measuring time per row")
    p.add_argument("--cpu-reps", type=int, default=1, help="timed repeats per row on CPU")
    p.add_argument(
        "--skip",
        default="",
        help="comma list of rows to leave out: dense,grouped_mm,triton,hf,cai_experts",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_moe.py: no CUDA device; use --device cpu with small shapes for a smoke test")
    if device.type == "cpu":  # the Triton path runs interpreted on CPU; set before its kernels are defined
        os.environ.setdefault("TRITON_INTERPRET", "1")

    from cai.kernels import _moe, grouped_linear, permute_tokens, unpermute_tokens

    skip = {s for s in args.skip.split(",") if s}
    dtype = DTYPES[args.dtype]
    t, e, k, h, f = args.tokens, args.experts, args.top_k, args.hidden, args.ffn
    r = t * k
    flops = 18.0 * r * h * f  # 3 GEMMs of the MLP's 2 (gate_up 2F, down) forward, x3 for the backward
    torch.manual_seed(args.seed)

    def randn(*shape, scale=1.0, grad=True, dt=dtype):
        return (torch.randn(*shape, device=device) * scale).to(dt).requires_grad_(grad)

    log(f"inputs: T={t} top-{k} of E={e}, H={h}, F={f}, {args.dtype} on {device}")
    x_tok = randn(t, h)
    router = torch.randn(e, h, device=device) / h**0.5
    bias = torch.randn(e, device=device) * args.imbalance
    probs = torch.softmax(x_tok.detach().float() @ router.t() + bias, dim=-1)
    top_w, top_i = probs.topk(k, dim=-1)
    top_w = (top_w / top_w.sum(-1, keepdim=True)).requires_grad_()  # Mixtral's renormalised top-k, in fp32
    w1 = torch.nn.Parameter(randn(e, 2 * f, h, scale=h**-0.5, grad=False))
    w2 = torch.nn.Parameter(randn(e, h, f, scale=f**-0.5, grad=False))
    with torch.no_grad():
        rows_sorted, _, counts = permute_tokens(x_tok, top_i, e)
    x_rows = rows_sorted.clone().requires_grad_()
    dy_rows, dy_tok = randn(r, h, grad=False), randn(t, h, grad=False)
    counts_list = counts.tolist()
    auto_path, auto_why = _moe._choose(device, dtype, e, 2 * f, h)

    def loop_mlp():
        outs = []
        for i, xe in enumerate(torch.split(x_rows, counts.tolist())):
            gate, up = (xe @ w1[i].t()).chunk(2, dim=-1)
            outs.append((F.silu(gate) * up) @ w2[i].t())
        return torch.cat(outs)

    def cai_mlp(backend):
        def forward():
            gate, up = grouped_linear(x_rows, w1, counts, backend=backend).chunk(2, dim=-1)
            return grouped_linear(F.silu(gate) * up, w2, counts, backend=backend)

        return forward

    def cai_experts(backend):
        def forward():
            rows, order, cnt = permute_tokens(x_tok, top_i, e)
            gate, up = grouped_linear(rows, w1, cnt, backend=backend).chunk(2, dim=-1)
            return unpermute_tokens(grouped_linear(F.silu(gate) * up, w2, cnt, backend=backend), order, top_w)

        return forward

    rows: list[Row] = []
    # Section "rows": the grouped GEMM on expert-sorted rows.
    if "dense" not in skip:
        xd = x_rows.detach()
        w1d = randn(2 * f, h, scale=h**-0.5)
        w2d = randn(h, f, scale=f**-0.5)

        def dense_mm():
            with torch.no_grad():
                return xd @ w1d.t()

        row = Row(section="rows", name="dense matmul (R,H)@(H,2F) fwd", flops=4.0 * r * h * f)
        measure(row, dense_mm, device, args)
        rows.append(row)

        def dense_mlp():
            gate, up = (x_rows @ w1d.t()).chunk(2, dim=-1)
            return (F.silu(gate) * up) @ w2d.t()

        row = Row(section="rows", name="dense MLP, one expert, fwd+bwd", flops=flops)
        measure(row, fwd_bwd(dense_mlp, [x_rows, w1d, w2d], dy_rows), device, args)
        rows.append(row)
        del w1d, w2d
    names = ["out", "dx", "dW_gate_up", "dW_down"]
    loop_row = Row(section="rows", name="torch per-expert loop", flops=flops, peer=True)
    ref_rows = measure(loop_row, fwd_bwd(loop_mlp, [x_rows, w1, w2], dy_rows), device, args, keep=True)
    if ref_rows is None:
        log("the torch loop failed: the cai rows of this section run unchecked")
    rows.append(loop_row)

    def cai_row(path: str, reference, names) -> Row:
        row = Row(section="rows", name=f"cai grouped_linear [{path}]", flops=flops)
        try:
            _moe._choose(device, dtype, e, 2 * f, h, path)
        except (ValueError, RuntimeError) as exc:
            row.note = f"not available: {exc}"
            return row
        if path == "triton":
            log(
                "the first Triton call autotunes 4 forward/input-grad and 2 weight-grad shapes (~20 compiles)"
            )
        measure(row, fwd_bwd(cai_mlp(path), [x_rows, w1, w2], dy_rows), device, args, reference, names)
        return row

    if "grouped_mm" not in skip:
        rows.append(cai_row("grouped_mm", ref_rows, names))

    # Section "module": routing weights, permutation and combine included.
    leaves = [x_tok, w1, w2, top_w]
    names = ["out", "dx", "dW_gate_up", "dW_down", "d_top_k_weights"]
    log("module: reference (cai experts with backend='loop')")
    try:
        ref_mod = fwd_bwd(cai_experts("loop"), leaves, dy_tok)()
    except Exception:
        traceback.print_exc(file=sys.stderr)
        ref_mod = None
        log("the reference failed: the module rows run unchecked")
    if "hf" not in skip:
        try:
            import transformers

            experts = mixtral_experts(w1, w2, args)
            for impl in ("eager", "grouped_mm"):
                row = Row(section="module", name=f"transformers {transformers.__version__} {impl}", flops=flops,
                          peer=True)  # fmt: skip

                def hf_forward(impl=impl):
                    experts.config._experts_implementation = impl
                    return experts(x_tok, top_i, top_w)

                measure(row, fwd_bwd(hf_forward, leaves, dy_tok), device, args, ref_mod, names)
                rows.append(row)
        except ImportError as exc:
            rows.append(
                Row(section="module", name="transformers", flops=flops, peer=True, note=f"skipped: {exc}")
            )
    if "cai_experts" not in skip:
        row = Row(section="module", name=f"cai experts [auto: {auto_path}]", flops=flops)
        measure(row, fwd_bwd(cai_experts("auto"), leaves, dy_tok), device, args, ref_mod, names)
        rows.append(row)
    del ref_mod
    # The Triton row runs last: a fault in a compiled kernel would end the CUDA context for every row after it.
    if "triton" not in skip:
        rows.append(cai_row("triton", ref_rows, ["out", "dx", "dW_gate_up", "dW_down"]))
    del ref_rows
    rows.sort(key=lambda x: x.section != "rows")  # stable: the table lists the rows section first

    dense = next((x.tflops for x in rows if x.name.startswith("dense matmul") and x.tflops), None)
    for section in ("rows", "module"):
        sec = [x for x in rows if x.section == section]
        loop_ms = next((x.ms for x in sec if x.peer and x.ms), None)  # the first peer is the per-expert loop
        best_ms = min((x.ms for x in sec if x.peer and x.ms), default=None)
        for x in sec:
            if x.flops != flops:  # the forward-only dense matmul: a rate, not a step to compare
                x.pct_dense = 100.0 if x.tflops else None
                continue
            if x.ms and loop_ms:
                x.vs_loop = loop_ms / x.ms
            if x.ms and best_ms:
                x.vs_best_peer = best_ms / x.ms
            if x.tflops and dense:
                x.pct_dense = 100 * x.tflops / dense

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    versions = f"torch {torch.__version__}"
    for mod in ("triton", "transformers"):
        try:
            versions += f", {mod} {__import__(mod).__version__}"
        except ImportError:
            versions += f", no {mod}"
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    if device.type == "cuda":
        where += f" (sm_{''.join(map(str, torch.cuda.get_device_capability(device)))})"
    print(f"\ndevice: {where}; {versions}")
    print(f"workload: T={t} tokens, top-{k} of E={e} experts (R={r} rows), H={h}, F={f}, {args.dtype}; rows per "
          f"expert {counts_list} (min {min(counts_list)}, max {max(counts_list)}); GEMM FLOPs fwd+bwd "
          f"{flops / 1e12:.2f} T")  # fmt: skip
    print(f"grouped_linear auto path here: {auto_path} ({auto_why})")
    print("timed, forward + backward (autograd.grad of every input and weight), median of do_bench:")
    print(
        "- rows: the SwiGLU expert MLP on rows already sorted by expert; torch loop = per-expert matmuls (peer)"
    )
    print(
        "- module: transformers' MixtralExperts.forward(hidden, top_k_index, top_k_weights) with its own eager loop"
    )
    print(
        "  or its grouped_mm implementation, against cai's permute_tokens + grouped_linear + unpermute_tokens;"
    )
    print("  the router is not timed, every row gets the same routing. TFLOP/s count the GEMMs only.\n")
    print(
        "| section | row | ms | TFLOP/s | % dense matmul | x loop | x best peer | peak GiB | warm-up s | check | note |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for x in rows:
        name = x.name + (" (peer)" if x.peer else "")
        print(f"| {x.section} | {name} | {fmt(x.ms, '.2f')} | {fmt(x.tflops, '.4g')} | {fmt(x.pct_dense, '.0f')} | "
              f"{fmt(x.vs_loop, '.2f')} | {fmt(x.vs_best_peer, '.2f')} | {fmt(x.peak_gib, '.2f')} | "
              f"{fmt(x.warmup_s, '.1f')} | {x.check} | {x.note} |")  # fmt: skip
    if device.type == "cuda" and "triton" not in skip:
        from cai.kernels import _moe_triton

        for kernel in (_moe_triton.grouped_mm_kernel, _moe_triton.grouped_mm_wgrad_kernel):
            for key, cfg in kernel.cache.items():
                print(f"autotuned {kernel.base_fn.__name__} {key}: {cfg}")
    print("\ntargets (cai rows):")
    cai_rows = [x for x in rows if x.name.startswith("cai")]
    failed = any(x.check.startswith("FAIL") or x.note.startswith("error") for x in cai_rows)
    for x in cai_rows:
        if not x.ms:
            print(f"- {x.section} / {x.name}: {x.note}")
            continue
        ok = x.pct_dense is not None and x.pct_dense >= 60
        print(f"- {x.section} / {x.name}: {x.tflops:.4g} TFLOP/s = {fmt(x.pct_dense, '.0f')}% of the dense matmul "
              f"{fmt(dense, '.4g')} TFLOP/s (target >= 60%): {'PASS' if ok else 'MISS'}; {fmt(x.vs_loop, '.2f')}x "
              f"the loop, {fmt(x.vs_best_peer, '.2f')}x the best peer; check {x.check.split(' ')[0]}")  # fmt: skip
    print(f"\ncommand: {shlex.join([sys.executable, *sys.argv])}")
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "bench_moe.json")
        with open(path, "w") as fh:
            json.dump({"device": where, "versions": versions, "counts": counts_list, "auto": [auto_path, auto_why],
                       "args": vars(args), "rows": [asdict(x) for x in rows]}, fh, indent=1)  # fmt: skip
        print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
