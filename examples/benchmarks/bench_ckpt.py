"""Checkpoint save/load throughput: cai.ckpt (sync and async) against torch.save/torch.load and
torch.distributed.checkpoint, on the same Llama-shaped state (3B by default), in the same run.

    python examples/benchmarks/bench_ckpt.py                    # 3B bf16 (~6.4 GB) on cuda when present
    python examples/benchmarks/bench_ckpt.py --size-gb 0.5      # a shrunken model for a quick local run
    python examples/benchmarks/bench_ckpt.py --dtype fp32

Tensors live on the GPU when one is present (the usual case: saving a training model) and are loaded back
into preallocated tensors there. Every file is written to --dir and read back right away, so loads come
mostly from the page cache, equally for every method. cai.ckpt's load is also timed with checksum verification
on (the default) and off, alternating on the same checkpoint, to report what verification costs. Prints a table;
JSON goes to $OUT/bench_ckpt.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import cai.ckpt as ck

LLAMA_3B = {"hidden": 3072, "intermediate": 8192, "layers": 28, "heads": 24, "kv_heads": 8, "vocab": 128256}


def llama_shapes(cfg: dict[str, int]) -> dict[str, tuple[int, ...]]:
    h, inter, hd = cfg["hidden"], cfg["intermediate"], cfg["hidden"] // cfg["heads"]
    kv = cfg["kv_heads"] * hd
    shapes = {"model.embed_tokens.weight": (cfg["vocab"], h)}
    for i in range(cfg["layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (h, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    shapes["model.norm.weight"] = (h,)  # lm_head is tied to the embedding, as in Llama 3.2 3B
    return shapes


def scaled_config(size_gb: float | None, elem: int) -> dict[str, int]:
    cfg = dict(LLAMA_3B)
    if size_gb is None:
        return cfg
    full = sum(math.prod(s) for s in llama_shapes(cfg).values()) * elem / 1e9
    f = math.sqrt(size_gb / full)  # parameters grow with hidden^2

    def r(x: int) -> int:
        return max(128, round(x * f / 128) * 128)

    cfg.update(hidden=r(cfg["hidden"]), intermediate=r(cfg["intermediate"]), vocab=r(cfg["vocab"]))
    cfg["heads"] = cfg["hidden"] // 128
    cfg["kv_heads"] = max(1, cfg["heads"] // 3)
    return cfg


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def check(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    for k in list(a)[:: max(1, len(a) // 8)]:
        if not torch.equal(a[k], b[k]):
            raise SystemExit(f"{what}: {k} differs after the round trip")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=None, help="shrink the model to about this many GB")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "bench_ckpt"))
    ap.add_argument("--repeats", type=int, default=2, help="median of this many save+load rounds per method")
    ap.add_argument("--size-per-shard", type=float, default=1024, help="cai shard size in MB")
    args = ap.parse_args()

    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    elem = torch.empty((), dtype=dtype).element_size()
    cfg = scaled_config(args.size_gb, elem)
    shapes = llama_shapes(cfg)
    gen = torch.Generator(device=device).manual_seed(0)
    state = {
        n: torch.randn(s, generator=gen, device=device, dtype=torch.float32).to(dtype)
        for n, s in shapes.items()
    }
    target = {n: torch.empty_like(t) for n, t in state.items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    params = sum(t.numel() for t in state.values())
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)

    def fresh_target() -> None:
        for t in target.values():
            t.zero_()

    methods = {}

    def torch_save() -> None:
        torch.save(state, root / "torch.pt")

    def torch_load() -> None:
        loaded = torch.load(root / "torch.pt", map_location=device, weights_only=True)
        for k, v in loaded.items():
            target[k].copy_(v)

    methods["torch.save/load"] = (torch_save, torch_load, lambda: (root / "torch.pt").unlink())
    methods["torch.distributed.checkpoint"] = (
        lambda: dcp.save(state, checkpoint_id=str(root / "dcp")),
        lambda: dcp.load(target, checkpoint_id=str(root / "dcp")),
        lambda: shutil.rmtree(root / "dcp"),
    )
    methods["cai.ckpt"] = (
        lambda: ck.save_model(state, root / "cai", size_per_shard=args.size_per_shard),
        lambda: ck.load_model(target, root / "cai"),
        lambda: shutil.rmtree(root / "cai"),
    )

    # What verification costs: loads of one checkpoint with verify on and off, alternating so that both see the
    # same page cache, each a median of --repeats + 1 rounds after one untimed load.
    ck.save_model(state, root / "cai_verify", size_per_shard=args.size_per_shard)
    verify_times: dict[bool, list[float]] = {True: [], False: []}
    ck.load_model(target, root / "cai_verify")
    for _ in range(args.repeats + 1):
        for verify in (True, False):
            fresh_target()
            verify_times[verify].append(
                timed(lambda verify=verify: ck.load_model(target, root / "cai_verify", verify=verify), device)
            )
            check(state, target, f"cai.ckpt load verify={verify}")
    shutil.rmtree(root / "cai_verify")
    verify_row = {
        "load_verify_s": statistics.median(verify_times[True]),
        "load_no_verify_s": statistics.median(verify_times[False]),
    }
    verify_row["verify_cost"] = verify_row["load_verify_s"] / verify_row["load_no_verify_s"] - 1
    print(
        f"cai.ckpt load: verify=True {verify_row['load_verify_s']:.2f} s, verify=False "
        f"{verify_row['load_no_verify_s']:.2f} s ({100 * verify_row['verify_cost']:+.1f}%)",
        flush=True,
    )

    rows = []
    for name, (save, load, clean) in methods.items():
        saves, loads = [], []
        for _ in range(args.repeats):
            saves.append(timed(save, device))
            fresh_target()
            loads.append(timed(load, device))
            check(state, target, name)
            clean()
            print(f"{name}: save {saves[-1]:.2f} s, load {loads[-1]:.2f} s", flush=True)
        rows.append({"method": name, "save_s": statistics.median(saves), "load_s": statistics.median(loads)})

    # Asynchronous saves: the caller is blocked only while the state is staged in host memory. The first save of
    # each method allocates its staging buffers, so it runs once untimed and its blocking time is reported apart.
    def cai_async() -> None:
        ck.save_model(state, root / "cai_async", size_per_shard=args.size_per_shard, use_async=True)

    def cai_async_load() -> None:
        ck.load_model(target, root / "cai_async")

    def dcp_async():
        return dcp.async_save(state, checkpoint_id=str(root / "dcp_async"))

    def dcp_async_load() -> None:
        dcp.load(target, checkpoint_id=str(root / "dcp_async"))

    asyncs = {
        "torch.distributed.checkpoint async": (
            dcp_async,
            lambda fut: fut.result(),
            dcp_async_load,
            "dcp_async",
        ),
        "cai.ckpt async": (cai_async, lambda _: ck.wait(), cai_async_load, "cai_async"),
    }
    for name, (start, finish, load, sub) in asyncs.items():
        try:
            blocking, total, first = [], [], None
            for i in range(args.repeats + 1):
                sync(device)
                t0 = time.perf_counter()
                handle = start()
                sync(device)
                b = time.perf_counter() - t0
                finish(handle)
                t = time.perf_counter() - t0
                fresh_target()
                load()
                check(state, target, name)
                shutil.rmtree(root / sub)
                print(f"{name}: blocked {b:.2f} s, committed after {t:.2f} s", flush=True)
                if i == 0:
                    first = b
                else:
                    blocking.append(b)
                    total.append(t)
        except Exception as e:  # a peer that does not run here is reported, not fatal
            print(f"{name}: failed ({e!r})")
            continue
        rows.append(
            {
                "method": name,
                "save_s": statistics.median(total),
                "load_s": None,
                "blocking_s": statistics.median(blocking),
                "first_blocking_s": first,
            }
        )
    shutil.rmtree(root, ignore_errors=True)

    dcp_row = rows[1]
    gb = nbytes / 1e9
    print(
        f"\ncheckpoint throughput: Llama-shaped {params / 1e9:.2f}B params ({cfg}), {args.dtype}, {gb:.2f} GB, "
        f"tensors on {device}, median of {args.repeats}, files in {root}"
    )
    print(
        f"{'method':<36}{'save s':>9}{'save GB/s':>11}{'vs DCP':>8}{'load s':>9}{'load GB/s':>11}{'vs DCP':>8}{'blocking s':>12}"
    )
    for r in rows:
        r["save_gbps"] = gb / r["save_s"]
        r["load_gbps"] = gb / r["load_s"] if r["load_s"] else None
        save_ratio = dcp_row["save_s"] / r["save_s"]
        load = (
            f"{r['load_s']:>9.2f}{r['load_gbps']:>11.2f}{dcp_row['load_s'] / r['load_s']:>8.2f}"
            if r["load_s"]
            else f"{'':>28}"
        )
        block = f"{r['blocking_s']:>12.3f}" if "blocking_s" in r else ""
        if "blocking_s" in r:
            r["async_blocking_vs_dcp_async"] = next(
                (x["blocking_s"] / r["blocking_s"] for x in rows if x["method"].endswith("checkpoint async")),
                None,
            )
        print(f"{r['method']:<36}{r['save_s']:>9.2f}{r['save_gbps']:>11.2f}{save_ratio:>8.2f}{load}{block}")
    print(
        "(vs DCP: speed ratio against synchronous torch.distributed.checkpoint, >1 is faster; async rows: save s "
        "is until the files are committed, blocking s is how long the caller was held once staging buffers exist; "
        "first async save blocking: "
        + ", ".join(f"{r['method']} {r['first_blocking_s']:.2f} s" for r in rows if "first_blocking_s" in r)
        + ")"
    )
    print(
        f"cai.ckpt load with checksum verification: {verify_row['load_verify_s']:.3f} s "
        f"({gb / verify_row['load_verify_s']:.2f} GB/s), without: {verify_row['load_no_verify_s']:.3f} s "
        f"({gb / verify_row['load_no_verify_s']:.2f} GB/s); ratio {1 + verify_row['verify_cost']:.3f} "
        f"(verification costs {100 * verify_row['verify_cost']:+.1f}% of the load)"
    )

    if not os.environ.get("OUT"):
        return
    out = Path(os.environ["OUT"])
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "config": cfg,
        "dtype": args.dtype,
        "device": str(device),
        "bytes": nbytes,
        "params": params,
        "rows": rows,
        "verify": verify_row,
    }
    (out / "bench_ckpt.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
