"""Optimizer checkpoints when the ranks' optimizers hold different parameters (pipeline stages), gloo on CPU.

In a split every rank builds the whole TinyTransformer and trains it on the same batch, but its optimizer holds
only its part's parameters: part 1 the matrices from block 1 on (so its group of vectors is empty), part 0 the
rest. After each step the part's first rank broadcasts what it updated, so every rank keeps the one-process
model and the parts' optimizer states are those of one AdamW over the whole model. A split saves and one process
loads, one process saves and a split loads, each compared with one process that never stopped (1e-6); a real
pipeline (a tiny Llama cut by ``build_stages``, 1F1B) saves and one process loads; and the errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import cai.ckpt as ck
from cai.ckpt._groups import group_mismatches, merge_optimizer_groups, own_groups
from cai.mesh import param_groups_state
from cai.mesh.testing import (
    CollectiveCounter,
    TinyTransformer,
    assert_close,
    make_batch,
    one_thread,
    run_distributed,
)

STEPS, BETAS, EPS = 3, (0.9, 0.99), 1e-8
HYPER = ({"lr": 1e-2, "weight_decay": 0.1}, {"lr": 3e-3, "weight_decay": 0.0})  # matrices, then vectors
OTHER = ({"lr": 0.5, "weight_decay": 0.0}, {"lr": 0.5, "weight_decay": 0.5})  # what only a load can undo


@dataclass(frozen=True, kw_only=True)
class Split:
    name: str
    kind: (
        str  # "adamw": a plain torch AdamW per rank; "zero": cai-zero's ZeroOptimizer, sharded over the part
    )
    dp: int = 1  # ranks per part (data-parallel replicas of it)

    @property
    def world(self) -> int:
        return 2 * self.dp


SAVES = [
    Split(name="adamw-2parts", kind="adamw"),
    Split(name="zero-2parts", kind="zero"),
    Split(name="zero-dp2x2parts", kind="zero", dp=2),
]
LOADS = SAVES[:2]


def _part(name: str, p: nn.Parameter) -> int:
    return int(p.dim() == 2 and (name.startswith("blocks.1.") or name == "head.weight"))


def _adamw(named: list[tuple[str, nn.Parameter]], hyper=HYPER) -> torch.optim.AdamW:
    groups = [{"params": [p for _, p in named if (p.dim() < 2) == bool(i)], **h} for i, h in enumerate(hyper)]
    return torch.optim.AdamW(groups, betas=BETAS, eps=EPS, foreach=False)


def _step(model: TinyTransformer, opt: Any, s: int, *, zero: bool = False) -> None:
    ids, labels = make_batch(seed=s)
    loss = model.loss(model(ids), labels)
    if zero:
        opt.backward(loss)
    else:
        loss.backward()
    opt.step()
    opt.zero_grad()
    model.zero_grad(set_to_none=True)  # the parameters other parts own


def _state(opt: torch.optim.Optimizer, names: dict[nn.Parameter, str]) -> dict[str, dict[str, torch.Tensor]]:
    return {names[p]: {k: v.clone() for k, v in opt.state[p].items()} for p in names if p in opt.state}


def _hyper(opt: torch.optim.Optimizer, names: dict[nn.Parameter, str]) -> list[dict[str, Any]]:
    """Each group's hyperparameters, as a checkpoint holds them (JSON: betas as a list)."""
    groups = param_groups_state(opt.param_groups, [[names[p] for p in g["params"]] for g in opt.param_groups])
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


