"""JSON with tensors on the side: small state (schedulers, scalers, samplers, param groups) without pickle."""

from __future__ import annotations

import math
from typing import Any

import torch


def encode(obj: Any, tensors: dict[str, torch.Tensor], path: str = "") -> Any:
    """A JSON-able copy of ``obj``; tensors move to ``tensors`` (referenced by key), tuples are tagged."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}
    if isinstance(obj, torch.Tensor):
        key = path or "tensor"
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(
                    f"cannot store key {k!r} at {path or '<root>'}: only str and int keys are supported"
                )
            out[str(k) if isinstance(k, str) else f"__int__{k}"] = encode(
                v, tensors, f"{path}.{k}" if path else str(k)
            )
        return out
    if hasattr(obj, "item") and hasattr(obj, "dtype"):  # numpy scalars
        return encode(obj.item(), tensors, path)
    raise TypeError(
        f"cannot store {type(obj).__name__} at {path or '<root>'} in a checkpoint: state must be JSON-able values, "
        "tuples and tensors (a callable such as a LambdaLR lambda is not saved; recreate it in code)"
    )


def decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [decode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return tensors[obj["__tensor__"]]
        if set(obj) == {"__tuple__"}:
            return tuple(decode(v, tensors) for v in obj["__tuple__"])
        if set(obj) == {"__float__"}:
            return float(obj["__float__"])
        return {(int(k[7:]) if k.startswith("__int__") else k): decode(v, tensors) for k, v in obj.items()}
    return obj
