#!/usr/bin/env python
"""Train a small Llama to reverse digit sequences with any cai plugin, checkpoint it, resume, and test it.

Quick start (CPU, two gloo processes, about two minutes)::

    python examples/train_llama.py

On GPUs (one process per GPU, NCCL, bf16)::

    cai run --nproc_per_node 8 examples/train_llama.py --plugin zero2 --steps 2000 --batch-size 256

Tensor x pipeline (x sequence) x data parallelism with ZeRO-1 (CPU: tp x pp x sp gloo processes, here 4)::

    python examples/train_llama.py --plugin hybrid --tp 2 --pp 2

The model is built from a ``LlamaConfig`` (hidden 128, 4 layers, ~0.66M parameters) and the data is generated on
the fly (``<bos> 3 1 4 <sep> 4 1 3 <eos>``, loss on the answer only: the mean over every answer token of the
global batch, through ``Booster.num_items_in_batch``), so nothing is downloaded. The run trains
``--steps`` steps, saves a checkpoint at ``--save-at`` (default halfway), rebuilds the model and optimizer from
scratch, loads the checkpoint and continues (the probe loss before saving and after loading must agree), and
ends with exact-match accuracy by greedy decoding on held-out sequences.

Without a launcher (no ``RANK``/``WORLD_SIZE`` in the environment) it spawns ``--nproc`` workers itself; under
``torchrun`` or ``cai run`` it uses theirs.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the examples' helper modules

import torch
import torch.distributed as dist
from _digits import BOS, EOS, PAD, VOCAB_SIZE, DigitReversal, DigitTask, collate, exact_match
from _launch import default_nproc, launched_externally, resolve_device, run
from _models import digit_llama_config
from _perf import ModelShape, ProgressBar, Throughput, peak_memory_gib, synchronize
from _plugins import (
    FP8_RECIPES,
    PLUGINS,
    SP_MODES,
    HybridLayout,
    PluginChoice,
    check_fp8,
    convert_fp8_before_boost,
    make_booster,
)

PROBE_SEED, EVAL_SEED = 10_000_019, 20_000_003  # held-out data: far from the training seeds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument(
        "--plugin",
        choices=PLUGINS,
        default="zero2",
        help="parallel strategy (default zero2: LowLevelZero stage 2)",
    )
    p.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16", "fp16"),
        default="auto",
        help="auto: bf16 on GPU, fp32 on CPU",
    )
    p.add_argument("--steps", type=int, default=400, help="optimizer steps in all (default 400)")
    p.add_argument("--batch-size", type=int, default=32, help="global batch size in sequences (default 32)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30, help="linear warm-up steps, then linear decay to 5%%")
    p.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping; 0 turns it off")
    p.add_argument("--ckpt-dir", default="checkpoints/train_llama", help="where the checkpoint goes")
    p.add_argument(
        "--save-at",
        type=int,
        default=None,
        help="step at which to save, rebuild and resume (default steps/2; 0: never save)",
    )
    p.add_argument("--resume", default=None, help="start from this checkpoint directory")
    p.add_argument("--nproc", type=int, default=None, help="workers to spawn without a launcher (2 on CPU)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--min-digits", type=int, default=4)
    p.add_argument("--max-digits", type=int, default=8)
    p.add_argument("--eval-samples", type=int, default=256)
    p.add_argument(
        "--kernels",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="swap in cai's fused kernels (cai.kernels.patch_hf_model)",
    )
    p.add_argument("-g", "--grad-ckpt", action="store_true", help="activation checkpointing")
    p.add_argument(
        "--fp8",
        action="store_true",
        help="FP8 linear layers (use_fp8=True; zero1, zero2, gemini and hybrid; matmuls on FP8 tensor cores from "
        "compute capability 8.9, emulated elsewhere)",
    )
    p.add_argument(
        "--fp8-recipe",
        choices=FP8_RECIPES,
        default=FP8_RECIPES[0],
        help="with --fp8: one scale per tensor (the plugins' default) or per row (cai.kernels.convert_to_fp8)",
    )
    p.add_argument("--log-every", type=int, default=10)
    hybrid = p.add_argument_group("--plugin hybrid (HybridParallelPlugin; dp = world / (tp x pp x sp))")
    hybrid.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default 1)")
    hybrid.add_argument("--pp", type=int, default=None, help="pipeline stages, 1F1B schedule (default 1)")
    hybrid.add_argument("--sp", type=int, default=None, help="sequence-parallel axis size (default 1)")
    hybrid.add_argument(
        "--sp-mode",
        choices=SP_MODES,
        default=None,
        help="sequence parallelism: split_gather/ring over the tp group, all_to_all/ring_attn over --sp "
        "(default all_to_all when --sp > 1, else off)",
    )
    hybrid.add_argument(
        "--zero-stage",
        type=int,
        default=None,
        help="ZeRO stage over dp: 0, 1 or 2 (default 1; 2 needs --pp 1)",
    )
    hybrid.add_argument(
        "--microbatches", type=int, default=None, help="micro-batches per batch with --pp > 1 (default 4)"
    )
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1:
        p.error(f"--steps {args.steps} and --batch-size {args.batch_size} must be >= 1")
    if args.save_at is None:
        args.save_at = args.steps // 2
    if not 0 <= args.save_at <= args.steps:
        p.error(f"--save-at {args.save_at} must be in [0, --steps {args.steps}]")
    try:
        if args.fp8:
            check_fp8(args.plugin, args.fp8_recipe)
        elif args.fp8_recipe != FP8_RECIPES[0]:
            raise ValueError(f"--fp8-recipe {args.fp8_recipe} needs --fp8")
        args.layout = hybrid_layout(args)
        args.world = world_size(args)
        dp = args.layout.dp_size(args.world) if args.layout else args.world
        if args.batch_size % dp:
            raise ValueError(
                f"--batch-size {args.batch_size} must be a multiple of the data-parallel size {dp} "
                f"(world {args.world}"
                + (f" / tp x pp x sp {args.layout.model_parallel})" if args.layout else ")")
            )
        if args.layout:
            args.layout.check_model(heads=args.heads, kv_heads=args.heads, layers=args.layers)
            args.layout.check_batch(args.batch_size // dp, flag=f"--batch-size {args.batch_size}")
    except ValueError as e:
        p.error(str(e))
    return args


def hybrid_layout(args: argparse.Namespace) -> HybridLayout | None:
    """``--plugin hybrid``'s sizes from the flags; the flags with any other plugin are an error."""
    flags = {"--tp": args.tp, "--pp": args.pp, "--sp": args.sp, "--sp-mode": args.sp_mode,
             "--zero-stage": args.zero_stage, "--microbatches": args.microbatches}  # fmt: skip
    if args.plugin != "hybrid":
        given = [f"{k} {v}" for k, v in flags.items() if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: HybridParallelPlugin's flags; add --plugin hybrid")
        return None
    pp = args.pp or 1
    return HybridLayout(
        tp=args.tp or 1,
        pp=pp,
        sp=args.sp or 1,
        sp_mode=args.sp_mode,
        zero_stage=1 if args.zero_stage is None else args.zero_stage,
        num_microbatches=(args.microbatches or 4) if pp > 1 else None,
        vocab_multiple=1,  # 16 tokens: no padding beyond a multiple of tp
    )


def world_size(args: argparse.Namespace) -> int:
    """The launcher's world size, or the number of workers this script will spawn (``--nproc`` or one per GPU,
    on CPU two, or tp x pp x sp for --plugin hybrid when that is more)."""
    if launched_externally():
        return int(os.environ["WORLD_SIZE"])
    if args.nproc:
        return args.nproc
    nproc = default_nproc(args.device)
    on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.layout and not on_gpu:
        nproc = max(nproc, args.layout.model_parallel)
    return nproc


class LinearWarmupDecay:
    """lr factor: linear warm-up over ``warmup`` steps, then linear decay to ``floor`` at ``total``.

    A class rather than a lambda, so that LambdaLR's state_dict records it and a resume restores it.
    """

    def __init__(self, warmup: int, total: int, floor: float = 0.05) -> None:
        self.warmup, self.total, self.floor = warmup, total, floor

    def __call__(self, step: int) -> float:
        return min(1.0, (step + 1) / max(self.warmup, 1)) * max(self.floor, 1.0 - step / self.total)


class Run:
    """One boosted (model, optimizer, dataloader, scheduler) built from scratch; ``load`` overwrites its state."""

    def __init__(
        self, args: argparse.Namespace, task: DigitTask, device: torch.device, *, init_seed: int
    ) -> None:
        from transformers import LlamaForCausalLM

        self.args, self.task, self.device = args, task, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        precision = args.precision
        if precision == "auto":
            precision = "bf16" if device.type == "cuda" else "fp32"
        self.choice = PluginChoice(
            name=args.plugin,
            precision=precision,
            max_norm=args.max_norm,
            hybrid=args.layout,
            use_fp8=args.fp8,
            fp8_recipe=args.fp8_recipe,
        )
        # Sequence parallelism cuts every sequence evenly: batches are right-padded to a multiple of this.
        self.seq_multiple = args.layout.seq_multiple if args.layout else 1

        config = digit_llama_config(
            hidden=args.hidden,
            layers=args.layers,
            heads=args.heads,
            vocab_size=VOCAB_SIZE,
            max_seq=task.max_len,
            bos_token_id=BOS,
            eos_token_id=EOS,
            pad_token_id=PAD,
        )
        torch.manual_seed(init_seed)  # same on every rank, different for the rebuilt run
        model = LlamaForCausalLM(config)
        if args.kernels:
            from cai.kernels import patch_hf_model

            patch_hf_model(model)
        if args.grad_ckpt:
            # Non-reentrant: works under DDP, FSDP2 and ZeRO hooks alike.
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.config, self.shape = config, ModelShape.of(model, config)

        convert_fp8_before_boost(model, self.choice)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, LinearWarmupDecay(args.warmup, args.steps))
        self.booster = make_booster(self.choice)
        # Data is sharded over the data-parallel axis only: the tp/pp/sp ranks of one replica read the same batch.
        self.dp = self.booster.plugin.dp_size
        data = DigitReversal(task, num_samples=args.steps * args.batch_size, seed=args.seed)
        loader = self.booster.plugin.prepare_dataloader(
            data,
            batch_size=args.batch_size // self.dp,
            shuffle=True,
            seed=args.seed,
            drop_last=True,
            collate_fn=functools.partial(collate, pad_to=self.seq_multiple),
        )
        self.model, self.optimizer, _, self.loader, self.scheduler = self.booster.boost(
            model, optimizer, dataloader=loader, lr_scheduler=scheduler
        )
        self.step = 0

    # ---- training -----------------------------------------------------------------------------------
    def train(self, until: int, bar: ProgressBar) -> float:
        """Train from ``self.step`` to step ``until``; returns the last logged loss (mean over ranks)."""
        args, device = self.args, self.device
        self.model.train()
        clip_here = self.choice.name in ("ddp", "fsdp") and args.max_norm > 0  # ZeRO/Gemini clip inside step
        loss_sum, steps, tokens, last_loss = torch.zeros((), device=device), 0, 0, float("nan")
        synchronize(device)
        t0 = time.perf_counter()
        batches = itertools.islice(self.loader, until - self.step)
        for batch in batches:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            # Answers differ in length: the loss is the mean over every answer token of the global batch, each
            # rank's forward dividing its token sum by the count over all data-parallel ranks.
            batch["num_items_in_batch"] = self.booster.num_items_in_batch([batch])
            if self.choice.pipelined:
                # Forward and backward of every micro-batch; the loss (their sum) reaches every stage.
                out = self.booster.execute_pipeline(
                    iter([batch]), self.model, _hf_loss, self.optimizer, return_loss=True
                )
                loss = out["loss"]
            else:
                loss = self.model(**batch).loss
                self.booster.backward(loss, self.optimizer)
            if clip_here:
                self.optimizer.clip_grad_by_norm(args.max_norm)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad()
            self.step += 1
            loss_sum += loss.detach().float()
            steps += 1
            tokens += batch["input_ids"].numel()
            if self.step % args.log_every == 0 or self.step == until:
                # One all-reduce per log line: the mean over the replicas of the losses since the last line,
                # each replica's loss its part of the global token mean, so their mean is that mean, alike on
                # every rank.
                last_loss = float(self.booster.mean_loss(loss_sum)) / steps
                synchronize(device)
                seconds = time.perf_counter() - t0
                # A replica of world / dp ranks shares its batch's work: this device's part is dp / world of it.
                perf = Throughput.measure(
                    self.shape,
                    tokens=tokens * self.dp / self.world,
                    seconds=seconds,
                    seq_len=batch["input_ids"].shape[1],
                    grad_ckpt=args.grad_ckpt,
                )
                bar.update(
                    self.step,
                    loss=last_loss,
                    tokens_per_s=perf.tokens_per_s * self.world,
                    mfu=perf.mfu,
                    mem_gib=peak_memory_gib(device),
                )
                loss_sum.zero_()
                steps, tokens, t0 = 0, 0, time.perf_counter()
        return last_loss

    @torch.no_grad()
    def probe_loss(self) -> float:
        """Loss on a fixed held-out batch; every rank computes the same one (for sharded models too)."""
        self.model.eval()
        rows = _round_up(64, self.args.layout.rows_multiple() if self.args.layout else 1)
        probe = DigitReversal(self.task, rows, seed=PROBE_SEED)
        batch = collate([probe[i] for i in range(rows)], pad_to=self.seq_multiple)
        batch = {k: v.to(self.device) for k, v in batch.items()}
        if self.choice.pipelined:
            # the mean of the micro-batches' losses: computed the same way before saving and after loading
            out = self.booster.execute_pipeline(iter([batch]), self.model, _hf_loss, return_loss=True)
            loss = out["loss"]
        else:
            loss = self.model(**batch).loss
        return float(loss.float())

    @torch.no_grad()
    def accuracy(self) -> float:
        self.model.eval()
        model = HybridLogits(self) if self.args.layout else self.model
        if self.choice.pipelined:
            return exact_match(model, self.task, self.args.eval_samples, EVAL_SEED, self.device)
        # sharded parameters (Gemini, FSDP) gathered once for all the decoding forwards, not once per forward
        with self.booster.gathered(self.model):
            return exact_match(model, self.task, self.args.eval_samples, EVAL_SEED, self.device)

    # ---- checkpoints --------------------------------------------------------------------------------
    def save(self, path: str) -> None:
        """Model (HF safetensors), optimizer by parameter name, scheduler, data position and step."""
        self.booster.save_state(
            path,
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.scheduler,
            dataloader=self.loader,
            step=self.step,
        )

    def load(self, path: str, step: int | None = None) -> None:
        """Restore the checkpoint at ``step`` (default: the latest one under ``path``)."""
        state = self.booster.load_state(
            path,
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.scheduler,
            dataloader=self.loader,
            step=step,
        )
        self.step = int(state["step"])


