"""cai-zero stage 0 through cai-ckpt: every rank reports the same whole-parameter pieces, which cai-ckpt stores once.

Optimizer state and fp32 masters saved by stage 0 at dp 2 load into stage 2 at dp 2, and saved from there load back
into stage 0: the full state (moments, step counts, param groups) and the parameters are identical at every hop,
and the stage 0 run that was restored continues exactly like the one that saved.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

import cai.ckpt as ck
from cai.mesh.testing import TinyTransformer, make_batch, run_distributed
from cai.zero import ZeroConfig, ZeroOptimizer

SAVE_STEP, MORE = 3, 2


class _Masters:
    """The state protocol of the fp32 masters, for ``ck.save_model`` / ``ck.load_model``."""

    def __init__(self, opt: ZeroOptimizer) -> None:
        self.sharded_state_dict = opt.model_sharded_state_dict
        self.load_sharded_state_dict = opt.load_model_sharded_state_dict


def _build(stage: int, seed: int) -> tuple[TinyTransformer, ZeroOptimizer]:
    model = TinyTransformer(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    return model, ZeroOptimizer(opt, model=model, config=ZeroConfig(stage=stage, bucket_size_mb=0.01))


def _train(model: TinyTransformer, opt: ZeroOptimizer, steps: range) -> list[float]:
    rank, losses = dist.get_rank(), []
    for s in steps:
        ids, labels = make_batch(batch_size=4, seed=s)
        loss = model.loss(model(ids[rank * 2 : rank * 2 + 2]), labels[rank * 2 : rank * 2 + 2])
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _snapshot(model: TinyTransformer, opt: ZeroOptimizer) -> dict:
    sd = opt.state_dict()  # gathered on every rank
    return {
        "state": sd["state"],
        "groups": sd["param_groups"],
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def _save(opt: ZeroOptimizer, root: Path, name: str) -> None:
    ck.save_model(_Masters(opt), root / f"{name}-model")
    ck.save_optimizer(opt, root / f"{name}-optim")


def _load(opt: ZeroOptimizer, root: Path, name: str) -> None:
    ck.load_model(_Masters(opt), root / f"{name}-model", verify=True)
    ck.load_optimizer(opt, root / f"{name}-optim", verify=True)


def _round_trip(root: str) -> dict:
    root_path = Path(root)
    model, opt = _build(0, seed=0)
    _train(model, opt, range(SAVE_STEP))
    # stage 0 reports whole parameters, the same on both ranks
    pieces = opt.sharded_state_dict()
    assert all(p.spec.is_full and p.spec.flat_range is None for p in pieces.values())
    out = {"stage0": _snapshot(model, opt)}
    _save(opt, root_path, "stage0")
    out["continued"] = _train(model, opt, range(SAVE_STEP, SAVE_STEP + MORE))

    model2, opt2 = _build(2, seed=5)  # other weights: only the checkpoint can make them match
    _load(opt2, root_path, "stage0")
    out["stage2"] = _snapshot(model2, opt2)
    _save(opt2, root_path, "stage2")

    model0, opt0 = _build(0, seed=7)
    _load(opt0, root_path, "stage2")
    out["back"] = _snapshot(model0, opt0)
    out["resumed"] = _train(model0, opt0, range(SAVE_STEP, SAVE_STEP + MORE))
    return out


def _assert_same(a: dict, b: dict, what: str) -> None:
    assert a["groups"] == b["groups"], what
    assert a["state"].keys() == b["state"].keys(), what
    for name, entry in a["state"].items():
        for key, t in entry.items():
            assert torch.equal(t, b["state"][name][key]), f"{what}: {name}.{key}"
    for name, t in a["params"].items():
        assert torch.equal(t, b["params"][name]), f"{what}: parameter {name}"


def test_stage0_state_loads_into_stage2_and_back_identically(tmp_path) -> None:
    for rank, got in enumerate(run_distributed(_round_trip, 2, str(tmp_path), timeout=300)):
        assert set(got["stage0"]["state"]["embed.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
        _assert_same(got["stage2"], got["stage0"], f"rank {rank} stage 0 -> stage 2")
        _assert_same(got["back"], got["stage0"], f"rank {rank} stage 0 -> stage 2 -> stage 0")
        assert got["resumed"] == got["continued"], f"rank {rank}: the restored run continues otherwise"
