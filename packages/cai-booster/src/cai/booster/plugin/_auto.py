"""AutoPlugin (``Booster(plugin="auto")``): the planner's fastest configuration that fits this machine, chosen when
``boost()`` sees the model, the optimizer and the first batch."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cai.booster._plan._hardware import available_host_bytes, free_device_bytes
from cai.booster._precision import check_precision
from cai.booster.plugin._base import BoostContext, Boosted, Capabilities, DPPluginBase, Plugin
from cai.mesh import get_dist_logger

__all__ = ["AutoPlugin"]

_PRECISIONS = ("bf16", "fp16", "fp32")
# Plugins auto may pick: the data-parallel ones, which keep the user's loop and data loader as they are (tensor or
# pipeline parallelism changes how batches are fed and is chosen by hand).
_AUTO_PLUGINS = ("ddp", "fsdp", "zero1", "zero2", "gemini")


class AutoPlugin(DPPluginBase):
    """Pick the plugin, host offload and activation checkpointing at ``boost()`` with ``cai.booster.plan``: the
    fastest configuration whose predicted peaks fit the free GPU memory and the available host memory, for the
    model, the micro-batch and sequence length of the first batch, and the world size. Logs one line saying what it
    chose and why; ``chosen`` holds the plan row afterwards.

    Args:
        precision: working precision (``"bf16"`` default); fp32 masters and Adam states either way.
        accumulation: micro-batches the training loop accumulates per optimizer step (default 1).
        seq_len: tokens per sequence (default: read from the first batch of the data loader given to ``boost``).
        micro_batch: sequences per rank per forward (default: read from that batch).
        gpu_budget_bytes, host_budget_bytes: memory the job may use (default: free device memory, available host
            memory shared by the local ranks).
        kernels: apply cai-kernels' fused kernels and loss to the model (default: on CUDA).
        hardware: the machine's rates (default: the stored calibration, see ``cai plan --calibrate``).

    Host offload is considered only with an optimizer that steps on the host (``HybridAdam``, ``CPUAdam``), and
    FSDP only with torch's optimizers.

    Example::

        booster = Booster(plugin="auto")
        model, optimizer, _, dataloader, _ = booster.boost(model, HybridAdam(model.parameters()), None, dataloader)
    """

    def __init__(
        self,
        *,
        precision: str = "bf16",
        accumulation: int = 1,
        seq_len: int | None = None,
        micro_batch: int | None = None,
        gpu_budget_bytes: int | None = None,
        host_budget_bytes: int | None = None,
        kernels: bool | None = None,
        hardware: Any = None,
    ) -> None:
        check_precision(precision, _PRECISIONS, owner="AutoPlugin")
        if accumulation < 1:
            raise ValueError(f"AutoPlugin: accumulation={accumulation} must be >= 1")
        self._precision = precision
        self.accumulation = accumulation
        self.seq_len = seq_len
        self.micro_batch = micro_batch
        self.gpu_budget_bytes = gpu_budget_bytes
        self.host_budget_bytes = host_budget_bytes
        self.kernels = kernels
        self.hardware = hardware
        self.chosen = None  # the plan row, after resolve()

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(precisions=_PRECISIONS, control_precision=True, no_sync=True, lora=False)

    @property
    def precision(self) -> str:
        return self._precision

    def configure(self, model, optimizer, criterion, dataloader, lr_scheduler, ctx: BoostContext) -> Boosted:
        raise RuntimeError(
            "AutoPlugin: Booster.boost() resolves it first; call Booster(plugin='auto').boost(...)"
        )

    def resolve(self, model: nn.Module, optimizer: Any, dataloader: Any, device: torch.device) -> Plugin:
        """Plan, apply the chosen recompute policy and kernels to ``model``, and return the chosen plugin."""
        from cai.booster._checkpointing import activation_checkpointing
        from cai.booster._plan import ModelSpec, plan
        from cai.kernels.optim import CPUAdam

        world = dist.get_world_size() if dist.is_initialized() else 1
        mb, seq = _batch_shape(dataloader, self.micro_batch, self.seq_len)
        host_optimizer = isinstance(optimizer, CPUAdam)
        plugins = tuple(
            p
            for p in _AUTO_PLUGINS
            if not (p == "fsdp" and host_optimizer) and not (p == "zero1" and world == 1)
        )
        kernels = device.type == "cuda" if self.kernels is None else self.kernels
        gpu_budget, host_budget = self._budgets(device)
        p = plan(
            ModelSpec.from_model(model), gpu_budget_bytes=gpu_budget, host_budget_bytes=host_budget, gpus=world,
            seq_len=seq, global_batch=mb * self.accumulation * world, precision=self._precision, kernels=kernels,
            hardware=self.hardware, device=device.type, plugins=plugins, micro_batches=(mb,),
            host_offload=host_optimizer,  # offload needs an optimizer that steps on the host
        )  # fmt: skip
        if p.best is None:
            raise ValueError(f"AutoPlugin: {p.summary()}")
        self.chosen = p.best
        get_dist_logger().info(f"AutoPlugin chose {p.summary()}", ranks=[0])
        c = p.best.candidate
        if c.recompute != "none" or c.offload_activations:
            activation_checkpointing(model, c.recompute, offload=c.offload_activations)
        if kernels:
            from cai.kernels import patch_hf_model

            patch_hf_model(model)
        return p.best.candidate.plugin_call(self._precision).build()

    def _budgets(self, device: torch.device) -> tuple[int, int]:
        """This job's budgets: given, or what is free now; the smallest over the ranks, so that every rank plans
        the same configuration (ranks that chose different plugins would hang in their first collective)."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        host = self.host_budget_bytes or available_host_bytes()
        if device.type == "cuda":
            gpu = self.gpu_budget_bytes or free_device_bytes(device)
        else:  # the "device" is the host, shared by the local ranks
            gpu = self.gpu_budget_bytes or host // local
        if dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor(
                [gpu, host], dtype=torch.int64, device=device if dist.get_backend() == "nccl" else "cpu"
            )
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            gpu, host = (int(v) for v in t.tolist())
        return gpu, host


def _batch_shape(dataloader: Any, micro_batch: int | None, seq_len: int | None) -> tuple[int, int]:
    """Micro-batch and sequence length: given, or read from the data loader's first batch (a fresh iterator: the
    user's iteration is untouched)."""
    if micro_batch and seq_len:
        return micro_batch, seq_len
    if dataloader is None:
        raise ValueError(
            "AutoPlugin: pass the data loader to boost(), or AutoPlugin(micro_batch=..., seq_len=...): the plan "
            "depends on the batch shape"
        )
    batch = next(iter(dataloader))
    x = _first_tensor(batch)
    if x is None or x.dim() < 2:
        raise ValueError(
            "AutoPlugin: the first batch has no (batch, sequence) tensor to read the shape from; pass "
            "AutoPlugin(micro_batch=..., seq_len=...)"
        )
    return micro_batch or x.shape[0], seq_len or x.shape[1]


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, dict):
        return batch.get("input_ids") if "input_ids" in batch else _first_tensor(list(batch.values()))
    if isinstance(batch, (list, tuple)):
        return next((t for t in map(_first_tensor, batch) if t is not None), None)
    return None
