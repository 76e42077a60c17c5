"""Shared measurement for the activation-checkpointing tests."""

from __future__ import annotations

import pytest
import torch


def _step_saving(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, int]:
    """A forward and backward of ``model`` on ``ids`` as its own labels: the loss and the bytes of floating-point
    tensors (parameters aside) autograd kept between them. The gradients stay on the parameters."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if t.is_floating_point() and storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), sum(saved.values())


@pytest.fixture
def step_saving():
    return _step_saving
