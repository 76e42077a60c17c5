"""Train-step throughput of each Booster plugin against plain PyTorch on one GPU, printed as one table.

Workload (shared/BENCHMARKS.md): Hugging Face Llama 1B shape (hidden 2048, 16 layers, vocab 32000), batch 8,
sequence 2048, bf16 compute. The peer is plain PyTorch bf16 eager with fused AdamW, measured in the same run.
Each plugin keeps fp32 master weights (so it moves more bytes per step than the bf16-only peer).

Run on the GPU machine from the repository root:
    python packages/cai-booster/benchmarks/bench_plugins.py            # all configurations
    python packages/cai-booster/benchmarks/bench_plugins.py --steps 5 --layers 4   # quick check
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch
import torch.distributed as dist


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 2.6875),
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 128,
        num_key_value_heads=args.hidden // 128,
        max_position_embeddings=args.seq,
        attn_implementation="sdpa",
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def batch(args: argparse.Namespace) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(0)
    return torch.randint(0, 32000, (args.batch, args.seq), device="cuda", generator=g)


def time_steps(step, steps: int, warmup: int) -> float:
    """Median seconds per step (CUDA events) after warm-up."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def peer(args: argparse.Namespace) -> tuple[float, float]:
    model = build_model(args).to(device="cuda", dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = batch(args)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return time_steps(step, args.steps, args.warmup), torch.cuda.max_memory_allocated() / 2**30


def plugin_run(name: str, args: argparse.Namespace) -> tuple[float, float]:
    from cai.booster import Booster
    from cai.booster.plugin import GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin, TorchFSDPPlugin

    plugins = {
        "TorchDDPPlugin + bf16 autocast": lambda: (TorchDDPPlugin(), "bf16"),
        "TorchFSDPPlugin bf16": lambda: (TorchFSDPPlugin(precision="bf16"), None),
        "LowLevelZeroPlugin stage 2 bf16": lambda: (LowLevelZeroPlugin(stage=2, precision="bf16"), None),
        "GeminiPlugin bf16": lambda: (GeminiPlugin(precision="bf16"), None),
    }
    plugin, mp = plugins[name]()
    booster = Booster(plugin=plugin, mixed_precision=mp, device="cuda")
    model = build_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model, opt, *_ = booster.boost(model, opt)
    ids = batch(args)

    def step() -> None:
        booster.backward(model(input_ids=ids, labels=ids).loss, opt)
        opt.step()
        opt.zero_grad()

    return time_steps(step, args.steps, args.warmup), torch.cuda.max_memory_allocated() / 2**30


def mfu(tok_s: float, n_params: int, args: argparse.Namespace) -> float:
    flops_per_token = 6 * n_params + 12 * args.layers * args.hidden * args.seq
    return tok_s * flops_per_token / 989e12


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    n_params = sum(p.numel() for p in build_model(args).parameters())
    tokens = args.batch * args.seq

    rows = []
    peer_s, peer_mem = peer(args)
    peer_tok = tokens / peer_s
    rows.append(("plain PyTorch bf16 + fused AdamW (peer)", peer_tok, peer_tok, peer_mem))
    for name in (
        "TorchDDPPlugin + bf16 autocast",
        "TorchFSDPPlugin bf16",
        "LowLevelZeroPlugin stage 2 bf16",
        "GeminiPlugin bf16",
    ):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        try:
            s, mem = plugin_run(name, args)
            rows.append((name, peer_tok, tokens / s, mem))
        except Exception as e:  # one failing configuration must not hide the others' numbers
            print(f"{name}: failed after {time.time() - t0:.0f} s: {type(e).__name__}: {e}")
        gc.collect()
        torch.cuda.empty_cache()

    print(
        f"\nLlama h{args.hidden} L{args.layers} ({n_params / 1e9:.2f}B params), b{args.batch} s{args.seq}, "
        f"{torch.cuda.get_device_name()}, median of {args.steps} steps"
    )
    print("| configuration | peer tok/s | cai tok/s | ratio | MFU | peak GiB |")
    print("|---|---|---|---|---|---|")
    for name, peer_t, tok, mem in rows:
        print(
            f"| {name} | {peer_t:,.0f} | {tok:,.0f} | {tok / peer_t:.2f} | {mfu(tok, n_params, args):.1%} | {mem:.1f} |"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
