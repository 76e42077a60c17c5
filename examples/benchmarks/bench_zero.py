"""cai-zero against its peers at world size 1 on one GPU: throughput, MFU, peak memory, overhead per step.

Default mode, HF Llama 1B (h2048, L16, vocab 32000), b8 s2048:
  PyTorch eager        : fp32 params, bf16 autocast, fused AdamW (BENCHMARKS.md: 63.9k tok/s)
  FSDP2 world 1        : fully_shard per layer + root, MixedPrecisionPolicy(bf16 params, fp32 reduce) (61.5k)
  cai-zero stage 1 / 2 : bf16 working params, fp32 master shards, fused AdamW on the flat shards
--offload mode, 3B (h3072, L28, vocab 128256), b4 s2048, activation checkpointing:
  FSDP2 CPUOffloadPolicy (1.6k tok/s), cai-zero cpu_offload=True (HybridAdam on the host; with and without the
  CPU step overlapped with backward), cai-zero without offload.

Every row builds the model with random weights from the config (nothing downloaded), runs a few warm-up steps
and times ``--steps`` steps (CUDA-synchronised wall clock, median). One process, a world-size-1 process group
(nccl on GPU, gloo on CPU). Prints one table; writes $OUT/bench_zero[_offload].json when OUT is set.

Run on the GPU machine (each mode < 5 minutes):
  python examples/benchmarks/bench_zero.py
  python examples/benchmarks/bench_zero.py --offload
Smoke test on CPU: python examples/benchmarks/bench_zero.py --tiny [--offload]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples' shared helpers

import torch
import torch.distributed as dist
from _models import preset_config
from _perf import ModelShape, Throughput, host_peak_gib, peak_memory_gib, synchronize

LR = 1e-5  # random weights on random tokens: keep the timed steps far from divergence
PEERS = {  # BENCHMARKS.md, measured on the same H200
    "eager": 63.9e3,
    "fsdp2": 61.5e3,
    "fsdp2_offload": 1.6e3,
}


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        if hasattr(torch._C, "_host_emptyCache"):  # pinned host blocks the previous row cached
            torch._C._host_emptyCache()


def _build(config, device: torch.device, grad_ckpt: bool, dtype: torch.dtype = torch.float32):
    from transformers import LlamaForCausalLM

    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    model.config.use_cache = False
    if grad_ckpt:
        # Non-reentrant: the post-accumulate-grad hooks then fire inside the one outer backward.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def row_eager(config, batch, grad_ckpt: bool):
    model = _build(config, batch.device, grad_ckpt)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=batch.device.type == "cuda")

    def step() -> None:
        with torch.autocast(batch.device.type, dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return "PyTorch eager (bf16 autocast, fp32 master, fused AdamW)", model, step, None


def row_fsdp2(config, batch, grad_ckpt: bool, offload: bool = False):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    model = _build(config, batch.device, grad_ckpt)
    kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=batch.device.type == "cuda")
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=batch.device.type == "cuda" and not offload)

    def step() -> None:
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    name = "FSDP2 world 1 (bf16 compute, fp32 master" + (", CPUOffloadPolicy)" if offload else ")")
    return name, model, step, None


def row_zero(
    config, batch, grad_ckpt: bool, *, stage: int, offload: bool = False, overlap_step: bool = False
):
    from cai.kernels.optim import HybridAdam
    from cai.zero import ZeroConfig, ZeroOptimizer

    model = _build(config, batch.device, grad_ckpt, dtype=torch.bfloat16)
    if offload:
        inner = HybridAdam(model.parameters(), lr=LR)
    else:
        inner = torch.optim.AdamW(model.parameters(), lr=LR, fused=batch.device.type == "cuda")
    cfg = ZeroConfig(stage=stage, cpu_offload=offload, overlap_cpu_step=overlap_step)
    opt = ZeroOptimizer(inner, model=model, config=cfg)
    timer = {"ms": []}

    def step() -> None:
        opt.backward(model(input_ids=batch, labels=batch).loss)
        t0 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        synchronize(batch.device)
        timer["ms"].append(1e3 * (time.perf_counter() - t0))

    name = f"cai-zero stage {stage} (bf16 params, fp32 master"
    name += (
        (", cpu_offload + HybridAdam" + (", CPU step overlapped" if overlap_step else "")) if offload else ""
    )
    return name + ")", model, step, timer


def measure(build: Callable, shape: ModelShape, batch, *, warmup: int, steps: int, grad_ckpt: bool, peer):
    _release()
    name = getattr(build, "__name__", "row")
    try:
        t0 = time.perf_counter()
        name, model, step, timer = build()
        print(
            f"[{name}] built in {time.perf_counter() - t0:.1f} s, {host_peak_gib():.1f} GiB host peak",
            file=sys.stderr,
            flush=True,
        )
        for _ in range(warmup):
            step()
        synchronize(batch.device)
        if timer:
            timer["ms"].clear()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            synchronize(batch.device)
            times.append(time.perf_counter() - t0)
            print(
                f"[{name}] step {len(times)}: {1e3 * times[-1]:.0f} ms, {host_peak_gib():.1f} GiB host peak",
                file=sys.stderr,
                flush=True,
            )
        sec = statistics.median(times)
        tput = Throughput.measure(
            shape, tokens=batch.numel(), seconds=sec, seq_len=batch.shape[1], grad_ckpt=grad_ckpt
        )
        row = {
            "name": name,
            "step_ms": 1e3 * sec,
            "tokens_per_s": tput.tokens_per_s,
            "mfu": tput.mfu,
            "tflops_megatron": tput.tflops_megatron,
            "tflops_simple": tput.tflops_simple,
            "peak_mem_gib": peak_memory_gib(batch.device),
            "peer_tokens_per_s": peer,
            "opt_step_ms": statistics.median(timer["ms"]) if timer and timer["ms"] else None,
        }
        del model, step
    except Exception as exc:  # one failing row must not hide the others
        traceback.print_exc()
        row = {"name": name, "error": f"{type(exc).__name__}: {exc}"[:200], "peer_tokens_per_s": peer}
    _release()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--offload", action="store_true", help="the 3B CPU-offload comparison")
    ap.add_argument("--tiny", action="store_true", help="tiny model on whatever device: a smoke test")
    ap.add_argument(
        "--no-peers", action="store_true", help="skip the peer rows (their figures: BENCHMARKS.md)"
    )
    ap.add_argument("--rows", default=None, help="comma-separated rows to run (default: all of the mode)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = True
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://127.0.0.1:{29500 + os.getpid() % 1000}",
            rank=0,
            world_size=1,
        )
    preset, batch_size, seq = ("3b", 4, 2048) if args.offload else ("1b", 8, 2048)
    if args.tiny:
        preset, batch_size, seq = "tiny", 2, 64
        args.steps, args.warmup = min(args.steps, 2), 1
    config = preset_config(preset, max_seq=seq)
    torch.manual_seed(0)
    batch = torch.randint(0, config.vocab_size, (batch_size, seq), device=device)
    grad_ckpt = args.offload
    with torch.device("meta"):
        from transformers import LlamaForCausalLM

        shape = ModelShape.of(LlamaForCausalLM(config), config)

    if args.offload:
        rows = {
            "fsdp2-offload": (
                lambda: row_fsdp2(config, batch, grad_ckpt, offload=True),
                PEERS["fsdp2_offload"],
            ),
            "zero2-offload": (lambda: row_zero(config, batch, grad_ckpt, stage=2, offload=True), None),
            "zero2-offload-overlap": (
                lambda: row_zero(config, batch, grad_ckpt, stage=2, offload=True, overlap_step=True),
                None,
            ),
            "zero2": (lambda: row_zero(config, batch, grad_ckpt, stage=2), None),
        }
    else:
        rows = {
            "eager": (lambda: row_eager(config, batch, grad_ckpt), PEERS["eager"]),
            "fsdp2": (lambda: row_fsdp2(config, batch, grad_ckpt), PEERS["fsdp2"]),
            "zero1": (lambda: row_zero(config, batch, grad_ckpt, stage=1), None),
            "zero2": (lambda: row_zero(config, batch, grad_ckpt, stage=2), None),
        }
    if args.rows:
        unknown = set(args.rows.split(",")) - rows.keys()
        if unknown:
            raise SystemExit(f"--rows: unknown {sorted(unknown)}; this mode has {list(rows)}")
        rows = {k: v for k, v in rows.items() if k in args.rows.split(",")}
    if args.no_peers:
        rows = {k: (b, p) for k, (b, p) in rows.items() if p is None}
    results = [
        measure(b, shape, batch, warmup=args.warmup, steps=args.steps, grad_ckpt=grad_ckpt, peer=p)
        for b, p in rows.values()
    ]
    report(results, args, preset, batch_size, seq, device, shape)
    dist.destroy_process_group()


def report(
    results: list[dict], args, preset: str, batch_size: int, seq: int, device: torch.device, shape
) -> None:
    base = results[0]
    ok = [r for r in results if "error" not in r]
    no_offload = next((r for r in ok if "cpu_offload" not in r["name"] and "cai-zero" in r["name"]), None)
    print(
        f"\nbench_zero: {preset} b{batch_size} s{seq} on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}"
    )
    head = f"{'configuration':<78} {'peer tok/s':>10} {'tok/s':>9} {'MFU':>6} {'TFLOPS(M/S)':>12} {'step ms':>8} {'opt ms':>7} {'vs row1':>7} {'mem GiB':>8}"
    print(head)
    print("-" * len(head))
    for r in results:
        peer = f"{r['peer_tokens_per_s']:,.0f}" if r.get("peer_tokens_per_s") else "-"
        if "error" in r:
            print(f"{r['name'][:78]:<78} {peer:>10}  FAILED: {r['error']}")
            continue
        ratio = r["tokens_per_s"] / base["tokens_per_s"] if "error" not in base else float("nan")
        opt_ms = f"{r['opt_step_ms']:.1f}" if r.get("opt_step_ms") is not None else "-"
        tfl = f"{r['tflops_megatron']:.0f}/{r['tflops_simple']:.0f}"
        print(
            f"{r['name'][:78]:<78} {peer:>10} {r['tokens_per_s']:>9,.0f} {100 * r['mfu']:>5.1f}% {tfl:>12} "
            f"{r['step_ms']:>8.1f} {opt_ms:>7} {ratio:>6.2f}x {r['peak_mem_gib']:>8.1f}"
        )
        r["ratio_vs_first_row"] = ratio
    if not args.offload and "error" not in base:
        for r in ok[1:]:
            print(f"overhead vs eager, {r['name'][:40]}: {r['step_ms'] - base['step_ms']:+.1f} ms/step")
    if args.offload and no_offload:
        fsdp2 = next((r for r in ok if r["name"].startswith("FSDP2")), None)
        peer, where = (
            (fsdp2["tokens_per_s"], "measured here") if fsdp2 else (PEERS["fsdp2_offload"], "BENCHMARKS.md")
        )
        for r in ok:
            if "cpu_offload" in r["name"]:
                print(
                    f"{r['name'][:70]}: {r['tokens_per_s'] / no_offload['tokens_per_s']:.0%} of no-offload, "
                    f"{r['tokens_per_s'] / peer:.1f}x FSDP2 offload ({peer:,.0f} tok/s, {where})"
                )
    if args.offload:
        bound = offload_bound(shape, no_offload)
        print(bound["text"])
        results.append({"name": "offload bound estimate", **{k: v for k, v in bound.items() if k != "text"}})
    out = os.environ.get("OUT")
    if out:
        path = Path(out) / ("bench_zero_offload.json" if args.offload else "bench_zero.json")
        path.write_text(
            json.dumps({"preset": preset, "batch": batch_size, "seq": seq, "rows": results}, indent=1)
        )


def offload_bound(shape: ModelShape, no_offload: dict | None) -> dict:
    """What bounds cpu_offload: bf16 gradients down and bf16 parameters up over PCIe, and the CPU Adam rate.

    Measures this host's CPU Adam (fp32 master, bf16 gradient, bf16 copy-out, all threads) on 2^26 elements.
    """
    from cai.kernels.optim import adam_update, cpu_adam_status

    n = 1 << 26
    pin = torch.cuda.is_available()
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    g = torch.randn(n, dtype=torch.bfloat16, pin_memory=pin)
    out = torch.empty(n, dtype=torch.bfloat16, pin_memory=pin)
    times = []
    for step in range(1, 5):
        t0 = time.perf_counter()
        adam_update(p, g, m, v, step=step, lr=1e-5, weight_decay=0.01, out=out)
        times.append(time.perf_counter() - t0)
    rate = n / statistics.median(times[1:])  # elements/s
    N = shape.num_params
    pcie_s = 2 * (2 * N) / 55e9  # bf16 gradients down + bf16 parameters up, at the measured 55 GB/s pinned
    adam_s = N / rate
    gpu_s = no_offload["step_ms"] / 1e3 if no_offload else float("nan")
    text = (
        f"offload bound: CPU Adam ({cpu_adam_status()[0]}, {torch.get_num_threads()} threads) {rate / 1e9:.2f} G elem/s "
        f"-> {1e3 * adam_s:.0f} ms for {N / 1e9:.2f}B params; PCIe 2 x {2 * N / 1e9:.1f} GB at 55 GB/s -> "
        f"{1e3 * pcie_s:.0f} ms; GPU step without offload {1e3 * gpu_s:.0f} ms. Without overlap a step costs about "
        f"GPU + Adam + copy-up = {1e3 * (gpu_s + adam_s + pcie_s / 2):.0f} ms; with the CPU step overlapped with "
        f"backward, about max(GPU, forward + Adam) + copy-up."
    )
    return {"text": text, "cpu_adam_elems_per_s": rate, "pcie_ms": 1e3 * pcie_s, "cpu_adam_ms": 1e3 * adam_s}


if __name__ == "__main__":
    main()
