"""Build a cai Booster plugin from a short name, the way the examples' ``--plugin`` flag spells it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

PLUGINS = ("ddp", "fsdp", "zero1", "zero2", "gemini", "hybrid")
PRECISIONS = ("fp32", "bf16", "fp16")
SP_MODES = ("split_gather", "ring", "all_to_all", "ring_attn")
_SP_ON_TP = ("split_gather", "ring")  # these split the sequence over the tp group: no sp axis of their own


@dataclass(kw_only=True, frozen=True)
class HybridLayout:
    """``--plugin hybrid``'s sizes: HybridParallelPlugin's tp x pp x sp, with ZeRO over the data-parallel axis
    (dp = world / (tp x pp x sp)). Errors speak of the flags, with their values.

    ``sp_mode`` None with ``sp > 1`` means ``all_to_all``; ``split_gather`` and ``ring`` split the sequence over
    the tp group (so ``sp`` stays 1). With ``pp > 1`` each batch is cut into ``num_microbatches`` micro-batches
    (or micro-batches of ``microbatch_size`` rows) and the pipeline runs 1F1B over them.
    """

    tp: int = 1
    pp: int = 1
    sp: int = 1
    sp_mode: str | None = None
    zero_stage: int = 1
    num_microbatches: int | None = None
    microbatch_size: int | None = None
    # The vocabulary is padded to a multiple of this x tp (Colossal-AI's make_vocab_size_divisible_by). A tiny
    # vocabulary needs 1: padded to 64 x tp, the last tp ranks would hold padding rows only, which is refused.
    vocab_multiple: int = 64

    def __post_init__(self) -> None:
        for flag, value in (("--tp", self.tp), ("--pp", self.pp), ("--sp", self.sp)):
            if value < 1:
                raise ValueError(f"{flag} {value} must be >= 1")
        if self.sp_mode is not None and self.sp_mode not in SP_MODES:
            raise ValueError(f"--sp-mode {self.sp_mode!r} is not one of {', '.join(SP_MODES)}")
        if self.sp_mode in _SP_ON_TP and (self.tp == 1 or self.sp > 1):
            raise ValueError(
                f"--sp-mode {self.sp_mode} splits the sequence over the tp group, so it needs --tp > 1 and --sp 1 "
                f"(got --tp {self.tp} --sp {self.sp}); for a sequence axis of its own use --sp N with --sp-mode "
                "all_to_all or ring_attn"
            )
        if self.sp == 1 and self.sp_mode in ("all_to_all", "ring_attn"):
            raise ValueError(f"--sp-mode {self.sp_mode} needs --sp > 1 (got --sp 1)")
        if self.zero_stage not in (0, 1, 2):
            raise ValueError(f"--zero-stage {self.zero_stage} must be 0, 1 or 2")
        if self.zero_stage == 2 and self.pp > 1:
            raise ValueError(
                f"--zero-stage 2 does not combine with --pp {self.pp} (every micro-batch's backward would "
                "reduce-scatter the gradients); use --zero-stage 1 or 0"
            )
        for flag, value in (("--microbatches", self.num_microbatches), ("--mbs", self.microbatch_size)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} {value} must be >= 1")
        if self.pp > 1 and self.num_microbatches is None and self.microbatch_size is None:
            raise ValueError(f"--pp {self.pp} needs --microbatches N or --mbs N (how each batch is split)")

    @property
    def mode(self) -> str | None:
        """The sequence-parallel mode the plugin runs (None: off)."""
        return self.sp_mode or ("all_to_all" if self.sp > 1 else None)

    @property
    def model_parallel(self) -> int:
        """Ranks per model replica: tp x pp x sp."""
        return self.tp * self.pp * self.sp

    @property
    def seq_multiple(self) -> int:
        """Sequence lengths must be a multiple of this (ring_attn cuts the sequence into 2 sp zigzag pieces)."""
        mode = self.mode
        if mode in _SP_ON_TP:
            return self.tp
        return 2 * self.sp if mode == "ring_attn" else self.sp

    def describe(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}"] + ([f"sp{self.sp}"] if self.sp > 1 else [])
        mode = f", sp {self.mode}" if self.mode else ""
        return f"{' x '.join(parts)}, ZeRO-{self.zero_stage}{mode}"

    def dp_size(self, world: int) -> int:
        """The data-parallel size ``world`` leaves; raises naming every factor when it does not fit."""
        if world % self.model_parallel:
            fits = [d for d in range(1, world + 1) if world % d == 0]
            raise ValueError(
                f"--tp {self.tp} x --pp {self.pp} x --sp {self.sp} = {self.model_parallel} ranks per replica does "
                f"not divide the world size {world} (--nproc or the launcher's); choose sizes whose product is one "
                f"of {fits}, or run {self.model_parallel} x N processes"
            )
        return world // self.model_parallel

    def check_model(self, *, heads: int, kv_heads: int, layers: int, source: str = "--heads") -> None:
        """The model must split: heads over tp (and over sp for all_to_all), decoder layers over the stages.
        ``source`` names where the model's sizes come from in the errors."""
        split = self.tp * (self.sp if self.mode == "all_to_all" else 1)
        over = f"--tp {self.tp}" + (
            f" x --sp {self.sp} (all_to_all splits heads too)" if split != self.tp else ""
        )
        for what, n in (("attention heads", heads), ("key/value heads", kv_heads)):
            if n % split:
                raise ValueError(
                    f"{n} {what} ({source}) do not divide over {over}; use a multiple of {split}"
                )
        if layers < self.pp:
            raise ValueError(
                f"{layers} decoder layers ({source.replace('heads', 'layers')}) are fewer than --pp {self.pp} "
                f"pipeline stages (one chunk each); use at least {self.pp} layers or a smaller --pp"
            )

    def check_batch(self, batch_per_replica: int, *, flag: str) -> None:
        """With pp > 1 a replica's batch must cut into whole micro-batches."""
        if self.pp == 1:
            return
        if self.num_microbatches is not None and batch_per_replica % self.num_microbatches:
            raise ValueError(
                f"{flag} gives each replica {batch_per_replica} sequences, which do not cut into --microbatches "
                f"{self.num_microbatches}; use a batch that is a multiple of {self.num_microbatches} per replica"
            )
        if self.microbatch_size is not None and batch_per_replica % self.microbatch_size:
            raise ValueError(
                f"{flag} gives each replica {batch_per_replica} sequences, which do not cut into micro-batches of "
                f"--mbs {self.microbatch_size}"
            )

    def rows_multiple(self) -> int:
        """Forward batches through the pipeline must have a multiple of this many rows."""
        if self.pp == 1:
            return 1
        return self.num_microbatches or self.microbatch_size or 1


