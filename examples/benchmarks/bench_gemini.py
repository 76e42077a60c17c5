"""cai-gemini against FSDP2 at world size 1: no offload, optimizer offload, and the largest model on a 24 GiB budget.

    python examples/benchmarks/bench_gemini.py --mode nooffload     # one H200; each mode < 5 minutes
    python examples/benchmarks/bench_gemini.py --mode offload
    python examples/benchmarks/bench_gemini.py --mode largest
    python examples/benchmarks/bench_gemini.py --mode all           # the three in one table (~12 minutes)
    python examples/benchmarks/bench_gemini.py --mode all --tiny    # CPU smoke run of every row

Every row runs in its own subprocess, so peaks (device: torch.cuda.max_memory_allocated; host: peak RSS) belong to
that row alone and one failing row does not lose the table. The planner's predicted peaks are printed beside the
measured ones. JSON goes to $OUT/bench_gemini_<mode>.json when OUT is set.

Model: a Hugging Face Llama of the 3B shape (h3072, L28, heads 24, kv 8, ffn 8192, vocab 128256), b4 s2048, bf16,
activation checkpointing (non-reentrant). FSDP2 keeps fp32 parameters with bf16 compute (MixedPrecisionPolicy), as
in BENCHMARKS.md; cai-gemini keeps bf16 chunks with fp32 master weights.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples' shared helpers
from _perf import host_peak_gib

GiB = 1024**3
PEAK_FLOPS = 989e12  # H200 bf16 dense, the convention of BENCHMARKS.md
LR = 1e-5


@dataclass(frozen=True, kw_only=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int


SHAPE_3B = Shape(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192, vocab=128256)
SHAPE_TINY = Shape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=256)
PEERS = {  # BENCHMARKS.md, the same H200
    "fsdp2": 14.3e3,
    "fsdp2-cpu-offload": 1.6e3,
}


@dataclass(frozen=True, kw_only=True)
class Row:
    name: str
    system: str  # "fsdp2" or "gemini"
    offload: str  # "none", "optim", "optim+param", "cpu-offload-policy"
    shape: Shape
    batch: int
    seq: int
    budget_gib: float | None = None  # torch.cuda.set_per_process_memory_fraction budget
    optim_frac: float = 1.0  # offload_optim_frac of the "optim" rows


def _llama(shape: Shape, seq: int, dtype: torch.dtype, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.ffn,
        vocab_size=shape.vocab,
        max_position_embeddings=max(seq, 2048),
        use_cache=False,
    )
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build directly in the storage precision: no fp32 copy of a 7B model
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _n_params(shape: Shape) -> int:
    h, kv = shape.hidden, shape.hidden * shape.kv_heads // shape.heads
    layer = 2 * h * h + 2 * h * kv + 3 * h * shape.ffn + 2 * h
    return shape.layers * layer + 2 * shape.vocab * h + h


def _flops_per_token(shape: Shape, seq: int) -> float:
    return 6 * _n_params(shape) + 12 * shape.layers * shape.hidden * seq


def _megatron_tflops_per_step(shape: Shape, batch: int, seq: int) -> float:
    # Megatron-LM's count with full recomputation (96 instead of 72)
    h, L, V = shape.hidden, shape.layers, shape.vocab
    return 96 * batch * seq * L * h * h * (1 + seq / (6 * h) + V / (16 * L * h)) / 1e12


def _init_dist(device: str) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)


def _plan(row: Row, model) -> dict:
    from cai.gemini import TransformerShape, plan

    shape = TransformerShape(
        hidden=row.shape.hidden,
        layers=row.shape.layers,
        ffn=row.shape.ffn,
        vocab=row.shape.vocab,
        heads=row.shape.heads,
        kv_heads=row.shape.kv_heads,
    )
    if row.optim_frac != 1.0:
        return {}  # the planner's rows are the whole-or-nothing placements
    budget = int((row.budget_gib or 141) * GiB)
    p = plan(model, row.batch, row.seq, budget, host_budget_bytes=120 * GiB, shape=shape)
    name = {
        "none": "no offload",
        "optim": "optimizer on host",
        "optim+param": "optimizer+params on host",
    }.get(row.offload)
    if name is None:
        return {}
    r = p.row(name)
    return {"pred_device_gib": r.device_bytes / GiB, "pred_host_gib": r.host_bytes / GiB}


def run_row(row: Row, steps: int, warmup: int) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and row.budget_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, row.budget_gib * GiB / total))
    torch.manual_seed(0)
    ids = torch.randint(0, row.shape.vocab, (row.batch, row.seq), device=device)
    result: dict = {}
    optimizer_s: list[float] = []
    if row.system == "fsdp2":
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        _init_dist(device)
        offload = row.offload == "cpu-offload-policy"
        model = _llama(row.shape, row.seq, torch.float32, "cpu" if offload or device == "cpu" else device)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kw = {"mp_policy": mp, **({"offload_policy": CPUOffloadPolicy()} if offload else {})}
        for layer in model.model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=device == "cuda" and not offload)

        def step() -> None:
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    else:
        from cai.gemini import ChunkConfig, GeminiConfig, shard
        from cai.kernels.optim import HybridAdam

        t_build = time.perf_counter()
        model = _llama(row.shape, row.seq, torch.bfloat16, device)  # a CPU init of 3B+ weights takes minutes
        print(f"[{row.name}] built in {time.perf_counter() - t_build:.1f} s", file=sys.stderr, flush=True)
        result.update(_plan(row, model))
        cfg = GeminiConfig(
            precision="bf16",
            offload_optim_frac=row.optim_frac if "optim" in row.offload else 0.0,
            offload_param_frac=1.0 if "param" in row.offload else 0.0,
            chunk=ChunkConfig(
                hidden_dim=row.shape.hidden, min_chunk_size_m=32 if row.shape.hidden > 256 else 0.01
            ),
            max_prefetch=2,
            overlap_host_step="optim"
            in row.offload,  # CPU Adam of each chunk runs during the rest of backward
        )
        memory = None
        if device == "cuda":
            from cai.gemini import CudaMemoryTracker

            cap = int(row.budget_gib * GiB) if row.budget_gib else None
            memory = CudaMemoryTracker(torch.device("cuda", 0), capacity=cap)
        t0 = time.perf_counter()
        model, optimizer = shard(model, HybridAdam(model.parameters(), lr=LR), config=cfg, memory=memory)
        result["shard_s"] = time.perf_counter() - t0
        print(f"[{row.name}] sharded in {result['shard_s']:.1f} s", file=sys.stderr, flush=True)
        result["chunk"] = str(model.chunk_manager.search)

        def step() -> None:
            loss = model(input_ids=ids, labels=ids).loss
            optimizer.backward(loss)
            t0 = time.perf_counter()
            optimizer.step()  # with the host step overlapped: the wait for the host updates still running
            optimizer_s.append(time.perf_counter() - t0)
            optimizer.zero_grad()

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(warmup):
        step()
    sync()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    optimizer_s.clear()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    dt = (time.perf_counter() - t0) / steps
    tps = row.batch * row.seq / dt
    result.update(
        tokens_per_s=tps,
        step_s=dt,
        mfu=tps * _flops_per_token(row.shape, row.seq) / PEAK_FLOPS,
        tflops_megatron=_megatron_tflops_per_step(row.shape, row.batch, row.seq) / dt,
        tflops_8n=tps * 8 * _n_params(row.shape) / 1e12,
        device_peak_gib=(torch.cuda.max_memory_allocated() / GiB) if device == "cuda" else 0.0,
        host_peak_gib=host_peak_gib(),
        params_b=_n_params(row.shape) / 1e9,
        optimizer_step_s=sum(optimizer_s) / len(optimizer_s) if optimizer_s else None,
    )
    return result


def largest_shape(budget_gib: float, host_gib: float, batch: int, seq: int) -> tuple[Shape, str]:
    """The most layers of the Llama-8B width that the planner fits on the budget (optimizer on the host)."""
    from cai.gemini import TransformerShape, plan

    best: tuple[Shape, str] | None = None
    for layers in range(24, 41):
        shape = Shape(hidden=4096, layers=layers, heads=32, kv_heads=8, ffn=14336, vocab=128256)
        ts = TransformerShape(hidden=4096, layers=layers, ffn=14336, vocab=128256, heads=32, kv_heads=8)
        with torch.device("meta"):
            model = _llama(shape, seq, torch.bfloat16, "meta")
        # the same chunk search as the run itself (ChunkConfig(hidden_dim=4096)), so padding is predicted too
        p = plan(model, batch, seq, int(budget_gib * GiB), host_budget_bytes=int(host_gib * GiB), shape=ts)
        fit = next((r for r in p.rows if r.fits and r.name != "no offload"), None)
        if fit is None:
            break
        best = (shape, "optim+param" if "params" in fit.name else "optim")
    if best is None:
        raise SystemExit("largest: nothing fits the budget")
    return best


def rows_for(mode: str, tiny: bool) -> list[Row]:
    shape, b, s = (SHAPE_TINY, 2, 64) if tiny else (SHAPE_3B, 4, 2048)
    rows: list[Row] = []

    def row(name: str, system: str, offload: str, **kw) -> Row:
        return Row(name=name, system=system, offload=offload, shape=shape, batch=b, seq=s, **kw)

    if mode in ("nooffload", "all"):
        rows += [row("fsdp2", "fsdp2", "none"), row("gemini", "gemini", "none")]
    if mode in ("offload", "all"):
        rows += [
            row("fsdp2-cpu-offload", "fsdp2", "cpu-offload-policy"),
            row("gemini-offload-optim", "gemini", "optim"),
            # three quarters of the optimizer on the host (the last chunks), the rest updated on the device
            row("gemini-offload-optim-0.75", "gemini", "optim", optim_frac=0.75),
        ]
    if mode in ("largest", "all"):
        if tiny:
            big, off = Shape(hidden=128, layers=3, heads=4, kv_heads=2, ffn=256, vocab=512), "optim+param"
        else:
            # plan against 110 of the 120 GiB of host memory allowed: a margin for what the planner does not see
            big, off = largest_shape(24, 110, 1, 2048)
        rows += [
            Row(
                name=f"gemini-largest-{off}",
                system="gemini",
                offload=off,
                shape=big,
                batch=1,
                seq=s,
                budget_gib=24,
            )
        ]
    return rows


def _print(table: list[dict]) -> None:
    cols = ["row", "params_b", "tokens_per_s", "step_s", "optimizer_step_s", "peer_tok_s", "ratio", "vs_gemini_nooffload", "mfu", "tflops_megatron", "tflops_8n",
            "device_peak_gib", "pred_device_gib", "host_peak_gib", "pred_host_gib", "error"]  # fmt: skip
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in table:
        cells = []
        for c in cols:
            v = r.get(c, "")
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v)[:80])
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["nooffload", "offload", "largest", "all"], default="all")
    ap.add_argument("--tiny", action="store_true", help="tiny model, CPU is fine: a smoke run of every row")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--rows", default=None, help="comma-separated row names to run (default: all of the mode)"
    )
    ap.add_argument("--row", default=None, help=argparse.SUPPRESS)  # internal: run one row, print JSON
    args = ap.parse_args()
    steps = args.steps or (2 if args.tiny else 5)
    if args.row:
        row_d = json.loads(args.row)
        row_d["shape"] = Shape(**row_d["shape"])
        print("ROW_RESULT " + json.dumps(run_row(Row(**row_d), steps, args.warmup)), flush=True)
        return
    table = []
    wanted = set(args.rows.split(",")) if args.rows else None
    for row in rows_for(args.mode, args.tiny):
        if wanted is not None and row.name not in wanted:
            continue
        cmd = [
            sys.executable,
            __file__,
            "--row",
            json.dumps(asdict(row)),
            "--steps",
            str(steps),
            "--warmup",
            str(args.warmup),
        ]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=1800)  # progress on stderr
        out = {"row": row.name, "wall_s": time.perf_counter() - t0}
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROW_RESULT ")]
        if lines:
            out.update(json.loads(lines[-1][len("ROW_RESULT ") :]))
        else:
            out["error"] = f"row process exited with code {proc.returncode} (its output is above)"
        # the peer of each cai row: measured in this run when its row ran, else the figure of BENCHMARKS.md
        peer_row = {"gemini": "fsdp2"}.get(
            row.name, "fsdp2-cpu-offload" if "offload-optim" in row.name else None
        )
        if peer_row and "tokens_per_s" in out:
            measured = next((t.get("tokens_per_s") for t in table if t["row"] == peer_row), None)
            out["peer_tok_s"] = measured or PEERS[peer_row]
            out["ratio"] = out["tokens_per_s"] / out["peer_tok_s"]
        if row.name.startswith("gemini-offload-optim"):
            base = next((t.get("tokens_per_s") for t in table if t["row"] == "gemini"), None)
            out["vs_gemini_nooffload"] = out.get("tokens_per_s", 0.0) / base if base else None
        table.append(out)
        print(json.dumps(out), flush=True)
    _print(table)
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], f"bench_gemini_{args.mode}{'_tiny' if args.tiny else ''}.json")
        with open(path, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
