"""The dynamic loss scaler and fp16/bf16 through the optimizer wrapper, in one process."""

from __future__ import annotations

import torch

from cai.booster import DynamicLossScaler, LossScalerConfig, OptimizerWrapper


def test_scaler_backs_off_after_hysteresis_and_grows_after_interval() -> None:
    s = DynamicLossScaler(LossScalerConfig(initial_scale=16, growth_interval=2, hysteresis=2, min_scale=2))
    s.update(True)
    assert s.scale == 16  # first overflow is absorbed by hysteresis
    s.update(True)
    assert s.scale == 8
    s.update(False)
    s.update(False)
    assert s.scale == 16
    for _ in range(10):
        s.update(True)
    assert s.scale == 2  # never below min_scale
    assert s.skipped_steps == 12
    restored = DynamicLossScaler(s.config)
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict()


def _setup(scale: float) -> tuple[torch.nn.Linear, OptimizerWrapper]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    scaler = DynamicLossScaler(LossScalerConfig(initial_scale=scale, hysteresis=1))
    return model, OptimizerWrapper(torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler)


def test_scaled_step_equals_unscaled_step() -> None:
    model, opt = _setup(1024.0)
    ref = torch.nn.Linear(4, 2)
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    opt.backward(model(x).sum())
    ref(x).sum().backward()
    norm = opt.clip_grad_by_norm(0.5)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    torch.testing.assert_close(norm, ref_norm)
    opt.step()
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=0)


def test_overflow_skips_the_step_and_backs_off() -> None:
    model, opt = _setup(2.0**20)
    before = [p.detach().clone() for p in model.parameters()]
    opt.backward(model(torch.full((1, 4), 3e38)).sum())  # inf gradients
    opt.step()
    assert opt.scaler.scale == 2.0**19 and opt.scaler.skipped_steps == 1
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
