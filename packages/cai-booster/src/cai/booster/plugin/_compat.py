"""Colossal-AI's plugin keyword arguments mapped onto cai's typed configs, by tables.

``LowLevelZeroPlugin(stage=2, precision="bf16", reduce_bucket_size_in_m=12, ...)`` and ``GeminiPlugin(...)``
take Colossal-AI's names so that its users' scripts run unchanged; inside, each plugin holds one frozen config
(``LowLevelZeroConfig``, ``GeminiConfig``). Every Colossal-AI name is in exactly one table of its plugin:

- ``mapped``: the name sets a config field (a dotted path), converted to the field's units where they differ;
- ``ignored``: accepted and ignored, with the reason (cai always behaves that way, or the knob has no meaning);
- ``rejected``: the feature is not implemented; any value but the accepted one raises with what to use instead;
- ``plugin``: the plugin itself reads the name (it acts on the model or adjusts the config), with what it does.

[Note: config= and keyword arguments]
Without ``config=`` the config is built from Colossal-AI's defaults (``defaults``: where they differ from the
config's own, such as ``precision="fp16"``) overlaid with the keywords given. With ``config=`` the config is used
as it is; a mapped keyword is still allowed when it agrees with the config (a script that passes
``precision="bf16"`` next to a config that says bf16 is not wrong), and raises when it disagrees, because either
choice would silently drop the other. Every error about a keyword names it and the value the user passed, in the
user's units, never only the config field it became. Arguments may also be given by position, in Colossal-AI's
order (``PluginArgs.positional``): ``HybridParallelPlugin(2, 1)`` is tp 2, pp 1.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "GEMINI_ARGS",
    "HYBRID_ARGS",
    "LOW_LEVEL_ZERO_ARGS",
    "MOE_HYBRID_ARGS",
    "PluginArgs",
    "config_from_kwargs",
    "hybrid_sp_kwargs",
]


def _same(value: Any) -> Any:
    return value


UNSET: Any = object()  # from a Mapped's convert: this value leaves that field as it is


@dataclass(frozen=True)
class Mapped:
    """One Colossal-AI keyword that sets ``path`` (dotted, into the config) to ``convert(value)``; a tuple of paths
    takes a tuple of values from ``convert`` (one keyword that sets several fields), where ``UNSET`` leaves a
    field alone.

    ``check(value)`` returns why a value is invalid, in the keyword's own units, or None; it runs before the
    conversion so that the error never speaks of the converted number.
    """

    path: str | tuple[str, ...]
    convert: Callable[[Any], Any] = _same
    check: Callable[[Any], str | None] | None = None

    def values(self, value: Any) -> dict[str, Any]:
        """The config fields ``value`` sets, by dotted path."""
        if isinstance(self.path, str):
            return {self.path: self.convert(value)}
        return {p: v for p, v in zip(self.path, self.convert(value), strict=True) if v is not UNSET}


@dataclass(frozen=True)
class Rejected:
    """Keywords whose feature cai does not implement: any value other than ``ok`` raises with ``fix``."""

    names: tuple[str, ...]
    ok: Any
    fix: str


@dataclass(frozen=True)
class PluginArgs:
    owner: str
    mapped: Mapping[str, Mapped]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    ignored: Mapping[str, str] = field(default_factory=dict)
    rejected: tuple[Rejected, ...] = ()
    plugin: Mapping[str, str] = field(default_factory=dict)
    positional: tuple[str, ...] = ()  # Colossal-AI's parameter order, for arguments given by position

    def names(self) -> list[str]:
        return sorted(
            {*self.mapped, *self.ignored, *self.plugin, *(n for r in self.rejected for n in r.names)}
        )

    def by_name(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """``kwargs`` with the positional ``args`` named in Colossal-AI's order."""
        if len(args) > len(self.positional):
            raise TypeError(
                f"{self.owner}() takes at most {len(self.positional)} positional arguments "
                f"({', '.join(self.positional)}), got {len(args)}; pass the others by keyword"
            )
        named = dict(zip(self.positional, args))
        twice = sorted(set(named) & set(kwargs))
        if twice:
            raise TypeError(f"{self.owner}() got multiple values for {', '.join(map(repr, twice))}")
        return {**named, **kwargs}


