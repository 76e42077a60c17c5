"""The layout-independent state protocol (``sharded_state_dict`` / ``load_sharded_state_dict``) for the objects
that only the Booster knows how to read: plain or DDP-wrapped modules, FSDP2 (``fully_shard``) modules whose
parameters are DTensors sharded on dim 0, and the torch optimizers built on them.

Keys are the parameter names of the user's unwrapped module; optimizer keys are ``<param name>.<state key>``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from cai.mesh import LocalShard, ShardSpec, load_param_groups_state, param_groups_state

__all__ = ["ModuleState", "OptimizerState", "local_tensor", "named_tensors", "param_spec"]

Read = Callable[[str, ShardSpec, torch.dtype], torch.Tensor]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def param_spec(t: torch.Tensor) -> ShardSpec:
    """Where this rank's piece of ``t`` lies: the whole tensor, or FSDP2's dim-0 chunk (``torch.chunk`` sizes)."""
    if not hasattr(t, "device_mesh"):
        return ShardSpec.full(tuple(t.shape))
    shape = tuple(t.shape)
    placements = t.placements
    if len(placements) != 1 or placements[0].is_replicate():
        if all(p.is_replicate() for p in placements):
            return ShardSpec.full(shape)
        raise NotImplementedError(
            f"param_spec: DTensor placements {placements} are not supported (only Shard(0))"
        )
    if not placements[0].is_shard(0):
        raise NotImplementedError(
            f"param_spec: DTensor placement {placements[0]} is not supported (only Shard(0))"
        )
    mesh = t.device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    chunk = math.ceil(shape[0] / world) if shape else 0
    start = min(rank * chunk, shape[0])
    stop = min(start + chunk, shape[0])
    return ShardSpec(
        global_shape=shape, offsets=(start,) + (0,) * (len(shape) - 1), block_shape=(stop - start, *shape[1:])
    )


def named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    # named_parameters drops the second name of a tied parameter, so tied weights are stored once.
    out: dict[str, torch.Tensor] = dict(module.named_parameters())
    for mod_name, mod in module.named_modules():
        for buf_name, buf in mod._buffers.items():
            if buf is not None and buf_name not in mod._non_persistent_buffers_set:
                out[f"{mod_name}.{buf_name}" if mod_name else buf_name] = buf
    return out


class ModuleState:
    """State-protocol view of a plain, DDP-wrapped or FSDP2-sharded module (``module`` is the unwrapped one)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def tensors(self) -> dict[str, torch.Tensor]:
        """Parameters (tied ones once) and persistent buffers, by name."""
        return named_tensors(self.module)

    def sharded_state_dict(self) -> dict[str, LocalShard]:
        return {
            name: LocalShard(local_tensor(t).detach(), param_spec(t))
            for name, t in named_tensors(self.module).items()
        }

    def load_sharded_state_dict(self, read: Read) -> None:
        with torch.no_grad():
            for name, t in named_tensors(self.module).items():
                local = local_tensor(t)
                local.copy_(read(name, param_spec(t), local.dtype).to(local.device))


class OptimizerState:
    """State-protocol view of a torch optimizer whose parameters belong to ``module`` (plain or FSDP2)."""

    def __init__(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
        self.optimizer = optimizer
        self.names = {id(p): n for n, p in module.named_parameters()}

    def _name(self, p: torch.Tensor) -> str:
        try:
            return self.names[id(p)]
        except KeyError:
            raise ValueError(
                "OptimizerState: the optimizer holds a parameter that is not in the model; "
                "build the optimizer on model.parameters() before boost()"
            ) from None

    def sharded_state_dict(self) -> dict[str, LocalShard]:
        out: dict[str, LocalShard] = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for key, value in self.optimizer.state.get(p, {}).items():
                    if not torch.is_tensor(value):
                        value = torch.tensor(value)
                    if value.dim() == 0:
                        out[f"{self._name(p)}.{key}"] = LocalShard(value.detach().float(), ShardSpec.full(()))
                    else:
                        out[f"{self._name(p)}.{key}"] = LocalShard(
                            local_tensor(value).detach(), param_spec(p)
                        )
        return out

    def load_sharded_state_dict(self, read: Read) -> None:
        init_optimizer_state(self.optimizer)
        with torch.no_grad():
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    state = self.optimizer.state[p]
                    for key, value in state.items():
                        name = f"{self._name(p)}.{key}"
                        if not torch.is_tensor(value):
                            state[key] = type(value)(read(name, ShardSpec.full(()), torch.float32).item())
                        elif value.dim() == 0:
                            value.copy_(read(name, ShardSpec.full(()), torch.float32))
                        else:
                            local = local_tensor(value)
                            local.copy_(read(name, param_spec(p), local.dtype).to(local.device))

    def _group_names(self) -> list[list[str]]:
        return [[self._name(p) for p in g["params"]] for g in self.optimizer.param_groups]

    def param_groups_state(self) -> list[dict[str, Any]]:
        return param_groups_state(self.optimizer.param_groups, self._group_names())

    def load_param_groups_state(self, groups: list[dict[str, Any]]) -> None:
        load_param_groups_state(
            self.optimizer.param_groups, self._group_names(), groups, owner="load_param_groups_state"
        )


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's per-parameter state (so a loader knows its keys) with a step that changes nothing.

    Every group's lr is set to 0 and absent gradients to zeros for one ``step``, then step counters are reset, so
    the state is that of an optimizer which has not stepped (and a save before the first step has every key).
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if all(optimizer.state.get(p) for p in params):
        return
    saved_lrs = [g["lr"] for g in optimizer.param_groups]
    saved_grads = [p.grad for p in params]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0 if not torch.is_tensor(g["lr"]) else torch.zeros_like(g["lr"])
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, saved_lrs):
        g["lr"] = lr
    for p, grad in zip(params, saved_grads):
        p.grad = grad
        # Back to "no step taken": zero moments with step 0 update exactly like a fresh optimizer.
        step = optimizer.state[p].get("step")
        if torch.is_tensor(step):
            step.zero_()
        elif step is not None:
            optimizer.state[p]["step"] = 0


class LoadView:
    """A state-protocol object seen by a checkpoint loader, with every key of the whole group present.

    A sharded object reports only the pieces its rank holds (ZeRO: a small tensor may lie entirely on another
    rank), but the loader checks the checkpoint's keys against the object's. The union of keys over the ranks
    (one ``all_gather_object``) is reported here, keys held elsewhere as empty pieces; loading still asks
    exactly for the local pieces.
    """

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def sharded_state_dict(self) -> dict[str, LocalShard]:
        import torch.distributed as dist

        local = dict(self.obj.sharded_state_dict())
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return local
        # A list is a rank's several pieces of one tensor (a fused projection's row blocks): same global shape.
        shapes = {k: (s[0] if isinstance(s, list) else s).spec.global_shape for k, s in local.items() if s}
        everyone: list[dict[str, tuple[int, ...]]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, shapes)
        for other in everyone:
            for name, shape in other.items():
                if name not in local:
                    spec = (
                        ShardSpec(global_shape=shape, flat_range=(0, 0)) if shape else ShardSpec.full(shape)
                    )
                    local[name] = LocalShard(torch.empty(0), spec)
        return local

    def load_sharded_state_dict(self, read: Read) -> None:
        self.obj.load_sharded_state_dict(read)

    def param_groups_state(self) -> list[dict[str, Any]]:
        return self.obj.param_groups_state()

    def load_param_groups_state(self, groups: list[dict[str, Any]]) -> None:
        self.obj.load_param_groups_state(groups)
