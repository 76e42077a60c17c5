"""GeminiPlugin: chunked ZeRO-3 with heterogeneous memory from cai-gemini (``cai.gemini.shard``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from cai.booster._precision import check_precision
from cai.booster._wrappers import ModelWrapper, OptimizerWrapper
from cai.booster.plugin._base import (
    BoostContext,
    Boosted,
    Capabilities,
    DPPluginBase,
    param_names,
    rebind_optimizer,
)
from cai.booster.plugin._torch_ddp import place_replicated

__all__ = ["GeminiPlugin"]

_PRECISIONS = ("fp32", "fp16", "bf16")


class GeminiPlugin(DPPluginBase):
    """Chunk-based ZeRO-3 over the whole world with static or auto placement; the plugin controls precision.

    Args (Colossal-AI names and defaults): ``placement_policy="static"``, ``shard_param_frac=1.0``,
    ``offload_optim_frac=0.0``, ``offload_param_frac=0.0``, ``warmup_non_model_data_ratio=0.8``,
    ``steady_cuda_cap_ratio=0.9``, ``precision="fp16"``, ``pin_memory=False``, ``search_range_m=32``,
    ``hidden_dim=None``, ``min_chunk_size_m=32``, ``chunk_config_dict=None`` (``{"chunk_size": n}``),
    ``max_prefetch=0``, the loss scaler (``initial_scale=2**16, min_scale=1, growth_factor=2, backoff_factor=0.5,
    growth_interval=1000, hysteresis=2, max_scale=2**32``), ``max_norm=0.0``, ``norm_type=2.0``.
    ``enable_gradient_accumulation``, ``chunk_init_device``, ``strict_ddp_mode``, ``enable_async_reduce`` and
    ``verbose`` are accepted (accumulation always works). Tensor parallelism (``tp_size > 1``, the ``enable_*``
    kernel flags), ``extra_dp_size > 1``, ``memstats``, ``gpu_margin_mem_ratio``, ``master_weights=False``,
    ``force_outputs_fp32`` and fp8 raise with what to use instead.

    cai's own: ``overlap_host_step=False``: with optimizer chunks on the host, update each one on a worker thread as
    soon as backward has reduced its gradient (needs ``max_norm=0`` and no fp16; see ``GeminiConfig``).
    """

    LORA = False
    NO_SYNC = True

    def __init__(
        self,
        chunk_config_dict: dict | None = None,
        chunk_init_device: Any = None,
        placement_policy: str = "static",
        enable_gradient_accumulation: bool = False,
        max_prefetch: int = 0,
        shard_param_frac: float = 1.0,
        offload_optim_frac: float = 0.0,
        offload_param_frac: float = 0.0,
        warmup_non_model_data_ratio: float = 0.8,
        steady_cuda_cap_ratio: float = 0.9,
        precision: str = "fp16",
        master_weights: bool = True,
        pin_memory: bool = False,
        force_outputs_fp32: bool = False,
        strict_ddp_mode: bool = False,
        search_range_m: float = 32,
        hidden_dim: int | None = None,
        min_chunk_size_m: float = 32,
        memstats: Any = None,
        gpu_margin_mem_ratio: float = 0.0,
        initial_scale: float = 2**16,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        max_norm: float = 0.0,
        norm_type: float = 2.0,
        tp_size: int = 1,
        extra_dp_size: int = 1,
        enable_all_optimization: bool = False,
        enable_fused_normalization: bool = False,
        enable_flash_attention: bool = False,
        enable_sequence_parallelism: bool = False,
        enable_jit_fused: bool = False,
        enable_async_reduce: bool = True,
        use_fp8: bool = False,
        verbose: bool = False,
        fp8_communication: bool = False,
        overlap_host_step: bool = False,
    ) -> None:
        from cai.gemini import ChunkConfig, GeminiConfig, LossScaleConfig

        check_precision(precision, _PRECISIONS, owner="GeminiPlugin")
        unsupported = {
            "tp_size": (tp_size, 1, "use HybridParallelPlugin for tensor parallelism"),
            "extra_dp_size": (extra_dp_size, 1, "the chunks are sharded over the whole world"),
            "memstats": (memstats, None, "placement_policy='auto' measures memory itself"),
            "gpu_margin_mem_ratio": (gpu_margin_mem_ratio, 0.0, "use steady_cuda_cap_ratio"),
            "master_weights": (master_weights, True, "fp32 master weights are always kept"),
            "force_outputs_fp32": (force_outputs_fp32, False, "cast the outputs in the loss"),
            "use_fp8": (use_fp8, False, "fp8 compute is not implemented"),
            "fp8_communication": (fp8_communication, False, "fp8 communication is not implemented"),
        }
        flags = {
            "enable_all_optimization": enable_all_optimization,
            "enable_fused_normalization": enable_fused_normalization,
            "enable_flash_attention": enable_flash_attention,
            "enable_sequence_parallelism": enable_sequence_parallelism,
            "enable_jit_fused": enable_jit_fused,
        }
        for key, on in flags.items():
            unsupported[key] = (on, False, "patch kernels with cai.kernels.patch_hf_model before boost()")
        for key, (value, ok, hint) in unsupported.items():
            if value != ok:
                raise ValueError(f"GeminiPlugin: {key}={value!r} is not supported; use {key}={ok!r} ({hint})")
        chunk_config_dict = dict(chunk_config_dict or {})
        chunk_size = chunk_config_dict.pop("chunk_size", None)
        if chunk_config_dict:
            raise ValueError(
                f"GeminiPlugin: chunk_config_dict keys {sorted(chunk_config_dict)} are not supported; only 'chunk_size'"
            )
        self._precision = precision
        self.config = GeminiConfig(
            placement_policy=placement_policy,  # type: ignore[arg-type]
            shard_param_frac=shard_param_frac,
            offload_optim_frac=offload_optim_frac,
            offload_param_frac=offload_param_frac,
            warmup_non_model_data_ratio=warmup_non_model_data_ratio,
            steady_cuda_cap_ratio=steady_cuda_cap_ratio,
            precision=precision,  # type: ignore[arg-type]
            chunk=ChunkConfig(
                chunk_size=chunk_size,
                search_range_m=search_range_m,
                hidden_dim=hidden_dim,
                min_chunk_size_m=min_chunk_size_m,
            ),
            max_prefetch=max_prefetch,
            max_norm=max_norm,
            norm_type=norm_type,
            loss_scale=LossScaleConfig(
                initial_scale=initial_scale,
                min_scale=min_scale,
                max_scale=max_scale,
                growth_factor=growth_factor,
                backoff_factor=backoff_factor,
                growth_interval=growth_interval,
                hysteresis=hysteresis,
            ),
            pin_memory=pin_memory or None,
            overlap_host_step=overlap_host_step,
        )

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(precisions=_PRECISIONS, control_precision=True, no_sync=True, lora=self.LORA)

    @property
    def precision(self) -> str:
        return self._precision

    def configure(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        criterion: Callable | None,
        dataloader: Any,
        lr_scheduler: Any,
        ctx: BoostContext,
    ) -> Boosted:
        from cai.gemini import shard

        names = param_names(model)
        # A lazy model is materialised whole on each rank before chunking (cai-gemini builds chunks from real
        # parameters); pretrained weights are read then.
        place_replicated(model, ctx)
        if optimizer is not None:
            rebind_optimizer(optimizer, names, dict(model.named_parameters(remove_duplicate=False)))
        gm, go = shard(model, optimizer, config=self.config, device=ctx.device)
        boosted_model = ModelWrapper(gm, unwrapped=model)
        object.__setattr__(boosted_model, "_cai_gemini", gm)
        boosted_opt = None
        if go is not None:
            boosted_opt = GeminiOptimizerWrapper(go, gm)
            boosted_opt.boosted_model = boosted_model
        return boosted_model, boosted_opt, criterion, dataloader, lr_scheduler

    @contextlib.contextmanager
    def no_sync(self, model: ModelWrapper, optimizer: OptimizerWrapper | None = None) -> Iterator[None]:
        with model._cai_gemini.no_sync():
            yield

    def model_state(self, model: ModelWrapper) -> Any:
        return model._cai_gemini

    def optimizer_state(self, optimizer: OptimizerWrapper, model: ModelWrapper) -> Any:
        return optimizer.unwrap()

    def prepare_optimizer_load(self, optimizer: OptimizerWrapper) -> None:
        # The loader checks keys before loading; cai-gemini creates a chunk's Adam state at its first step.
        optimizer.unwrap().ensure_state()


class GeminiOptimizerWrapper(OptimizerWrapper):
    """The boosted optimizer over a ``GeminiOptimizer`` (gradients live in the chunks)."""

    def __init__(self, go: Any, gm: Any) -> None:
        super().__init__(go)
        self.go = go
        self.gm = gm

    @property
    def scaler(self) -> Any:  # type: ignore[override]
        return None  # cai-gemini's loss scaler lives in the optimizer and has no state_dict yet

    @scaler.setter
    def scaler(self, value: Any) -> None:
        pass

    def backward(self, loss: torch.Tensor, inputs: Any = None, retain_graph: bool = False) -> None:
        self.go.backward(loss)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        return self.go.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.go.zero_grad(set_to_none=set_to_none)

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0, **_: Any) -> Any:
        return self.go.clip_grad_norm_(max_norm, norm_type)

    def clip_grad_by_value(self, clip_value: float, *args: Any, **kwargs: Any) -> None:
        raise ValueError(
            "clip_grad_by_value is not supported under Gemini; use clip_grad_by_norm or max_norm="
        )

    def get_grad_norm(self, norm_type: float = 2.0, **_: Any) -> float:
        # Between backward and step the fp16 gradients still carry the loss scale (step() removes it).
        scale = self.go.scaler.scale if self.go.scaler is not None else 1.0
        return self.go.grad_norm(norm_type) / scale

    def unwrap(self) -> Any:
        return self.go

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.gm.no_sync():
            yield