# ---- LowLevelZeroPlugin ---------------------------------------------------------------------------------------


def _positive(unit: str, default: Any) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return None
        return f"must be > 0 ({unit}; Colossal-AI's default is {default})"

    return check


def _bucket_mb(in_m: float) -> float:
    # Colossal-AI counts the bucket in millions of elements; ZeroConfig counts MiB. The conversion takes fp32
    # elements (4 bytes), so a bf16 bucket holds twice as many elements as Colossal-AI's of the same name.
    return in_m * 4


# The dynamic loss scaler's arguments, the same names in both plugins and in the scaler's config.
_LOSS_SCALE = {
    name: Mapped(f"loss_scale.{name}")
    for name in (
        "initial_scale", "min_scale", "growth_factor", "backoff_factor", "growth_interval", "hysteresis",
        "max_scale",
    )
}  # fmt: skip

# Colossal-AI's parameter order, for arguments given by position
_LOW_LEVEL_ZERO_ORDER = (
    "stage", "precision", "initial_scale", "min_scale", "growth_factor", "backoff_factor", "growth_interval",
    "hysteresis", "max_scale", "max_norm", "norm_type", "reduce_bucket_size_in_m", "communication_dtype",
    "overlap_communication", "overlap_allgather", "cpu_offload", "master_weights", "verbose", "cast_inputs",
    "fp8_communication", "use_fp8", "extra_dp_size",
)  # fmt: skip

LOW_LEVEL_ZERO_ARGS = PluginArgs(
    owner="LowLevelZeroPlugin",
    mapped={
        "stage": Mapped("zero.stage"),
        "precision": Mapped("precision"),
        **_LOSS_SCALE,
        "max_norm": Mapped("zero.max_norm"),
        "reduce_bucket_size_in_m": Mapped(
            "zero.bucket_size_mb", _bucket_mb, _positive("millions of elements per gradient bucket", 12)
        ),
        "communication_dtype": Mapped("zero.comm_dtype"),
        "overlap_communication": Mapped("zero.overlap_comm"),
        "overlap_allgather": Mapped("zero.overlap_allgather"),
        "cpu_offload": Mapped("zero.cpu_offload"),
        "cast_inputs": Mapped("cast_inputs"),
        "use_fp8": Mapped("use_fp8"),
        "fp8_communication": Mapped("zero.fp8_communication"),
    },
    # Colossal-AI's defaults where they differ from LowLevelZeroConfig's.
    defaults={
        "stage": 1,
        "precision": "fp16",
        "initial_scale": 2**32,
        "max_scale": 2**32,
        "reduce_bucket_size_in_m": 12,
        "overlap_communication": True,
    },
    ignored={"verbose": "cai logs through cai.mesh's rank-aware logger"},
    rejected=(
        Rejected(("norm_type",), 2.0, "use norm_type=2.0 (clipping uses the global L2 norm)"),
        Rejected(("master_weights",), True, "use master_weights=True; fp32 masters are kept"),
        Rejected(("extra_dp_size",), 1, "use 1 (the ZeRO group is the whole world)"),
    ),
    positional=_LOW_LEVEL_ZERO_ORDER,
)


# ---- GeminiPlugin ---------------------------------------------------------------------------------------------


def _chunk_entries(value: Mapping) -> list[Mapping]:
    """Colossal-AI's chunk configurations: ``{"chunk_size": n}``, or ``{dp degree: {"chunk_size": n,
    "keep_gathered": False}}`` as its ``search_chunk_configuration`` returns them."""
    if value and all(isinstance(k, int) and not isinstance(k, bool) for k in value):
        return list(value.values())
    return [value]


def _chunk_fields(chunk_config_dict: dict | None) -> tuple[int | None, Any]:
    """``(chunk size, shard_param_frac)``: ``keep_gathered=True`` keeps every chunk gathered, which is
    ``shard_param_frac=0.0`` (each rank holds the whole parameters; the fp32 masters stay sharded)."""
    if not chunk_config_dict:
        return None, UNSET
    entry = _chunk_entries(chunk_config_dict)[0]
    return entry.get("chunk_size"), 0.0 if entry.get("keep_gathered") else UNSET


