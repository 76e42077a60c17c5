#!/usr/bin/env python
"""cai's Triton training kernels against torch eager, torch.compile and Liger-Kernel, side by side on one GPU.

Measures the device copy bandwidth first, then for every row a forward+backward with
`triton.testing.do_bench` (median) and the peak memory above the inputs (gradients included). Prints one
markdown table (kernel, shape, impl, ms, GB/s, % of copy bandwidth, peak extra MiB, speed-up over Liger) and
the targets, and writes `$OUT/bench_kernels.json` when `OUT` is set. Liger rows appear when `import
liger_kernel` works; otherwise the ratios use Liger's figures recorded on the same H200 (BENCHMARKS.md).

    python examples/benchmarks/bench_kernels.py            # full shapes, < 4 minutes on an H200
    python examples/benchmarks/bench_kernels.py --quick    # tiny shapes, a smoke test
    python examples/benchmarks/bench_kernels.py --only rms_norm,flce --no-compile
    python examples/benchmarks/bench_kernels.py --only rms_norm,layer_norm,rope,flce --split --graphs

`--split` notes forward alone, backward alone and the host time of one forward+backward; `--graphs` adds
eager, cai and Liger replayed from a CUDA graph (GPU time without host overhead, which bounds the plain
figures of these sub-millisecond kernels). `CAI_KERNELS_TUNE_LOG=1` prints the autotuner's timings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
import triton.testing

from cai.kernels import (
    apply_rotary_pos_emb,
    fused_linear_cross_entropy,
    kernel_report,
    layer_norm,
    rms_norm,
    swiglu,
)

MiB = 2**20
# Liger-Kernel on the same H200 (BENCHMARKS.md), used when Liger cannot be imported here.
RECORDED_LIGER_MS = {"rms_norm": 0.58, "swiglu": 0.79, "flce": 54.3}


@dataclass(kw_only=True)
class Row:
    kernel: str
    shape: str
    impl: str
    ms: float | None = None
    gbps: float | None = None
    pct_copy: float | None = None
    peak_extra_mib: float | None = None
    vs_liger: float | None = None  # Liger's ms / this row's ms: above 1 is faster than Liger
    note: str = ""


@dataclass(kw_only=True)
class Case:
    """One kernel at one shape: `make()` builds inputs, each impl maps inputs to a fwd+bwd closure."""

    kernel: str
    shape: str
    nbytes: int | None  # bytes a perfect fwd+bwd must move (None: compute bound)
    make: Callable[[], dict]
    impls: dict[str, Callable[[dict], Callable[[], None]]]
    flops: float | None = None


def liger():
    try:
        import liger_kernel.transformers.functional as lf
    except Exception:
        return None
    return lf


def leaves(inputs: dict) -> list[torch.Tensor]:
    return [t for t in inputs.values() if isinstance(t, torch.Tensor) and t.requires_grad]


def measure(fn: Callable[[], None], inputs: dict) -> tuple[float, float]:
    grads = leaves(inputs)
    for t in grads:
        t.grad = None
    fn()  # warm-up / compile outside the measured peak
    for t in grads:
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / MiB
    ms = triton.testing.do_bench(fn, warmup=100, rep=500, grad_to_none=grads, return_mode="median")
    return ms, peak


def split_note(forward: Callable[[dict], object], inputs: dict, grad_key: str | None) -> str:
    """Forward alone, backward alone (autograd.grad on a retained graph: no accumulation into .grad), and the
    host time to issue one forward+backward (no synchronisation), to tell slow kernels from launch overhead."""
    fwd_ms = triton.testing.do_bench(lambda: forward(inputs), warmup=50, rep=200, return_mode="median")
    out = forward(inputs)
    outs = out if isinstance(out, tuple) else (out,)
    grads = (inputs["dq"], inputs["dk"]) if isinstance(out, tuple) else (inputs[grad_key],)
    leaves_ = leaves(inputs)

    def bwd():
        torch.autograd.grad(outs, leaves_, grads, retain_graph=True, allow_unused=True)

    bwd_ms = triton.testing.do_bench(bwd, warmup=50, rep=200, return_mode="median")
    out = outs = None  # free the retained graph
    for t in leaves_:
        t.grad = None
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):  # ~10 launches each: far from filling the launch queue, so this is host time
        o = forward(inputs)
        torch.autograd.backward(o if isinstance(o, tuple) else (o,), grads)
    host_us = (time.perf_counter() - start) / 20 * 1e6
    torch.cuda.synchronize()
    return f"fwd {fwd_ms:.3f} bwd {bwd_ms:.3f} host {host_us:.0f} us"


def copy_bandwidth_gbps() -> float:
    src = torch.randn(2**29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median")
    return 2 * src.nbytes / ms / 1e6


def fwd_bwd(forward: Callable[[dict], torch.Tensor], grad_key: str | None = "dy"):
    def bind(inp):
        def run():
            out = forward(inp)
            if isinstance(out, tuple):
                torch.autograd.backward(out, (inp["dq"], inp["dk"]))
            elif grad_key is None:
                out.backward()
            else:
                out.backward(inp[grad_key])

        return run

    bind.forward, bind.grad_key = forward, grad_key
    return bind


def compiled(forward):
    return fwd_bwd(torch.compile(forward, dynamic=False))


def randn(*shape, scale=1.0, grad=True, dtype=torch.bfloat16):
    return (torch.randn(*shape, device="cuda", dtype=torch.float32) * scale).to(dtype).requires_grad_(grad)


def hf_rms_norm(inp):
    x = inp["x"].float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    return inp["w"] * x.to(inp["x"].dtype)


def hf_rope(inp):
    def rot(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    c, s = inp["cos"].unsqueeze(1), inp["sin"].unsqueeze(1)
    q, k = inp["q"], inp["k"]
    return q * c + rot(q) * s, k * c + rot(k) * s


def eager_ce(inp):
    return F.cross_entropy((inp["h"] @ inp["w"].T).float(), inp["y"])


def flce_one_stream(i):
    from cai.kernels import _fused_ce

    _fused_ce._OVERLAP = False  # grad_h's matmul on the current stream, after grad_W's
    try:
        return fused_linear_cross_entropy(i["h"], i["w"], i["y"])
    finally:
        _fused_ce._OVERLAP = True


def flce_check(inp) -> str:
    """Loss and gradients against the eager fp32-softmax reference, as errors relative to the largest value."""
    leaves_ = [inp["h"], inp["w"]]
    ref = eager_ce(inp)
    ref_g = torch.autograd.grad(ref, leaves_)
    out = fused_linear_cross_entropy(inp["h"], inp["w"], inp["y"])
    out_g = torch.autograd.grad(out, leaves_)
    errs = [abs(out.item() - ref.item()) / abs(ref.item())]
    errs += [
        ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(out_g, ref_g)
    ]
    return "rel err loss {:.1e} dh {:.1e} dw {:.1e}".format(*errs)


def cases(quick: bool) -> list[Case]:
    lf = liger()
    m, n = (256, 512) if quick else (16384, 4096)
    sm, sn = (256, 1024) if quick else (8192, 14336)
    t, h, v = (512, 256, 4000) if quick else (8192, 4096, 128256)
    b, s, hq, hk, d = (2, 128, 4, 2, 64) if quick else (8, 2048, 32, 8, 128)

    def norm_inputs():
        return {
            "x": randn(m, n),
            "w": randn(n),
            "b": randn(n),
            "r": randn(m, n),
            "dy": randn(m, n, grad=False),
        }

    def swiglu_inputs():
        return {"a": randn(sm, sn), "b": randn(sm, sn), "dy": randn(sm, sn, grad=False)}

    def ce_inputs():
        y = torch.randint(0, v, (t,), device="cuda")
        y[::10] = -100
        return {"h": randn(t, h), "w": randn(v, h, scale=0.02), "y": y}

    def rope_inputs():
        pos = torch.arange(s, device="cuda").float()
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
        emb = torch.cat([pos[:, None] * inv] * 2, dim=-1)
        cos, sin = (
            emb.cos()[None].expand(b, s, d).to(torch.bfloat16),
            emb.sin()[None].expand(b, s, d).to(torch.bfloat16),
        )
        q = randn(b, s, hq, d, grad=False).transpose(1, 2).requires_grad_()
        k = randn(b, s, hk, d, grad=False).transpose(1, 2).requires_grad_()
        return {"q": q, "k": k, "cos": cos, "sin": sin, "dq": randn(b, hq, s, d, grad=False),
                "dk": randn(b, hk, s, d, grad=False)}  # fmt: skip

    rms = {
        "eager": fwd_bwd(hf_rms_norm),
        "compile": compiled(hf_rms_norm),
        "cai": fwd_bwd(lambda i: rms_norm(i["x"], i["w"], 1e-6)),
    }
    ln = {
        "eager": fwd_bwd(lambda i: F.layer_norm(i["x"], (n,), i["w"], i["b"], 1e-5)),
        "compile": compiled(lambda i: F.layer_norm(i["x"], (n,), i["w"], i["b"], 1e-5)),
        "cai": fwd_bwd(lambda i: layer_norm(i["x"], i["w"], i["b"], 1e-5)),
    }
    sw = {
        "eager": fwd_bwd(lambda i: F.silu(i["a"]) * i["b"]),
        "compile": compiled(lambda i: F.silu(i["a"]) * i["b"]),
        "cai": fwd_bwd(lambda i: swiglu(i["a"], i["b"])),
    }
    ce = {
        "eager": fwd_bwd(eager_ce, None),
        "compile": fwd_bwd(torch.compile(eager_ce, dynamic=False), None),
        "cai": fwd_bwd(lambda i: fused_linear_cross_entropy(i["h"], i["w"], i["y"]), None),
        "cai one stream": fwd_bwd(flce_one_stream, None),
        "cai chunk=512": fwd_bwd(
            lambda i: fused_linear_cross_entropy(i["h"], i["w"], i["y"], chunk_size=512), None
        ),
        "cai chunk=1024": fwd_bwd(
            lambda i: fused_linear_cross_entropy(i["h"], i["w"], i["y"], chunk_size=1024), None
        ),
    }
    rope = {
        "eager": fwd_bwd(hf_rope),
        "compile": compiled(hf_rope),
        "cai": fwd_bwd(lambda i: apply_rotary_pos_emb(i["q"], i["k"], i["cos"], i["sin"])),
    }
    if lf is not None:
        rms["liger"] = fwd_bwd(lambda i: lf.liger_rms_norm(i["x"], i["w"], 1e-6))
        ln["liger"] = fwd_bwd(lambda i: lf.liger_layer_norm(i["x"], i["w"], i["b"], 1e-5))
        sw["liger"] = fwd_bwd(lambda i: lf.liger_swiglu(i["a"], i["b"]))
        ce["liger"] = fwd_bwd(lambda i: lf.liger_fused_linear_cross_entropy(i["h"], i["w"], i["y"]), None)
        rope["liger"] = fwd_bwd(lambda i: lf.liger_rope(i["q"], i["k"], i["cos"], i["sin"]))
    fused_res = {
        "eager": fwd_bwd(lambda i: hf_rms_norm({"x": i["x"] + i["r"], "w": i["w"]})),
        "cai": fwd_bwd(lambda i: rms_norm(i["x"], i["w"], 1e-6, residual=i["r"])[0]),
    }
    e = 2  # bf16
    return [
        Case(kernel="rms_norm", shape=f"{m}x{n} bf16", nbytes=5 * m * n * e, make=norm_inputs, impls=rms),
        Case(
            kernel="rms_norm+residual",
            shape=f"{m}x{n} bf16",
            nbytes=7 * m * n * e,
            make=norm_inputs,
            impls=fused_res,
        ),
        Case(kernel="layer_norm", shape=f"{m}x{n} bf16", nbytes=5 * m * n * e, make=norm_inputs, impls=ln),
        Case(kernel="swiglu", shape=f"{sm}x{sn} bf16", nbytes=8 * sm * sn * e, make=swiglu_inputs, impls=sw),
        Case(
            kernel="rope",
            shape=f"b{b} s{s} hq{hq} hk{hk} d{d} bf16",
            nbytes=4 * b * s * (hq + hk) * d * e,
            make=rope_inputs,
            impls=rope,
        ),
        Case(
            kernel="flce",
            shape=f"T{t} H{h} V{v} bf16",
            nbytes=None,
            make=ce_inputs,
            impls=ce,
            flops=6.0 * t * h * v,
        ),
    ]


def graphed(bind):
    """The same forward+backward captured once in a CUDA graph and replayed: GPU time alone, free of the host
    time (Python, autograd, kernel launches) that bounds the eager figures of these sub-millisecond kernels."""

    def bind_graph(inp):
        fn = bind(inp)
        grads = leaves(inp)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(
            side
        ):  # warm-up (compiles, autotunes) off the default stream, as capture needs
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        for t in grads:
            t.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay

    return bind_graph


def run_case(
    case: Case, copy_gbps: float, quick: bool, split: bool = False, graphs: bool = False
) -> list[Row]:
    rows = []
    inputs = case.make()
    impls = dict(case.impls)
    if graphs and case.nbytes:
        for impl in ("eager", "cai", "liger"):
            if impl in case.impls:
                impls[f"{impl} graphed"] = graphed(case.impls[impl])
    for impl, bind in impls.items():
        row = Row(kernel=case.kernel, shape=case.shape, impl=impl)
        try:
            row.ms, row.peak_extra_mib = measure(bind(inputs), inputs)
            if impl.endswith("graphed"):
                row.peak_extra_mib = None  # the graph's private pool, not comparable
            if split and case.nbytes and impl != "compile" and hasattr(bind, "forward"):
                row.note = split_note(bind.forward, inputs, bind.grad_key)
            if case.kernel == "flce" and impl == "cai":
                row.note = flce_check(inputs)
            if case.nbytes:
                row.gbps = case.nbytes / row.ms / 1e6
                row.pct_copy = 100 * row.gbps / copy_gbps
            if case.flops:
                row.note = f"{case.flops / row.ms / 1e9:.0f} TFLOP/s" + (f"; {row.note}" if row.note else "")
        except Exception as exc:  # one failing peer must not lose the other rows
            row.note = f"error: {type(exc).__name__}: {' '.join(str(exc).split())[:80]}"
            traceback.print_exc(file=sys.stderr)
        rows.append(row)
        torch.cuda.empty_cache()
    liger_ms = next((r.ms for r in rows if r.impl == "liger" and r.ms), None)
    # Recorded Liger figures are for the full shapes only.
    recorded = liger_ms is None and not quick and case.kernel in RECORDED_LIGER_MS
    liger_ms = liger_ms or (RECORDED_LIGER_MS.get(case.kernel) if recorded else None)
    liger_graph_ms = next((r.ms for r in rows if r.impl == "liger graphed" and r.ms), None)
    for r in rows:
        if r.impl.endswith("graphed"):  # graphed rows against graphed Liger
            r.vs_liger = liger_graph_ms / r.ms if liger_graph_ms and r.ms else None
        elif liger_ms and r.ms:
            r.vs_liger = liger_ms / r.ms
            if recorded:
                r.note = (r.note + "; " if r.note else "") + f"vs recorded Liger {liger_ms} ms"
    del inputs
    torch.cuda.empty_cache()
    return rows


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def print_table(rows: list[Row], copy_gbps: float) -> None:
    print(f"\ndevice: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"copy bandwidth {copy_gbps:.0f} GB/s, Liger: {'yes' if liger() else 'not importable'}\n")  # fmt: skip
    print("| kernel | shape | impl | ms | GB/s | % copy bw | peak extra MiB | x Liger | note |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.kernel} | {r.shape} | {r.impl} | {fmt(r.ms, '.3f')} | {fmt(r.gbps, '.0f')} | "
              f"{fmt(r.pct_copy, '.0f')} | {fmt(r.peak_extra_mib, '.0f')} | {fmt(r.vs_liger, '.2f')} | {r.note} |")  # fmt: skip


def print_targets(rows: list[Row]) -> None:
    def cai(kernel):
        return next((r for r in rows if r.kernel == kernel and r.impl == "cai" and r.ms), None)

    print("\ntargets:")
    for kernel, want in (("rms_norm", 2.0), ("swiglu", 1.2)):
        for r in (r for r in rows if r.kernel == kernel and r.impl in ("cai", "cai graphed") and r.vs_liger):
            ok = "PASS" if r.vs_liger >= want else "MISS"
            print(f"- {kernel} {r.impl}: {r.vs_liger:.2f}x Liger (target >= {want}x): {ok}")
    for kernel, peer in (("layer_norm", "eager"), ("rope", "liger")):  # not slower than the best peer
        for suffix in ("", " graphed"):
            r = next((r for r in rows if r.kernel == kernel and r.impl == "cai" + suffix and r.ms), None)
            p = next((p for p in rows if p.kernel == kernel and p.impl == peer + suffix and p.ms), None)
            if r and p:
                ok = "PASS" if r.ms <= p.ms else "MISS"
                print(f"- {kernel}{suffix}: {p.ms / r.ms:.2f}x {peer}{suffix} (target >= 1.0x): {ok}")
    for r in (r for r in rows if r.kernel == "flce" and r.impl.startswith("cai") and r.ms):
        ok_t = r.vs_liger is not None and 1 / r.vs_liger <= 0.8
        ok_m = r.peak_extra_mib is not None and r.peak_extra_mib <= 1.2 * 1024
        ratio = f"{1 / r.vs_liger:.2f}" if r.vs_liger else "-"
        print(f"- flce {r.impl}: {ratio}x Liger's time (target <= 0.8), {r.peak_extra_mib:.0f} MiB extra "
              f"(target <= 1229): {'PASS' if ok_t and ok_m else 'MISS'}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    parser.add_argument(
        "--no-compile", action="store_true", help="skip the torch.compile rows (saves compile time)"
    )
    parser.add_argument(
        "--split", action="store_true", help="memory-bound rows: also forward, backward and host time alone"
    )
    parser.add_argument(
        "--graphs", action="store_true", help="memory-bound rows: also eager, cai and Liger in a CUDA graph"
    )
    parser.add_argument("--only", default="", help="comma-separated kernels (rms_norm, swiglu, flce, ...)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA device")
    torch.manual_seed(0)
    for name, impl, why in kernel_report():
        print(f"{name}: {impl} ({why})", file=sys.stderr)
    copy_gbps = copy_bandwidth_gbps()
    only = {k for k in args.only.split(",") if k}
    rows = []
    # Compute-bound cases (fused CE) first: their figures must not depend on a later graph capture going well.
    for case in sorted(cases(args.quick), key=lambda c: c.nbytes is not None):
        if only and case.kernel not in only:
            continue
        if args.no_compile:
            case.impls.pop("compile", None)
        print(f"running {case.kernel} {case.shape}", file=sys.stderr, flush=True)
        done = run_case(case, copy_gbps, args.quick, args.split, args.graphs)
        for r in done:  # as they come, so a run cut short still reports what it measured
            print(f"done {r}", file=sys.stderr, flush=True)
        rows += done
    print_table(rows, copy_gbps)
    print_targets(rows)
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "bench_kernels.json")
        with open(path, "w") as f:
            json.dump({"copy_gbps": copy_gbps, "device": torch.cuda.get_device_name(),
                       "rows": [asdict(r) for r in rows]}, f, indent=1)  # fmt: skip
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
