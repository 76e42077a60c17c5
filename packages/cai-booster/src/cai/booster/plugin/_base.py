"""The plugin contract: declared capabilities checked when the Booster is built, and the pieces every
data-parallel plugin shares (device choice, data loading, rebinding an optimizer to new parameters)."""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cai.booster._dataloader import ResumableDataLoader, prepare_dataloader
from cai.booster._precision import MixedPrecision
from cai.booster._wrappers import ModelWrapper, OptimizerWrapper

__all__ = ["BoostContext", "Boosted", "Capabilities", "DPPluginBase", "Plugin"]

Boosted = tuple[ModelWrapper, OptimizerWrapper | None, Callable | None, Any, Any]


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What a plugin supports; ``Booster`` checks its arguments against this when it is built.

    Attributes:
        precisions: precision names the plugin accepts (``"fp32"``, ``"fp16"``, ``"bf16"``).
        devices: device types it runs on (``"cpu"`` runs on gloo, ``"cuda"`` on NCCL).
        control_precision: True if precision is a plugin argument (Booster ``mixed_precision`` must be unset).
        control_device: True if the plugin places the model itself.
        no_sync: True if ``booster.no_sync`` can skip gradient synchronisation during accumulation.
        lora: True if ``enable_lora`` is supported.
        pipeline: True if ``execute_pipeline`` is supported.
        checkpoint_format: what ``save_model`` writes.
    """

    precisions: tuple[str, ...]
    devices: tuple[str, ...] = ("cpu", "cuda")
    control_precision: bool
    control_device: bool = True
    no_sync: bool
    lora: bool
    pipeline: bool = False
    checkpoint_format: str = "Hugging Face safetensors (model) + per-parameter-name safetensors (optimizer)"


@dataclass(frozen=True, kw_only=True)
class BoostContext:
    """What the Booster passes to ``Plugin.configure``."""

    device: torch.device
    mixed_precision: MixedPrecision | None = None
    pretrained: str | None = None  # safetensors directory recorded by LazyInitContext.from_pretrained


class Plugin(ABC):
    """Base class of every plugin. Subclasses declare ``capabilities`` and implement ``configure``.

    The class attributes summarise the declaration for error messages that list which plugins would work.
    """

    LORA = False
    NO_SYNC = False
    PIPELINE = False
    CONTROLS_PRECISION = True

    @property
    @abstractmethod
    def capabilities(self) -> Capabilities: ...

    @abstractmethod
    def configure(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        criterion: Callable | None,
        dataloader: Any,
        lr_scheduler: Any,
        ctx: BoostContext,
    ) -> Boosted: ...

    # Colossal-AI's capability methods, derived from the declaration.
    def supported_devices(self) -> list[str]:
        return list(self.capabilities.devices)

    def supported_precisions(self) -> list[str]:
        return list(self.capabilities.precisions)

    def control_precision(self) -> bool:
        return self.capabilities.control_precision

    def control_device(self) -> bool:
        return self.capabilities.control_device

    def support_no_sync(self) -> bool:
        return self.capabilities.no_sync

    def support_lora(self) -> bool:
        return self.capabilities.lora

    def control_checkpoint_io(self) -> bool:
        return True

    @property
    def name(self) -> str:
        return type(self).__name__

    @property
    def precision(self) -> str | None:
        """The plugin's own precision argument, for plugins that control precision."""
        return None

    @contextlib.contextmanager
    def no_sync(self, model: ModelWrapper, optimizer: OptimizerWrapper | None = None) -> Iterator[None]:
        raise NotImplementedError(f"{self.name} does not support no_sync")
        yield

    @contextlib.contextmanager
    def gathered(self, model: ModelWrapper) -> Iterator[None]:
        """Whole parameters for the forwards inside (``Booster.gathered``); nothing to do where they are whole."""
        yield

    def model_state(self, model: ModelWrapper) -> Any:
        """The state-protocol object (``sharded_state_dict``/``load_sharded_state_dict``) for a boosted model."""
        from cai.booster._state import ModuleState

        return ModuleState(model.unwrap())

    def optimizer_state(self, optimizer: OptimizerWrapper, model: ModelWrapper) -> Any:
        from cai.booster._state import OptimizerState

        return OptimizerState(optimizer.unwrap(), model.unwrap())

    def rng_states(self) -> dict[str, Any]:
        """Random generators of this rank that ``save_state`` keeps beside the global ones (name -> object with
        ``state_dict``/``load_state_dict``)."""
        return {}

    def prepare_optimizer_load(self, optimizer: OptimizerWrapper) -> None:
        """Create the optimizer's per-parameter state before a checkpoint is loaded (the loader checks keys first)."""
        from cai.booster._state import init_optimizer_state

        init_optimizer_state(optimizer.unwrap())

    def check_device(self, device: torch.device) -> None:
        """Raise if a plugin option cannot run on ``device``; the Booster calls this when it is built."""
        return None  # every option of the base plugin runs on every device it declares

    def sync_replicas(self, model: nn.Module) -> None:
        """Check that the data-parallel ranks built the same model and give them rank 0's weights, before
        ``configure`` (see [Note: replicas agree at boost]). A plugin whose ranks hold different parts of the model
        before ``boost()`` overrides this."""
        from cai.booster._replicas import sync_replicas

        sync_replicas(model, self.dp_group, owner=f"{self.name} boost()")

    def default_device(self) -> torch.device:
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cpu")

    # Data parallelism: subclasses with a smaller data-parallel group override these.
    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return None

    @property
    def dp_size(self) -> int:
        return dist.get_world_size(self.dp_group) if dist.is_initialized() else 1

    @property
    def dp_rank(self) -> int:
        return dist.get_rank(self.dp_group) if dist.is_initialized() else 0

    def prepare_dataloader(
        self,
        dataset: Any,
        batch_size: int,
        shuffle: bool = False,
        seed: int = 1024,
        drop_last: bool = False,
        pin_memory: bool = False,
        num_workers: int = 0,
        **kwargs: Any,
    ) -> ResumableDataLoader:
        """A resumable DataLoader that gives this data-parallel rank its share of ``dataset`` (per-rank seeds)."""
        return prepare_dataloader(
            dataset,
            batch_size,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            pin_memory=pin_memory,
            num_workers=num_workers,
            **kwargs,
        )

    def enable_lora(
        self, model: nn.Module, pretrained_dir: str | None = None, lora_config: Any = None
    ) -> nn.Module:
        from cai.booster._lora import enable_lora

        if not self.capabilities.lora:
            raise ValueError(
                f"{self.name} does not support LoRA; use one of the plugins that do ({lora_plugins()})"
            )
        return enable_lora(model, pretrained_dir=pretrained_dir, lora_config=lora_config)


