"""HybridParallelPlugin: tensor x pipeline x sequence x data parallelism with ZeRO, composed from cai-shardformer
(tensor and sequence parallelism), cai-pipeline (stages and schedules) and cai-zero (stage 0, 1 or 2 over the
data-parallel axis).

[Note: the order of composition]
``configure`` applies, in this order, and each step needs the one before it:
1. every rank holds the whole model, with rank 0's weights (``sync_replicas`` over the world: before sharding, all
   ranks are replicas of one model);
2. cai-shardformer shards it over tp (and sp). Tensor-parallel layers replace modules, so the parameters are new
   objects, under the same names;
3. cai-pipeline cuts this rank's chunks out of the sharded model (after sharding, so that a stage holds tp shards;
   the other stages' modules are dropped with the full model);
4. the chunks are cast to the working precision (after the cut: nothing is cast that this rank does not keep);
5. the user's optimizer is rebound by name to the parameters this rank kept and wrapped by cai-zero over dp. Its
   parameter names are the full model's (``PipelineModel.global_name``: global block indices, a tied head weight
   under the embedding's name), so checkpoints and optimizer state read the same under any layout.

[Note: one gradient norm over tp x pp x dp]
cai-zero sums squared gradient norms over its dp shards and over the tp and pp groups (``norm_groups``). A weight
that several of those ranks hold identically is divided by its number of copies (``replicas``): norm weights and
replicated kv heads over tp (counted by comparing the tp blocks' specs once, at boost), and a tied embedding whose
copy sits on the last stage. Those two copies also sum their gradients over the tied group inside the optimizer
step (``shared``), so both take the same update. sp ranks hold the same parameters with gradients that
cai-shardformer already reduced over sp, so sp is in no norm group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from cai.booster._checkpointing import activation_checkpointing
from cai.booster._lazy import initialise, is_lazy, materialize
from cai.booster._precision import precision_dtype
from cai.booster._pretrained import load_pretrained_into
from cai.booster._replicas import broadcast_tensors
from cai.booster._wrappers import ModelWrapper, OptimizerWrapper
from cai.booster.plugin._base import BoostContext, Boosted, Capabilities, Plugin
from cai.booster.plugin._compat import HYBRID_ARGS, config_from_kwargs, hybrid_sp_kwargs
from cai.booster.plugin._hybrid_config import _PRECISIONS, HybridParallelConfig, PipelineConfig
from cai.booster.plugin._low_level_zero import ZeroOptimizerWrapper, _cast_floating_inputs
from cai.booster.plugin._torch_ddp import place_replicated

if TYPE_CHECKING:
    from cai.mesh import ParallelMesh

__all__ = ["HybridParallelConfig", "HybridParallelPlugin", "PipelineConfig"]


class HybridParallelPlugin(Plugin):
    """Tensor, pipeline, sequence and data parallelism with ZeRO, in one plugin (see [Note: the order of
    composition]).

    Takes ``config=HybridParallelConfig(...)`` or Colossal-AI's keyword arguments with its defaults: ``tp_size``,
    ``pp_size``, ``sp_size=None``, ``precision="fp16"``, ``zero_stage=0``, ``enable_sequence_parallelism=False``,
    ``sequence_parallelism_mode=None`` ("all_to_all" when enabled), ``parallel_output=True``,
    ``num_microbatches=None``, ``microbatch_size=None``, the loss scaler (``initial_scale=2**16, min_scale=1,
    growth_factor=2, backoff_factor=0.5, growth_interval=1000, hysteresis=2, max_scale=2**32``), ``max_norm=0``,
    ``zero_bucket_size_in_m=12``, ``cpu_offload=False``, ``communication_dtype=None``,
    ``overlap_communication=True``, ``custom_policy=None``, ``pp_style="1f1b"``, ``num_model_chunks=1``,
    ``num_layers_per_stage=None``, ``gradient_checkpoint_config=None``, ``enable_metadata_cache=True``,
    ``make_vocab_size_divisible_by=64``, ``overlap_allgather=False``, the ``enable_*`` kernel switches. The tables
    (mapped, ignored with the reason, rejected with what to use) are in ``cai/booster/plugin/_compat.py``.

    With ``pp_size > 1`` train with ``booster.execute_pipeline(iter(loader), model, criterion, optimizer)``, where
    ``criterion(outputs, batch)`` returns the loss of one micro-batch; otherwise ``model(**batch)`` and
    ``booster.backward(loss, optimizer)`` as with the other plugins.

    Example::

        plugin = HybridParallelPlugin(tp_size=2, pp_size=2, zero_stage=1, precision="bf16", microbatch_size=1)
        booster = Booster(plugin=plugin)
        model, optimizer, criterion, loader, _ = booster.boost(model, optimizer, criterion, loader)
        out = booster.execute_pipeline(iter(loader), model, criterion, optimizer, return_loss=True)
        optimizer.step(); optimizer.zero_grad()
    """

    NO_SYNC = True
    PIPELINE = True
    LORA = True  # with tp_size = pp_size = 1 and no sequence parallelism (see enable_lora)
    _GROUPS: tuple = ("pp", "dp", "sp", "tp", ("dp", "sp"))  # the mesh groups, created in this order at once

    _ARGS = HYBRID_ARGS  # Colossal-AI's keywords (cai/booster/plugin/_compat.py) and the config they build
    _CONFIG: type = HybridParallelConfig

    def __init__(self, *args: Any, config: HybridParallelConfig | None = None, **kwargs: Any) -> None:
        self.config: HybridParallelConfig = config_from_kwargs(
            self._ARGS, self._CONFIG, config, hybrid_sp_kwargs(self._ARGS.by_name(args, kwargs))
        )
        self._mesh: ParallelMesh | None = None
        if dist.is_available() and dist.is_initialized():
            self._mesh = self.mesh  # sizes that do not fit the world fail here, when the plugin is built

    # ---- the mesh -------------------------------------------------------------------------------------------
    @property
    def mesh(self) -> ParallelMesh:
        """The (pp, dp, sp, tp) mesh, built on first use (collective)."""
        if self._mesh is None:
            dims = self.config.dims()
            self._mesh = dims.build_mesh()
            for axis in self._GROUPS:
                self._mesh.group(axis)  # every rank creates the groups in the same order
        return self._mesh

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.mesh.group("dp") if dist.is_initialized() else None

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        return self.mesh.group("tp") if dist.is_initialized() else None

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        return self.mesh.group("pp") if dist.is_initialized() else None

    @property
    def sp_group(self) -> dist.ProcessGroup | None:
        if not dist.is_initialized():
            return None
        return self.mesh.group("tp") if self.config.sp_on_tp else self.mesh.group("sp")

    @property
    def tp_size(self) -> int:
        return self.config.tp_size

    @property
    def pp_size(self) -> int:
        return self.config.pp_size

    @property
    def sp_size(self) -> int:
        return self.config.sp_size

    @property
    def zero_stage(self) -> int:
        return self.config.zero.stage

    @property
    def stage_manager(self) -> Any:
        """This rank's ``cai.pipeline.PipelineStageManager`` (None without pipeline parallelism)."""
        return getattr(self, "_manager", None) if self.pp_size > 1 else None

    # ---- the plugin contract --------------------------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            precisions=_PRECISIONS,
            control_precision=True,
            no_sync=True,
            lora=self._lora_fits(),
            pipeline=True,
        )

    def _lora_fits(self) -> bool:
        return self.tp_size == 1 and self.pp_size == 1 and self.config.sequence_parallelism_mode is None

    @property
    def precision(self) -> str:
        return self.config.precision

    def sync_replicas(self, model: nn.Module) -> None:
        # Before sharding every rank holds the whole model: all of them are replicas of it.
        from cai.booster._replicas import sync_replicas

        sync_replicas(model, None, owner=f"{self.name} boost()")

    def configure(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        criterion: Callable | None,
        dataloader: Any,
        lr_scheduler: Any,
        ctx: BoostContext,
    ) -> Boosted:
        cfg = self.config
        aliases = _aliases(model.get_base_model() if _is_peft(model) else model)
        lazy = is_lazy(model)
        if not lazy:
            place_replicated(model, ctx)
        if (
            cfg.flash_attention
            and getattr(getattr(model, "config", None), "_attn_implementation", None) == "eager"
        ):
            model.set_attn_implementation("sdpa")  # Colossal-AI's enable_flash_attention
        model = self._shard(model)
        module: nn.Module = self._split(model) if self.pp_size > 1 else model
        if cfg.use_fp8:
            from cai.kernels import convert_to_fp8
            from cai.shardformer import enable_fp8

            enable_fp8(module)
            convert_to_fp8(module)
        # after the split: the ratios count this stage's blocks
        if cfg.gradient_checkpointing or cfg.activation_offload:
            policy = "full" if cfg.gradient_checkpointing is True else cfg.gradient_checkpointing or "none"
            activation_checkpointing(
                module, policy, ratio=cfg.gradient_checkpointing_ratio, offload=cfg.activation_offload
            )
        rename = module.global_name if self.pp_size > 1 else _same
        # a peft model is named by its base model's names, as the checkpoint states see it (ModelWrapper.unwrap)
        named_from = module.get_base_model() if _is_peft(module) else module
        if lazy:
            self._materialize(module, rename, ctx)
        dtype = precision_dtype(cfg.precision)
        module.to(dtype)
        if self.pp_size == 1 and dtype != torch.float32:
            _cast_floating_inputs(module, dtype)
        boosted = ModelWrapper(module)
        object.__setattr__(boosted, "_cai_rename", rename)
        if optimizer is None:
            return boosted, None, criterion, dataloader, lr_scheduler
        named = _named_parameters(named_from, rename)
        _rebind(optimizer, aliases, dict(named))
        zo = self._zero(optimizer, named_from, named, rename)
        boosted_opt = ZeroOptimizerWrapper(zo)
        boosted_opt.boosted_model = boosted
        return boosted, boosted_opt, criterion, dataloader, lr_scheduler

    def _shard(self, model: nn.Module) -> nn.Module:
        cfg = self.config
        if not self._needs_policy(model):
            if cfg.custom_policy is not None:
                raise ValueError(
                    f"{self.name}: custom_policy is given but tp_size=1 without sequence parallelism, so no policy "
                    "would be applied; use tp_size > 1 or drop custom_policy"
                )
            return model  # nothing to shard: the model stays the user's, with whatever kernels it has
        from cai.shardformer import ShardConfig, ShardFormer

        shard_config = ShardConfig(
            tensor_parallel_process_group=self.tp_group,
            sequence_parallel_process_group=self.sp_group,
            enable_tensor_parallelism=self.tp_size > 1,
            enable_fused_normalization=cfg.fused_normalization,
            enable_all_optimization=cfg.fused_kernels,
            enable_sequence_parallelism=cfg.sequence_parallelism_mode is not None,
            sequence_parallelism_mode=cfg.sequence_parallelism_mode,
            parallel_output=cfg.parallel_output,
            make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
            sync_sp_grads=False,  # summed in cai-zero's reduction over dp x sp (see _zero)
            **self._shard_config_extra(),
        )
        sharded, _ = ShardFormer(shard_config).optimize(model, self._policy(model))
        return sharded

    def _needs_policy(self, model: nn.Module) -> bool:
        cfg = self.config
        return (
            self.tp_size > 1
            or cfg.sequence_parallelism_mode is not None
            or cfg.fused_normalization
            or cfg.fused_kernels
        )

    def _policy(self, model: nn.Module) -> Any:
        return self.config.custom_policy  # None: the one registered for the model's class

    def _shard_config_extra(self) -> dict[str, Any]:
        return {}

    def _split(self, model: nn.Module) -> nn.Module:
        from cai.pipeline import LocalState, PipelineStageManager, build_schedule, build_stages
        from cai.shardformer import load_sharded_state_dict, sharded_state_dict

        pipe = self.config.pipeline
        self._manager = PipelineStageManager(
            self.mesh,
            "pp",
            enable_interleave=pipe.num_model_chunks > 1,
            num_model_chunks=pipe.num_model_chunks,
            use_zbv=pipe.style == "zbv",
            num_layers_per_stage=pipe.num_layers_per_stage,
        )
        self._schedule = build_schedule(
            pipe.style,
            self._manager,
            num_microbatches=pipe.num_microbatches,
            microbatch_size=pipe.microbatch_size,
            num_model_chunks=pipe.num_model_chunks if pipe.style != "1f1b" else None,
            enable_metadata_cache=pipe.enable_metadata_cache,
        )
        return build_stages(
            model, self._manager, local_state=LocalState(sharded_state_dict, load_sharded_state_dict)
        )

    def _materialize(self, module: nn.Module, rename: Callable[[str], str], ctx: BoostContext) -> None:
        """Allocate and fill a lazy model's parameters after sharding and splitting: each rank allocates only its
        own tp blocks of its own stages (see [Note: lazy init under hybrid parallelism])."""
        materialize(module, ctx.device, init=False)
        if ctx.pretrained is not None:
            load_pretrained_into(_RenamedState(module, rename), ctx.pretrained)
            return
        _initialise(module)
        _agree(module, rename, self)

    def _replica_sets(self, module: nn.Module, rename: Callable) -> list[tuple[Any, list[nn.Parameter]]]:
        """(group, parameters) whose copies over the group must hold the same values (lazy random init)."""
        return [(self.mesh.group(("dp", "sp")), list(module.parameters()))]

    def _zero(
        self, optimizer: torch.optim.Optimizer, module: nn.Module, named: list, rename: Callable
    ) -> Any:
        from cai.zero import ZeroOptimizer

        cfg = self.config
        return ZeroOptimizer(
            optimizer,
            model=named,
            config=cfg.zero,
            loss_scale=cfg.loss_scale if cfg.precision == "fp16" else None,
            **self._reduction(module, named, rename),
        )

    def _reduction(self, module: nn.Module, named: list, rename: Callable) -> dict[str, Any]:
        """cai-zero's groups: what gradients are reduced over, and what the norm sums over (see [Note: one
        gradient norm over tp x pp x dp])."""
        norm_groups = [
            g for g, size in ((self.tp_group, self.tp_size), (self.pp_group, self.pp_size)) if size > 1
        ]
        shared: dict[str, dist.ProcessGroup] = {}
        tied_group = getattr(module, "tied_group", None)
        if tied_group is not None:
            ids = {id(p) for p in module.shared_params()}
            shared = {n: tied_group for n, p in named if id(p) in ids and p.requires_grad}  # frozen: no sums
        replicas = _replicas(module, rename, self.tp_group if self.tp_size > 1 else None, named)
        for n in shared:
            replicas[n] = replicas.get(n, 1) * 2
        # With a sequence-parallel axis of its own, each sp rank holds the gradient of its tokens: the buckets are
        # reduced over dp x sp in one collective, summed over sp and averaged over dp (and sharded over both).
        group = self.mesh.group(("dp", "sp")) if self.sp_size > 1 else self.dp_group
        return dict(
            group=group,
            norm_groups=norm_groups,
            replicas=replicas,
            shared=shared,
            grad_divisor=self.mesh.size("dp") if self.sp_size > 1 else None,
        )

    # ---- training ---------------------------------------------------------------------------------------------
    def execute_pipeline(
        self,
        data_iter: Iterator,
        model: ModelWrapper,
        criterion: Callable,
        optimizer: OptimizerWrapper | None = None,
        return_loss: bool = True,
        return_outputs: bool = False,
    ) -> dict[str, Any]:
        """One batch from ``data_iter`` through the pipeline: forward and (with grad enabled) backward of every
        micro-batch; gradients accumulate in the optimizer, which you then step. Returns ``{"loss", "outputs"}``:
        the loss averaged over micro-batches on every stage (cai broadcasts it, so any rank can log it), the last
        stage's outputs (None elsewhere). A batch with ``num_items_in_batch`` (``Booster.num_items_in_batch``)
        is token-weighted: its micro-batches' losses are summed, not averaged."""
        if self.pp_size == 1:
            raise ValueError(
                f"{self.name}.execute_pipeline: pp_size=1, so there is no pipeline; call model(**batch) and "
                "booster.backward(loss, optimizer)"
            )
        zo = optimizer.unwrap() if optimizer is not None else getattr(model, "_cai_zero", None)
        return self._schedule.forward_backward_step(
            model.unwrap(), data_iter, criterion, zo, return_loss=return_loss, return_outputs=return_outputs
        )

    @contextlib.contextmanager
    def gathered(self, model: ModelWrapper) -> Iterator[None]:
        # tensor-parallel shards stay split: the sharded forward computes the whole model's outputs
        if self.pp_size > 1:
            raise ValueError(
                f"{self.name}.gathered: with pp_size={self.pp_size} each rank holds only its stages, so "
                "model(...) and generate() cannot run on one rank; run forwards through execute_pipeline, or "
                "save the model and serve it with cai-infer"
            )
        yield

    @contextlib.contextmanager
    def no_sync(self, model: ModelWrapper, optimizer: OptimizerWrapper | None = None) -> Iterator[None]:
        if optimizer is None:
            raise ValueError(f"{self.name}.no_sync: pass the boosted optimizer (gradients live in it)")
        with optimizer.no_sync():
            yield

    def enable_lora(
        self, model: nn.Module, pretrained_dir: str | None = None, lora_config: Any = None
    ) -> nn.Module:
        if not self._lora_fits():
            raise ValueError(
                f"{self.name}: LoRA needs tp_size=1, pp_size=1 and no sequence parallelism (got tp_size="
                f"{self.tp_size}, pp_size={self.pp_size}, sequence_parallelism_mode="
                f"{self.config.sequence_parallelism_mode!r}): peft's adapters are not sharded or split; LoRA with "
                "data parallelism and ZeRO works with those sizes"
            )
        return super().enable_lora(model, pretrained_dir=pretrained_dir, lora_config=lora_config)

    # ---- checkpoints ------------------------------------------------------------------------------------------
    def rng_states(self) -> dict[str, Any]:
        if self.tp_size == 1:
            return {}
        from cai.shardformer import get_rng_tracker

        # [Note: dropout RNG under tp] in cai-shardformer
        return {"tp_dropout": get_rng_tracker(self.tp_group)}

    def model_state(self, model: ModelWrapper) -> Any:
        from cai.shardformer import tp_model_state

        module, rename = model.unwrap(), model._cai_rename
        zo = getattr(model, "_cai_zero", None)
        return tp_model_state(module, zo, rename=rename) if zo is not None else _RenamedState(module, rename)

    def optimizer_state(self, optimizer: OptimizerWrapper, model: ModelWrapper) -> Any:
        from cai.shardformer import tp_optimizer_state

        return tp_optimizer_state(model.unwrap(), optimizer.unwrap(), rename=model._cai_rename)

    def prepare_optimizer_load(self, optimizer: OptimizerWrapper) -> None:
        optimizer.unwrap().ensure_state()


