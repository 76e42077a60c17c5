"""GeminiPlugin: chunked ZeRO-3 with heterogeneous memory from cai-gemini (``cai.gemini.shard``)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from cai.booster._lazy import is_lazy
from cai.booster._plan._hardware import free_device_bytes
from cai.booster._wrappers import ModelWrapper, OptimizerWrapper
from cai.booster.plugin._base import (
    BoostContext,
    Boosted,
    Capabilities,
    DPPluginBase,
    param_names,
    rebind_optimizer,
)
from cai.booster.plugin._compat import GEMINI_ARGS, config_from_kwargs
from cai.booster.plugin._torch_ddp import place_replicated
from cai.mesh import advance_step

if TYPE_CHECKING:
    from cai.gemini import GeminiConfig

__all__ = ["GeminiPlugin"]

_PRECISIONS = ("fp32", "fp16", "bf16")


class GeminiPlugin(DPPluginBase):
    """Chunk-based ZeRO-3 over the whole world with static or auto placement; the plugin controls precision.

    Takes either ``config=GeminiConfig(...)`` (cai-gemini's config, whose default precision is bf16) or
    Colossal-AI's keyword arguments, with its defaults: ``placement_policy="static"``, ``shard_param_frac=1.0``,
    ``offload_optim_frac=0.0``, ``offload_param_frac=0.0``, ``warmup_non_model_data_ratio=0.8``,
    ``steady_cuda_cap_ratio=0.9``, ``precision="fp16"``, ``pin_memory=False``, ``search_range_m=32``,
    ``hidden_dim=None``, ``min_chunk_size_m=32``, ``chunk_config_dict=None`` (``{"chunk_size": n}``;
    ``"keep_gathered": True`` there is ``shard_param_frac=0.0``),
    ``max_prefetch=0``, the loss scaler (``initial_scale=2**16, min_scale=1, growth_factor=2, backoff_factor=0.5,
    growth_interval=1000, hysteresis=2, max_scale=2**32``), ``max_norm=0.0``, ``norm_type=2.0``.
    ``chunk_init_device``, ``strict_ddp_mode``, ``enable_async_reduce`` and ``verbose`` are ignored.
    ``enable_gradient_accumulation=True`` turns the overlapped host step off (below). ``enable_all_optimization``,
    ``enable_fused_normalization``, ``enable_jit_fused`` and ``enable_flash_attention`` apply cai-kernels' fused
    norms, SwiGLU, rotary and loss to the model at ``boost()`` (``cai.kernels.patch_hf_model``). Tensor
    parallelism (``tp_size > 1``), ``extra_dp_size > 1``, ``memstats``, ``gpu_margin_mem_ratio``,
    ``master_weights=False`` and ``force_outputs_fp32`` raise with what to use instead. ``use_fp8=True`` runs the
    linear layers in FP8 (``cai.kernels.convert_to_fp8``; the blocks are not compiled as under LowLevelZero, since
    Gemini's hooks on every layer would break their graph); ``fp8_communication=True`` reduce-scatters gradients in
    FP8 (``GeminiConfig.fp8_communication``). The tables are in ``cai/booster/plugin/_compat.py``; a keyword that
    disagrees with ``config=`` raises.

    cai's own: ``overlap_host_step=None``: with optimizer chunks on the host, update each one on a worker thread as
    soon as backward has reduced its gradient; None (the default) turns it on wherever it is exact (``max_norm=0``
    and no fp16; see ``GeminiConfig``). It then needs one synchronised backward per step: accumulate inside
    ``booster.no_sync(model, optimizer)``, or pass ``enable_gradient_accumulation=True`` (Colossal-AI's switch for
    accumulation), which turns it off.

    Example::

        booster = Booster(plugin=GeminiPlugin(precision="bf16", offload_optim_frac=1.0))  # host step overlapped
    """

    LORA = False
    NO_SYNC = True

    def __init__(self, *args: Any, config: GeminiConfig | None = None, **kwargs: Any) -> None:
        from cai.gemini import GeminiConfig

        kwargs = GEMINI_ARGS.by_name(args, kwargs)
        own = {name: kwargs.pop(name) for name in list(kwargs) if name in GEMINI_ARGS.plugin}
        cfg: GeminiConfig = config_from_kwargs(GEMINI_ARGS, GeminiConfig, config, kwargs)
        if own.pop("enable_gradient_accumulation", False):
            if cfg.overlap_host_step:
                raise ValueError(
                    "GeminiPlugin: enable_gradient_accumulation=True conflicts with overlap_host_step=True (the "
                    "overlapped host step updates host chunks during the first synchronised backward); drop one, "
                    "or keep overlap_host_step=True and accumulate inside booster.no_sync(model, optimizer)"
                )
            cfg = dataclasses.replace(cfg, overlap_host_step=False)
        self.config = cfg
        self.use_fp8 = bool(own.pop("use_fp8", False))
        self.flash_attention = bool(own.get("enable_flash_attention", False))
        # any of Colossal-AI's kernel switches applies cai-kernels at boost()
        self.patch_kernels = any(own.values())

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(precisions=_PRECISIONS, control_precision=True, no_sync=True, lora=self.LORA)

    @property
    def precision(self) -> str:
        return self.config.precision

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

        if self.patch_kernels:
            apply_kernels(model, flash_attention=self.flash_attention)
        if self.use_fp8:
            from cai.kernels import convert_to_fp8

            convert_to_fp8(model)
        names = param_names(model)
        # A lazy model is materialised whole on each rank before chunking (cai-gemini builds chunks from real
        # parameters, moving each to its chunk as it goes); pretrained weights are read then.
        place_replicated(model, ctx, self._materialize_on(model, ctx.device))
        if optimizer is not None:
            rebind_optimizer(optimizer, names, dict(model.named_parameters(remove_duplicate=False)))
        gm, go = shard(model, optimizer, config=self.config, device=ctx.device)
        boosted_model = GeminiModelWrapper(gm, unwrapped=model)
        object.__setattr__(boosted_model, "_cai_gemini", gm)
        boosted_opt = None
        if go is not None:
            boosted_opt = GeminiOptimizerWrapper(go, gm)
            boosted_opt.boosted_model = boosted_model
        return boosted_model, boosted_opt, criterion, dataloader, lr_scheduler

    def _materialize_on(self, model: nn.Module, device: torch.device) -> torch.device:
        """Where a lazy model is materialised before chunking: the host when parameters are to be offloaded or
        the whole model (in its construction dtype, often fp32) would take more than 80% of the device's free
        memory, else ``device``. Training may need far less device memory than the whole model does."""
        if device.type != "cuda" or not is_lazy(model):
            return device
        if self.config.offload_param_frac > 0:
            return torch.device("cpu")
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        return device if size <= 0.8 * free_device_bytes(device) else torch.device("cpu")

    @contextlib.contextmanager
    def no_sync(self, model: ModelWrapper, optimizer: OptimizerWrapper | None = None) -> Iterator[None]:
        with model._cai_gemini.no_sync():
            yield

    @contextlib.contextmanager
    def gathered(self, model: ModelWrapper) -> Iterator[None]:
        with model._cai_gemini.gathered():
            yield

    def model_state(self, model: ModelWrapper) -> Any:
        return model._cai_gemini

    def optimizer_state(self, optimizer: OptimizerWrapper, model: ModelWrapper) -> Any:
        return optimizer.unwrap()

    def prepare_optimizer_load(self, optimizer: OptimizerWrapper) -> None:
        # The loader checks keys before loading; cai-gemini creates a chunk's Adam state at its first step.
        optimizer.unwrap().ensure_state()


def apply_kernels(model: nn.Module, *, flash_attention: bool) -> None:
    """Colossal-AI's ``enable_*`` kernel switches, done with cai-kernels: fused RMSNorm, SwiGLU, rotary and the
    fused linear cross-entropy (``patch_hf_model``, in place, the same Parameters); with ``flash_attention`` a
    Hugging Face model on eager attention moves to torch SDPA (flash kernels where they apply)."""
    from cai.kernels import patch_hf_model

    config = getattr(model, "config", None)
    if flash_attention and getattr(config, "_attn_implementation", None) == "eager":
        model.set_attn_implementation("sdpa")
    patch_hf_model(model)


class GeminiModelWrapper(ModelWrapper):
    """The boosted model over a ``GeminiModel``: its parameters are views into chunks (empty while released), so
    ``state_dict`` gathers the chunks instead of reading them."""

    def state_dict(  # type: ignore[override]
        self,
        destination: dict[str, torch.Tensor] | None = None,
        prefix: str = "",
        keep_vars: bool = False,
        *,
        only_rank_0: bool = True,
        dtype: torch.dtype | None = None,
    ) -> dict[str, torch.Tensor]:
        """The full, unpadded model by the user's module's names (tied weights under each name, persistent
        buffers), in fp32 master precision unless ``dtype`` is given; every rank must call it (one all-gather per
        chunk). With ``only_rank_0=True`` (Colossal-AI's default) ranks other than 0 get ``{}``.

        For checkpoints prefer ``booster.save_model``, which writes each rank's shards without gathering."""
        return self.module.state_dict(destination, prefix, keep_vars, only_rank_0=only_rank_0, dtype=dtype)

    def load_state_dict(  # type: ignore[override]
        self, state_dict: dict[str, torch.Tensor], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a full state dict (as ``state_dict(only_rank_0=False)`` or the unsharded model's gives) on every
        rank; each rank keeps its pieces."""
        return self.module.load_state_dict(state_dict, strict=strict)


class GeminiOptimizerWrapper(OptimizerWrapper):
    """The boosted optimizer over a ``GeminiOptimizer`` (gradients live in the chunks)."""

    def __init__(self, go: Any, gm: Any) -> None:
        super().__init__(go)
        self.go = go
        self.gm = gm

    @property
    def scaler(self) -> Any:  # type: ignore[override]
        return self.go.scaler  # cai-gemini's optimizer owns its loss scaler (None unless fp16)

    @scaler.setter
    def scaler(self, value: Any) -> None:
        pass  # the GeminiOptimizer owns its loss scaler

    def backward(self, loss: torch.Tensor, inputs: Any = None, retain_graph: bool = False) -> None:
        self.go.backward(loss)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        advance_step()  # the step that collective timeouts report
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
