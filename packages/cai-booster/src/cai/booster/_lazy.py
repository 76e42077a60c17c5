"""Lazy initialisation: build a model with its parameters on the meta device, shard it, then allocate and fill
only each rank's part.

[Note: lazy parameters]
Inside ``LazyInitContext`` every parameter a module registers is replaced by a meta tensor of the same shape,
dtype and ``requires_grad``; buffers stay real (they are small, and some, like rotary ``inv_freq``, are computed
in ``__init__``). Tied parameters stay one object, so ``materialize`` allocates them once and ties them again.
Values come from pretrained safetensors files (``from_pretrained`` inside the context records the path and
``Booster.boost`` loads it into the shards) or from replaying the construction ([Note: replaying construction]).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from cai.booster._replay import (
    LOGS,
    OF_META,
    OPEN,
    Log,
    Pending,
    View,
    as_view,
    covers,
    poison,
)

__all__ = ["LazyInitContext", "is_lazy", "pretrained_path", "set_pretrained_path"]

_PRETRAINED_ATTR = "_cai_pretrained_path"
# torch.nn.init functions that return at once for a meta tensor, and whether they draw random numbers
_META_SKIPPING_INITS = {"trunc_normal_": True, "orthogonal_": True, "sparse_": True, "dirac_": False}
_PENDING: WeakIdKeyDictionary = WeakIdKeyDictionary()  # allocated, not yet initialised parameter -> Pending


class LazyInitContext:
    """Context manager under which modules are built with meta parameters and their initialisation is recorded,
    so that materialising gives the values eager construction gives (see [Note: replaying construction]).

    Args:
        tensor_cls: accepted for Colossal-AI compatibility and ignored (cai records the ops itself).
        default_device: device that ``materialize`` allocates on when it is not given one (default: CPU).

    Example::

        with LazyInitContext():
            model = LlamaForCausalLM.from_pretrained("path/to/llama")   # nothing allocated, nothing read
        model, optimizer, *_ = booster.boost(model, optimizer)          # shards, then reads each rank's part

    Initialise the model inside the context: ops on its lazy parameters after the context closes are not
    recorded. Materialising replays on the device the model was built on (the CPU unless built under
    ``torch.device``), which costs what eager initialisation there costs.
    """

    def __init__(self, tensor_cls: object = None, default_device: torch.device | str | None = None) -> None:
        self.default_device = (
            torch.device(default_device) if default_device is not None else torch.device("cpu")
        )
        self._saved: list[tuple[Any, str, Any]] = []
        self._log: Log | None = None

    def __enter__(self) -> LazyInitContext:
        log = self._log = Log(self.default_device)
        original_register = nn.Module.register_parameter

        def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            original_register(module, name, param)
            if param is not None:
                module._parameters[name] = log.adopt(param)

        self._patch(nn.Module, "register_parameter", register_parameter)
        self._patch_from_pretrained()
        # torch.nn.init skips these for meta tensors: record each call as one op (Hugging Face keeps its own
        # references to them)
        hf_init = getattr(sys.modules.get("transformers.initialization"), "TORCH_INIT_FUNCTIONS", {})
        for name, random in _META_SKIPPING_INITS.items():
            original = getattr(nn.init, name)
            original = getattr(original, "_cai_init", original)  # an enclosing context's
            recorded = functools.wraps(original)(functools.partial(log.init_call, original, random))
            recorded._cai_init = original
            self._patch(nn.init, name, recorded)
            if getattr(hf_init.get(name), "_cai_init", hf_init.get(name)) is original:
                self._patch(hf_init, name, recorded)
        log.open()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._log.close()
        for owner, name, value in reversed(self._saved):
            if isinstance(owner, dict):
                owner[name] = value
            else:
                setattr(owner, name, value)
        self._saved.clear()

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        if isinstance(owner, dict):
            self._saved.append((owner, name, owner[name]))
            owner[name] = value
            return
        self._saved.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, value)

    def _patch_from_pretrained(self) -> None:
        # Only when transformers is installed: this package does not depend on it. Imported now, so that a model
        # class first touched inside the context (transformers imports lazily) finds the patch in place.
        if importlib.util.find_spec("transformers") is None:
            return
        modeling_utils = importlib.import_module("transformers.modeling_utils")
        from cai.booster._pretrained import build_from_pretrained

        def from_pretrained(cls: type, path: str | os.PathLike, *args: Any, **kwargs: Any) -> nn.Module:
            model, weights = build_from_pretrained(cls, path, *args, **kwargs)
            return set_pretrained_path(model, weights)

        self._patch(modeling_utils.PreTrainedModel, "from_pretrained", classmethod(from_pretrained))

    @staticmethod
    def materialize(
        module: nn.Module, device: torch.device | str | None = None, *, init: bool = True
    ) -> nn.Module:
        """Allocate every meta parameter of ``module`` on ``device`` (default: the ``default_device`` of the
        context that built it), tying shared ones, and give it its eager values (``init=False``: leave it empty)."""
        if device is None:
            logs = (_slot_of(p)[0] for p in module.parameters() if p.device.type == "meta")
            device = next((log.default_device for log in logs if log is not None), torch.device("cpu"))
        materialize(module, torch.device(device), init=init)
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
    """Replace meta parameters by ones on ``device`` (one allocation per shared storage), then initialise them.

    With ``init=False`` they stay empty; ``initialise`` fills them later (after pretrained weights did not)."""
    fresh: dict[int, nn.Parameter] = {}
    bases: dict[tuple[int, int], torch.Tensor] = {}
    touched: list[nn.Module] = []
    with _paused(), torch.no_grad():
        for sub in module.modules():
            for name, param in list(sub._parameters.items()):
                if param is None or param.device.type != "meta":
                    continue
                new = fresh.get(id(param))
                if new is None:
                    new = fresh[id(param)] = _allocate(param, device, bases)
                sub._parameters[name] = new
                touched.append(sub)
        for sub in module.modules():
            for name, buf in list(sub._buffers.items()):
                if buf is not None and buf.device != device:
                    sub._buffers[name] = buf.to(device)
        if init:
            unlinked = [p for p in fresh.values() if p not in _PENDING]
            for p in unlinked:
                poison(p)
            initialise(module, touched)
            _check(module, unlinked)


def initialise(module: nn.Module, touched: list[nn.Module]) -> None:
    """Fill freshly allocated parameters of ``touched`` modules: replay their construction, or, for those that
    cannot be replayed, run their modules' own initialisers (see [Note: replaying construction])."""
    replays: dict[int, tuple[Log, dict[int, torch.Tensor]]] = {}
    replayed: list[tuple[nn.Parameter, Log, int]] = []
    owners: list[nn.Module] = []  # modules holding parameters that cannot be replayed
    checked: list[nn.Parameter] = []
    seen: set[int] = set()
    with _paused(), torch.no_grad():
        for sub in dict.fromkeys(touched):
            for p in sub.parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                pending = _PENDING.pop(p, None)
                base = pending.base(p) if pending is not None else None
                if base is not None:
                    replays.setdefault(id(pending.log), (pending.log, {}))[1][pending.slot] = base
                    replayed.append((p, pending.log, pending.slot))
                    continue
                if sub not in owners:
                    owners.append(sub)
                if hasattr(p, "to_local"):  # a shard: nothing fills it after this
                    poison(p.to_local())
                    checked.append(p)
        if owners:
            _fallback(module, owners)
        unsure = {(id(log), s) for log, targets in replays.values() for s in log.replay(targets)}
        checked += [p for p, log, s in replayed if (id(log), s) in unsure]
        _check(module, checked)


