#!/usr/bin/env python
"""Fine-tune a local Hugging Face causal LM with any cai plugin, fully or with LoRA, and save it so that
``from_pretrained`` loads it.

    python examples/finetune_hf.py --model path/to/hf_model_dir --data train.jsonl --plugin zero2
    python examples/finetune_hf.py --model path/to/config.json --lora-rank 8      # random init, LoRA
    python examples/finetune_hf.py --model tiny                                   # a built-in preset, CPU demo

``--model`` is a model directory (weights are loaded when it has them, else the model is built from its
config.json), a config.json file, or a preset name of examples/_models.py. ``--data`` is a .txt file or a
.jsonl file with a "text" field, tokenized with the model directory's tokenizer and packed into blocks of
``--max-length`` tokens; without ``--data`` the model learns the digit-reversal task of train_llama.py (token
ids 0-15) and the run ends with its exact-match accuracy. At the end rank 0 reloads what was saved with
``from_pretrained`` (peft's ``PeftModel.from_pretrained`` for an adapter) and checks that it computes the same
loss as the trained model. Launching works as in train_llama.py (spawns its own workers without torchrun).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the examples' helper modules

import torch
import torch.distributed as dist
from _digits import DigitReversal, DigitTask, collate, exact_match
from _launch import default_nproc, resolve_device, run
from _models import PRESETS, preset_config
from _perf import ModelShape, ProgressBar, Throughput, peak_memory_gib, synchronize
from _plugins import PLUGINS, PluginChoice, make_booster
from torch.utils.data import Dataset

PROBE_SEED, EVAL_SEED = 10_000_019, 20_000_003


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", required=True, help=f"HF model dir, config.json, or a preset ({', '.join(PRESETS)})"
    )
    p.add_argument("--data", default=None, help=".txt or .jsonl ('text' field); default: digit reversal")
    p.add_argument("--plugin", choices=PLUGINS, default="ddp")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"), default="auto")
    p.add_argument(
        "--lora-rank", type=int, default=0, help="0: full fine-tuning; r > 0: LoRA adapters of rank r"
    )
    p.add_argument("--lora-alpha", type=float, default=None, help="default 2 x rank")
    p.add_argument(
        "--lora-targets", default="all-linear", help="peft target_modules (comma list or all-linear)"
    )
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16, help="global batch size")
    p.add_argument("--max-length", type=int, default=512, help="block length for --data")
    p.add_argument(
        "--lr", type=float, default=None, help="default 3e-3 (digits) / 2e-5 (text); x10 with LoRA"
    )
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--save-dir", default="checkpoints/finetune_hf")
    p.add_argument("--nproc", type=int, default=None)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--eval-samples", type=int, default=128)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("-g", "--grad-ckpt", action="store_true", help="activation checkpointing")
    args = p.parse_args(argv)
    if args.lr is None:
        args.lr = (3e-3 if args.data is None else 2e-5) * (10 if args.lora_rank and args.data else 1)
    return args


class PackedText(Dataset):
    """A text corpus tokenized once and cut into ``block`` -token training sequences (labels = inputs)."""

    def __init__(self, path: str, tokenizer, block: int) -> None:
        with open(path, encoding="utf-8") as f:
            if path.endswith(".jsonl"):
                texts = [json.loads(line)["text"] for line in f if line.strip()]
            else:
                texts = [f.read()]
        ids: list[int] = []
        for text in texts:
            ids += tokenizer(text)["input_ids"] + (
                [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
            )
        if len(ids) < block:
            raise ValueError(
                f"--data {path} has {len(ids)} tokens, fewer than one block of --max-length {block}"
            )
        self.blocks = torch.tensor(ids[: len(ids) // block * block]).view(-1, block)

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def load_model(spec: str):
    """(model, config, has_weights) from a directory, a config file or a preset name."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if spec in PRESETS:
        config = preset_config(spec, max_seq=2048)
        return AutoModelForCausalLM.from_config(config), config, False
    path = Path(spec)
    if path.is_file():
        raw = json.loads(path.read_text())
        config = AutoConfig.for_model(**raw)
        return AutoModelForCausalLM.from_config(config), config, False
    weights = list(path.glob("*.safetensors")) + list(path.glob("*.bin"))
    if weights:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return model, model.config, True
    config = AutoConfig.from_pretrained(path)
    return AutoModelForCausalLM.from_config(config), config, False