class DPPluginBase(Plugin):
    """A plugin whose data-parallel group is the whole world."""


def lora_plugins() -> str:
    from cai.booster.plugin import PLUGINS

    return ", ".join(p.__name__ for p in PLUGINS if p.LORA)


def rebind_optimizer(
    optimizer: torch.optim.Optimizer, old_names: dict[int, str], new_params: dict[str, nn.Parameter]
) -> torch.optim.Optimizer:
    """Rebuild ``optimizer`` (same class, same groups and hyperparameters) on new parameter objects.

    Sharding (FSDP2) and lazy materialisation replace parameter objects; an optimizer built before ``boost`` still
    points at the old ones. ``old_names`` maps id(old param) -> name; ``new_params`` maps name -> new param.
    """
    if any(optimizer.state.values()):
        raise ValueError(
            f"boost(): {type(optimizer).__name__} already has state (it has stepped); boost before the first step, "
            "or load the state after boost() with booster.load_optimizer"
        )
    # The state is empty, so swapping the parameter lists in place is the whole rebuild; it keeps the optimizer's
    # class, hyperparameters and any hooks, whatever optimizer it is.
    for group in optimizer.param_groups:
        group["params"] = [new_params[old_names[id(p)]] for p in group["params"]]
    return optimizer


def param_names(module: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
