"""Save under each sharded layout, load under every other (gloo on CPU, hand-made state-protocol objects).

``ShardedAdam`` keeps the model replicated and its fp32 master weights and Adam moments sharded: flat ZeRO-style
pieces (with padding) at dp 1/2/4, or row blocks (tensor-parallel style). Every layout runs the same elementwise
arithmetic on its pieces, so all of them match a one-process run bit for bit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import cai.ckpt as ck
from cai.mesh import LocalShard, ShardSpec
from cai.mesh.testing import CollectiveCounter, TinyTransformer, make_batch, one_thread, run_distributed


@dataclass(frozen=True, kw_only=True)
class Layout:
    name: str
    world: int
    kind: str  # "flat": ZeRO-style flat pieces; "rows": blocks along dim 0 (replicated when not divisible)


LAYOUTS = [
    Layout(name="dp1", world=1, kind="flat"),
    Layout(name="dp2", world=2, kind="flat"),
    Layout(name="dp4", world=4, kind="flat"),
    Layout(name="rows2", world=2, kind="rows"),
]
SAVE_STEP, MORE_STEPS, LR, BETAS, EPS = 3, 5, 1e-2, (0.9, 0.99), 1e-8


def _spec(shape: torch.Size, rank: int, layout: Layout) -> ShardSpec:
    if layout.kind == "flat":
        return ShardSpec.flat_shard(shape, rank, layout.world)
    if len(shape) and shape[0] % layout.world == 0:
        return ShardSpec.block(shape, dim=0, index=rank, parts=layout.world)
    return ShardSpec.full(shape)


class ShardedAdam:
    """Adam over sharded fp32 state; implements the state protocol for the model and the optimizer."""

    def __init__(self, model: torch.nn.Module, layout: Layout):
        self.model, self.layout = model, layout
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.params = dict(model.named_parameters())
        self.specs = {n: _spec(p.shape, self.rank, layout) for n, p in self.params.items()}
        self.master = {n: self.specs[n].cut(p.detach()).clone() for n, p in self.params.items()}
        self.exp_avg = {n: torch.zeros_like(m) for n, m in self.master.items()}
        self.exp_avg_sq = {n: torch.zeros_like(m) for n, m in self.master.items()}
        self.step_count = torch.zeros(())
        self.lr = LR
        self.model_view = _View(self._model_state, self._load_model_state)

    def step(self) -> None:
        self.step_count += 1
        t = float(self.step_count)
        for n, p in self.params.items():
            g = self.specs[n].cut(p.grad)
            m, v = self.exp_avg[n], self.exp_avg_sq[n]
            m.mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0])
            v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
            denom = (v / (1 - BETAS[1] ** t)).sqrt().add_(EPS)
            self.master[n].addcdiv_(m, denom, value=-self.lr / (1 - BETAS[0] ** t))
        self._sync_params()

    def _sync_params(self) -> None:
        """All-gather the updated pieces into the replicated parameters."""
        with torch.no_grad():
            for n, p in self.params.items():
                local = self.master[n]
                pieces = [local]
                if self.layout.world > 1:
                    pieces = [torch.empty_like(local) for _ in range(self.layout.world)]
                    dist.all_gather(pieces, local.contiguous())
                for r, piece in enumerate(pieces):
                    _spec(p.shape, r, self.layout).place(piece, p.data)
                p.grad = None

    # ---- the state protocol ------------------------------------------------------------------------------
    def _model_state(self) -> dict[str, LocalShard]:
        return {n: LocalShard(self.master[n], self.specs[n]) for n in self.params}

    def _load_model_state(self, read) -> None:
        for n in self.params:
            self.master[n].copy_(read(n, self.specs[n], torch.float32))
        self._sync_params()

    def sharded_state_dict(self) -> dict[str, LocalShard]:
        out = {}
        for n in self.params:
            out[f"{n}.exp_avg"] = LocalShard(self.exp_avg[n], self.specs[n])
            out[f"{n}.exp_avg_sq"] = LocalShard(self.exp_avg_sq[n], self.specs[n])
            out[f"{n}.step"] = LocalShard(self.step_count, ShardSpec.full(()))
        return out

    def load_sharded_state_dict(self, read) -> None:
        for n in self.params:
            self.exp_avg[n].copy_(read(f"{n}.exp_avg", self.specs[n], torch.float32))
            self.exp_avg_sq[n].copy_(read(f"{n}.exp_avg_sq", self.specs[n], torch.float32))
            self.step_count.copy_(read(f"{n}.step", ShardSpec.full(()), torch.float32))

    def param_groups_state(self) -> list[dict[str, Any]]:
        return [{"lr": self.lr, "betas": list(BETAS), "params": list(self.params)}]

    def load_param_groups_state(self, groups: list[dict[str, Any]]) -> None:
        self.lr = groups[0]["lr"]


class _View:
    def __init__(self, get, load):
        self.sharded_state_dict, self.load_sharded_state_dict = get, load


def _train(model: TinyTransformer, opt: ShardedAdam, start: int, steps: int) -> list[float]:
    losses = []
    for s in range(start, start + steps):
        x, y = make_batch(seed=s)  # the same batch on every rank: replicated gradients, no all-reduce needed
        loss = model.loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---- rank functions ------------------------------------------------------------------------------------------
def _save_run(layout: Layout, path: str, use_async: bool) -> dict[str, torch.Tensor]:
    model = TinyTransformer(seed=0)
    opt = ShardedAdam(model, layout)
    _train(model, opt, 0, SAVE_STEP)
    with CollectiveCounter() as cc:
        ck.save_state(
            path,
            model=opt.model_view,
            optimizer=opt,
            step=SAVE_STEP,
            size_per_shard=0.005,
            use_async=use_async,
        )
        ck.wait()
    if layout.world > 1:
        # metadata once per state object, pieces by point-to-point only: no tensor collective, no rank gathers all
        assert (
            cc.count("all_gather_object") == 2 and cc.count("all_gather") == 0 and cc.count("all_reduce") == 0
        )
        own = sum(
            t.numel() * t.element_size()
            for t, _ in [*opt._model_state().values(), *opt.sharded_state_dict().values()]
        )
        assert cc.bytes("isend") <= own
    return _full_params(model)


def _load_run(
    layout: Layout, path: str
) -> tuple[dict[str, torch.Tensor], list[float], dict[str, torch.Tensor]]:
    model = TinyTransformer(seed=7)  # different weights: only the checkpoint can make it match
    opt = ShardedAdam(model, layout)
    info = ck.load_state(path, model=opt.model_view, optimizer=opt, verify=True)
    assert info["step"] == SAVE_STEP
    loaded = _full_params(model)
    losses = _train(model, opt, SAVE_STEP, MORE_STEPS)
    return loaded, losses, _full_params(model)


def _reference_run() -> tuple[dict[str, torch.Tensor], list[float], dict[str, torch.Tensor]]:
    model = TinyTransformer(seed=0)
    opt = ShardedAdam(model, LAYOUTS[0])
    _train(model, opt, 0, SAVE_STEP)
    at_save = _full_params(model)
    losses = _train(model, opt, SAVE_STEP, MORE_STEPS)
    return at_save, losses, _full_params(model)


# ---- tests ---------------------------------------------------------------------------------------------------
def _run(fn, layout: Layout, *args: Any, **kwargs: Any) -> list[Any]:
    """One rank runs here without a process group (the non-distributed path); more go to gloo workers."""
    if layout.world == 1:
        with one_thread():
            return [fn(layout, *args, **kwargs)]
    return run_distributed(fn, layout.world, layout, *args, **kwargs)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layouts")
    out = {}
    for i, layout in enumerate(LAYOUTS):
        path = root / layout.name
        _run(_save_run, layout, str(path), use_async=bool(i % 2))
        out[layout.name] = path
    return out


@pytest.fixture(scope="module")
def reference():
    with one_thread():
        return _reference_run()


def _bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    for k in a:
        assert torch.equal(a[k], b[k]), (
            f"{what}: {k} differs (max abs diff {(a[k] - b[k]).abs().max().item()})"
        )


@pytest.mark.parametrize("load", LAYOUTS, ids=lambda layout: f"to-{layout.name}")
@pytest.mark.parametrize("save", LAYOUTS, ids=lambda layout: f"from-{layout.name}")
def test_save_under_one_layout_load_under_another(saved, reference, save: Layout, load: Layout):
    at_save, ref_losses, ref_final = reference
    results = _run(_load_run, load, str(saved[save.name]))
    for loaded, losses, final in results:
        _bitwise(at_save, loaded, "parameters after load")
        assert losses == ref_losses
        _bitwise(ref_final, final, f"parameters after {MORE_STEPS} more steps")


def test_saved_files_hold_full_unpadded_tensors(saved, reference):
    at_save = reference[0]
    reader = ck.CheckpointReader(
        saved["dp4"] / "step-000003" / "model",
        index_name="model.safetensors.index.json",
        single_name=None,
        verify=True,
    )
    for n, t in at_save.items():
        assert torch.equal(reader.read(n, ShardSpec.full(t.shape)), t)
    files = sorted(p.name for p in (saved["dp4"] / "step-000003" / "model").glob("model-*"))
    assert len(files) > 4
    layout = json.loads((saved["dp4"] / "step-000003" / "manifest.json").read_text())["layout"]
    assert layout["world_size"] == 4 and layout["model/model"]["piece_kinds"] == ["flat"]
    assert all(n > 0 for n in layout["model/model"]["files_per_rank"])  # every rank wrote files
    rows = json.loads((saved["rows2"] / "step-000003" / "manifest.json").read_text())["layout"]
    assert rows["world_size"] == 2 and rows["model/model"]["piece_kinds"] == ["block"]


def _save_with_failing_rank(layout: Layout, path: str) -> str:
    import cai.ckpt._save as save_module

    model = TinyTransformer(seed=0)
    opt = ShardedAdam(model, layout)
    ck.save_state(path, model=opt.model_view, optimizer=opt, step=1, size_per_shard=0.005)
    original = save_module._write_file

    def broken(*args: Any, **kwargs: Any) -> None:
        raise OSError("No space left on device (injected)")

    if dist.get_rank() == 1:
        save_module._write_file = broken
    try:
        ck.save_state(path, model=opt.model_view, optimizer=opt, step=2, size_per_shard=0.005)
        return "saved"
    except Exception as e:
        return str(e)
    finally:
        save_module._write_file = original


def test_a_rank_that_fails_to_write_stops_every_rank_and_keeps_the_previous_checkpoint(tmp_path):
    messages = run_distributed(_save_with_failing_rank, 2, LAYOUTS[1], str(tmp_path), timeout=120)
    assert "No space left on device (injected)" in messages[1]
    assert "was not saved: rank-00001 failed" in messages[0] and "No space left" in messages[0]
    assert ck.latest_checkpoint(tmp_path) == tmp_path / "step-000001"
    assert not (tmp_path / "step-000002").exists()