def _chunk_dict_check(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(e, Mapping) for e in _chunk_entries(value)):
        return "must be a dict such as {'chunk_size': 2**24} (or {dp_degree: {'chunk_size': ...}}) or None"
    entries = _chunk_entries(value)
    extra = sorted({k for e in entries for k in e} - {"chunk_size", "keep_gathered"})
    if extra:
        return f"has keys {extra} that are not supported; only 'chunk_size' and 'keep_gathered'"
    if len({bool(e.get("keep_gathered")) for e in entries}) > 1:
        return "has keep_gathered both True and False for different dp degrees; cai keeps all chunks alike"
    sizes = [e.get("chunk_size") for e in entries]
    if len(set(sizes)) > 1:
        return f"has chunk sizes {sizes} for different dp degrees; cai uses one chunk size"
    return None


_KERNELS = "True applies cai-kernels to the model at boost() (cai.kernels.patch_hf_model)"

_GEMINI_ORDER = (
    "chunk_config_dict", "chunk_init_device", "placement_policy", "enable_gradient_accumulation",
    "max_prefetch", "shard_param_frac", "offload_optim_frac", "offload_param_frac",
    "warmup_non_model_data_ratio", "steady_cuda_cap_ratio", "precision", "master_weights", "pin_memory",
    "force_outputs_fp32", "strict_ddp_mode", "search_range_m", "hidden_dim", "min_chunk_size_m", "memstats",
    "gpu_margin_mem_ratio", "initial_scale", "min_scale", "growth_factor", "backoff_factor", "growth_interval",
    "hysteresis", "max_scale", "max_norm", "norm_type", "tp_size", "extra_dp_size", "enable_all_optimization",
    "enable_fused_normalization", "enable_flash_attention", "enable_sequence_parallelism", "enable_jit_fused",
    "enable_async_reduce", "use_fp8", "verbose", "fp8_communication",
)  # fmt: skip

GEMINI_ARGS = PluginArgs(
    owner="GeminiPlugin",
    mapped={
        "chunk_config_dict": Mapped(
            ("chunk.chunk_size", "shard_param_frac"), _chunk_fields, _chunk_dict_check
        ),
        "placement_policy": Mapped("placement_policy"),
        "max_prefetch": Mapped("max_prefetch"),
        "shard_param_frac": Mapped("shard_param_frac"),
        "offload_optim_frac": Mapped("offload_optim_frac"),
        "offload_param_frac": Mapped("offload_param_frac"),
        "warmup_non_model_data_ratio": Mapped("warmup_non_model_data_ratio"),
        "steady_cuda_cap_ratio": Mapped("steady_cuda_cap_ratio"),
        "precision": Mapped("precision"),
        # False means "not asked for": GeminiConfig then pins host buffers when CUDA is there, which
        # Colossal-AI's default enable_async_reduce=True does as well.
        "pin_memory": Mapped("pin_memory", lambda v: True if v else None),
        "search_range_m": Mapped("chunk.search_range_m"),
        "hidden_dim": Mapped("chunk.hidden_dim"),
        "min_chunk_size_m": Mapped("chunk.min_chunk_size_m"),
        **_LOSS_SCALE,
        "max_norm": Mapped("max_norm"),
        "norm_type": Mapped("norm_type"),
        # cai's own: update host-resident chunks during backward (see GeminiConfig.overlap_host_step).
        "overlap_host_step": Mapped("overlap_host_step"),
        "fp8_communication": Mapped("fp8_communication"),
    },
    defaults={"precision": "fp16"},
    ignored={
        "chunk_init_device": "chunks are built on the boost() device",
        "strict_ddp_mode": "every parameter is in a chunk sharded over the whole world",
        "enable_async_reduce": "reductions already overlap backward where the device allows",
        "verbose": "cai logs through cai.mesh's rank-aware logger",
    },
    rejected=(
        Rejected(("tp_size",), 1, "use tp_size=1 (tensor parallelism is HybridParallelPlugin's)"),
        Rejected(("extra_dp_size",), 1, "use extra_dp_size=1 (the chunks are sharded over the whole world)"),
        Rejected(("memstats",), None, "leave it None (placement_policy='auto' measures memory itself)"),
        Rejected(("gpu_margin_mem_ratio",), 0.0, "leave it 0.0 (use steady_cuda_cap_ratio)"),
        Rejected(("master_weights",), True, "use master_weights=True (fp32 master weights are always kept)"),
        Rejected(("force_outputs_fp32",), False, "leave it False and cast the outputs in the loss"),
        Rejected(
            ("enable_sequence_parallelism",), False, "leave it False (sequence parallelism needs tp_size > 1)"
        ),
    ),
    plugin={
        "enable_all_optimization": _KERNELS,
        "enable_fused_normalization": _KERNELS,
        "enable_jit_fused": _KERNELS,
        "enable_flash_attention": _KERNELS + ", and a model on eager attention switches to torch SDPA",
        "use_fp8": (
            "True runs the linear layers (not the output head) in FP8 (cai.kernels.convert_to_fp8) at boost(), "
            "under LowLevelZero the decoder blocks compiled on FP8 GPUs (cai.booster.compile_blocks)"
        ),
        "enable_gradient_accumulation": (
            "True turns the overlapped host step off unless it is asked for (then plain repeated backward "
            "accumulates too); without it, accumulate inside no_sync()"
        ),
    },
    positional=_GEMINI_ORDER,
)


