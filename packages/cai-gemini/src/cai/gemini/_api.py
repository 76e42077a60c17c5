"""The one-call entry point."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from cai.gemini._config import GeminiConfig
from cai.gemini._memory import MemoryTracker
from cai.gemini._model import GeminiModel
from cai.gemini._optim import GeminiOptimizer

__all__ = ["shard"]


def shard(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    config: GeminiConfig | None = None,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    memory: MemoryTracker | None = None,
) -> tuple[GeminiModel, GeminiOptimizer | None]:
    """Pack ``model``'s parameters into chunks sharded over ``group`` and wrap ``optimizer`` to step them.

    Args:
        model: the model, typically built on the host (it may be larger than the device).
        optimizer: an Adam/AdamW over ``model.parameters()`` (torch or ``cai.kernels.optim``), or None.
        config: see ``GeminiConfig`` (default: static, bf16, everything on the device, ZeRO-3 sharding).
        group: data-parallel group (default: the world, or one process without torch.distributed).
        device: compute device (default: the current CUDA device, else the CPU).
        memory: a ``MemoryTracker``; inject one with ``device_capacity`` to simulate a budget.

    Returns:
        ``(GeminiModel, GeminiOptimizer or None)``.

    Example::

        model = AutoModelForCausalLM.from_config(cfg)
        optimizer = HybridAdam(model.parameters(), lr=1e-4)
        model, optimizer = gemini.shard(model, optimizer, config=GeminiConfig(offload_optim_frac=1.0))
        for batch in loader:
            loss = model(**batch).loss
            optimizer.backward(loss); optimizer.step(); optimizer.zero_grad()
    """
    gm = GeminiModel(model, config=config, group=group, device=device, memory=memory)
    return gm, (GeminiOptimizer(optimizer, gm) if optimizer is not None else None)
