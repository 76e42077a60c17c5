"""Lazy initialisation: build a model with its parameters on the meta device, shard it, then allocate and fill
only each rank's part.

[Note: lazy parameters]
Inside ``LazyInitContext`` every parameter a module registers is replaced by a meta tensor of the same shape,
dtype and ``requires_grad``; buffers stay real (they are small, and some, like rotary ``inv_freq``, are computed
in ``__init__`` and cannot be recomputed later). Tied parameters stay one object, so ``materialize`` allocates
them once and ties them again. Values come either from the module's own initialisers (``reset_parameters``, or a
Hugging Face model's ``initialize_weights``), which draw from the same distributions as eager construction but
not the same numbers, or from pretrained safetensors files (``from_pretrained`` inside the context records the
path and ``Booster.boost`` loads it into the shards).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import nn

__all__ = ["LazyInitContext", "is_lazy", "pretrained_path", "set_pretrained_path"]

_PRETRAINED_ATTR = "_cai_pretrained_path"


class LazyInitContext:
    """Context manager under which modules are built with meta parameters (see [Note: lazy parameters]).

    Args:
        default_device: device that ``materialize`` allocates on when it is not given one (default: CPU).

    Example::

        with LazyInitContext():
            model = LlamaForCausalLM.from_pretrained("path/to/llama")   # nothing allocated, nothing read
        model, optimizer, *_ = booster.boost(model, optimizer)          # shards, then reads each rank's part
    """

    def __init__(self, default_device: torch.device | str | None = None) -> None:
        self.default_device = (
            torch.device(default_device) if default_device is not None else torch.device("cpu")
        )
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> LazyInitContext:
        original_register = nn.Module.register_parameter

        def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            original_register(module, name, param)
            if param is not None and param.device.type != "meta":
                meta = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
                for key, value in vars(param).items():  # keep attributes such as tensor-parallel markers
                    setattr(meta, key, value)
                module._parameters[name] = meta

        self._patch(nn.Module, "register_parameter", register_parameter)
        self._patch_from_pretrained()
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, value in reversed(self._saved):
            setattr(owner, name, value)
        self._saved.clear()

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, value)

    def _patch_from_pretrained(self) -> None:
        # Only when transformers is already imported: this package does not depend on it.
        modeling_utils = sys.modules.get("transformers.modeling_utils")
        if modeling_utils is None:
            return
        base = modeling_utils.PreTrainedModel

        def from_pretrained(cls: type, path: str | os.PathLike, *args: Any, **kwargs: Any) -> nn.Module:
            from transformers import AutoConfig

            config = kwargs.pop("config", None)
            if config is None:
                config = AutoConfig.from_pretrained(path, **kwargs.pop("config_kwargs", {}))
            dtype = kwargs.pop("torch_dtype", None) or kwargs.pop("dtype", None)
            build_kwargs = {"dtype": dtype} if isinstance(dtype, torch.dtype) else {}
            model = cls._from_config(config, **build_kwargs)
            setattr(model, _PRETRAINED_ATTR, os.fspath(path))
            return model

        self._patch(base, "from_pretrained", classmethod(from_pretrained))

    @staticmethod
    def materialize(
        module: nn.Module, device: torch.device | str | None = None, *, init: bool = True
    ) -> nn.Module:
        """Allocate every meta parameter of ``module`` on ``device`` (tying shared ones) and initialise it."""
        materialize(module, torch.device(device) if device is not None else torch.device("cpu"), init=init)
        return module


def is_lazy(module: nn.Module) -> bool:
    """True if any parameter of ``module`` is still on the meta device."""
    return any(p.device.type == "meta" for p in module.parameters())


def pretrained_path(module: nn.Module) -> str | None:
    """The checkpoint directory recorded by ``from_pretrained`` inside ``LazyInitContext``, if any."""
    return getattr(module, _PRETRAINED_ATTR, None)


def set_pretrained_path(module: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Mark a lazy model so that ``Booster.boost`` fills it from the safetensors files in ``path``."""
    setattr(module, _PRETRAINED_ATTR, os.fspath(path))
    return module


def materialize(module: nn.Module, device: torch.device, *, init: bool = True) -> None:
    """Replace meta parameters by empty ones on ``device`` (one allocation per shared parameter), then initialise."""
    replaced: dict[int, nn.Parameter] = {}
    touched: list[nn.Module] = []
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is None or param.device.type != "meta":
                continue
            new = replaced.get(id(param))
            if new is None:
                new = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                for key, value in vars(param).items():
                    setattr(new, key, value)
                replaced[id(param)] = new
            sub._parameters[name] = new
            touched.append(sub)
    for sub in module.modules():
        for name, buf in list(sub._buffers.items()):
            if buf is not None and buf.device != device:
                sub._buffers[name] = buf.to(device)
    if init:
        initialise(module, touched)


def initialise(module: nn.Module, touched: list[nn.Module]) -> None:
    """Fill freshly allocated parameters with the modules' own initialisers."""
    with torch.no_grad():
        seen: set[int] = set()
        for sub in touched:
            if id(sub) not in seen and hasattr(sub, "reset_parameters"):
                seen.add(id(sub))
                sub.reset_parameters()
        # Hugging Face models re-initialise with their own scheme (normal(0, initializer_range), ...).
        if hasattr(module, "initialize_weights") and hasattr(module, "config"):
            for sub in module.modules():
                for p in sub.parameters(recurse=False):
                    p.__dict__.pop("_is_hf_initialized", None)
                sub.__dict__.pop("_is_hf_initialized", None)
            module.initialize_weights()
