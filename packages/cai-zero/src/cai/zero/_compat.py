"""``LowLevelZeroOptimizer``: Colossal-AI's most-used keyword names mapped onto :class:`ZeroOptimizer`."""

from __future__ import annotations

import torch
import torch.distributed as dist

from cai.zero._config import LossScaleConfig, ZeroConfig
from cai.zero._optimizer import NamedParams, ZeroOptimizer


def LowLevelZeroOptimizer(
    optimizer: torch.optim.Optimizer,
    *,
    model: NamedParams,
    initial_scale: float = 2**16,
    min_scale: float = 1,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    hysteresis: int = 2,
    max_scale: float = 2**24,
    clip_grad_norm: float = 0.0,
    reduce_bucket_size: int = 1024 * 1024,
    communication_dtype: torch.dtype | None = None,
    overlap_communication: bool = False,
    partition_grad: bool = False,
    cpu_offload: bool = False,
    dp_process_group: dist.ProcessGroup | None = None,
    overlap_allgather: bool = False,
) -> ZeroOptimizer:
    """Build a :class:`ZeroOptimizer` from Colossal-AI style arguments.

    ``partition_grad=True`` is stage 2, else stage 1; ``reduce_bucket_size`` counts elements (as there);
    the loss-scale arguments apply only when the model's parameters are fp16. ``model`` is required because
    cai's state is keyed by parameter name.
    """
    # Checked here, in the caller's units: ZeroConfig would report the converted MiB (and clip_grad_norm by its
    # own name, max_norm).
    if not reduce_bucket_size > 0:
        raise ValueError(
            f"LowLevelZeroOptimizer: reduce_bucket_size={reduce_bucket_size!r} must be > 0 (elements per gradient "
            "bucket; Colossal-AI's default is 1024 * 1024)"
        )
    if not clip_grad_norm >= 0:
        raise ValueError(
            f"LowLevelZeroOptimizer: clip_grad_norm={clip_grad_norm!r} must be >= 0 (0 disables clipping)"
        )
    dtypes = {p.dtype for group in optimizer.param_groups for p in group["params"]}
    comm = communication_dtype or next(iter(dtypes))
    itemsize = torch.empty((), dtype=comm).element_size()
    config = ZeroConfig(
        stage=2 if partition_grad else 1,
        bucket_size_mb=reduce_bucket_size * itemsize / 2**20,
        comm_dtype=communication_dtype,
        overlap_comm=overlap_communication,
        overlap_allgather=overlap_allgather,
        cpu_offload=cpu_offload,
        max_norm=clip_grad_norm,
    )
    loss_scale = None
    if torch.float16 in dtypes:
        loss_scale = LossScaleConfig(
            initial_scale=initial_scale,
            min_scale=min_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            max_scale=max_scale,
        )
    return ZeroOptimizer(optimizer, model=model, config=config, loss_scale=loss_scale, group=dp_process_group)