class _Rank:
    """This rank of a split: the whole model, its part's parameters (named) and their optimizer."""

    def __init__(self, split: Split, *, seed: int = 0, hyper=HYPER):
        self.split = split
        self.part = dist.get_rank() // split.dp
        self.model = TinyTransformer(seed=seed)
        self.owner = {n: _part(n, p) * split.dp for n, p in self.model.named_parameters()}
        named = [(n, p) for n, p in self.model.named_parameters() if _part(n, p) == self.part]
        self.names = {p: n for n, p in named}
        self.opt: Any = _adamw(named, hyper)
        if split.kind == "zero":
            from cai.zero import ZeroConfig, ZeroOptimizer

            parts = [dist.new_group(list(range(q * split.dp, (q + 1) * split.dp))) for q in range(2)]
            cfg = ZeroConfig(stage=2, bucket_size_mb=0.01)
            self.opt = ZeroOptimizer(self.opt, model=named, config=cfg, group=parts[self.part])

    def train(self, steps: int) -> None:
        for s in range(steps):
            _step(self.model, self.opt, s, zero=self.split.kind == "zero")
            with torch.no_grad():  # every rank keeps the one-process model
                for n, p in self.model.named_parameters():
                    dist.broadcast(p.data, src=self.owner[n])

    def save(self, path: str) -> None:
        names = None if self.split.kind == "zero" else self.names
        ck.save_optimizer(self.opt, path, param_names=names, size_per_shard=0.01)

    def load(self, path: str) -> None:
        names = None if self.split.kind == "zero" else self.names
        ck.load_optimizer(self.opt, path, param_names=names)

    def state(self) -> dict[str, dict[str, torch.Tensor]]:
        if self.split.kind == "zero":
            return self.opt.state_dict()["state"]
        return _state(self.opt, self.names)

    def hyper(self) -> list[dict[str, Any]]:
        if self.split.kind == "zero":
            return [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups_state()]
        return _hyper(self.opt, self.names)


def _whole(*, seed: int = 0, hyper=HYPER) -> tuple[TinyTransformer, torch.optim.AdamW, dict]:
    model = TinyTransformer(seed=seed)
    named = list(model.named_parameters())
    return model, _adamw(named, hyper), {p: n for n, p in named}


@pytest.fixture(scope="module")
def reference() -> tuple[dict, list[dict]]:
    """One AdamW over the whole model after ``STEPS`` steps: its state by name and its groups' hyperparameters."""
    with one_thread():
        model, opt, names = _whole()
        for s in range(STEPS):
            _step(model, opt, s)
        return _state(opt, names), _hyper(opt, names)


def _check(state: dict, hyper: list[dict], reference: tuple[dict, list[dict]], what: str) -> None:
    ref_state, ref_hyper = reference
    assert set(state) == set(ref_state), what
    for name, values in ref_state.items():
        assert_close(state[name], values, rtol=1e-6, name=f"{what} {name}")
    assert hyper == ref_hyper, what


# ---- the merge and the per-rank checks (no processes) ------------------------------------------------------
def _doc(*groups: tuple[float, list[str]], scalars: dict | None = None) -> dict[str, Any]:
    return {"param_groups": [{"lr": lr, "params": ps} for lr, ps in groups], "scalar_state": scalars or {}}


def test_merge_lists_each_name_once_in_rank_order_and_ignores_empty_and_absent_groups() -> None:
    docs = [
        _doc((1.0, ["a", "b"]), (2.0, ["c"])),
        _doc((1.0, ["b", "d"]), (9.0, []), scalars={"d": {"k": 1}}),  # a replica of b; an empty group
        _doc((1.0, ["e"])),  # one group only
    ]
    assert merge_optimizer_groups(docs) == _doc(
        (1.0, ["a", "b", "d", "e"]), (2.0, ["c"]), scalars={"d": {"k": 1}}
    )
    assert merge_optimizer_groups([_doc((1.0, ["a"]), (3.0, [])), _doc((1.0, ["b"]), (4.0, []))]) == _doc(
        (1.0, ["a", "b"]), (3.0, [])
    )  # no rank has parameters in group 1: the first rank's hyperparameters


def test_merge_names_the_group_the_key_and_the_values() -> None:
    docs = [_doc((1.0, ["a"])), _doc((1.0, ["b"]))]
    docs[1]["param_groups"][0]["foreach"] = True
    with pytest.raises(
        ValueError, match=r"param group 0 has foreach=\(absent\) on rank 0 and foreach=True on rank 1"
    ):
        merge_optimizer_groups(docs)
    with pytest.raises(
        ValueError, match="parameter 'a' is in param group 0 on one rank and in param group 1 on rank 1"
    ):
        merge_optimizer_groups([_doc((1.0, ["a"])), _doc((1.0, []), (2.0, ["a"]))])
    with pytest.raises(
        ValueError, match=r"scalar state of 'a' is \{'k': 1\} on rank 0 and \{'k': 2\} on rank 1"
    ):
        merge_optimizer_groups(
            [_doc((1.0, ["a"]), scalars={"a": {"k": 1}}), _doc((1.0, ["a"]), scalars={"a": {"k": 2}})]
        )


