#!/usr/bin/env python
"""Whole-model effect of cai kernels: a Hugging Face Llama 1B train step with and without `patch_hf_model`.

Llama 1B from its config (h2048, i5632, L16, 16 heads, vocab 32000; random weights), batch 8 x 2048 random
tokens (labels = inputs), bf16 weights, the default (SDPA) attention, fused AdamW. Each configuration builds the same model
(same seed), runs warm-up steps, then timed steps; prints one markdown table (tokens/s, MFU, peak memory,
first-step loss, ratio to the unpatched model) and writes `$OUT/bench_llama_kernels.json` when `OUT` is set.
Rows: HF eager, cai (all kernels), one row per kernel alone, and Liger's `apply_liger_kernel_to_llama` when
`import liger_kernel` works. Under 3 minutes on an H200.

    python examples/benchmarks/bench_llama_kernels.py
    python examples/benchmarks/bench_llama_kernels.py --quick     # tiny model, a smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama

from cai.kernels import kernel_report, patch_hf_model

PEAK_FLOPS = 989e12  # dense bf16 of one H100/H200 (the MFU convention of BENCHMARKS.md)
LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                num_key_value_heads=16, vocab_size=32000)  # fmt: skip
TINY = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=1024)  # fmt: skip
ORIGINAL_ROPE = modeling_llama.apply_rotary_pos_emb

# name -> patch_hf_model flags (None: unpatched)
CONFIGS = {
    "hf eager": None,
    "cai all": dict(rms_norm=True, swiglu=True, rope=True, fused_loss=True),
    "cai fused_loss only": dict(rms_norm=False, swiglu=False, rope=False, fused_loss=True),
    "cai rms_norm only": dict(rms_norm=True, swiglu=False, rope=False, fused_loss=False),
    "cai swiglu only": dict(rms_norm=False, swiglu=True, rope=False, fused_loss=False),
    "cai rope only": dict(rms_norm=False, swiglu=False, rope=True, fused_loss=False),
}


@dataclass(kw_only=True)
class Result:
    config: str
    tokens_per_s: float | None = None
    mfu_pct: float | None = None
    peak_gib: float | None = None
    first_loss: float | None = None
    vs_hf: float | None = None
    note: str = ""


def build(cfg: dict, seq: int) -> LlamaForCausalLM:
    config = LlamaConfig(**cfg, max_position_embeddings=max(seq, 2048), tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16).train()


def run(name: str, flags, args, cfg) -> Result:
    res = Result(config=name)
    modeling_llama.apply_rotary_pos_emb = (
        ORIGINAL_ROPE  # the rotary patch is module-level: undo it between rows
    )
    if name == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()
    model = build(cfg, args.seq)
    if flags is not None:
        patch_hf_model(model, **flags)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, cfg["vocab_size"], (args.batch, args.seq), device="cuda", generator=gen)
               for _ in range(2)]  # fmt: skip
    times = []
    for step in range(args.warmup + args.steps):
        ids = batches[step % 2]
        if step == args.warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 0:
            res.first_loss = loss.item()
        torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    tokens = args.batch * args.seq
    res.tokens_per_s = tokens / statistics.median(times)
    flops_per_token = 6 * n_params + 12 * cfg["num_hidden_layers"] * cfg["hidden_size"] * args.seq
    res.mfu_pct = 100 * res.tokens_per_s * flops_per_token / PEAK_FLOPS
    res.peak_gib = torch.cuda.max_memory_allocated() / 2**30
    del model, opt, batches, loss
    gc.collect()
    torch.cuda.empty_cache()
    return res


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny model and batch (smoke test)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_llama_kernels.py needs a CUDA device")
    cfg = TINY if args.quick else LLAMA_1B
    if args.quick:
        args.batch, args.seq = 2, 256
    for name, impl, why in kernel_report():
        print(f"{name}: {impl} ({why})", file=sys.stderr)
    configs = dict(CONFIGS)
    try:
        import liger_kernel  # noqa: F401

        configs["liger"] = None  # last: it patches the Llama classes for the rest of the process
    except Exception:
        pass
    results = []
    for name, flags in configs.items():
        print(f"running {name}", file=sys.stderr, flush=True)
        try:
            results.append(run(name, flags, args, cfg))
        except Exception as exc:  # keep the other rows
            note = f"error: {type(exc).__name__}: {' '.join(str(exc).split())[:100]}"
            results.append(Result(config=name, note=note))
            gc.collect()
            torch.cuda.empty_cache()
    base = results[0].tokens_per_s
    for r in results:
        if base and r.tokens_per_s:
            r.vs_hf = r.tokens_per_s / base
    shape = f"Llama {'tiny' if args.quick else '1B'} b{args.batch} s{args.seq} bf16, fused AdamW"
    print(f"\n{shape} on {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| config | tokens/s | MFU % | peak GiB | first-step loss | x hf eager | note |")
    print("|---|---|---|---|---|---|---|")

    def f(x, spec):
        return "-" if x is None else format(x, spec)

    for r in results:
        print(f"| {r.config} | {f(r.tokens_per_s, ',.0f')} | {f(r.mfu_pct, '.1f')} | {f(r.peak_gib, '.1f')} | "
              f"{f(r.first_loss, '.4f')} | {f(r.vs_hf, '.3f')} | {r.note} |")  # fmt: skip
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "bench_llama_kernels.json")
        with open(path, "w") as fh:
            json.dump({"shape": shape, "rows": [asdict(r) for r in results]}, fh, indent=1)
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
