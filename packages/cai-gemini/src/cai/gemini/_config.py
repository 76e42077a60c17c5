"""Typed configuration for cai-gemini: chunk layout, placement, precision, loss scaling."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from cai.kernels.optim import LossScaleConfig

__all__ = ["ChunkConfig", "GeminiConfig", "LossScaleConfig"]

_PRECISIONS = ("fp32", "bf16", "fp16")
_POLICIES = ("static", "auto")


def _frac(name: str, value: float) -> None:
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"GeminiConfig: {name}={value} must be a fraction in [0.0, 1.0]")


@dataclass(frozen=True, kw_only=True)
class ChunkConfig:
    """How parameters are packed into chunks.

    Args:
        chunk_size: elements per chunk; None searches for the size that wastes the least (see ``search_chunk_size``).
        search_range_m: width of the searched range, in millions of elements (default 32).
        search_interval: step of the search in elements; None uses ``hidden_dim`` or 1024.
        hidden_dim: the model's hidden size, used as the search step when ``search_interval`` is None.
        min_chunk_size_m: smallest chunk, in millions of elements (default 32). A group of parameters smaller than
            this becomes one chunk that stays gathered (no all-gather ever needed for it).
        filter_exlarge_params: ignore parameters larger than mean + 3 std when choosing the size (they get a chunk of
            their own size instead of inflating every chunk).
    """

    chunk_size: int | None = None
    search_range_m: float = 32.0
    search_interval: int | None = None
    hidden_dim: int | None = None
    min_chunk_size_m: float = 32.0
    filter_exlarge_params: bool = True

    def __post_init__(self) -> None:
        if self.chunk_size is not None and self.chunk_size <= 0:
            raise ValueError(
                f"ChunkConfig: chunk_size={self.chunk_size} must be a positive element count or None"
            )
        if self.search_range_m < 0 or self.min_chunk_size_m < 0:
            raise ValueError(
                f"ChunkConfig: search_range_m={self.search_range_m} and min_chunk_size_m={self.min_chunk_size_m} "
                "must be >= 0"
            )
        for name in ("search_interval", "hidden_dim"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"ChunkConfig: {name}={v} must be a positive element count or None")


@dataclass(frozen=True, kw_only=True)
class GeminiConfig:
    """Everything ``cai.gemini.shard`` needs besides the model, the optimizer and the group.

    Args:
        placement_policy: ``"static"`` (fixed fractions below) or ``"auto"`` (measure non-model memory in a warm-up
            step, then cache parameter shards and optimizer states on the device while they fit, evicting the chunk
            used furthest in the future).
        shard_param_frac: fraction of chunk memory whose parameters are sharded (1.0 is ZeRO-3, 0.0 keeps every chunk
            gathered, ZeRO-2 style). Static only.
        offload_optim_frac: fraction of chunk memory whose fp32 master weights, gradients and optimizer states live on
            the host (updated there). The last chunks in registration order go first: backward reduces them
            first, so their host updates have the most backward left to hide behind. Static only.
        offload_param_frac: fraction of chunk memory whose working-precision parameter shards live on the host; needs
            ``shard_param_frac == 1.0``. Static only.
        warmup_non_model_data_ratio: auto: share of the device budget assumed to be non-model data during warm-up.
        steady_cuda_cap_ratio: auto: share of the device budget the policy may fill after warm-up.
        precision: ``"bf16"`` (default), ``"fp16"`` (with dynamic loss scaling) or ``"fp32"``.
        chunk: the chunk layout (see ``ChunkConfig``).
        max_prefetch: chunks to all-gather ahead of use, following the order recorded in the first step.
        max_norm: clip the global gradient norm to this value (0 disables clipping).
        norm_type: the norm used for clipping (2.0 or inf).
        loss_scale: fp16 dynamic loss scaling.
        pin_memory: pin host buffers (None: when CUDA is available) so host<->device copies are asynchronous.
        cast_inputs: cast floating-point forward inputs to the working precision.
        overlap_host_step: update each host-resident chunk on a worker thread as soon as its gradient is reduced,
            overlapping the CPU Adam with the rest of backward. Needs exactly one synchronised backward per
            optimizer step (accumulate inside ``no_sync()``), no clipping and no fp16. ``None`` (the default): on
            wherever it is exact and the placement is fixed, that is ``max_norm == 0``, precision other than fp16
            and the static policy (see ``overlaps_host_step``); a second synchronised backward before ``step()``
            then raises, naming ``no_sync()`` and ``overlap_host_step=False``.
        fp8_communication: reduce-scatter gradient chunks as float8 e4m3 with one fp32 scale per 256 values
            (``cai.mesh``'s [Note: fp8 collectives]), summed in fp32 where they arrive: a quarter of the bytes of
            fp32 gradients, half of bf16's. Parameter all-gathers stay in the working dtype (see cai-zero's
            ``ZeroConfig.fp8_communication`` for why).
    """

    placement_policy: Literal["static", "auto"] = "static"
    shard_param_frac: float = 1.0
    offload_optim_frac: float = 0.0
    offload_param_frac: float = 0.0
    warmup_non_model_data_ratio: float = 0.8
    steady_cuda_cap_ratio: float = 0.9
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    chunk: ChunkConfig = field(default_factory=ChunkConfig)
    max_prefetch: int = 0
    max_norm: float = 0.0
    norm_type: float = 2.0
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    pin_memory: bool | None = None
    cast_inputs: bool = True
    overlap_host_step: bool | None = None
    fp8_communication: bool = False

    def __post_init__(self) -> None:
        if self.placement_policy not in _POLICIES:
            raise ValueError(
                f"GeminiConfig: placement_policy={self.placement_policy!r}; use one of {_POLICIES}"
            )
        if self.precision not in _PRECISIONS:
            raise ValueError(f"GeminiConfig: precision={self.precision!r}; use one of {_PRECISIONS}")
        for name in ("shard_param_frac", "offload_optim_frac", "offload_param_frac"):
            _frac(name, getattr(self, name))
        for name in ("warmup_non_model_data_ratio", "steady_cuda_cap_ratio"):
            _frac(name, getattr(self, name))
        if self.offload_param_frac > 0 and self.shard_param_frac < 1.0:
            raise ValueError(
                f"GeminiConfig: offload_param_frac={self.offload_param_frac} needs shard_param_frac=1.0 (got "
                f"{self.shard_param_frac}): a gathered chunk lives on the device; set shard_param_frac=1.0 or "
                "offload_param_frac=0.0"
            )
        if self.placement_policy == "auto" and (
            self.shard_param_frac != 1.0 or self.offload_optim_frac or self.offload_param_frac
        ):
            raise ValueError(
                "GeminiConfig: placement_policy='auto' decides placement itself; leave shard_param_frac=1.0, "
                f"offload_optim_frac=0.0, offload_param_frac=0.0 (got {self.shard_param_frac}, "
                f"{self.offload_optim_frac}, {self.offload_param_frac}) or use placement_policy='static'"
            )
        if self.max_prefetch < 0:
            raise ValueError(f"GeminiConfig: max_prefetch={self.max_prefetch} must be >= 0")
        if self.max_norm < 0:
            raise ValueError(f"GeminiConfig: max_norm={self.max_norm} must be >= 0 (0 disables clipping)")
        if self.overlap_host_step and (self.max_norm > 0 or self.precision == "fp16"):
            raise ValueError(
                f"GeminiConfig: overlap_host_step=True updates chunks before the global norm and the overflow check "
                f"are known; it needs max_norm=0.0 (got {self.max_norm}) and precision other than fp16 "
                f"(got {self.precision!r})"
            )
        if self.overlap_host_step and self.placement_policy == "auto":
            raise ValueError(
                "GeminiConfig: overlap_host_step=True needs placement_policy='static'; the auto policy moves "
                "optimizer chunks while the overlapped updates run on a worker thread (leave overlap_host_step=None "
                "or use the static policy with offload_optim_frac)"
            )
        if self.norm_type not in (2.0, float("inf")):
            raise ValueError(f"GeminiConfig: norm_type={self.norm_type}; use 2.0 or float('inf')")

    @property
    def overlaps_host_step(self) -> bool:
        """Whether host-resident chunks are updated during backward: ``overlap_host_step``, or where it is None
        whenever that is exact (no clipping, no fp16 loss scale) under the static policy (the auto policy moves
        optimizer chunks between steps, which the worker's updates would race with)."""
        if self.overlap_host_step is None:
            return self.max_norm == 0 and self.precision != "fp16" and self.placement_policy == "static"
        return self.overlap_host_step

    @property
    def working_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.precision]
