"""Compare a sharded run with a single-process reference."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["assert_close"]


def assert_close(
    actual: Any, expected: Any, *, rtol: float = 1e-6, atol: float = 0.0, name: str = ""
) -> None:
    """Assert tensors (or dicts / lists of them) match: ``|a - e| <= atol + rtol * |e|`` element-wise.

    The message names the first mismatching entry, the worst element, both values and the largest relative error,
    which is what one needs to tell a scaling bug (every element off by a factor) from accumulated rounding.
    """
    if isinstance(expected, Mapping):
        if not isinstance(actual, Mapping):
            raise AssertionError(f"{name or 'value'}: expected a mapping, got {type(actual).__name__}")
        missing, extra = expected.keys() - actual.keys(), actual.keys() - expected.keys()
        if missing or extra:
            raise AssertionError(
                f"{name or 'dict'}: missing keys {sorted(missing)}, unexpected keys {sorted(extra)}"
            )
        for k in expected:
            assert_close(actual[k], expected[k], rtol=rtol, atol=atol, name=f"{name}.{k}" if name else str(k))
        return
    if isinstance(expected, Sequence) and not isinstance(expected, str):
        if len(actual) != len(expected):
            raise AssertionError(f"{name or 'sequence'}: length {len(actual)} != {len(expected)}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_close(a, e, rtol=rtol, atol=atol, name=f"{name}[{i}]")
        return
    a = torch.as_tensor(actual).detach().cpu()
    e = torch.as_tensor(expected).detach().cpu()
    label = name or "tensor"
    if a.shape != e.shape:
        raise AssertionError(f"{label}: shape {tuple(a.shape)} != expected {tuple(e.shape)}")
    a64, e64 = a.double(), e.double()
    if not torch.equal(a64.isnan(), e64.isnan()):
        raise AssertionError(f"{label}: NaN pattern differs")
    diff = (a64 - e64).abs().nan_to_num(0.0)
    bad = diff > atol + rtol * e64.abs().nan_to_num(0.0)
    if bool(bad.any()):
        idx = int(torch.argmax((diff - rtol * e64.abs()).flatten()))
        rel = (diff / e64.abs().clamp_min(1e-30)).max().item()
        where = tuple(int(i) for i in torch.unravel_index(torch.tensor(idx), a.shape)) if a.dim() else ()
        raise AssertionError(
            f"{label}: {int(bad.sum())} of {a.numel()} elements differ (rtol={rtol}, atol={atol}); worst at {where}: "
            f"actual {a64.flatten()[idx].item():.9g}, expected {e64.flatten()[idx].item():.9g}; "
            f"max abs diff {diff.max().item():.3g}, max rel diff {rel:.3g}"
        )