def _hf_loss(outputs: dict, batch: dict) -> torch.Tensor:
    """The pipeline's criterion: the batch carries labels, so the Hugging Face model computed the loss."""
    return outputs["loss"]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class HybridLogits:
    """``input_ids -> logits`` on every rank of a HybridParallelPlugin model, for greedy decoding.

    Pads the sequence on the right to what sequence parallelism cuts evenly (causal attention never looks right,
    so the real positions' logits are unchanged) and the rows to whole micro-batches; with pp > 1 runs a
    forward-only pipeline step and broadcasts the last stage's logits over the pipeline group.
    """

    def __init__(self, run_: Run) -> None:
        self.run = run_
        plugin = run_.booster.plugin
        self.pp_group = plugin.pp_group if run_.choice.pipelined else None
        if self.pp_group is not None:
            self.last = dist.get_global_rank(self.pp_group, dist.get_world_size(self.pp_group) - 1)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        run_ = self.run
        B, T = input_ids.shape
        rows = _round_up(B, run_.args.layout.rows_multiple())
        ids = torch.full(
            (rows, _round_up(T, run_.seq_multiple)), PAD, dtype=input_ids.dtype, device=input_ids.device
        )
        ids[:B, :T] = input_ids
        ids[B:, :T] = input_ids[:1]  # filler rows, dropped below
        if self.pp_group is None:
            logits = run_.model(input_ids=ids).logits
        else:
            out = run_.booster.execute_pipeline(
                iter([{"input_ids": ids}]), run_.model, None, return_loss=False, return_outputs=True
            )
            shape = (*ids.shape, run_.config.vocab_size)
            logits = out["outputs"]["logits"] if dist.get_rank() == self.last else None
            if logits is None:
                logits = torch.empty(shape, dtype=torch.float32, device=ids.device)
            logits = logits.float().contiguous()
            dist.broadcast(logits, src=self.last, group=self.pp_group)
        return logits[:B, :T]  # (B, T, V)


