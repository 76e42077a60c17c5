"""A plain ``torch.optim.Optimizer`` seen through the state protocol: state by parameter name."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cai.mesh import LocalShard, ShardSpec, param_groups_state


def param_name_map(optimizer: torch.optim.Optimizer, param_names: Any) -> dict[int, str]:
    """id(param) -> name, from a model (its ``named_parameters``; a pipeline stage's ``global_named_parameters``, the
    full model's names), a dict param -> name, or a list of names."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if isinstance(param_names, nn.Module):
        # A stage's own names would repeat across stages (each has a "layers.0"); the full model's do not.
        named = getattr(param_names, "global_named_parameters", param_names.named_parameters)
        names = {id(p): n for n, p in named()}
    elif isinstance(param_names, dict):
        names = {id(p): n for p, n in param_names.items()}
    elif isinstance(param_names, (list, tuple)):
        if len(param_names) != len(params):
            raise ValueError(
                f"param_names has {len(param_names)} names, the optimizer has {len(params)} parameters"
            )
        names = {id(p): n for p, n in zip(params, param_names)}
    else:
        raise TypeError(
            "a plain torch optimizer needs parameter names: pass model=<the nn.Module> or param_names=<list|dict>, "
            f"got {type(param_names).__name__}"
        )
    unnamed = [i for i, p in enumerate(params) if id(p) not in names]
    if unnamed:
        raise ValueError(
            f"optimizer parameters at positions {unnamed[:10]} have no name in the given model/param_names"
        )
    return names


class TorchOptimizerAdapter:
    """Implements ``sharded_state_dict``/``param_groups_state`` (and loading) for a plain optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, param_names: Any):
        self.optimizer = optimizer
        self.names = param_name_map(optimizer, param_names)

    def sharded_state_dict(self) -> dict[str, LocalShard]:
        out = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for k, v in self.optimizer.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        out[f"{self.names[id(p)]}.{k}"] = LocalShard(v.detach(), ShardSpec.full(v.shape))
        return out

    def scalar_state(self) -> dict[str, dict[str, Any]]:
        """Non-tensor per-parameter state (some optimizers keep python numbers)."""
        out: dict[str, dict[str, Any]] = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for k, v in self.optimizer.state.get(p, {}).items():
                    if not isinstance(v, torch.Tensor):
                        out.setdefault(self.names[id(p)], {})[k] = v
        return out

    def param_groups_state(self) -> list[dict[str, Any]]:
        names = [[self.names[id(p)] for p in g["params"]] for g in self.optimizer.param_groups]
        return param_groups_state(self.optimizer.param_groups, names)

    def load(
        self, groups: list[dict[str, Any]], tensors: dict[str, torch.Tensor], scalars: dict[str, dict]
    ) -> None:
        """Load via ``Optimizer.load_state_dict`` (which casts state to each parameter's dtype and device)."""
        current = self.param_groups_state()
        if len(groups) != len(current):
            raise ValueError(f"checkpoint has {len(groups)} param groups, the optimizer has {len(current)}")
        index = {}
        for i, (saved, cur) in enumerate(zip(groups, current)):
            if sorted(saved["params"]) != sorted(cur["params"]):
                diff = sorted(set(saved["params"]) ^ set(cur["params"]))
                raise ValueError(
                    f"param group {i} holds different parameters in the checkpoint and the optimizer: {diff[:10]}"
                )
        position = 0
        for cur in current:
            for name in cur["params"]:
                index[name] = position
                position += 1
        state: dict[int, dict[str, Any]] = {}
        for key, t in tensors.items():
            name, k = key.rsplit(".", 1)
            state.setdefault(index[name], {})[k] = t
        for name, kv in scalars.items():
            state.setdefault(index[name], {}).update(kv)
        out_groups = []
        for saved, cur, live in zip(groups, current, self.optimizer.param_groups):
            # types from the live group (the saved values are JSON: lists, numbers); a key JSON could not hold keeps
            # its current value, since Optimizer.load_state_dict replaces the whole group
            g = {k: v for k, v in live.items() if k != "params"}
            g.update({k: _like(v, live.get(k)) for k, v in saved.items() if k != "params"})
            g["params"] = [index[n] for n in cur["params"]]
            out_groups.append(g)
        # Optimizer.load_state_dict matches params by position, so saved groups are reordered to ours above.
        self.optimizer.load_state_dict({"state": state, "param_groups": out_groups})


def _like(value: Any, current: Any) -> Any:
    """Give a loaded hyperparameter the type the optimizer uses now (tuple betas, tensor lr)."""
    if isinstance(current, tuple) and isinstance(value, list):
        return tuple(value)
    if isinstance(current, torch.Tensor) and not isinstance(value, torch.Tensor):
        return torch.tensor(value, dtype=current.dtype, device=current.device)
    return value