def main(args: argparse.Namespace) -> None:
    from cai.mesh import launch_from_torch

    device = resolve_device(args.device)
    launch_from_torch(seed=args.seed, verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    say = print if rank == 0 else (lambda *a, **k: None)
    precision = args.precision if args.precision != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    if args.batch_size % world:
        raise ValueError(f"--batch-size {args.batch_size} must be a multiple of the world size {world}")

    model, config, has_weights = load_model(args.model)
    model.config.use_cache = False
    if args.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    shape = ModelShape.of(model, config)
    task = None
    if args.data is None:
        task = DigitTask()
        data = DigitReversal(task, num_samples=args.steps * args.batch_size, seed=args.seed)
        collate_fn = collate
    else:
        from transformers import AutoTokenizer

        data = PackedText(args.data, AutoTokenizer.from_pretrained(args.model), args.max_length)
        collate_fn = None

    choice = PluginChoice(name=args.plugin, precision=precision, max_norm=args.max_norm)
    booster = make_booster(choice)
    if args.lora_rank:
        from peft import LoraConfig

        targets = args.lora_targets if args.lora_targets == "all-linear" else args.lora_targets.split(",")
        lora = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha or 2 * args.lora_rank,
                          target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM")  # fmt: skip
        model = booster.enable_lora(model, lora_config=lora)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    loader = booster.plugin.prepare_dataloader(
        data,
        batch_size=args.batch_size // world,
        shuffle=True,
        seed=args.seed,
        drop_last=True,
        collate_fn=collate_fn,
    )
    model, optimizer, _, loader, _ = booster.boost(model, optimizer, dataloader=loader)
    say(f"cai finetune_hf: {type(model.unwrap()).__name__} {shape.num_params / 1e6:.2f}M params "
        f"({sum(p.numel() for p in trainable) / 1e6:.3g}M trainable{', LoRA r=' + str(args.lora_rank) if args.lora_rank else ''}) "
        f"| data: {args.data or 'digit reversal'} | plugin {choice.label} ({precision}) | {world} x {device.type}",
        flush=True)  # fmt: skip

    bar = ProgressBar(args.steps, enabled=rank == 0)
    clip_here = choice.name in ("ddp", "fsdp") and args.max_norm > 0
    model.train()
    loss_sum, n, tokens, step, last = torch.zeros((), device=device), 0, 0, 0, float("nan")
    t0 = time.perf_counter()
    for epoch in itertools.count():
        loader.set_epoch(epoch)
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            loss = model(**batch).loss
            booster.backward(loss, optimizer)
            if clip_here:
                optimizer.clip_grad_by_norm(args.max_norm)
            optimizer.step()
            optimizer.zero_grad()
            step, n, tokens = step + 1, n + 1, tokens + batch["input_ids"].numel()
            loss_sum += loss.detach().float()
            if step % args.log_every == 0 or step == args.steps:
                dist.all_reduce(loss_sum)
                last = float(loss_sum) / (n * world)
                synchronize(device)
                perf = Throughput.measure(shape, tokens=tokens, seconds=time.perf_counter() - t0,
                                          seq_len=batch["input_ids"].shape[1], grad_ckpt=args.grad_ckpt)  # fmt: skip
                bar.update(step, loss=last, tokens_per_s=perf.tokens_per_s * world, mfu=perf.mfu,
                           mem_gib=peak_memory_gib(device))  # fmt: skip
                loss_sum.zero_()
                n, tokens, t0 = 0, 0, time.perf_counter()
            if step == args.steps:
                break
        if step == args.steps:
            break

    probe = _probe_batch(task, data, device)
    model.eval()
    with torch.no_grad():
        trained_loss = float(model(**probe).loss.float())
    if args.lora_rank:
        booster.save_lora_as_pretrained(model, args.save_dir)
    else:
        booster.save_model(model, args.save_dir, shard=True)
    say(f"saved {'LoRA adapter' if args.lora_rank else 'model'} to {args.save_dir} after {step} steps "
        f"(final loss {last:.4f}, probe loss {trained_loss:.4f})", flush=True)  # fmt: skip
    if task is not None:
        acc = exact_match(model, task, args.eval_samples, EVAL_SEED, device)
        say(
            f"final accuracy: {100 * acc:.1f}% exact match on {args.eval_samples} held-out sequences",
            flush=True,
        )
    if rank == 0:
        _check_reload(args, has_weights, probe, trained_loss, precision)
    dist.barrier()
    dist.destroy_process_group()


def _probe_batch(task, data, device) -> dict[str, torch.Tensor]:
    if task is not None:
        return {
            k: v.to(device)
            for k, v in collate([DigitReversal(task, 16, seed=PROBE_SEED)[i] for i in range(16)]).items()
        }
    return {k: v.unsqueeze(0).to(device) for k, v in data[len(data) - 1].items()}


def _check_reload(
    args, has_weights: bool, probe: dict[str, torch.Tensor], trained_loss: float, precision: str
) -> None:
    """Load the saved files the way a user would and compare the loss on the probe batch (rank 0 only)."""
    from transformers import AutoModelForCausalLM

    if args.lora_rank:
        if not has_weights:
            print("reload check skipped: the base model was randomly initialised, so only the adapter exists")
            return
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        reloaded = PeftModel.from_pretrained(base, args.save_dir)
    else:
        reloaded = AutoModelForCausalLM.from_pretrained(args.save_dir, dtype=torch.float32)
    reloaded.to(probe["input_ids"].device).eval()
    with (
        torch.no_grad(),
        torch.autocast(probe["input_ids"].device.type, dtype=torch.bfloat16, enabled=precision == "bf16"),
    ):
        loss = float(reloaded(**probe).loss.float())
    # Low-precision training computes the trained loss in bf16/fp16; the reload recomputes it, so allow for that.
    tol = 1e-4 if precision == "fp32" else 5e-2
    verdict = "matches" if abs(loss - trained_loss) <= tol * max(1.0, abs(trained_loss)) else "DIFFERS FROM"
    print(f"reloaded with from_pretrained: probe loss {loss:.4f} ({verdict} the trained model)", flush=True)


if __name__ == "__main__":
    arguments = parse_args()
    run(main, arguments, nproc=arguments.nproc or default_nproc(arguments.device))
