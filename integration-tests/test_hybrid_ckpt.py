"""Checkpoints of HybridParallelPlugin against other layouts, both ways: two hybrid layouts (tp 2 x pp 2 with tied
embeddings, pp 2 x dp 2 with ZeRO-1) save and load against LowLevelZero at dp 2 and one process, and against
each other; tp 2 alone, where one rank holds both names of the tied embedding, against one process and tp 2 x pp 2.

After 3 steps the saver writes the model and the optimizer and trains 5 more steps. The loader, in another layout,
reads both: its parameters must equal the saved ones bit for bit (fp32 masters are what is written), and its next
5 losses must equal the saver's (to 1e-5: the layouts sum in different orders). A save/load_state resume of a
hybrid layout continues exactly.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from cai.ckpt import CheckpointReader
from cai.mesh.testing import assert_close, run_distributed

transformers = pytest.importorskip("transformers")

from _booster_cases import VOCAB, gathered_params, hybrid_llama  # noqa: E402

SEQ = 12
GLOBAL_BATCH = 8
LAYERS = 4
TIED = True  # the tied weight lives on the first and the last stage under tp 2 x pp 2


@dataclass(frozen=True, kw_only=True)
class Layout:
    name: str
    world: int

    def plugin(self):
        from cai.booster.plugin import HybridParallelPlugin, LowLevelZeroPlugin, TorchDDPPlugin

        if self.name == "one":
            return TorchDDPPlugin()
        if self.name == "zero2-dp2":
            return LowLevelZeroPlugin(stage=2, precision="fp32")
        if self.name == "tp2xpp2":
            return HybridParallelPlugin(
                tp_size=2, pp_size=2, zero_stage=1, precision="fp32", num_microbatches=2
            )
        if self.name == "pp2xdp2":
            return HybridParallelPlugin(
                tp_size=1, pp_size=2, zero_stage=1, precision="fp32", num_microbatches=2
            )
        if self.name == "tp2":
            return HybridParallelPlugin(tp_size=2, pp_size=1, zero_stage=1, precision="fp32")
        raise ValueError(self.name)


LAYOUTS = {
    lay.name: lay
    for lay in (
        Layout(name="one", world=1),
        Layout(name="zero2-dp2", world=2),
        Layout(name="tp2xpp2", world=4),
        Layout(name="pp2xdp2", world=4),
        Layout(name="tp2", world=2),
    )
}
HYBRID = ("tp2xpp2", "pp2xdp2")


@dataclass(frozen=True, kw_only=True)
class Pair:
    save: str
    load: str

    @property
    def id(self) -> str:
        return f"{self.save}-to-{self.load}"


PAIRS = [Pair(save=h, load=o) for h in HYBRID for o in ("one", "zero2-dp2")]
PAIRS += [Pair(save=o, load=h) for h in HYBRID for o in ("one", "zero2-dp2")]
PAIRS += [Pair(save="tp2xpp2", load="pp2xdp2"), Pair(save="pp2xdp2", load="tp2xpp2")]
# The tied embedding: stored once by tp 2 (the head's name an alias) and once by one process and tp 2 x pp 2 (no
# alias: the head's name is not reported), read under either convention.
TIED_PAIRS = [Pair(save="tp2", load="one"), Pair(save="one", load="tp2"), Pair(save="tp2xpp2", load="tp2")]


def boosted(layout: Layout, scheduler: bool = False):
    from cai.booster import Booster

    model = hybrid_llama(TIED, layers=LAYERS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if scheduler else None
    booster = Booster(plugin=layout.plugin(), device="cpu")
    model, opt, _, _, sched = booster.boost(model, opt, lr_scheduler=sched)
    return booster, model, opt, sched


def _dp(booster) -> tuple[int, int, dist.ProcessGroup | None]:
    plugin = booster.plugin
    if hasattr(plugin, "mesh"):
        return plugin.mesh.size("dp"), plugin.mesh.coordinate("dp"), plugin.dp_group
    return dist.get_world_size(), dist.get_rank(), None


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def train_step(booster, model, opt, ids: torch.Tensor) -> float:
    """One step on this data-parallel rank's rows of the global batch ``ids``; returns the global batch's loss."""
    size, rank, _ = _dp(booster)
    return local_step(booster, model, opt, ids.chunk(size)[rank])


def local_step(booster, model, opt, mine: torch.Tensor) -> float:
    """One step on this data-parallel rank's batch ``mine``; returns the loss averaged over the replicas."""
    size, _, group = _dp(booster)
    part = {"input_ids": mine, "labels": mine}
    if getattr(booster.plugin, "pp_size", 1) > 1:
        loss = booster.execute_pipeline(iter([part]), model, lambda out, _b: out["loss"], opt)["loss"]
    else:
        loss = model(**part).loss
        booster.backward(loss, opt)
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return total.item() / size


