"""HybridParallelPlugin's configuration: the pipeline schedule and stage layout (``PipelineConfig``) and every
setting of the plugin (``HybridParallelConfig``), validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from cai.booster._precision import check_precision

if TYPE_CHECKING:
    from cai.zero import LossScaleConfig, ZeroConfig

__all__ = ["HybridParallelConfig", "PipelineConfig"]

_PRECISIONS = ("fp32", "fp16", "bf16")
_SP_MODES = ("split_gather", "ring", "all_to_all", "ring_attn")
_SP_ON_TP = ("split_gather", "ring")  # these split the sequence over the tp group itself
_PP_STYLES = ("1f1b", "interleaved", "zbv")


def _zero_config() -> ZeroConfig:
    from cai.zero import ZeroConfig

    return ZeroConfig(stage=0)


def _loss_scale_config() -> LossScaleConfig:
    from cai.zero import LossScaleConfig

    return LossScaleConfig()


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """How the model is cut into stages and which schedule runs them (cai-pipeline).

    Args:
        style: ``"1f1b"`` (one chunk per stage), ``"interleaved"`` (``num_model_chunks`` >= 2) or ``"zbv"``
            (zero-bubble V, two chunks).
        num_microbatches / microbatch_size: how each batch is split; exactly one of them with ``pp_size > 1``.
        num_model_chunks: model chunks per pipeline rank.
        num_layers_per_stage: decoder blocks per virtual stage, in order (default: an even split).
        enable_metadata_cache: send tensor shapes between stages only when they change.
    """

    style: str = "1f1b"
    num_microbatches: int | None = None
    microbatch_size: int | None = None
    num_model_chunks: int = 1
    num_layers_per_stage: tuple[int, ...] | None = None
    enable_metadata_cache: bool = True

    def __post_init__(self) -> None:
        if self.style not in _PP_STYLES:
            raise ValueError(f"HybridParallelPlugin: pp_style={self.style!r}; use one of {list(_PP_STYLES)}")
        need = {"1f1b": "== 1", "interleaved": ">= 2", "zbv": "== 2"}[self.style]
        ok = {"1f1b": self.num_model_chunks == 1, "interleaved": self.num_model_chunks >= 2}.get(
            self.style, self.num_model_chunks == 2
        )
        if not ok:
            raise ValueError(
                f"HybridParallelPlugin: pp_style={self.style!r} needs num_model_chunks {need}, got "
                f"num_model_chunks={self.num_model_chunks}"
            )
        if self.num_microbatches is not None and self.microbatch_size is not None:
            raise ValueError(
                f"HybridParallelPlugin: give num_microbatches or microbatch_size, not both (got "
                f"num_microbatches={self.num_microbatches}, microbatch_size={self.microbatch_size})"
            )
        for name in ("num_microbatches", "microbatch_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"HybridParallelPlugin: {name}={value!r} must be a positive int")
        if self.num_layers_per_stage is not None:
            object.__setattr__(self, "num_layers_per_stage", tuple(self.num_layers_per_stage))


@dataclass(frozen=True, kw_only=True)
class HybridParallelConfig:
    """Everything ``HybridParallelPlugin`` needs.

    Args:
        tp_size, pp_size: tensor- and pipeline-parallel sizes; the data-parallel size is what the world leaves.
        sp_size: sequence-parallel size for the ``"all_to_all"`` and ``"ring_attn"`` modes (a mesh axis of its own);
            ``"split_gather"`` and ``"ring"`` split the sequence over the tp group and need ``sp_size == 1``.
        sequence_parallelism_mode: one of ``"split_gather"``, ``"ring"``, ``"all_to_all"``, ``"ring_attn"``;
            None turns sequence parallelism off.
        precision: working precision, ``"bf16"`` (default), ``"fp16"`` (with dynamic loss scaling) or ``"fp32"``;
            fp32 master weights are kept in the optimizer whatever this is.
        zero: cai-zero's ``ZeroConfig`` over the data-parallel axis: ``stage`` 0 (replicated masters, gradients
            all-reduced), 1 or 2, buckets, communication dtype, overlap, ``max_norm`` (clipping by the norm over
            every rank) and CPU offload. Stage 2 with ``pp_size > 1`` is refused.
        loss_scale: the fp16 loss scaler (``cai.zero.LossScaleConfig``).
        pipeline: schedule and stage layout (``PipelineConfig``); needs a micro-batch setting when ``pp_size > 1``.
        parallel_output: compute the causal-LM loss vocab-parallel from the hidden states (logits never gathered).
        fused_normalization: replace RMSNorm / LayerNorm by cai-kernels' fused ones (a pre-norm decoder layer's
            residual adds then run inside them).
        fused_kernels: cai-kernels' SwiGLU, rotary, shared q/k/v input and trimmed training forward too, and the
            fused linear cross-entropy where the head is not vocab-parallel (tp 1); with the tp policies, the
            kernels run around the parallel layers. This is cai-shardformer's ``enable_all_optimization``, which
            also moves a model on eager attention to torch SDPA.
        flash_attention: a Hugging Face model on eager attention moves to torch SDPA (flash kernels where they
            apply) before it is sharded; one already on another implementation keeps it.
        make_vocab_size_divisible_by: pad the vocabulary to a multiple of this times tp (None: no padding).
        custom_policy: a cai-shardformer ``Policy`` instead of the one registered for the model's class.
        gradient_checkpointing: recompute decoder blocks in backward: ``"full"`` (or True) keeps only each
            block's input, ``"selective"`` keeps the matmul and attention outputs and recomputes the elementwise
            ops (``cai.booster.activation_checkpointing``); False keeps everything.
        gradient_checkpointing_ratio: the leading fraction of each pipeline stage's blocks that are recomputed
            (the first ``int(ratio * blocks)``, Colossal-AI's ``GradientCheckpointConfig``); the rest keep all
            their activations.
        activation_offload: the leading fraction of each stage's blocks whose activations wait in pinned host
            memory instead (copied on a side stream; ``activation_checkpointing(offload=...)``); checkpointing
            then applies to the blocks after them.
        use_fp8: run the linear layers' matmuls (not the output head) in FP8 with dynamic scales in training:
            the tensor-parallel layers' local products (``cai.shardformer.enable_fp8``, row-wise scales) and any
            plain ``nn.Linear`` left (``cai.kernels.convert_to_fp8``, tensor-wise); their communication stays in
            the working dtype.
            Set ``zero=ZeroConfig(fp8_communication=True)`` (Colossal-AI's ``fp8_communication``) to reduce the
            data-parallel gradients in FP8.

    Example::

        HybridParallelPlugin(config=HybridParallelConfig(tp_size=2, pp_size=2, zero=ZeroConfig(stage=1),
                                                         pipeline=PipelineConfig(num_microbatches=4)))
    """

    tp_size: int = 1
    pp_size: int = 1
    sp_size: int = 1
    sequence_parallelism_mode: str | None = None
    precision: str = "bf16"
    zero: ZeroConfig = field(default_factory=_zero_config)
    loss_scale: LossScaleConfig = field(default_factory=_loss_scale_config)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    parallel_output: bool = True
    fused_normalization: bool = False
    fused_kernels: bool = False
    flash_attention: bool = False
    make_vocab_size_divisible_by: int | None = 64
    custom_policy: Any = None
    gradient_checkpointing: bool | Literal["full", "selective"] = False
    gradient_checkpointing_ratio: float = 1.0
    activation_offload: float = 0.0
    use_fp8: bool = False

    def __post_init__(self) -> None:
        owner = "HybridParallelPlugin"
        if self.gradient_checkpointing not in (False, True, "full", "selective"):
            raise ValueError(
                f"{owner}: gradient_checkpointing={self.gradient_checkpointing!r}; use False, True / 'full' or "
                "'selective'"
            )
        if not 0.0 <= self.gradient_checkpointing_ratio <= 1.0:
            raise ValueError(
                f"{owner}: gradient_checkpointing_ratio={self.gradient_checkpointing_ratio} must be in [0, 1] (the "
                "fraction of each stage's blocks recomputed)"
            )
        if not 0.0 <= self.activation_offload <= 1.0:
            raise ValueError(
                f"{owner}: activation_offload={self.activation_offload} must be in [0, 1] (the fraction of each "
                "stage's blocks offloaded)"
            )
        check_precision(self.precision, _PRECISIONS, owner=owner)
        for name in ("tp_size", "pp_size", "sp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{owner}: {name}={value!r} must be a positive int")
        mode = self.sequence_parallelism_mode
        if mode is not None and mode not in _SP_MODES:
            raise ValueError(f"{owner}: sequence_parallelism_mode={mode!r}; use one of {list(_SP_MODES)}")
        if mode is None and self.sp_size > 1:
            raise ValueError(
                f"{owner}: sp_size={self.sp_size} without sequence parallelism; set "
                "enable_sequence_parallelism=True with sequence_parallelism_mode='all_to_all' or 'ring_attn' (or "
                "sp_size=1)"
            )
        if mode in _SP_ON_TP and self.tp_size == 1:
            raise ValueError(
                f"{owner}: sequence_parallelism_mode={mode!r} splits the sequence over the tp group, but "
                "tp_size=1; use tp_size > 1, or mode 'all_to_all' / 'ring_attn' with sp_size > 1"
            )
        if mode in _SP_ON_TP and self.sp_size > 1:
            raise ValueError(
                f"{owner}: sequence_parallelism_mode={mode!r} uses the tp group (size {self.tp_size}) as its "
                f"sequence-parallel group, so sp_size={self.sp_size} would be a second axis; use sp_size=1, or mode "
                "'all_to_all' / 'ring_attn' for a sequence-parallel axis of its own"
            )
        if self.pp_size > 1 and self.zero.stage == 2:
            raise ValueError(
                f"{owner}: zero_stage=2 with pp_size={self.pp_size} is not supported (every micro-batch's backward "
                "would reduce-scatter the gradients); use zero_stage=1 or 0 with pipeline parallelism"
            )
        pipe = self.pipeline
        if self.pp_size > 1 and pipe.num_microbatches is None and pipe.microbatch_size is None:
            raise ValueError(
                f"{owner}: pp_size={self.pp_size} needs num_microbatches or microbatch_size (how each batch is split "
                f"into micro-batches), for example num_microbatches={2 * self.pp_size}"
            )
        if self.pp_size == 1 and (pipe.style != "1f1b" or pipe.num_model_chunks != 1):
            raise ValueError(
                f"{owner}: pp_style={pipe.style!r} with num_model_chunks={pipe.num_model_chunks} needs pp_size > 1"
            )

    @property
    def sp_on_tp(self) -> bool:
        return self.sequence_parallelism_mode in _SP_ON_TP

    def dims(self, world_size: int | None = None) -> Any:
        """The validated ``cai.mesh.ParallelDims`` (the data-parallel size fills the world)."""
        from cai.mesh import ParallelDims

        return ParallelDims(dp=-1, pp=self.pp_size, tp=self.tp_size, sp=self.sp_size, world_size=world_size)