# ---- HybridParallelPlugin -------------------------------------------------------------------------------------


def _sp_size(value: int | None) -> int:
    return 1 if value is None else value


def _layers(value: Any) -> Any:
    return None if value is None else tuple(value)


def _checkpoint_from_colossal(value: Any) -> tuple[Any, float]:
    # Colossal-AI's GradientCheckpointConfig(gradient_checkpointing_ratio): the first int(ratio * layers) layers
    # of each stage are recomputed; None (or False) turns checkpointing off, True recomputes every layer.
    if value is None or value is False:
        return False, 1.0
    if value is True:
        return "full", 1.0
    return "full", float(getattr(value, "gradient_checkpointing_ratio", 1.0))


def _checkpoint_config_check(value: Any) -> str | None:
    if value is None or isinstance(value, bool):
        return None
    if getattr(value, "num_ckpt_layers_per_stage", None) is not None:
        return (
            "has num_ckpt_layers_per_stage; per-stage layer counts are not built, use gradient_checkpointing_ratio "
            "(the first int(ratio * layers) of every stage)"
        )
    ratio = getattr(value, "gradient_checkpointing_ratio", 1.0)
    if not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
        return f"has gradient_checkpointing_ratio={ratio!r}; use a fraction in [0, 1]"
    return None


_NO_DDP = "no torch DDP inside: gradients are reduced in cai-zero's flat buckets (zero_bucket_size_in_m)"

_HYBRID_ORDER = (
    "tp_size", "pp_size", "sp_size", "precision", "zero_stage", "enable_all_optimization",
    "enable_fused_normalization", "enable_flash_attention", "enable_jit_fused", "enable_sequence_parallelism",
    "sequence_parallelism_mode", "parallel_output", "num_microbatches", "microbatch_size", "initial_scale",
    "min_scale", "growth_factor", "backoff_factor", "growth_interval", "hysteresis", "max_scale", "max_norm",
    "broadcast_buffers", "ddp_bucket_cap_mb", "find_unused_parameters", "check_reduction",
    "gradient_as_bucket_view", "static_graph", "zero_bucket_size_in_m", "cpu_offload", "communication_dtype",
    "overlap_communication", "custom_policy", "pp_style", "num_model_chunks", "scheduler_nodes",
    "num_layers_per_stage", "gradient_checkpoint_config", "enable_metadata_cache", "make_vocab_size_divisible_by",
    "dp_outside", "overlap_p2p", "overlap_allgather", "fp8_communication", "use_fp8", "inner_ring_size",
)  # fmt: skip