FP8_RECIPES = ("tensorwise", "rowwise")  # cai.kernels.convert_to_fp8's recipes, the default first


def check_fp8(plugin: str, recipe: str = "tensorwise") -> None:
    """``--fp8`` (``use_fp8=True``) exists on LowLevelZero, Gemini and HybridParallel: an error for any other.
    ``--fp8-recipe rowwise`` is applied before ``boost()`` (``convert_to_fp8(model, recipe=...)``), which the
    hybrid plugin's sharding does not take: its tensor-parallel layers are row-wise anyway."""
    if plugin not in ("zero1", "zero2", "gemini", "hybrid"):
        raise ValueError(f"--fp8 applies to zero1, zero2, gemini and hybrid, not --plugin {plugin}")
    if recipe not in FP8_RECIPES:
        raise ValueError(f"--fp8-recipe {recipe!r} is not one of {', '.join(FP8_RECIPES)}")
    if recipe != "tensorwise" and plugin == "hybrid":
        raise ValueError(f"--fp8-recipe {recipe} applies to zero1, zero2 and gemini, not --plugin hybrid")


def convert_fp8_before_boost(model, choice: PluginChoice) -> None:
    """A recipe other than the plugins' default: the linear layers converted before ``boost()``, whose
    ``use_fp8=True`` then keeps them as they are."""
    if choice.use_fp8 and choice.fp8_recipe != "tensorwise":
        from cai.kernels import convert_to_fp8

        convert_to_fp8(model, recipe=choice.fp8_recipe)


