"""What a pipeline stage is: the contract between stage construction and the schedules.

[Note: stage contract]
A stage is an ``nn.Module``, one per model chunk that this rank holds (one chunk, or several for the interleaved
and V schedules), called as::

    outputs = stage(hidden, batch)      # forward(hidden: Hidden | None, batch: Batch) -> StageOutput

- Every pipeline rank reads the same micro-batch from its own data iterator, so every stage sees ``batch`` (the
  model's keyword inputs: input_ids, attention_mask, position_ids, labels, ...).
- The first stage gets ``hidden=None`` and reads ``batch``. A later stage gets the previous stage's output dict
  as ``hidden`` (its tensors arrive by P2P; non-tensor values pass through) and may read ``batch`` for masks and
  positions.
- A stage that is not the last returns the activations the next stage needs, e.g. ``{"hidden_states": h}``.
  The last stage returns the model's outputs: ``{"logits": ...}``, ``{"loss": ..., "logits": ...}`` when
  ``labels`` are in ``batch``, or the final hidden states of a model without a head.
- The schedule calls ``criterion(outputs, batch)`` on the last stage's outputs and backpropagates its result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Batch", "Criterion", "Hidden", "Stage", "StageOutput"]

Batch = dict[str, Any]
"""One micro-batch as the data iterator yields it: the model's keyword inputs."""

Hidden = dict[str, torch.Tensor | Any]
"""What one stage sends to the next: tensors (sent by P2P) and plain values (passed through)."""

StageOutput = dict[str, torch.Tensor | Any]
"""A stage's return value: the next stage's ``Hidden``, or the model's outputs on the last stage."""

Criterion = Callable[[StageOutput, Batch], torch.Tensor]
"""``criterion(outputs, batch) -> loss``, called on the last stage (e.g. ``lambda out, batch: out["loss"]``)."""


@runtime_checkable
class Stage(Protocol):
    """A model chunk as the schedules call it (see [Note: stage contract])."""

    def __call__(self, hidden: Hidden | None, batch: Batch) -> StageOutput: ...