HYBRID_ARGS = PluginArgs(
    owner="HybridParallelPlugin",
    mapped={
        "tp_size": Mapped("tp_size"),
        "pp_size": Mapped("pp_size"),
        "sp_size": Mapped("sp_size", _sp_size),
        "precision": Mapped("precision"),
        "zero_stage": Mapped("zero.stage"),
        # enable_sequence_parallelism folds into the mode in HybridParallelPlugin.__init__ (see sp_mode_kwargs)
        "sequence_parallelism_mode": Mapped("sequence_parallelism_mode"),
        "parallel_output": Mapped("parallel_output"),
        "num_microbatches": Mapped("pipeline.num_microbatches"),
        "microbatch_size": Mapped("pipeline.microbatch_size"),
        "pp_style": Mapped("pipeline.style"),
        "num_model_chunks": Mapped("pipeline.num_model_chunks"),
        "num_layers_per_stage": Mapped("pipeline.num_layers_per_stage", _layers),
        "enable_metadata_cache": Mapped("pipeline.enable_metadata_cache"),
        **_LOSS_SCALE,
        "max_norm": Mapped("zero.max_norm"),
        "zero_bucket_size_in_m": Mapped(
            "zero.bucket_size_mb", _bucket_mb, _positive("millions of elements per gradient bucket", 12)
        ),
        "cpu_offload": Mapped("zero.cpu_offload"),
        "communication_dtype": Mapped("zero.comm_dtype"),
        "overlap_communication": Mapped("zero.overlap_comm"),
        "overlap_allgather": Mapped("zero.overlap_allgather"),
        "custom_policy": Mapped("custom_policy"),
        "make_vocab_size_divisible_by": Mapped("make_vocab_size_divisible_by"),
        "use_fp8": Mapped("use_fp8"),
        "fp8_communication": Mapped("zero.fp8_communication"),
        # enable_all_optimization folds into these three (see hybrid_sp_kwargs)
        "enable_fused_normalization": Mapped("fused_normalization"),
        "enable_flash_attention": Mapped("flash_attention"),
        "enable_jit_fused": Mapped("fused_kernels"),
        "gradient_checkpoint_config": Mapped(
            ("gradient_checkpointing", "gradient_checkpointing_ratio"),
            _checkpoint_from_colossal,
            _checkpoint_config_check,
        ),
    },
    defaults={
        "precision": "fp16",
        "zero_stage": 0,
        "initial_scale": 2**16,
        "max_scale": 2**32,
        "zero_bucket_size_in_m": 12,
        "overlap_communication": True,
    },
    ignored={
        "enable_sequence_overlap": "the 'ring' mode already overlaps its sends with the matmuls",
        "broadcast_buffers": _NO_DDP,
        "ddp_bucket_cap_mb": _NO_DDP,
        "find_unused_parameters": _NO_DDP,
        "check_reduction": _NO_DDP,
        "gradient_as_bucket_view": _NO_DDP,
        "static_graph": _NO_DDP,
        "dp_outside": "the mesh order is fixed: pp, dp, sp, tp from outer to inner (tp ranks are neighbours)",
        "overlap_p2p": "pipeline sends are asynchronous (isend) already",
        "verbose": "cai logs through cai.mesh's rank-aware logger",
    },
    rejected=(
        Rejected(
            ("scheduler_nodes",), None, "leave it None (pp_style='zbv' builds its own zero-bubble plan)"
        ),
        Rejected(("inner_ring_size",), None, "leave it None (double-ring attention is not built)"),
    ),
    positional=_HYBRID_ORDER,
)


# Colossal-AI's order: ep_size third; no inner_ring_size, moe_dp_outside in place of dp_outside
_MOE_HYBRID_ORDER = (
    *_HYBRID_ORDER[:2], "ep_size", *_HYBRID_ORDER[2:40], "moe_dp_outside",
    *_HYBRID_ORDER[41:45],
)  # fmt: skip

MOE_HYBRID_ARGS = PluginArgs(
    owner="MoeHybridParallelPlugin",
    mapped={**HYBRID_ARGS.mapped, "ep_size": Mapped("ep_size")},
    defaults=HYBRID_ARGS.defaults,
    ignored={
        **HYBRID_ARGS.ignored,
        "moe_dp_outside": "the mesh order is fixed: pp, dp, ep, sp, tp from outer to inner",
    },
    rejected=HYBRID_ARGS.rejected,
    positional=_MOE_HYBRID_ORDER,
)


