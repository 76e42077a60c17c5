"""Helpers the encoder policies share: size checks and weight ties kept across module replacement."""

from __future__ import annotations

from torch import nn


def check_divisible(name: str, tp: int, **sizes: int) -> None:
    """Raise naming the first size (heads, intermediate size, ...) that does not divide over tp."""
    for what, n in sizes.items():
        if n % tp:
            raise ValueError(
                f"{name}: {what}={n} does not divide over tensor_parallel_size={tp}; use a tp size that divides {n}"
            )


def tied_names(model: nn.Module, path: str) -> list[str]:
    """The other parameter names of the tensor at `path` (a model's shared embedding and the layers tied to it)."""
    target = model.get_parameter(path)
    return [n for n, p in model.named_parameters(remove_duplicate=False) if p is target and n != path]


def retie(model: nn.Module, path: str, names: list[str]) -> None:
    """Point every name in `names` at the (replaced) parameter at `path` again."""
    target = model.get_parameter(path)
    for name in names:
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, target)
