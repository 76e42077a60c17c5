"""A small training program run in fresh processes by test_resume.py (not collected by pytest).

Usage: python resume_worker.py straight STEPS OUT | first STEPS CKPT [async] | resume CKPT STEPS OUT | loop CKPT OUT
Everything that carries state across a restart is used: AdamW, a cosine LR schedule, a CPU grad scaler, a
sampler with a position, and torch/python/numpy randomness inside the step.
"""

from __future__ import annotations

import random
import sys

import torch

import cai.ckpt as ck

try:  # numpy is not a dependency of cai-ckpt; its RNG is exercised when it is installed
    import numpy as np
except ImportError:
    np = None
from cai.mesh.testing import TinyTransformer, make_batch

BATCH, DATASET = 4, 24


class ResumableSampler:
    """Shuffles each epoch with ``seed + epoch`` and remembers how far it got (the ``Stateful`` protocol)."""

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed, self.epoch, self.pos = n, seed, 0, 0

    def next_batch(self) -> list[int]:
        if self.pos + BATCH > self.n:
            self.epoch, self.pos = self.epoch + 1, 0
        order = torch.randperm(
            self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)
        ).tolist()
        out = order[self.pos : self.pos + BATCH]
        self.pos += BATCH
        return out

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.epoch, self.pos = state["seed"], state["epoch"], state["pos"]


def build():
    torch.manual_seed(0)
    random.seed(0)
    if np is not None:
        np.random.seed(0)
    model = TinyTransformer(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=40)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    return model, opt, sched, scaler, ResumableSampler(DATASET)


def train(parts, steps: int) -> list[float]:
    model, opt, sched, scaler, sampler = parts
    ids, labels = make_batch(batch_size=DATASET, seed=123)
    losses = []
    for _ in range(steps):
        idx = sampler.next_batch()
        logits = torch.nn.functional.dropout(model(ids[idx]), p=0.1)  # torch RNG
        weight = 1.0 + 0.1 * random.random()  # python RNG
        if np is not None:
            weight += 0.1 * float(np.random.rand())  # numpy RNG
        loss = model.loss(logits, labels[idx]) * weight
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses


def dump(parts, losses: list[float], out: str) -> None:
    tensors = {n: p.detach().contiguous() for n, p in parts[0].named_parameters()}
    tensors["__losses__"] = torch.tensor(losses, dtype=torch.float64)
    _save_file(tensors, out)


def _save_file(tensors: dict[str, torch.Tensor], out: str) -> None:
    """A single safetensors file (safetensors' own writer needs numpy, which cai-ckpt does not depend on)."""
    from pathlib import Path

    from cai.ckpt._format import SafetensorsWriter

    writer = SafetensorsWriter(
        Path(out), [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()], {"format": "pt"}
    )
    for k, v in tensors.items():
        writer.write(k, v)
    writer.close()


def save(parts, path: str, step: int, use_async: bool = False) -> None:
    model, opt, sched, scaler, sampler = parts
    ck.save_state(
        path,
        model=model,
        optimizer=opt,
        lr_scheduler=sched,
        grad_scaler=scaler,
        dataloader=sampler,
        step=step,
        size_per_shard=0.01,
        use_async=use_async,
        extra={"note": "worker"},
    )


def main(argv: list[str]) -> None:
    torch.use_deterministic_algorithms(True)
    mode = argv[0]
    parts = build()
    if mode == "straight":
        dump(parts, train(parts, int(argv[1])), argv[2])
    elif mode == "first":
        train(parts, int(argv[1]))
        save(parts, argv[2], int(argv[1]), use_async=len(argv) > 3 and argv[3] == "async")
        # an asynchronous save is finished by the exit hook
    elif mode == "resume":
        info = ck.load_state(
            argv[0 + 1],
            model=parts[0],
            optimizer=parts[1],
            lr_scheduler=parts[2],
            grad_scaler=parts[3],
            dataloader=parts[4],
            verify=True,
        )
        assert info["extra"] == {"note": "worker"}, info
        dump(parts, train(parts, int(argv[2])), argv[3])
    elif mode == "loop":  # save every step until killed
        step = 0
        while True:
            train(parts, 1)
            step += 1
            print(f"saving {step}", flush=True)
            save(parts, argv[1], step)
            if step == 1:
                dump(parts, [], argv[2])
            print(f"committed {step}", flush=True)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