class _RenamedState:
    """The state protocol of a sharded and/or split model without an optimizer (its working parameters)."""

    def __init__(self, module: nn.Module, rename: Callable[[str], str]) -> None:
        self.module, self.rename = module, rename

    def sharded_state_dict(self) -> dict[str, Any]:
        from cai.shardformer import sharded_state_dict

        return sharded_state_dict(self.module, self.rename)

    def load_sharded_state_dict(self, read: Any) -> None:
        from cai.shardformer import load_sharded_state_dict

        load_sharded_state_dict(self.module, read, self.rename)


def _is_peft(module: nn.Module) -> bool:
    return hasattr(module, "get_base_model") and type(module).__name__.startswith("Peft")


def _same(key: str) -> str:
    return key


def _aliases(model: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every name it has in the user's model (a tied weight has two)."""
    out: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(name)
    return out


def _named_parameters(module: nn.Module, rename: Callable[[str], str]) -> list[tuple[str, nn.Parameter]]:
    return [(rename(n), p) for n, p in module.named_parameters()]


def _rebind(
    optimizer: torch.optim.Optimizer, aliases: dict[int, list[str]], kept: dict[str, nn.Parameter]
) -> None:
    """Point the optimizer's groups at the parameters this rank kept (sharded copies, this stage's only), by name."""
    if any(optimizer.state.values()):
        raise ValueError(
            f"boost(): {type(optimizer).__name__} already has state (it has stepped); boost before the first step"
        )
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            new = next((kept[n] for n in aliases[id(p)] if n in kept), None)
            if new is not None and all(new is not q for q in params):
                params.append(new)
        group["params"] = params


def _replicas(
    module: nn.Module, rename: Callable[[str], str], tp_group: dist.ProcessGroup | None, named: list
) -> dict[str, int]:
    """Parameter name -> how many tp ranks hold the same block of it (see [Note: one gradient norm over tp x pp x
    dp]); only names with more than one copy."""
    if tp_group is None:
        return {}
    from cai.shardformer import sharded_state_dict

    names = {n for n, _ in named}
    mine = {n: _spec_key(e) for n, e in sharded_state_dict(module, rename).items() if n in names}
    everyone: list[Any] = [None] * dist.get_world_size(tp_group)
    dist.all_gather_object(everyone, mine, group=tp_group)
    out = {}
    for n, spec in mine.items():
        copies = sum(other.get(n) == spec for other in everyone)
        if copies > 1:
            out[n] = copies
    return out


# [Note: lazy init under hybrid parallelism]
# A model built under LazyInitContext is sharded and split while its parameters are still on the meta device, so a
# rank allocates only what it keeps. From ``from_pretrained``, each rank then reads its blocks from the safetensors
# files. With random initialisation each rank draws its own values, so the copies that must agree are made equal
# afterwards, from the lowest rank holding each: every tensor over its replicas (dp x sp: the replicas of one tp
# block of one stage; under MoeHybridParallelPlugin dense weights over dp x ep, experts over dp), tensors held identically by several tp ranks (norm weights; kv heads replicated over tp) over tp, and a
# tied head copy from the first stage's embedding.
def _agree(module: nn.Module, rename: Callable[[str], str], plugin: HybridParallelPlugin) -> None:
    from cai.shardformer import sharded_state_dict

    # buffers stayed real (LazyInitContext): computed alike on every rank
    for group, params in plugin._replica_sets(module, rename):
        broadcast_tensors(params, src=dist.get_global_rank(group, 0), group=group)
    if plugin.tp_size > 1:
        tp = plugin.tp_group
        params = dict(_named_parameters(module, rename))
        specs = {n: _spec_key(e) for n, e in sharded_state_dict(module, rename).items() if n in params}
        everyone: list[Any] = [None] * plugin.tp_size
        dist.all_gather_object(everyone, specs, group=tp)
        with torch.no_grad():
            for n, spec in sorted(specs.items()):
                holders = [r for r, other in enumerate(everyone) if other.get(n) == spec]
                if len(holders) < 2:
                    continue  # a block of its own: nothing to agree on
                p = params[n]
                got = [torch.empty_like(p) for _ in range(plugin.tp_size)]
                dist.all_gather(got, p.detach().contiguous(), group=tp)
                p.copy_(got[holders[0]])
    tied = getattr(module, "tied_group", None)
    if tied is not None:
        broadcast_tensors(module.shared_params(), src=min(dist.get_process_group_ranks(tied)), group=tied)


def _initialise(module: nn.Module) -> None:
    """Random values for a materialised model: each (stage's) Hugging Face model's own scheme, and for
    cai-shardformer's parallel layers, which that scheme does not know, the one it uses for linear and embedding
    layers (normal with the config's ``initializer_range``, biases zero)."""
    from cai.shardformer import ParallelModule

    models = [c.module for c in module.chunks] if hasattr(module, "chunks") else [module]
    for m in models:
        initialise(m, list(m.modules()))
    std = getattr(getattr(module, "config", None), "initializer_range", 0.02)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, ParallelModule):
                for p in m.parameters(recurse=False):
                    p.normal_(0.0, std) if p.dim() > 1 else p.zero_()


def _spec_key(entry: Any) -> list[tuple]:
    pieces = entry if isinstance(entry, list) else [entry]
    return [(s.spec.offsets, s.spec.block_shape, s.spec.flat_range) for s in pieces]
