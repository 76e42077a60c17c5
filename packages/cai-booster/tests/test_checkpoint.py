"""Single-process checkpoint round trips through the Booster (the cross-plugin matrix is in integration-tests)."""

from __future__ import annotations

import os

import torch

from cai.booster import Booster
from cai.mesh.testing import TinyTransformer, make_batch


def _boosted(seed: int):
    booster = Booster(device="cpu")
    model = TinyTransformer(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, *_ = booster.boost(model, opt)
    return booster, model, opt


def test_save_before_the_first_step_loads_and_steps_identically(tmp_path) -> None:
    booster, model, opt = _boosted(0)
    booster.save_model(model, tmp_path / "model")
    booster.save_optimizer(opt, tmp_path / "optim")
    assert "model.safetensors.index.json" in os.listdir(tmp_path / "model")
    other_booster, other, other_opt = _boosted(5)
    other_booster.load_model(other, tmp_path / "model")
    other_booster.load_optimizer(other_opt, tmp_path / "optim")
    ids, labels = make_batch()
    for m, o in ((model, opt), (other, other_opt)):
        o.backward(TinyTransformer.loss(m(ids), labels))
        o.step()
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q)


def test_lr_scheduler_round_trip(tmp_path) -> None:
    booster, _, opt = _boosted(0)
    sched = torch.optim.lr_scheduler.StepLR(opt.unwrap(), step_size=2, gamma=0.5)
    for _ in range(3):
        opt.step()
        sched.step()
    booster.save_lr_scheduler(sched, tmp_path / "sched.json")
    fresh = torch.optim.lr_scheduler.StepLR(_boosted(0)[2].unwrap(), step_size=2, gamma=0.5)
    booster.load_lr_scheduler(fresh, tmp_path / "sched.json")
    assert fresh.state_dict() == sched.state_dict()


def test_async_save_then_load(tmp_path) -> None:
    booster, model, opt = _boosted(0)
    ids, labels = make_batch()
    opt.backward(TinyTransformer.loss(model(ids), labels))
    opt.step()
    booster.save_model(model, tmp_path / "model", use_async=True)
    booster.save_optimizer(opt, tmp_path / "optim", use_async=True)
    other_booster, other, other_opt = _boosted(5)
    other_booster.load_model(other, tmp_path / "model")  # waits for the pending writes first
    other_booster.load_optimizer(other_opt, tmp_path / "optim")
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q)
    assert opt.state_dict()["state"][0]["step"] == other_opt.state_dict()["state"][0]["step"]


def test_gemini_fp16_save_state_resumes_the_loss_scale(tmp_path) -> None:
    from cai.booster.plugin import GeminiPlugin

    def fresh():
        booster = Booster(
            plugin=GeminiPlugin(precision="fp16", initial_scale=2.0**10, hysteresis=1), device="cpu"
        )
        model = TinyTransformer(seed=0)
        model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        return booster, model, opt

    booster, model, opt = fresh()
    ids, labels = make_batch()
    opt.backward(TinyTransformer.loss(model(ids), labels) * float("inf"))  # overflow: the scale backs off
    opt.step()
    opt.zero_grad()
    assert opt.scaler.scale == 2.0**9
    booster.save_state(tmp_path / "ckpt", step=1, model=model, optimizer=opt)

    other_booster, other, other_opt = fresh()
    assert other_opt.scaler.scale == 2.0**10
    other_booster.load_state(tmp_path / "ckpt", model=other, optimizer=other_opt)
    assert other_opt.scaler.state_dict() == opt.scaler.state_dict()
    assert other_opt.scaler.skipped_steps == 1
