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