def test_each_rank_must_hold_the_checkpoints_groups_cut_to_its_parameters() -> None:
    saved = _doc((1.0, ["a", "b", "d"]), (2.0, ["c"]))["param_groups"]
    assert group_mismatches([[["a"], ["c"]], [["b", "d"]]], saved, strict=True) == []
    assert group_mismatches([[["a", "b", "d"], ["c"]]] * 2, saved, strict=True) == []  # replicas
    assert group_mismatches([[["a"]], [["b", "d"]]], saved, strict=True) == [
        "the checkpoint has 2 param groups, the optimizer 1"
    ]
    assert group_mismatches([[["a"], ["c"]], [["b"], ["d"]]], saved, strict=True) == [
        "rank 1: param group 0 lacks ['d'], which the checkpoint's group 0 holds",
        "rank 1: param group 1 holds ['d'], which the checkpoint's group 1 does not",
    ]
    assert own_groups(saved, {"b", "c"}, 2) == _doc((1.0, ["b"]), (2.0, ["c"]))["param_groups"]


# ---- a split saves, one process loads ------------------------------------------------------------------------
def _save_split(split: Split, path: str) -> dict[str, int]:
    r = _Rank(split)
    r.train(STEPS)
    with CollectiveCounter() as cc:
        r.save(path)
    return {op: cc.count(op) for op in ("all_gather_object", "all_gather", "all_reduce", "broadcast")}


@pytest.mark.parametrize("split", SAVES, ids=lambda s: s.name)
def test_a_split_saves_and_one_process_loads(tmp_path: Path, reference, split: Split) -> None:
    counts = run_distributed(_save_split, split.world, split, str(tmp_path / "o"), timeout=180)
    # the groups travel with the tensor metadata: one exchange of objects, no tensor collective
    assert all(
        c == {"all_gather_object": 1, "all_gather": 0, "all_reduce": 0, "broadcast": 0} for c in counts
    )
    with one_thread():
        model, opt, names = _whole(seed=5, hyper=OTHER)
        ck.load_optimizer(opt, tmp_path / "o", model=model)
        _check(_state(opt, names), _hyper(opt, names), reference, split.name)


# ---- one process saves, a split loads ------------------------------------------------------------------------
def _load_split(split: Split, path: str) -> tuple[dict, list[dict], set[str], set[str]]:
    r = _Rank(split, seed=5, hyper=OTHER)
    read: list[str] = []
    original = ck.CheckpointReader.read

    def recording(self, name, *args, **kwargs):
        read.append(name)
        return original(self, name, *args, **kwargs)

    ck.CheckpointReader.read = recording
    try:
        r.load(path)
    finally:
        ck.CheckpointReader.read = original
    return r.state(), r.hyper(), {k.rsplit(".", 1)[0] for k in read}, set(r.names.values())


@pytest.mark.parametrize("split", LOADS, ids=lambda s: s.name)
def test_one_process_saves_and_a_split_loads(tmp_path: Path, reference, split: Split) -> None:
    with one_thread():
        model, opt, _ = _whole()
        for s in range(STEPS):
            _step(model, opt, s)
        ck.save_optimizer(opt, tmp_path / "o", model=model, size_per_shard=0.01)
    results = run_distributed(_load_split, split.world, split, str(tmp_path / "o"), timeout=180)
    ref_state, ref_hyper = reference
    for rank, (state, hyper, read, own) in enumerate(results):
        assert read and read <= own, f"rank {rank} read the state of parameters it does not hold"
        # each rank holds its own parameters' state, and every group the checkpoint's hyperparameters (part 1's
        # empty group of vectors too)
        _check(state, hyper, ({n: ref_state[n] for n in own}, ref_hyper), f"{split.name} rank {rank}")


# ---- a real pipeline ---------------------------------------------------------------------------------------
PP_STEPS, PP_M = 2, 2
PP_HYPER = ({"lr": 1e-3, "weight_decay": 0.1}, {"lr": 3e-4, "weight_decay": 0.0})


def _llama() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=251,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(cfg).eval()  # eval: no dropout


def _llama_batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 251, (4, 12), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _llama_adamw(named: list[tuple[str, nn.Parameter]]) -> torch.optim.AdamW:
    groups = [
        {"params": [p for _, p in named if (p.dim() < 2) == bool(i)], **h} for i, h in enumerate(PP_HYPER)
    ]
    return torch.optim.AdamW(groups, eps=1e-6)  # eps: Adam's first update smooth in the gradient