def hybrid_sp_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Colossal-AI's two sequence-parallel switches as the one mode cai's config holds, and
    ``enable_all_optimization`` as the fused normalization, fused kernels and flash attention it turns on."""
    out = dict(kwargs)
    enable = out.pop("enable_sequence_parallelism", False)
    mode = out.get("sequence_parallelism_mode")
    if enable:
        out["sequence_parallelism_mode"] = mode or "all_to_all"  # Colossal-AI's default mode
    elif mode is not None:
        raise ValueError(
            f"HybridParallelPlugin: sequence_parallelism_mode={mode!r} but enable_sequence_parallelism=False; set "
            "enable_sequence_parallelism=True to use it, or drop the mode"
        )
    if out.pop("enable_all_optimization", False):
        out.setdefault("enable_fused_normalization", True)
        out.setdefault("enable_jit_fused", True)
        out.setdefault("enable_flash_attention", True)
    return out


# ---- building ---------------------------------------------------------------------------------------------------


def config_from_kwargs(args: PluginArgs, config_type: type, config: Any, kwargs: dict[str, Any]) -> Any:
    """The config a plugin runs with: ``config`` checked against ``kwargs``, or built from them.

    See [Note: config= and keyword arguments]. Raises ``TypeError`` for an unknown keyword (with the closest
    known names) and ``ValueError`` for a rejected feature, an invalid value or a conflict with ``config``.
    """
    owner = args.owner
    unknown = sorted(set(kwargs) - set(args.names()))
    if unknown:
        hints = {n: difflib.get_close_matches(n, args.names(), n=1) for n in unknown}
        said = ", ".join(f"{n!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for n, h in hints.items())
        raise TypeError(
            f"{owner}() got unexpected keyword arguments {said}; it takes config= or {', '.join(args.names())}"
        )
    for row in args.rejected:
        values = {n: kwargs.get(n, row.ok) for n in row.names}
        if any(v != row.ok for v in values.values()):
            given = ", ".join(f"{n}={v!r}" for n, v in values.items())
            verb = "is" if len(values) == 1 else "are"
            raise ValueError(f"{owner}: {given} {verb} not supported; {row.fix}")
    mapped = {n: v for n, v in kwargs.items() if n in args.mapped}
    for name, value in mapped.items():
        check = args.mapped[name].check
        reason = check(value) if check else None
        if reason:
            raise ValueError(f"{owner}: {name}={value!r} {reason}")
    fields = {name: args.mapped[name].values(value) for name, value in mapped.items()}  # by keyword, by path
    if config is not None:
        if not isinstance(config, config_type):
            raise TypeError(
                f"{owner}: config={type(config).__name__}(...) is not a {config_type.__name__}; pass "
                f"config={config_type.__name__}(...) or Colossal-AI's keyword arguments"
            )
        for name, value in mapped.items():
            for path, want in fields[name].items():
                have = _get(config, path)
                if want != have:
                    raise ValueError(
                        f"{owner}: {name}={value!r} conflicts with config.{path}={have!r}; set it in the config "
                        f"(dataclasses.replace) or drop the keyword"
                    )
        return config
    values = {
        path: v
        for n, value in args.defaults.items()
        if n not in mapped
        for path, v in args.mapped[n].values(value).items()
    }
    setters: dict[str, str] = {}  # field -> the keyword that set it
    for name, value in mapped.items():
        for path, v in fields[name].items():
            first = setters.setdefault(path, name)
            if first != name and values[path] != v:
                raise ValueError(
                    f"{owner}: {first}={mapped[first]!r} and {name}={value!r} disagree; drop one of them"
                )
            values[path] = v
    try:
        return _build(config_type(), values)
    except (ValueError, TypeError) as err:
        text = str(err)
        if text.startswith(f"{owner}: "):
            raise  # a check written for the plugin already speaks of its keywords
        # The config names its own fields; name the keywords the user passed that set them.
        blamed = [n for n in mapped if any(re.search(rf"\b{p.split('.')[-1]}\b", text) for p in fields[n])]
        said = ", ".join(f"{n}={kwargs[n]!r}" for n in blamed)
        lead = f"{said} {'is' if len(blamed) == 1 else 'are'} invalid: " if blamed else ""
        raise type(err)(f"{owner}: {lead}{text}") from err


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _build(base: Any, values: dict[str, Any]) -> Any:
    """``base`` with the dotted ``values`` replaced; nested configs are rebuilt (and so validated) first."""
    top: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for path, value in values.items():
        head, _, rest = path.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            top[head] = value
    for head, sub in nested.items():
        top[head] = _build(getattr(base, head), sub)
    return dataclasses.replace(base, **top)