@dataclass(kw_only=True, frozen=True)
class PluginChoice:
    """What ``--plugin`` and its companion flags ask for.

    ``offload_optim_frac`` / ``offload_param_frac`` / ``shard_param_frac`` are Gemini's (Colossal-AI's meaning);
    ``cpu_offload`` is LowLevelZero's and FSDP's all-or-nothing optimizer offload.
    """

    name: str
    precision: str = "fp32"
    max_norm: float = 0.0
    cpu_offload: bool = False
    shard_param_frac: float = 1.0
    offload_optim_frac: float = 0.0
    offload_param_frac: float = 0.0
    hybrid: HybridLayout | None = None  # --plugin hybrid's sizes (default: tp 1, pp 1, ZeRO-1)
    use_fp8: bool = False  # FP8 linear layers (LowLevelZero, Gemini and HybridParallel)
    fp8_recipe: str = "tensorwise"  # with use_fp8: how the FP8 operands are scaled (convert_fp8_before_boost)
    options: Mapping[str, Any] = field(default_factory=dict)  # more keyword arguments for the plugin

    def __post_init__(self) -> None:
        if self.name not in PLUGINS:
            raise ValueError(f"--plugin {self.name!r} is not one of {', '.join(PLUGINS)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        for name in ("shard_param_frac", "offload_optim_frac", "offload_param_frac"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"--{name.replace('_', '-')} {value} must be in [0, 1]")
        offloads = self.offload_optim_frac > 0 or self.offload_param_frac > 0 or self.shard_param_frac < 1
        if offloads and self.name != "gemini":
            raise ValueError(
                f"--shard-param-frac/--offload-*-frac are GeminiPlugin's; got --plugin {self.name}. "
                "Use --plugin gemini, or --cpu-offload for zero1/zero2/fsdp"
            )
        if self.cpu_offload and self.name not in ("zero1", "zero2", "fsdp"):
            raise ValueError(f"--cpu-offload applies to zero1, zero2 and fsdp, not --plugin {self.name}")
        if self.use_fp8:
            check_fp8(self.name, self.fp8_recipe)
        if self.hybrid is not None and self.name != "hybrid":
            raise ValueError(
                f"--tp/--pp/--sp/--sp-mode/--zero-stage/--microbatches are HybridParallelPlugin's; got --plugin "
                f"{self.name}. Use --plugin hybrid"
            )
        if self.name == "hybrid" and self.hybrid is None:
            object.__setattr__(self, "hybrid", HybridLayout())

    @property
    def pipelined(self) -> bool:
        """Training goes through ``booster.execute_pipeline`` (hybrid with pp > 1)."""
        return self.hybrid is not None and self.hybrid.pp > 1

    @property
    def label(self) -> str:
        return (
            {
                "ddp": "TorchDDP",
                "fsdp": "TorchFSDP",
                "zero1": "LowLevelZero-1",
                "zero2": "LowLevelZero-2",
                "hybrid": f"HybridParallel {self.hybrid.describe()}" if self.hybrid else "HybridParallel",
            }.get(self.name, "Gemini")
            + (" FP8" if self.use_fp8 else "")
            + (f" {self.fp8_recipe}" if self.use_fp8 and self.fp8_recipe != "tensorwise" else "")
            + "".join(f", {k}={v}" for k, v in self.options.items())
        )


def make_booster(choice: PluginChoice):
    """A ``cai.booster.Booster`` with the plugin ``choice`` names, configured for its precision."""
    from cai.booster import Booster
    from cai.booster import plugin as plugins

    if choice.name == "ddp":
        # TorchDDP does not own precision: the Booster's mixed precision casts for it.
        mixed = None if choice.precision == "fp32" else choice.precision
        return Booster(plugin=plugins.TorchDDPPlugin(**choice.options), mixed_precision=mixed)
    if choice.name == "fsdp":
        return Booster(
            plugin=plugins.TorchFSDPPlugin(
                precision=choice.precision, cpu_offload=choice.cpu_offload, **choice.options
            )
        )
    if choice.name in ("zero1", "zero2"):
        plugin = plugins.LowLevelZeroPlugin(
            stage=int(choice.name[-1]),
            precision=choice.precision,
            max_norm=choice.max_norm,
            cpu_offload=choice.cpu_offload,
            use_fp8=choice.use_fp8,
            **choice.options,
        )
        return Booster(plugin=plugin)
    if choice.name == "hybrid":
        h = choice.hybrid
        plugin = plugins.HybridParallelPlugin(
            tp_size=h.tp,
            pp_size=h.pp,
            sp_size=h.sp,
            enable_sequence_parallelism=h.mode is not None,
            sequence_parallelism_mode=h.mode,
            zero_stage=h.zero_stage,
            precision=choice.precision,
            use_fp8=choice.use_fp8,
            max_norm=choice.max_norm,
            make_vocab_size_divisible_by=h.vocab_multiple,
            **({"num_microbatches": h.num_microbatches} if h.num_microbatches else {}),
            **({"microbatch_size": h.microbatch_size} if h.microbatch_size else {}),
            **choice.options,
        )
        return Booster(plugin=plugin)
    plugin = plugins.GeminiPlugin(
        precision=choice.precision,
        max_norm=choice.max_norm,
        shard_param_frac=choice.shard_param_frac,
        offload_optim_frac=choice.offload_optim_frac,
        offload_param_frac=choice.offload_param_frac,
        use_fp8=choice.use_fp8,
        **choice.options,
    )  # host optimizer chunks update during backward by default wherever that is exact
    return Booster(plugin=plugin)
