"""Checkpoints through the Booster: a save under each plugin loads under every other plugin (at another world
size), and ``save_state``/``load_state`` resume training exactly.

The check is behavioural: after loading, three more training steps give the same losses and parameters as the
run that saved and kept going.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from cai.mesh.testing import assert_close, run_distributed

transformers = pytest.importorskip("transformers")

from _booster_cases import (  # noqa: E402
    PLUGINS,
    VOCAB,
    gathered_params,
    make_plugin,
    shared_tmpdir,
    tiny_llama,
)

SEQ = 12
GLOBAL_BATCH = 4
LOAD_WORLD = {"ddp": 1, "fsdp": 4, "zero1": 2, "zero2": 4, "gemini": 2}  # every pair changes the layout


def boosted(name: str, scheduler: bool = False):
    from cai.booster import Booster

    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if scheduler else None
    booster = Booster(plugin=make_plugin(name), device="cpu")
    model, opt, _, _, sched = booster.boost(model, opt, lr_scheduler=sched)
    return booster, model, opt, sched


def batch(step: int) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    return ids.chunk(dist.get_world_size())[dist.get_rank()]


def train_step(booster, model, opt, ids: torch.Tensor) -> float:
    loss = torch.nn.functional.cross_entropy(
        model(ids).logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)
    )
    booster.backward(loss, opt)
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def save_run(name: str, root: str) -> dict:
    booster, model, opt, _ = boosted(name)
    for step in range(3):
        train_step(booster, model, opt, batch(step))
    path = shared_tmpdir(root)
    booster.save_model(model, os.path.join(path, "model"), shard=True, size_per_shard=0.01)
    booster.save_optimizer(opt, os.path.join(path, "optim"), shard=True, size_per_shard=0.01)
    losses = [train_step(booster, model, opt, batch(step)) for step in range(3, 6)]
    return {"path": path, "losses": losses, "params": gathered_params(booster, model)}


def load_run(name: str, path: str) -> dict:
    booster, model, opt, _ = boosted(name)
    booster.load_model(model, os.path.join(path, "model"))
    booster.load_optimizer(opt, os.path.join(path, "optim"))
    losses = [train_step(booster, model, opt, batch(step)) for step in range(3, 6)]
    return {"losses": losses, "params": gathered_params(booster, model)}


_SAVED: dict[str, dict] = {}


def saved(name: str, root: str) -> dict:
    if name not in _SAVED:
        _SAVED[name] = run_distributed(save_run, 2, name, root, timeout=180)[0]
    return _SAVED[name]


@dataclass(frozen=True, kw_only=True)
class Pair:
    save: str
    load: str

    @property
    def id(self) -> str:
        return f"{self.save}-to-{self.load}{LOAD_WORLD[self.load]}"


PAIRS = [Pair(save=s, load=lo) for s in PLUGINS for lo in PLUGINS]


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: p.id)
def test_save_under_one_plugin_load_under_another(pair: Pair, root: str) -> None:
    ref = saved(pair.save, root)
    got = run_distributed(load_run, LOAD_WORLD[pair.load], pair.load, ref["path"], timeout=180)[0]
    assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, name="loss after load")
    assert_close(got["params"], ref["params"], rtol=1e-4, atol=1e-6, name="params after load")


class Tokens(Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))


def resume_run(name: str, root: str) -> dict:
    """8 steps straight vs 4 steps + save_state + new objects + load_state + 4 steps."""

    def loop(booster, model, opt, sched, loader, steps: int, path: str | None) -> list[float]:
        losses = []
        it = iter(loader)
        for _ in range(steps):
            losses.append(train_step(booster, model, opt, next(it)))
            sched.step()
        if path is not None:
            booster.save_state(
                path, step=steps, model=model, optimizer=opt, lr_scheduler=sched, dataloader=loader
            )
        return losses

    def fresh():
        booster, model, opt, sched = boosted(name, scheduler=True)
        loader = booster.plugin.prepare_dataloader(Tokens(), batch_size=2, shuffle=True, seed=11)
        return booster, model, opt, sched, loader

    straight = loop(*fresh(), steps=8, path=None)
    path = shared_tmpdir(root)
    first = loop(*fresh(), steps=4, path=path)
    booster, model, opt, sched, loader = fresh()
    info = booster.load_state(path, model=model, optimizer=opt, lr_scheduler=sched, dataloader=loader)
    assert info["step"] == 4
    assert sched.get_last_lr() == [1e-3 * 0.25]
    second = loop(booster, model, opt, sched, loader, steps=4, path=None)
    return {"straight": straight, "resumed": first + second}


@pytest.mark.parametrize("plugin", PLUGINS)
def test_save_state_resumes_exactly(plugin: str, root: str) -> None:
    for r in run_distributed(resume_run, 2, plugin, root, timeout=180):
        assert_close(torch.tensor(r["resumed"]), torch.tensor(r["straight"]), rtol=0, name="resumed losses")


def lazy_hf_run(name: str, root: str) -> dict:
    """A Hugging Face model built lazily by from_pretrained, boosted, filled from its safetensors into the shards;
    then saved by the Booster and loaded back by transformers with identical logits."""
    from cai.booster import Booster, LazyInitContext

    path = shared_tmpdir(root)
    if dist.get_rank() == 0:
        tiny_llama().save_pretrained(os.path.join(path, "pretrained"))
    dist.barrier()
    with LazyInitContext():
        model = transformers.LlamaForCausalLM.from_pretrained(os.path.join(path, "pretrained"))
    assert all(p.device.type == "meta" for p in model.parameters())
    booster = Booster(plugin=make_plugin(name), device="cpu")
    model, *_ = booster.boost(model)
    got = gathered_params(booster, model)
    booster.save_model(model, os.path.join(path, "saved"), shard=True, size_per_shard=0.02)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    reference = tiny_llama()
    with torch.no_grad():
        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.join(path, "saved"), attn_implementation="eager"
        )
        logits = loaded.float()(ids).logits
        expected = reference(ids).logits
    assert_close(got, dict(reference.named_parameters()), rtol=0, name="lazy pretrained params")
    assert_close(logits, expected, rtol=0, name="logits after save_model + from_pretrained")
    return {"ok": True}


@pytest.mark.parametrize("plugin", PLUGINS)
def test_lazy_from_pretrained_loads_into_shards_and_saves_hf(plugin: str, root: str) -> None:
    assert all(r["ok"] for r in run_distributed(lazy_hf_run, 2, plugin, root, timeout=180))
