"""Booster: the facade a training script talks to. It checks the plugin's capabilities against its own
arguments when it is built, delegates ``boost`` to the plugin, and routes every checkpoint through cai-ckpt."""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cai.booster._lazy import is_lazy, pretrained_path
from cai.booster._precision import MixedPrecision, mixed_precision_factory
from cai.booster._pretrained import check_checkpoint_keys
from cai.booster._state import LoadView
from cai.booster._wrappers import ModelWrapper, OptimizerWrapper
from cai.booster.plugin import PLUGINS, AutoPlugin, BoostContext, Plugin, TorchDDPPlugin
from cai.mesh import debug_checks_on

__all__ = ["Booster"]

# The user's modules that boost() sharded or wrapped in place, with the plugin's name: a second boost() of the same
# module would shard it twice. Weak, and outside the module, so that a copy.deepcopy of a module can be boosted.
_BOOSTED: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def _names(predicate: Callable[[type], bool]) -> str:
    return ", ".join(p.__name__ for p in PLUGINS if predicate(p)) or "none yet"


class Booster:
    """Turn a model, optimizer and data loader into their distributed versions under one plugin.

    Args:
        plugin: the parallel strategy (default: ``TorchDDPPlugin()``, which is plain training in one process), or
            ``"auto"`` (``AutoPlugin()``): the planner's fastest configuration that fits, chosen at ``boost()``.
        mixed_precision: ``"fp32"``, ``"fp16"``, ``"bf16"`` or a ``MixedPrecision``, for plugins that do not control
            precision (TorchDDPPlugin); plugins that do take ``precision=`` themselves, and giving both raises.
        device: ``"cpu"`` or ``"cuda"`` (default: CUDA when available); must be among the plugin's devices.

    Example::

        booster = Booster(plugin=LowLevelZeroPlugin(stage=2, precision="bf16", max_norm=1.0))
        model, optimizer, criterion, dataloader, lr_scheduler = booster.boost(model, optimizer, criterion,
                                                                              dataloader, lr_scheduler)
        loss = criterion(model(x), y)
        booster.backward(loss, optimizer)
        optimizer.step(); optimizer.zero_grad()
        booster.save_state("ckpt", step=100, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler)

    Notes:
        Every argument is checked here, not in the first step: an unsupported precision, device or a precision
        given twice raises ``ValueError`` naming the values and the plugins or values that would work.
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        mixed_precision: str | MixedPrecision | None = None,
        plugin: Plugin | str | None = None,
    ) -> None:
        if plugin == "auto":
            plugin = AutoPlugin()
        if plugin is not None and not isinstance(plugin, Plugin):
            raise TypeError(
                f"Booster: plugin must be a cai.booster.plugin.Plugin, got {type(plugin).__name__}"
            )
        self.plugin = plugin if plugin is not None else TorchDDPPlugin()
        caps = self.plugin.capabilities
        name = self.plugin.name
        mp = mixed_precision_factory(mixed_precision)
        if mp is not None and caps.control_precision:
            if mp.precision != (self.plugin.precision or "fp32"):
                raise ValueError(
                    f"Booster: {name} controls precision, so mixed_precision={mp.precision!r} would be ignored; "
                    f"pass precision={mp.precision!r} to {name} instead (plugins that take Booster "
                    f"mixed_precision: {_names(lambda p: not p.CONTROLS_PRECISION)})"
                )
            mp = None  # it says what the plugin does already
        precision = mp.precision if mp is not None else (self.plugin.precision or "fp32")
        if precision not in caps.precisions:
            raise ValueError(
                f"Booster: {name} does not support precision {precision!r}; it supports {list(caps.precisions)}"
            )
        self.mixed_precision = mp
        self.device = torch.device(device) if device is not None else self.plugin.default_device()
        if self.device.type not in caps.devices:
            raise ValueError(
                f"Booster: {name} does not run on device {self.device.type!r}; it supports {list(caps.devices)}"
            )
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("Booster: device='cuda' but CUDA is not available; use device='cpu'")
        self.plugin.check_device(self.device)

    # ---- boost ------------------------------------------------------------------------------------------
    def boost(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Callable | None = None,
        dataloader: Any = None,
        lr_scheduler: Any = None,
    ) -> tuple[ModelWrapper, OptimizerWrapper | None, Callable | None, Any, Any]:
        """Apply the plugin: returns ``(model, optimizer, criterion, dataloader, lr_scheduler)``.

        A model built under ``LazyInitContext`` is sharded first and then materialised rank by rank; if it came
        from ``from_pretrained`` inside the context, its safetensors weights are read into the shards here.
        Build the optimizer on ``model.parameters()`` before calling this, and the LR scheduler on the optimizer:
        both keep working on the boosted objects.

        Before the plugin shards or wraps anything, the data-parallel ranks check that they built the same model
        (parameter and persistent-buffer names, shapes, dtypes: a difference raises ``ValueError`` on every rank)
        and take rank 0's weights, as DDP does; see [Note: replicas agree at boost] in ``cai.booster._replicas``.
        """
        if isinstance(model, ModelWrapper):
            raise ValueError(
                "Booster.boost: the model is already boosted (it is the ModelWrapper that boost() returned); boost "
                "each model once and keep using the returned model"
            )
        done = _BOOSTED.get(model)
        if done is not None:
            raise ValueError(
                f"Booster.boost: this {type(model).__name__} was already boosted by {done}, which sharded or "
                "wrapped it in place; boost each model once and use the model that boost() returned (build a new "
                "model to boost it again)"
            )
        _check_optimizer(model, optimizer)
        if isinstance(self.plugin, AutoPlugin):
            # the chosen plugin takes over every later call (no_sync, checkpoints); DDP takes its precision here
            auto = self.plugin
            self.plugin = auto.resolve(model, optimizer, dataloader, self.device)
            if not self.plugin.capabilities.control_precision:
                self.mixed_precision = mixed_precision_factory(auto.precision)
        ctx = BoostContext(
            device=self.device,
            mixed_precision=self.mixed_precision,
            pretrained=pretrained_path(model) if is_lazy(model) else None,
        )
        if ctx.pretrained is not None:
            check_checkpoint_keys(model, ctx.pretrained)  # before any work: every rank sees the same files
        self.plugin.sync_replicas(model)
        boosted = self.plugin.configure(model, optimizer, criterion, dataloader, lr_scheduler, ctx)
        _BOOSTED[model] = self.plugin.name
        _refuse_resize(self.plugin.name, model, boosted[0].unwrap())
        if ctx.pretrained is not None:
            boosted[0]._cai_pretrained = ctx.pretrained
            if debug_checks_on():  # the debug checks: the weights read into the shards are the checkpoint's
                self.verify_weights(boosted[0])
        return boosted

    def verify_weights(self, model: ModelWrapper, checkpoint: str | os.PathLike | None = None) -> None:
        """Check that every rank's part of the boosted model equals the safetensors checkpoint ``checkpoint`` (a
        Hugging Face directory; default: the one ``from_pretrained`` named inside ``LazyInitContext``), in the
        dtype the plugin holds it. Raises ``ValueError`` on every rank naming the tensors that differ or are
        missing, with the ranks holding them, and the checkpoint's tensors that no rank holds (those Hugging Face
        skips on load aside). Nothing is gathered: each rank reads the regions it holds. Runs
        at ``boost()`` with the debug checks on (``CAI_DEBUG_COLLECTIVES=1``); call it yourself after loading
        weights any other way, or before step 1 to check what training starts from."""
        from cai.booster._verify import verify_against_checkpoint

        _check_boosted(model, ModelWrapper, "verify_weights", "model")
        path = checkpoint if checkpoint is not None else getattr(model, "_cai_pretrained", None)
        if path is None:
            raise ValueError(
                "Booster.verify_weights: this model was not filled from a checkpoint at boost() (no "
                "from_pretrained inside LazyInitContext); pass checkpoint=<safetensors directory>"
            )
        # every rank of the job takes part
        verify_against_checkpoint(self.plugin.model_state(model), path, model=model.unwrap())

    # ---- training-step helpers ---------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, optimizer: OptimizerWrapper) -> None:
        """Backward through the optimizer (which applies the loss scale and starts gradient reduction)."""
        _check_boosted(optimizer, OptimizerWrapper, "backward", "optimizer")
        optimizer.backward(loss)

    def num_items_in_batch(
        self, micro_batches: Iterable[Mapping[str, Any] | torch.Tensor], *, ignore_index: int = -100
    ) -> torch.Tensor:
        """What to pass as ``num_items_in_batch`` to the forward of each of a step's ``micro_batches`` so that the
        step's gradient is that of the mean loss over every target token of the step: all its micro-batches on
        all data-parallel ranks, however unevenly each is padded ([Note: token-weighted loss]).

        Each micro-batch is a mapping with ``labels`` (shifted by one, as Hugging Face's causal-LM loss does) or
        ``shift_labels`` (taken as they are), or a labels tensor; tokens equal to ``ignore_index`` do not count.
        The count is summed over the data-parallel group without a host read. Call it on every rank, with the
        micro-batches of this rank's step, before their forwards. Under a pipeline (``pp_size > 1``) put it in the
        batch given to ``execute_pipeline`` as ``batch["num_items_in_batch"]``: every micro-batch's forward gets it
        and the schedule sums their losses instead of averaging them.
        """
        count = torch.zeros((), dtype=torch.float64, device=self.device)
        for mb in micro_batches:
            if isinstance(mb, Mapping) and mb.get("shift_labels") is not None:
                shifted = mb["shift_labels"]
            elif isinstance(mb, Mapping) and mb.get("labels") is not None:
                shifted = mb["labels"][..., 1:]
            elif isinstance(mb, Mapping):
                raise ValueError(
                    "Booster.num_items_in_batch: a micro-batch has neither 'labels' nor 'shift_labels'"
                )
            elif isinstance(mb, torch.Tensor):
                shifted = mb[..., 1:]
            else:
                raise TypeError(
                    f"Booster.num_items_in_batch: a micro-batch is a {type(mb).__name__}; pass mappings with "
                    "'labels' or 'shift_labels', or labels tensors"
                )
            count += (shifted != ignore_index).sum().to(count.device)
        group = self.plugin.dp_group
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(count, group=group)
        # gradients are averaged over the data-parallel ranks, so each rank divides by its share of the count
        return (count.clamp_min(1) / self.plugin.dp_size).float()

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean over the data-parallel ranks of ``loss`` (this rank's loss, or a sum of its losses over several
        steps), detached, in fp32: the same value on every rank, for logging. One all-reduce of a scalar.

        With the count from ``num_items_in_batch`` each rank's loss is its part of the step's mean over every
        target token, and this is that mean, the loss one process would compute on the whole batch. Without it,
        it is the mean of the ranks' own means. Under a pipeline pass the loss ``execute_pipeline`` returned (every
        stage has it); the ranks of one tensor- or sequence-parallel group hold the same loss already. Call it on
        every rank.
        """
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(
                f"Booster.mean_loss: expected a one-element loss tensor, got "
                f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}"
            )
        mean = loss.detach().float().reshape(()).to(self.device, copy=True)
        group = self.plugin.dp_group
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(mean, group=group)  # a sum: gloo has no average
            mean /= dist.get_world_size(group)
        return mean

    @contextlib.contextmanager
    def no_sync(
        self, model: ModelWrapper | None = None, optimizer: OptimizerWrapper | None = None
    ) -> Iterator[None]:
        """Skip gradient synchronisation for the backwards inside (gradient accumulation).

        Accumulation is also correct without it (each micro-step is reduced); ``no_sync`` only saves traffic.
        """
        if not self.plugin.support_no_sync():
            raise ValueError(
                f"Booster.no_sync: {self.plugin.name} does not support no_sync (accumulate without it: gradients "
                f"of every micro-step are reduced and summed); plugins with no_sync: "
                f"{_names(lambda p: p.NO_SYNC)}"
            )
        if model is not None:
            _check_boosted(model, ModelWrapper, "no_sync", "model")
        if optimizer is not None:
            _check_boosted(optimizer, OptimizerWrapper, "no_sync", "optimizer")
        with self.plugin.no_sync(model, optimizer):
            yield

    @contextlib.contextmanager
    def gathered(self, model: ModelWrapper) -> Iterator[None]:
        """The model's parameters gathered once for the forwards inside, and freed again on exit.

        For generation and evaluation under sharded plugins: ``model.generate(...)`` runs one forward per token,
        and GeminiPlugin and TorchFSDPPlugin would otherwise all-gather every parameter for each of them. Every
        rank enters it (the gathers are collectives); the whole model must fit on the device. Forwards inside run
        without gradients and issue no collective of the plugin's, so ranks may run different numbers of them
        (evaluation over uneven shards of a dataset). Plugins whose ranks hold whole parameters (DDP,
        LowLevelZero, HybridParallel's tensor-parallel shards, which compute whole outputs) have nothing to
        gather; with ``pp_size > 1`` it raises, since no rank holds the whole model.
        """
        _check_boosted(model, ModelWrapper, "gathered", "model")
        with self.plugin.gathered(model):
            yield

    def execute_pipeline(
        self,
        data_iter: Iterator,
        model: ModelWrapper,
        criterion: Callable,
        optimizer: OptimizerWrapper | None = None,
        return_loss: bool = True,
        return_outputs: bool = False,
    ) -> dict[str, Any]:
        """Run one pipeline-parallel forward/backward over micro-batches (pipeline plugins only)."""
        if not self.plugin.capabilities.pipeline:
            raise ValueError(
                f"Booster.execute_pipeline: {self.plugin.name} has no pipeline parallelism; plugins that support it: "
                f"{_names(lambda p: p.PIPELINE)} (with pp_size > 1); with this plugin call model(...) and "
                "booster.backward(loss, optimizer)"
            )
        return self.plugin.execute_pipeline(
            data_iter, model, criterion, optimizer, return_loss, return_outputs
        )

    # ---- LoRA -------------------------------------------------------------------------------------------
    def enable_lora(
        self,
        model: nn.Module,
        pretrained_dir: str | None = None,
        lora_config: Any = None,
        bnb_quantization_config: Any = None,
        quantize: bool = False,
    ) -> nn.Module:
        """Add LoRA adapters with peft (``pip install cai-booster[lora]``) before ``boost``; base weights freeze."""
        if bnb_quantization_config is not None or quantize:
            raise ValueError(
                "Booster.enable_lora: quantized (QLoRA) base weights are not supported; use quantize=False"
            )
        if isinstance(model, ModelWrapper):
            raise ValueError("Booster.enable_lora: call it before boost() (on the user's model)")
        return self.plugin.enable_lora(model, pretrained_dir=pretrained_dir, lora_config=lora_config)

    def save_lora_as_pretrained(
        self, model: ModelWrapper, checkpoint: str, use_safetensors: bool = False
    ) -> None:
        """Write the LoRA adapter in peft's format (``adapter_config.json`` + weights), loadable by peft."""
        from cai.booster._lora import save_lora_as_pretrained

        if not self.plugin.support_lora():
            raise ValueError(f"Booster.save_lora_as_pretrained: {self.plugin.name} does not support LoRA")
        _check_boosted(model, ModelWrapper, "save_lora_as_pretrained", "model")
        save_lora_as_pretrained(model.unwrap(unwrap_peft=False), checkpoint)

    # ---- checkpoints (all through cai-ckpt) ---------------------------------------------------------------
    def save_model(
        self,
        model: ModelWrapper,
        checkpoint: str | os.PathLike,
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_safetensors: bool = False,
        use_async: bool = False,
        *,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Save the model as a Hugging Face safetensors directory (``from_pretrained`` loads it) from any plugin.

        Always safetensors, always a directory with an index; ``shard=False`` writes one file when the model fits
        in ``size_per_shard`` MB. ``dtype`` (e.g. ``torch.bfloat16``) stores the floating tensors in that dtype
        and says so in ``config.json``; default: as the plugin holds them (fp32 masters where it keeps them).
        ``gather_dtensor``, ``prefix`` and ``use_safetensors`` are accepted for
        Colossal-AI compatibility: no rank gathers the model and pickle is never written. ``checkpoint`` may be
        new, empty, or an earlier cai checkpoint (replaced atomically); a file or a directory holding other files
        raises ``FileExistsError`` on every rank before anything is written.
        """
        import cai.ckpt

        _check_prefix(prefix)
        _check_boosted(model, ModelWrapper, "save_model", "model")
        cai.ckpt.save_model(
            self.plugin.model_state(model),
            checkpoint,
            size_per_shard=size_per_shard if shard else float("inf"),
            use_async=use_async,
            config=getattr(model.unwrap(), "config", None),
            dtype=dtype,
        )

    def load_model(
        self,
        model: ModelWrapper,
        checkpoint: str | os.PathLike,
        strict: bool = True,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
        *,
        verify: bool = True,
    ) -> None:
        """Load a checkpoint saved under any plugin and layout (or a Hugging Face safetensors directory).

        ``verify`` (default) checks every byte read against the checkpoint's checksums and raises
        ``cai.ckpt.CheckpointError`` naming the file and tensor on a mismatch; ``verify=False`` skips it.
        """
        import cai.ckpt

        _check_boosted(model, ModelWrapper, "load_model", "model")
        cai.ckpt.load_model(
            LoadView(self.plugin.model_state(model)), checkpoint, strict=strict, verify=verify
        )

    def save_optimizer(
        self,
        optimizer: OptimizerWrapper,
        checkpoint: str | os.PathLike,
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_async: bool = False,
        *,
        model: ModelWrapper | None = None,
    ) -> None:
        """Save optimizer state by parameter name (fp32), loadable under any plugin and layout."""
        import cai.ckpt

        _check_prefix(prefix)
        cai.ckpt.save_optimizer(
            self._optimizer_state(optimizer, model),
            checkpoint,
            size_per_shard=size_per_shard if shard else float("inf"),
            use_async=use_async,
        )

    def load_optimizer(
        self,
        optimizer: OptimizerWrapper,
        checkpoint: str | os.PathLike,
        prefix: str | None = None,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
        *,
        model: ModelWrapper | None = None,
        strict: bool = True,
        verify: bool = True,
    ) -> None:
        """Load optimizer state saved by ``save_optimizer`` under any plugin and layout (``verify``: as for
        ``load_model``)."""
        import cai.ckpt

        _check_prefix(prefix)
        cai.ckpt.load_optimizer(
            self._optimizer_state(optimizer, model, for_load=True), checkpoint, strict=strict, verify=verify
        )

    def save_lr_scheduler(self, lr_scheduler: Any, checkpoint: str | os.PathLike) -> None:
        """Save ``lr_scheduler.state_dict()`` as JSON (rank 0 writes)."""
        from cai.booster._lr import save_lr_scheduler

        save_lr_scheduler(lr_scheduler, Path(checkpoint))

    def load_lr_scheduler(self, lr_scheduler: Any, checkpoint: str | os.PathLike) -> None:
        from cai.booster._lr import load_lr_scheduler

        load_lr_scheduler(lr_scheduler, Path(checkpoint))

    def save_state(
        self,
        checkpoint: str | os.PathLike,
        *,
        step: int,
        model: ModelWrapper,
        optimizer: OptimizerWrapper | None = None,
        lr_scheduler: Any = None,
        dataloader: Any = None,
        extra: dict[str, Any] | None = None,
        size_per_shard: int = 1024,
        use_async: bool = False,
    ) -> Path:
        """Save everything for an exact resume (model, optimizer, scheduler, loss scaler, every rank's RNG and data
        position) as ``checkpoint/step-NNNNNN``; returns that directory."""
        import cai.ckpt

        _check_boosted(model, ModelWrapper, "save_state", "model")
        final = cai.ckpt.save_state(
            checkpoint,
            model=self.plugin.model_state(model),
            step=step,
            optimizer=self._optimizer_state(optimizer, model) if optimizer is not None else None,
            lr_scheduler=lr_scheduler,
            grad_scaler=_scaler(optimizer),
            dataloader=dataloader,
            rng_states=self.plugin.rng_states(),
            extra=extra,
            size_per_shard=size_per_shard,
            use_async=use_async,
        )
        if not use_async and dist.is_initialized():
            # cai-ckpt commits the directory before rank 0 moves the "latest" pointer; without this barrier a rank
            # that loads right away can find the previous (or no) pointer.
            dist.barrier()
        return final

    def load_state(
        self,
        checkpoint: str | os.PathLike,
        *,
        model: ModelWrapper,
        optimizer: OptimizerWrapper | None = None,
        lr_scheduler: Any = None,
        dataloader: Any = None,
        step: int | None = None,
        strict: bool = True,
        verify: bool = True,
    ) -> dict[str, Any]:
        """Restore what ``save_state`` wrote (the latest step, or ``step``) under any plugin and layout; returns
        ``{"step": int, "extra": dict, "path": Path}`` (``verify``: as for ``load_model``)."""
        import cai.ckpt

        _check_boosted(model, ModelWrapper, "load_state", "model")
        return cai.ckpt.load_state(
            checkpoint,
            model=LoadView(self.plugin.model_state(model)),
            optimizer=self._optimizer_state(optimizer, model, for_load=True)
            if optimizer is not None
            else None,
            lr_scheduler=lr_scheduler,
            grad_scaler=_scaler(optimizer),
            dataloader=dataloader,
            rng_states=self.plugin.rng_states(),
            step=step,
            strict=strict,
            verify=verify,
        )

    def _optimizer_state(
        self, optimizer: OptimizerWrapper, model: ModelWrapper | None, *, for_load: bool = False
    ) -> Any:
        _check_boosted(optimizer, OptimizerWrapper, "save_optimizer/load_optimizer/save_state", "optimizer")
        if model is not None:
            _check_boosted(model, ModelWrapper, "save_optimizer/load_optimizer/save_state", "model")
        model = model if model is not None else getattr(optimizer, "boosted_model", None)
        if model is None:
            raise ValueError(
                "Booster: this optimizer was boosted without its model; pass model= (the boosted model) so its "
                "state can be saved by parameter name"
            )
        state = self.plugin.optimizer_state(optimizer, model)
        # Both ways the per-parameter state must exist: the loader checks keys before loading, and a save before
        # the first step must still write every key.
        self.plugin.prepare_optimizer_load(optimizer)
        return LoadView(state) if for_load else state


def _check_boosted(obj: Any, kind: type, method: str, what: str) -> None:
    if not isinstance(obj, kind):
        raise TypeError(
            f"Booster.{method}: {what} is a {type(obj).__module__}.{type(obj).__name__}, not the {what} that "
            f"boost() returned; pass the boosted {what} (model, optimizer, *_ = booster.boost(model, optimizer))"
        )


def _refuse_resize(plugin: str, *modules: nn.Module) -> None:
    """Resizing the embeddings of a boosted model would make new parameters that the plugin never saw: not in its
    buckets, chunks or shards, not reduced over the ranks and not in the optimizer. So a Hugging Face model's
    ``resize_token_embeddings`` raises after ``boost()`` (an attribute of this instance only)."""

    for m in modules:
        base = m.get_base_model() if hasattr(m, "get_base_model") else m
        for target in {id(m): m, id(base): base}.values():
            if callable(getattr(target, "resize_token_embeddings", None)):
                target.resize_token_embeddings = _ResizeRefused(plugin)


class _ResizeRefused:
    """What ``resize_token_embeddings`` becomes at ``boost()`` (a class, so that the model still pickles)."""

    def __init__(self, plugin: str) -> None:
        self.plugin = plugin

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError(
            f"resize_token_embeddings after boost(): {self.plugin} has laid out, sharded and handed to the "
            "optimizer the embeddings as they were, and new ones would not train; resize the model before boost() "
            "(and build the optimizer after resizing)"
        )


def _check_optimizer(model: nn.Module, optimizer: Any) -> None:
    """The optimizer must be a torch optimizer over (some of) this model's parameters."""
    if optimizer is None:
        return
    if isinstance(optimizer, OptimizerWrapper):
        raise ValueError(
            "Booster.boost: the optimizer is already boosted (it is the wrapper that boost() returned); pass the "
            "torch optimizer built on model.parameters() and boost it together with its model once"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"Booster.boost: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}; build one "
            "on model.parameters() (or pass optimizer=None)"
        )
    own = {id(p) for p in model.parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    foreign = sum(id(p) not in own for p in params)
    if foreign:
        raise ValueError(
            f"Booster.boost: the optimizer ({type(optimizer).__name__}) holds parameters that are not in the model "
            f"({foreign} of its {len(params)}; the {type(model).__name__} has {len(own)}): it was built over another "
            "model or a copy of this one; build it on this model's "
            "parameters right before boost(): optimizer = AdamW(model.parameters(), ...)"
        )


def _scaler(optimizer: OptimizerWrapper | None) -> Any:
    scaler = getattr(optimizer, "scaler", None) if optimizer is not None else None
    return scaler if hasattr(scaler, "state_dict") else None


def _check_prefix(prefix: str | None) -> None:
    if prefix is not None:
        raise ValueError(
            f"Booster: prefix={prefix!r} is not supported; checkpoint file names are fixed, use prefix=None"
        )
