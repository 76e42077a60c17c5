"""cai-shardformer tp=2 against transformers' own tensor parallel on CPU, gloo, in the same run.

Both sides load the same checkpoint (a Llama written by rank 0 with random weights), train fp32 with AdamW on the
same batches, and are timed per step (wall clock, median after warm-up), alternating step by step so that load
on the machine hits both alike:
  cai   : `LlamaForCausalLM.from_pretrained(dir)` then `cai.shardformer.shard_model(model, tp group)`: local
          tensors, explicit collectives, the loss vocab-parallel from the hidden states.
  cai-logits : the same with `parallel_output=False`: full logits gathered and the model's own loss, as hf-tp.
  torch-plan : `parallelize_module(model, mesh, cai.shardformer.tp_plan(model, mesh))`: cai's policy exported to
          torch's DTensor styles (full logits, the model's loss).
  hf-tp : `from_pretrained(dir, distributed_config=DistributedConfig(tp_size=2))`: DTensor parameters from the
          model's `base_model_tp_plan`, full logits and the model's own loss.
It also prints the first losses of both (the same weights and data: they agree), and the collectives each issues
per transformer layer in one training step, forward and backward (torch's CommDebugMode, which sees both the
`torch.distributed` calls of cai and DTensor's functional collectives; cai's also through cai-mesh's
CollectiveCounter), from a model of `--layers` layers minus the same model with one layer.

Run: cai run --standalone --nproc_per_node 2 examples/benchmarks/bench_shardformer_tp.py [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections import Counter

import torch
import torch.distributed as dist


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=704)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("-b", "--batch", type=int, default=4)
    p.add_argument("-l", "--seq", type=int, default=128)
    p.add_argument("-s", "--steps", type=int, default=10, help="timed steps")
    p.add_argument("-i", "--warmup", type=int, default=2, help="untimed steps first")
    return p.parse_args()


def _config(args, layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
    )  # fmt: skip


def _checkpoint(args, layers: int) -> str:
    """Rank 0 writes a random-weight Llama; every rank gets the directory."""
    from transformers import LlamaForCausalLM

    path = [None]
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        path[0] = tempfile.mkdtemp(prefix=f"bench_tp_L{layers}_")
        _TEMP.append(path[0])
        LlamaForCausalLM(_config(args, layers)).save_pretrained(path[0])
    dist.broadcast_object_list(path)
    return path[0]


_TEMP: list[str] = []  # rank 0's checkpoint directories, removed at the end


def _load(kind: str, path: str):
    from transformers import LlamaForCausalLM

    from cai.shardformer import shard_model

    if kind in ("cai", "cai-logits"):
        model = LlamaForCausalLM.from_pretrained(path)
        return shard_model(model, dist.group.WORLD, parallel_output=kind == "cai")
    if kind == "torch-plan":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        from cai.shardformer import tp_plan

        model = LlamaForCausalLM.from_pretrained(path)
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        return parallelize_module(model, mesh, tp_plan(model, mesh))
    from transformers.distributed import DistributedConfig

    return LlamaForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=2))


def _step(model, opt, ids) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach())


def _comm_counts(model, ids) -> tuple[Counter, Counter, Counter | None]:
    """(forward, backward) counts by op from CommDebugMode, and cai-mesh's CollectiveCounter of both."""
    from torch.distributed.tensor.debug import CommDebugMode

    from cai.mesh.testing import CollectiveCounter

    counts = []
    with CollectiveCounter() as counter:
        with CommDebugMode() as fwd:
            loss = model(input_ids=ids, labels=ids).loss
        with CommDebugMode() as bwd:
            loss.backward()
    model.zero_grad()
    for mode in (fwd, bwd):
        counts.append(Counter({str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}))
    return counts[0], counts[1], Counter((e.op, e.nbytes) for e in counter.events)


def _per_layer(args, kind: str, ids) -> dict[str, Counter]:
    out = {}
    for layers in (args.layers, 1):
        model = _load(kind, _checkpoint(args, layers))
        out[layers] = _comm_counts(model, ids)
    fwd = out[args.layers][0] - out[1][0]
    bwd = out[args.layers][1] - out[1][1]
    n = args.layers - 1
    return {
        "forward": {k: v / n for k, v in fwd.items()},
        "backward": {k: v / n for k, v in bwd.items()},
        "counter": {
            f"{op} {nbytes}B": c / n for (op, nbytes), c in (out[args.layers][2] - out[1][2]).items()
        },
    }


def main() -> None:
    args = _args()
    import transformers

    transformers.utils.logging.disable_progress_bar()
    # CommDebugMode's module tracker registers backward hooks on every module; their warnings are noise here.
    warnings.filterwarnings("ignore", message=".*(backward hook|Full backward hook).*")
    dist.init_process_group("gloo")
    if dist.get_world_size() != 2:
        raise SystemExit(f"run with 2 processes (cai run --nproc_per_node 2), not {dist.get_world_size()}")
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    path = _checkpoint(args, args.layers)
    models = {kind: _load(kind, path) for kind in ("cai", "cai-logits", "torch-plan", "hf-tp")}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    g = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {k: [] for k in models}
    first_losses = {}
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        for kind in list(models)[step % 4 :] + list(models)[: step % 4]:  # rotate the order
            dist.barrier()
            t0 = time.perf_counter()
            loss = _step(models[kind], opts[kind], ids)
            dist.barrier()
            if step >= args.warmup:
                times[kind].append(time.perf_counter() - t0)
            first_losses.setdefault(kind, loss)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    comm = {kind: _per_layer(args, kind, ids) for kind in ("cai", "torch-plan", "hf-tp")}
    if dist.get_rank() == 0:
        shape = f"h{args.hidden} L{args.layers} heads {args.heads}/{args.kv_heads} ffn {args.ffn} vocab {args.vocab}"
        print(f"Llama {shape}, b{args.batch} s{args.seq}, fp32, tp=2 gloo, {args.steps} timed steps")
        med = {k: statistics.median(v) for k, v in times.items()}
        for kind in models:
            print(
                f"  {kind:10s} step {med[kind] * 1e3:8.1f} ms (min {min(times[kind]) * 1e3:.1f})  "
                f"first loss {first_losses[kind]:.6f}"
            )
        print(
            f"  step time over hf-tp: cai {med['cai'] / med['hf-tp']:.3f}, "
            f"cai-logits {med['cai-logits'] / med['hf-tp']:.3f}, torch-plan {med['torch-plan'] / med['hf-tp']:.3f}"
        )
        for kind in comm:
            print(
                f"  {kind} collectives per layer: forward {comm[kind]['forward']}, backward {comm[kind]['backward']}"
            )
        print(f"  cai per layer by CollectiveCounter (op, bytes): {comm['cai']['counter']}")
        for path in _TEMP:
            shutil.rmtree(path, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
