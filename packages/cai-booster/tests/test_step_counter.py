"""The boosted optimizer's step() advances cai-mesh's step counter, which collective timeouts report."""

from __future__ import annotations

import torch

from cai.booster._wrappers import OptimizerWrapper
from cai.mesh import current_step


def test_optimizer_step_advances_the_training_step() -> None:
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = OptimizerWrapper(torch.optim.SGD([param], lr=0.5))
    before = current_step()
    for expected in (1, 2):
        param.grad = torch.ones(2)
        optimizer.step()
        assert current_step() == before + expected
    assert torch.equal(param.detach(), torch.zeros(2))  # the wrapped optimizer still stepped twice


def _plugin_steps() -> None:
    from cai.booster import Booster
    from cai.booster.plugin import GeminiPlugin, LowLevelZeroPlugin

    # the plugins whose optimizer wrappers step a cai-zero or cai-gemini optimizer of their own
    for plugin in (LowLevelZeroPlugin(stage=2, precision="fp32"), GeminiPlugin(precision="fp32")):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        booster = Booster(plugin=plugin, device="cpu")
        model, optimizer, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=0.1))
        before = current_step()
        for expected in (1, 2):
            booster.backward(model(torch.ones(2, 4)).sum(), optimizer)
            optimizer.step()
            optimizer.zero_grad()
            assert current_step() == before + expected, type(plugin).__name__


def test_plugin_optimizer_steps_advance_the_training_step() -> None:
    from cai.mesh.testing import run_distributed

    run_distributed(_plugin_steps, 1)