def main(args: argparse.Namespace) -> None:
    from cai.mesh import launch_from_torch

    device = resolve_device(args.device)
    launch_from_torch(seed=args.seed, verbose=False)
    if device.type == "cpu":
        # The workers share this machine's cores; more threads than cores each only adds contention.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    rank0 = dist.get_rank() == 0
    say = print if rank0 else (lambda *a, **k: None)
    task = DigitTask(min_digits=args.min_digits, max_digits=args.max_digits)
    started = time.perf_counter()

    run_ = Run(args, task, device, init_seed=args.seed)
    say(
        f"cai train_llama: {run_.shape.num_params / 1e6:.2f}M-parameter Llama, task: reverse "
        f"{task.min_digits}-{task.max_digits} digits | plugin {run_.choice.label} ({run_.choice.precision}) | "
        f"{dist.get_world_size()} x {device.type} ({dist.get_backend()}) | global batch {args.batch_size}",
        flush=True,
    )
    if args.resume:
        run_.load(args.resume)
        say(f"resumed from {args.resume} at step {run_.step}", flush=True)
    bar = ProgressBar(args.steps, enabled=rank0)

    if args.save_at and run_.step < args.save_at < args.steps:
        run_.train(args.save_at, bar)
        before = run_.probe_loss()
        bar.newline()
        run_.save(args.ckpt_dir)
        say(f"saved checkpoint at step {run_.step} to {args.ckpt_dir} (probe loss {before:.4f})", flush=True)
        # Rebuild everything from a different random init and resume: only the checkpoint carries the state.
        del run_
        run_ = Run(args, task, device, init_seed=args.seed + 1)
        run_.load(args.ckpt_dir, step=args.save_at)
        after = run_.probe_loss()
        say(
            f"resumed from {args.ckpt_dir} at step {run_.step} (probe loss {after:.4f}, "
            f"{'matches' if abs(after - before) <= 1e-3 * max(1.0, abs(before)) else 'DIFFERS FROM'} the saved run)",
            flush=True,
        )
    final_loss = run_.train(args.steps, bar)
    if args.save_at == args.steps:
        run_.save(args.ckpt_dir)
        say(f"saved checkpoint at step {run_.step} to {args.ckpt_dir}", flush=True)

    acc = run_.accuracy()
    say(
        f"final loss {final_loss:.4f} after {run_.step} steps in {time.perf_counter() - started:.0f} s, "
        f"peak memory {peak_memory_gib(device):.2f} GiB",
        flush=True,
    )
    say(f"final accuracy: {100 * acc:.1f}% exact match on {args.eval_samples} held-out sequences", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    arguments = parse_args()
    run(main, arguments, nproc=arguments.world)