def _fallback(module: nn.Module, owners: list[nn.Module]) -> None:
    for sub in owners:
        if hasattr(sub, "reset_parameters"):
            sub.reset_parameters()
    # Hugging Face models initialise with their own scheme (normal(0, initializer_range), ...).
    if hasattr(module, "initialize_weights") and hasattr(module, "config"):
        for sub in module.modules():
            for p in sub.parameters(recurse=False):
                p.__dict__.pop("_is_hf_initialized", None)
            sub.__dict__.pop("_is_hf_initialized", None)
        module.initialize_weights()


def _check(module: nn.Module, params: Iterable[nn.Parameter]) -> None:
    bad = {
        id(p)
        for p in params
        if p.is_floating_point() and bool(torch.isnan(p.to_local() if hasattr(p, "to_local") else p).any())
    }
    if bad:
        names = sorted({n for n, p in module.named_parameters(remove_duplicate=False) if id(p) in bad})
        raise RuntimeError(
            f"LazyInitContext: no initial values for {', '.join(names)}: nothing wrote (all of) them while the "
            "model was built, where eager construction would leave uninitialised memory, and no initialiser of "
            "their modules did. Initialise them in __init__ inside the context (nn.init.*, fill_, copy_) or give "
            "pretrained weights (from_pretrained inside the context, or set_pretrained_path)"
        )


def _allocate(param: nn.Parameter, device: torch.device, bases: dict) -> nn.Parameter:
    log, slot = _slot_of(param)
    geometry = (tuple(param.shape), tuple(param.stride()), param.storage_offset(), param.dtype)
    if slot is None:
        data = torch.empty_like(param, device=device)
    else:
        info, key = log.slots[slot], (id(log), slot)
        base = bases.get(key)
        if base is None and covers(View(slot, *geometry), info):
            data = torch.empty_strided(param.shape, param.stride(), dtype=param.dtype, device=device)
            bases[key] = data.as_strided((info.numel,), (1,), 0)
        else:
            if base is None:
                base = bases[key] = torch.empty(info.numel, dtype=info.dtype, device=device)
            data = as_view(base, *geometry)
    new = nn.Parameter(data, requires_grad=param.requires_grad)
    for key, value in vars(param).items():  # keep attributes such as tensor-parallel markers
        setattr(new, key, value)
    if slot is not None and param.dtype == log.slots[slot].dtype:
        _PENDING[new] = Pending(log, slot, param.storage_offset())
    return new


def _slot_of(t: torch.Tensor) -> tuple[Log | None, int | None]:
    first = OF_META.get(t)
    for log in ([first] if first is not None else []) + list(LOGS):
        slot = log.slot_of(t)
        if slot is not None:
            return log, slot
    return None, None


@contextlib.contextmanager
def _paused() -> Iterator[None]:
    """Stop the open contexts from recording (ops run while materialising are not construction)."""
    logs = list(OPEN)
    for log in logs:
        log.paused += 1
    try:
        yield
    finally:
        for log in logs:
            log.paused -= 1
