"""LoRA through peft (an optional extra: ``pip install cai-booster[lora]``)."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from torch import nn

__all__ = ["enable_lora", "save_lora_as_pretrained"]


def _peft() -> Any:
    try:
        import peft
    except ImportError as e:
        raise ImportError("LoRA needs peft: pip install 'cai-booster[lora]' (or pip install peft)") from e
    return peft


def enable_lora(model: nn.Module, *, pretrained_dir: str | None = None, lora_config: Any = None) -> nn.Module:
    """Wrap ``model`` with LoRA adapters (a new ``lora_config``, or a saved adapter from ``pretrained_dir``)."""
    peft = _peft()
    if pretrained_dir is not None:
        return peft.PeftModel.from_pretrained(model, pretrained_dir, is_trainable=True)
    if lora_config is None:
        raise ValueError(
            "enable_lora: give lora_config (a peft.LoraConfig) or pretrained_dir (a saved adapter)"
        )
    return peft.get_peft_model(model, lora_config)


def save_lora_as_pretrained(model: nn.Module, checkpoint: str | os.PathLike) -> None:
    """Rank 0 writes the adapter with peft's ``save_pretrained``; the plugins that support LoRA keep whole,
    identical parameters on every rank, so rank 0's adapter is the adapter."""
    _peft()
    if not hasattr(model, "save_pretrained") or not hasattr(model, "peft_config"):
        raise ValueError(
            "save_lora_as_pretrained: the model has no LoRA adapter; call booster.enable_lora first"
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        model.save_pretrained(os.fspath(checkpoint), safe_serialization=True)
    if dist.is_initialized():
        dist.barrier()
