"""A Mixtral-shape model on one GPU: MoeHybridParallelPlugin(ep_size=1), whose experts run as cai-kernels' grouped
GEMM, against the plain transformers model (its own loop over experts), both with torch's fused AdamW, bf16
compute with fp32 master weights, in the same process and alternating rounds.

    python examples/benchmarks/bench_moe_model.py                       # one H200: 8 experts top-2, L8, h4096
    python examples/benchmarks/bench_moe_model.py --device cpu --hidden 64 --ffn 64 --layers 2 -b 2 -l 32 -s 2 -i 1

Prints one table: configuration, tokens/s, ratio to the peer, peak memory. Tokens/s counts the global batch;
the active parameters per token (attention, router, 2 of 8 experts, embeddings) give the model FLOP/s column
(6 N_active + 12 L h s per token, over the measured step time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import transformers

from cai.mesh import launch_from_torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument(
        "--ffn", type=int, default=4096, help="expert FFN size (the model must fit with Adam in fp32)"
    )
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("-b", "--batch-size", type=int, default=4)
    p.add_argument("-l", "--max-length", type=int, default=2048)
    p.add_argument("-s", "--steps", type=int, default=8, help="timed steps per round")
    p.add_argument("-i", "--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="peer, cai, peer, cai, ...")
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    return p.parse_args()


def config_of(args: argparse.Namespace) -> transformers.MixtralConfig:
    heads = max(1, args.hidden // 128)
    return transformers.MixtralConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), num_local_experts=args.experts,
        num_experts_per_tok=args.top_k, max_position_embeddings=args.max_length, output_router_logits=True,
        use_cache=False, tie_word_embeddings=False,
    )  # fmt: skip


def active_params(cfg: transformers.MixtralConfig) -> int:
    h, f, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    attention = 2 * h * h + 2 * h * kv
    experts = cfg.num_experts_per_tok * 3 * h * f
    router = h * cfg.num_local_experts
    return layers * (attention + experts + router) + 2 * cfg.vocab_size * h


def build(cfg, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.MixtralForCausalLM(cfg)


def peer(cfg, device: torch.device, batch: dict, experts: str = "eager", pure: bool = False):
    """transformers' model with fused AdamW: fp32 parameters with bf16 autocast (what a plain PyTorch user writes),
    or with ``pure`` bf16 parameters and no master copy; ``experts`` is transformers' experts implementation
    (``"eager"``: its loop over experts; ``"grouped_mm"``: torch._grouped_mm, which needs bf16 weights)."""
    model = build(cfg, device)
    model.config._experts_implementation = experts
    if pure:
        model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")

    def step() -> float:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, (model, opt)


def cai(cfg, device: torch.device, batch: dict):
    from cai.booster import Booster
    from cai.booster.plugin import MoeHybridParallelPlugin

    model = build(cfg, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    plugin = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=1, zero_stage=2, precision="bf16")
    booster = Booster(plugin=plugin, device=device.type)
    model, opt, *_ = booster.boost(model, opt)

    def step() -> float:
        loss = model(**batch).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step, (model, opt)


def timed(step, args, device: torch.device) -> list[float]:
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29531"), ("RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):  # fmt: skip
        os.environ.setdefault(key, value)  # one process without a launcher
    launch_from_torch(seed=0)
    cfg = config_of(args)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, cfg.vocab_size, (args.batch_size, args.max_length), generator=g).to(device)
    batch = {"input_ids": ids, "labels": ids}
    n_total = sum(p.numel() for p in build(cfg, torch.device("meta")).parameters())
    n_active = active_params(cfg)
    tokens = args.batch_size * args.max_length
    flops = tokens * (6 * n_active + 12 * cfg.num_hidden_layers * cfg.hidden_size * args.max_length)
    print(
        f"Mixtral shape: {n_total / 1e9:.2f}B parameters ({n_active / 1e9:.2f}B active per token), {cfg.num_local_experts}"
        f" experts top-{cfg.num_experts_per_tok}, L{cfg.num_hidden_layers} h{cfg.hidden_size} ffn{cfg.intermediate_size},"
        f" b{args.batch_size} s{args.max_length}, bf16 compute, fp32 masters, fused AdamW, {device}",
        flush=True,
    )
    runs = {
        "peer": peer,
        "peer-grouped-pure": lambda c, d, b: peer(c, d, b, experts="grouped_mm", pure=True),
        "cai": cai,
    }
    labels = {
        "peer": "transformers Mixtral (eager experts loop), fp32 params + autocast bf16, fused AdamW",
        "peer-grouped-pure": "transformers Mixtral (grouped_mm experts), bf16 params, no fp32 master, fused AdamW",
        "cai": "MoeHybridParallelPlugin(ep_size=1), grouped GEMM experts, bf16 + fp32 masters, fused AdamW",
    }
    results: dict[str, list[float]] = {name: [] for name in runs}
    peaks: dict[str, float] = {}
    for r in range(args.rounds):
        for name, make in runs.items():
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            step, keep = make(cfg, device, batch)
            times = timed(step, args, device)
            results[name] += times
            if device.type == "cuda":
                peaks[name] = max(peaks.get(name, 0.0), torch.cuda.max_memory_allocated(device) / 2**30)
            print(f"round {r + 1}: {name} median step {statistics.median(times) * 1e3:.1f} ms", flush=True)
            del step, keep
    rows = []
    base = statistics.median(results["peer"])
    for name, label in labels.items():
        t = statistics.median(results[name])
        rows.append((label, tokens / t, base / t, flops / t / 1e12, peaks.get(name, float("nan"))))
    print("\n| configuration | tok/s | ratio to peer | model TFLOP/s | peak GiB |\n|---|---|---|---|---|")
    for label, tps, ratio, tflops, peak in rows:
        print(f"| {label} | {tps:,.0f} | {ratio:.3f} | {tflops:.0f} | {peak:.1f} |")


if __name__ == "__main__":
    main()