def gathered(booster, model) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor assembled from all ranks' pieces of the plugin's state, the tied weight once: a
    layout that reports it under the head's name too (tp 2) must report the embedding's values there."""
    params = gathered_params(booster, model, "all")
    if TIED and "lm_head.weight" in params:
        head = params.pop("lm_head.weight")
        assert torch.equal(head, params["model.embed_tokens.weight"]), "the tied head is not the embedding"
    return params


def shared_tmpdir() -> str:
    obj = [tempfile.mkdtemp(prefix="cai-hybrid-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    return obj[0]


def save_run(name: str) -> dict:
    booster, model, opt, _ = boosted(LAYOUTS[name])
    for step in range(3):
        train_step(booster, model, opt, batch(step))
    path = shared_tmpdir()
    booster.save_model(model, os.path.join(path, "model"), shard=True, size_per_shard=0.01)
    booster.save_optimizer(opt, os.path.join(path, "optim"), shard=True, size_per_shard=0.01)
    params = gathered(booster, model)
    losses = [train_step(booster, model, opt, batch(step)) for step in range(3, 8)]
    return {"path": path, "losses": losses, "params": params}


def load_run(name: str, path: str) -> dict:
    booster, model, opt, _ = boosted(LAYOUTS[name])
    booster.load_model(model, os.path.join(path, "model"))
    booster.load_optimizer(opt, os.path.join(path, "optim"))
    params = gathered(booster, model)
    losses = [train_step(booster, model, opt, batch(step)) for step in range(3, 8)]
    return {"losses": losses, "params": params}


_SAVED: dict[str, dict] = {}


def saved(name: str) -> dict:
    if name not in _SAVED:
        _SAVED[name] = run_distributed(save_run, LAYOUTS[name].world, name, timeout=240)[0]
    return _SAVED[name]


@pytest.mark.parametrize("pair", PAIRS + TIED_PAIRS, ids=lambda p: p.id)
def test_hybrid_checkpoints_load_under_other_layouts(pair: Pair) -> None:
    ref = saved(pair.save)
    got = run_distributed(load_run, LAYOUTS[pair.load].world, pair.load, ref["path"], timeout=240)[0]
    assert_close(got["params"], ref["params"], rtol=0, atol=0, name="params after load")
    assert_close(
        torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, name="losses after load"
    )


@pytest.mark.parametrize("name", sorted({p.save for p in TIED_PAIRS}))
def test_tied_embedding_is_stored_once(name: str) -> None:
    reader = CheckpointReader(os.path.join(saved(name)["path"], "model"))
    assert "model.embed_tokens.weight" in reader.weight_map and "lm_head.weight" not in reader.weight_map


@pytest.mark.parametrize("name", ["tp2xpp2", "tp2"])
def test_hybrid_checkpoint_loads_in_from_pretrained(name: str) -> None:
    ref = saved(name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(ref["path"], "model"))
    assert_close(
        {n: p.detach() for n, p in hf.named_parameters()},
        {n: ref["params"][n] for n, _ in hf.named_parameters()},
        rtol=0,
        atol=0,
        name="from_pretrained",
    )


class Tokens(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))


def resume_run(name: str, attention_dropout: float = 0.0) -> dict:
    """6 steps straight vs 3 steps + save_state + new objects + load_state + 3 steps, with a data loader that
    gives each data-parallel rank its own rows. ``attention_dropout`` draws its masks from the tensor-parallel
    RNG tracker, whose streams the checkpoint must keep."""

    def loop(booster, model, opt, sched, loader, steps: int, path: str | None) -> list[float]:
        losses = []
        it = iter(loader)
        for _ in range(steps):
            losses.append(local_step(booster, model, opt, next(it)))
            sched.step()
        if path is not None:
            booster.save_state(
                path, step=steps, model=model, optimizer=opt, lr_scheduler=sched, dataloader=loader
            )
        return losses

    trackers = {}  # the tp tracker's streams as a new process starts them (the tracker lives with the tp group)

    def fresh():
        booster, model, opt, sched = boosted(LAYOUTS[name], scheduler=True)
        for m in model.modules():
            if hasattr(m, "attention_dropout"):
                m.attention_dropout = attention_dropout
        for key, tracker in booster.plugin.rng_states().items():
            tracker.load_state_dict(trackers.setdefault(key, tracker.state_dict()))
        loader = booster.plugin.prepare_dataloader(Tokens(), batch_size=4, shuffle=True, seed=11)
        return booster, model, opt, sched, loader

    straight = loop(*fresh(), steps=6, path=None)
    path = shared_tmpdir()
    first = loop(*fresh(), steps=3, path=path)
    booster, model, opt, sched, loader = fresh()
    info = booster.load_state(path, model=model, optimizer=opt, lr_scheduler=sched, dataloader=loader)
    assert info["step"] == 3
    second = loop(booster, model, opt, sched, loader, steps=3, path=None)
    return {"straight": straight, "resumed": first + second}


@pytest.mark.parametrize(("name", "dropout"), [*((h, 0.0) for h in HYBRID), ("tp2", 0.5)])
def test_hybrid_save_state_resumes_exactly(name: str, dropout: float) -> None:
    for r in run_distributed(resume_run, LAYOUTS[name].world, name, dropout, timeout=240):
        assert_close(torch.tensor(r["resumed"]), torch.tensor(r["straight"]), rtol=0, name="resumed losses")


def lazy_run(name: str, pretrained: str | None) -> dict:
    """A model built under LazyInitContext (from ``pretrained`` or randomly) boosted under a hybrid layout: the full
    model is never allocated, and every copy of a tensor (dp replicas, tp-replicated norms, the tied head copy on
    the last stage) holds the same values."""
    from cai.booster import Booster, LazyInitContext

    with LazyInitContext():
        if pretrained is None:
            model = hybrid_llama(TIED, layers=LAYERS)
        else:
            model = transformers.LlamaForCausalLM.from_pretrained(pretrained)
    assert all(p.device.type == "meta" for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    booster = Booster(plugin=LAYOUTS[name].plugin(), device="cpu")
    model, opt, *_ = booster.boost(model, opt)
    pieces: dict[str, list] = {}
    for n, entry in booster.plugin.model_state(model).sharded_state_dict().items():
        for s in entry if isinstance(entry, list) else [entry]:
            pieces.setdefault(n, []).append((s.tensor.detach().clone(), s.spec))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, pieces)
    for n in pieces:
        by_spec: dict = {}
        for r in everyone:
            for t, spec in r.get(n, []):
                first = by_spec.setdefault(spec, t)
                assert torch.equal(first, t), f"{name}: two copies of {n} {spec} differ"
    return {"params": gathered(booster, model), "loss": train_step(booster, model, opt, batch(0))}


@pytest.mark.parametrize("name", HYBRID)
def test_lazy_init_materialises_shards_that_agree(name: str) -> None:
    results = run_distributed(lazy_run, LAYOUTS[name].world, name, None, timeout=240)
    assert len({r["loss"] for r in results}) == 1
    # initialised like the eager model (small weights): the first loss is that of a near-uniform prediction
    assert abs(results[0]["loss"] - math.log(VOCAB)) < 0.5, results[0]["loss"]


@pytest.mark.parametrize("name", ["tp2xpp2", "tp2"])
def test_lazy_from_pretrained_reads_each_rank_its_blocks(name: str) -> None:
    path = tempfile.mkdtemp(prefix="cai-hybrid-pretrained-")
    reference = hybrid_llama(TIED, layers=LAYERS)
    reference.save_pretrained(path)  # the tied weight once, under the embedding's name
    got = run_distributed(lazy_run, LAYOUTS[name].world, name, path, timeout=240)[0]
    want = {n: p.detach() for n, p in reference.named_parameters()}
    assert_close(got["params"], want, rtol=0, atol=0, name="lazily loaded params")
    ids = batch(0)
    assert_close(torch.tensor(got["loss"]), reference(input_ids=ids, labels=ids).loss.detach(), rtol=1e-5)
