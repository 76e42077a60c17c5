#!/usr/bin/env python
"""cai-kernels' paged decode attention against the bandwidth bound and torch SDPA over a dense (unpaged) cache.

Decode shapes of the Llama-3-8B attention (32 query heads, 8 kv heads, head dim 128, bf16, 16-token blocks
scattered over the pool) for one layer: every call is replayed from a CUDA graph (how the engine runs decode
steps, so host time is left out) and timed as the median of `triton.testing.do_bench`. The bound is the K/V bytes
read over the device copy bandwidth measured in the same run; SDPA (`enable_gqa`, its fastest backend) reads the
same K/V from one contiguous tensor per batch, the layout a paged cache gives up. `--sweep` times tile width, warps,
pipeline stages and split counts per shape and prints the best, which is how the static choices were made.

    python examples/benchmarks/bench_paged_attention.py                  # the default shapes, < 1 minute
    python examples/benchmarks/bench_paged_attention.py --sweep
    python examples/benchmarks/bench_paged_attention.py --shapes 1x8192,256x1024
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import torch.nn.functional as F
import triton.testing

from cai.kernels import paged_attention
from cai.kernels._paged_attention import _auto_splits, _paged_attention_triton

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16


def copy_bandwidth_gbps() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    ms = triton.testing.do_bench(lambda: x.clone(), rep=200)
    return 2 * x.numel() / ms / 1e6


def graphed_ms(fn) -> float:
    fn()  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, rep=200)


def decode_inputs(batch: int, ctx: int, gen: torch.Generator) -> dict:
    blocks_per_seq = -(-ctx // PAGE)
    num_blocks = batch * blocks_per_seq
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm.view(batch, blocks_per_seq).to(torch.int32).cuda()
    k_cache = torch.randn(num_blocks * PAGE, KV_HEADS, HEAD_DIM, generator=gen).to("cuda", torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    # (1, heads, T, hd) -> (T, heads, hd), the layout transformers' attention hands the engine
    query = (
        torch.randn(1, HEADS, batch, HEAD_DIM, generator=gen).to("cuda", torch.bfloat16)[0].transpose(0, 1)
    )
    kwargs = dict(
        block_tables=tables, query_start=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        num_computed=torch.full((batch,), ctx - 1, dtype=torch.int32, device="cuda"), block_size=PAGE,
        max_query_len=1, max_context_len=ctx, scaling=HEAD_DIM**-0.5,
    )  # fmt: skip
    return dict(query=query, k_cache=k_cache, v_cache=v_cache, kwargs=kwargs, tables=tables)


def dense_reference(inp: dict, batch: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    slots = (inp["tables"].long()[:, :, None] * PAGE + torch.arange(PAGE, device="cuda")).view(batch, -1)[
        :, :ctx
    ]
    k = inp["k_cache"][slots].transpose(1, 2).contiguous()  # (B, kv_heads, ctx, hd)
    v = inp["v_cache"][slots].transpose(1, 2).contiguous()
    q = inp["query"].unsqueeze(2).contiguous()  # (B, heads, 1, hd)
    return q, k, v


def sweep(inp: dict, batch: int, ctx: int) -> list[tuple[float, dict]]:
    base = _auto_splits(inp["query"], batch * KV_HEADS, 1, ctx)
    splits = sorted({max(1, base // 2), base, min(16, base * 2), min(16, base * 4)})
    found = []
    for block_n, warps, stages, split in itertools.product((32, 64, 128), (4, 8), (2, 3), splits):
        cfg = dict(block_n=block_n, num_warps=warps, stages=stages, num_splits=split)
        kw = inp["kwargs"]

        def run(cfg=cfg, kw=kw):
            _paged_attention_triton(
                inp["query"], inp["k_cache"], inp["v_cache"], kw["block_tables"], kw["query_start"],
                kw["num_computed"], PAGE, 1, ctx, kw["scaling"], None, None, cfg["num_splits"],
                block_n=cfg["block_n"], num_warps=cfg["num_warps"], stages=cfg["stages"],
            )  # fmt: skip

        try:
            found.append((graphed_ms(run), cfg))
        except Exception as exc:  # e.g. a tile that needs more shared memory than the device has
            print(f"  {cfg}: {type(exc).__name__}")
    return sorted(found, key=lambda r: r[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--shapes", default="1x1024,1x4096,8x2048,64x1024,256x640,256x2048", help="BATCHxCONTEXT,..."
    )
    p.add_argument("--sweep", action="store_true", help="time launch parameters per shape and print the best")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_paged_attention.py needs a CUDA GPU")
    gen = torch.Generator().manual_seed(0)
    gbps = copy_bandwidth_gbps()
    print(f"copy bandwidth {gbps:,.0f} GB/s; {HEADS} heads, {KV_HEADS} kv heads, head dim {HEAD_DIM}, bf16")
    print(
        "| batch x context | K/V MB | cai us | cai GB/s | % of copy | SDPA dense us | cai / SDPA time | max err |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for shape in args.shapes.split(","):
        batch, ctx = (int(x) for x in shape.split("x"))
        inp = decode_inputs(batch, ctx, gen)
        kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2
        got = paged_attention(inp["query"], inp["k_cache"], inp["v_cache"], **inp["kwargs"])
        q, k, v = dense_reference(inp, batch, ctx)
        want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True).squeeze(2)
        err = (got.float() - want.float()).abs().max().item()
        ms = graphed_ms(
            lambda inp=inp: paged_attention(inp["query"], inp["k_cache"], inp["v_cache"], **inp["kwargs"])
        )
        sdpa_ms = graphed_ms(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        row = dict(
            batch=batch, context=ctx, kv_mb=kv_bytes / 1e6, cai_us=ms * 1e3, cai_gbps=kv_bytes / ms / 1e6,
            sdpa_us=sdpa_ms * 1e3, max_err=err,
        )  # fmt: skip
        print(
            f"| {batch} x {ctx} | {row['kv_mb']:.1f} | {row['cai_us']:.1f} | {row['cai_gbps']:,.0f} | "
            f"{100 * row['cai_gbps'] / gbps:.0f} | {row['sdpa_us']:.1f} | {ms / sdpa_ms:.2f} | {err:.1e} |"
        )
        if args.sweep:
            best = sweep(inp, batch, ctx)
            row["sweep"] = [dict(us=t * 1e3, **cfg) for t, cfg in best[:5]]
            for t, cfg in best[:5]:
                print(f"  sweep {batch} x {ctx}: {t * 1e3:.1f} us {cfg}")
        rows.append(row)
        del inp, q, k, v
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_paged_attention.json"), "w") as f:
            json.dump({"copy_gbps": gbps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