def _pipeline_save(path: str) -> tuple[dict, list[dict], dict, list[dict]]:
    from cai.mesh import ParallelDims
    from cai.pipeline import OneForwardOneBackwardSchedule, PipelineStageManager, build_stages

    manager = PipelineStageManager(ParallelDims(pp=2).build_mesh(), "pp")
    pm = build_stages(_llama(), manager)
    named = pm.global_named_parameters()
    names = {p: n for n, p in named}
    opt = _llama_adamw(named)
    schedule = OneForwardOneBackwardSchedule(manager, num_microbatches=PP_M)
    for step in range(PP_STEPS):
        schedule.forward_backward_step(pm, iter([_llama_batch(step)]), lambda o, _b: o["loss"], opt)
        opt.step()
        opt.zero_grad()
    ck.save_optimizer(opt, path, param_names=names)
    ck.save_optimizer(opt, path + "-by-model", model=pm)  # named through the stage's global_named_parameters
    fresh = torch.optim.AdamW([{"params": g["params"], "lr": 0.5} for g in opt.param_groups])
    ck.load_optimizer(fresh, path, model=pm)  # and each stage loads its part of the whole model's checkpoint
    return _state(opt, names), _hyper(opt, names), _state(fresh, names), _hyper(fresh, names)


def test_pipeline_stages_save_and_one_process_loads(tmp_path: Path) -> None:
    stages = run_distributed(_pipeline_save, 2, str(tmp_path / "o"), timeout=300)
    with one_thread():
        model = _llama()
        named = list(model.named_parameters())
        names = {p: n for n, p in named}
        ref = _llama_adamw(named)
        for step in range(PP_STEPS):
            model(**_llama_batch(step)).loss.backward()
            ref.step()
            ref.zero_grad()
        fresh = torch.optim.AdamW(
            [{"params": g["params"], "lr": 0.5} for g in ref.param_groups]
        )  # the same parameters per group, other hyperparameters
        ck.load_optimizer(fresh, tmp_path / "o", model=model)
    loaded, hyper = _state(fresh, names), _hyper(fresh, names)
    for state, stage_hyper, back, back_hyper in stages:
        assert set(back) == set(state) and back_hyper == stage_hyper
        for n, values in state.items():
            assert_close(back[n], values, rtol=0.0, name=f"stage reload {n}")
    whole = {n: v for state, *_ in stages for n, v in state.items()}
    assert set(loaded) == set(whole) == set(names.values())
    for n, values in whole.items():  # what the stages held, bit for bit
        assert_close(loaded[n], values, rtol=0.0, name=n)
    assert hyper == _hyper(ref, names) and all(h == hyper for _, h, *_ in stages)
    by_model = tmp_path / "o-by-model"
    for f in ("param_groups.json", "optimizer.safetensors.index.json"):
        assert (by_model / f).read_text() == (tmp_path / "o" / f).read_text(), f
    # and the one-process run (micro-batches change only the summation order; see cai-pipeline's parity tests)
    for n, values in _state(ref, names).items():
        assert_close(loaded[n], values, rtol=1e-5, atol=1e-6, name=f"one process {n}")


# ---- errors ----------------------------------------------------------------------------------------------------
def _save_disagreeing(path: str) -> str:
    r = _Rank(SAVES[0], hyper=HYPER if dist.get_rank() == 0 else ({**HYPER[0], "lr": 2e-2}, HYPER[1]))
    try:
        r.save(path)
    except ValueError as e:
        return str(e)
    return "saved"


def test_hyperparameters_that_disagree_across_ranks_raise_on_every_rank(tmp_path: Path) -> None:
    messages = run_distributed(_save_disagreeing, 2, str(tmp_path / "o"), timeout=120)
    for m in messages:
        assert "param group 0 has lr=0.01 on rank 0 and lr=0.02 on rank 1" in m, m
    assert not (tmp_path / "o").exists()


def _load_expecting_error(path: str) -> str:
    try:
        _Rank(SAVES[0]).load(path)
    except ck.CheckpointError as e:
        return str(e)
    return "loaded"


def test_a_parameter_missing_from_the_checkpoint_raises_on_every_rank(tmp_path: Path) -> None:
    model = TinyTransformer(seed=0)
    opt = _adamw([(n, p) for n, p in model.named_parameters() if n != "head.weight"])
    ck.save_optimizer(opt, tmp_path / "o", model=model)  # head.weight (part 1's) is not in it
    messages = run_distributed(_load_expecting_error, 2, str(tmp_path / "o"), timeout=120)
    for m in messages:
        assert "parameters missing from the checkpoint ['head.weight']" in m, m
