"""ShardConfig: Colossal-AI's field names and defaults, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

SUPPORT_SP_MODE = ("split_gather", "ring", "all_to_all", "ring_attn")
BUILT_SP_MODES = ("split_gather", "ring", "all_to_all", "ring_attn")  # the modes optimize() applies


@dataclass(frozen=True)
class ShardConfig:
    """How `ShardFormer.optimize` shards a model (Colossal-AI's `ShardConfig`, same names and defaults).

    Args:
        tensor_parallel_process_group: the tp group; None means the default (world) group.
        enable_tensor_parallelism: False leaves the layers unsharded (tp size 1).
        make_vocab_size_divisible_by: the vocabulary is padded to a multiple of this times tp (64); None turns
            padding off (the vocabulary must then divide by tp).
        parallel_output: True computes the causal-LM loss vocab-parallel from the hidden states (the logits are
            never gathered); False gathers the logits and leaves the loss to the model.
        enable_fused_normalization: RMSNorm and LayerNorm modules become cai-kernels' `RMSNorm` / `LayerNorm`
            (same Parameters, same state-dict keys); a pre-norm decoder layer's residual adds then run inside them.
        enable_sequence_parallelism / sequence_parallelism_mode: one of `SUPPORT_SP_MODE`; the mode defaults to
            "split_gather" when sequence parallelism is on. split_gather and ring split the sequence over the tp
            group (the sp group is the tp group); "all_to_all" (Ulysses) and "ring_attn" run on
            `sequence_parallel_process_group` (see `cai.shardformer._sp_attention`). A policy applies the modes
            it lists in `sequence_parallel_modes`.
        sync_sp_grads: under "all_to_all" and "ring_attn", sum every parameter's gradient over the sp group when
            backward ends (see [Note: gradients of parameters under sequence parallelism]), as one process would
            have it. False leaves each rank the gradient of its own tokens, for a caller that sums them itself (a
            ZeRO optimizer whose reduction group spans dp x sp, as cai's HybridParallelPlugin does).
        enable_all_optimization: turns on the fused normalization and flash attention, and applies the rest of
            `cai.kernels.patch_hf_model`: SwiGLU, rotary, the shared q/k/v input, the trimmed training forward and,
            where the head is not vocab-parallel (tp 1), the fused linear cross-entropy.
        enable_flash_attention: a Hugging Face model on eager attention moves to torch SDPA (flash kernels where
            they apply); one on another implementation keeps it.
        enable_jit_fused: accepted for compatibility, no effect (there are no JIT-fused kernels).
        The remaining fields (pipeline_stage_manager, gradient_checkpoint_config, sp_axis, pg_mesh,
        inner_ring_size, moe_dp_group, ep_group, fp8_communication, extra_kwargs) are accepted; `optimize`
        rejects the ones whose feature is not built yet, naming them.

    Example:
        >>> model, shared = ShardFormer(ShardConfig(tensor_parallel_process_group=tp_group)).optimize(model)
    """

    tensor_parallel_process_group: dist.ProcessGroup | None = None
    sequence_parallel_process_group: dist.ProcessGroup | None = None
    pipeline_stage_manager: Any = None
    enable_tensor_parallelism: bool = True
    enable_all_optimization: bool = False
    enable_fused_normalization: bool = False
    enable_flash_attention: bool = False
    enable_jit_fused: bool = False
    enable_sequence_parallelism: bool = False
    sequence_parallelism_mode: str | None = None
    parallel_output: bool = True
    make_vocab_size_divisible_by: int | None = 64
    gradient_checkpoint_config: Any = None
    extra_kwargs: dict[str, Any] = field(default_factory=dict)
    sp_axis: int | None = None
    pg_mesh: Any = None
    inner_ring_size: int | None = None
    moe_dp_group: dist.ProcessGroup | None = None
    ep_group: dist.ProcessGroup | None = None
    fp8_communication: bool = False
    sync_sp_grads: bool = True

    def __post_init__(self) -> None:
        mode = self.sequence_parallelism_mode
        if mode is not None and mode not in SUPPORT_SP_MODE:
            raise ValueError(
                f"sequence_parallelism_mode={mode!r} is not a sequence-parallel mode; use one of {SUPPORT_SP_MODE}"
            )
        if self.enable_sequence_parallelism and mode is None:
            object.__setattr__(self, "sequence_parallelism_mode", "split_gather")  # Colossal-AI's default
            mode = "split_gather"
        if not self.enable_sequence_parallelism:
            return
        if mode in ("split_gather", "ring") and not self.enable_tensor_parallelism:
            raise ValueError(
                f"sequence_parallelism_mode={mode!r} splits the sequence over the tp group, but "
                f"enable_tensor_parallelism=False; enable tensor parallelism or use 'all_to_all'"
            )
        if mode in ("all_to_all", "ring_attn") and self.sequence_parallel_process_group is None:
            raise ValueError(
                f"sequence_parallelism_mode={mode!r} runs on its own sequence-parallel group, but "
                f"sequence_parallel_process_group is None; pass the sp group (for example mesh.group('sp'))"
            )

    @property
    def tensor_parallel_size(self) -> int:
        if not self.enable_tensor_parallelism:
            return 1
        return dist.get_world_size(self.tensor_parallel_process_group)

    @property
    def sequence_parallel_size(self) -> int:
        if not self.enable_sequence_parallelism:
            return 1
        if self.sequence_parallelism_mode in ("split_gather", "ring"):
            return self.tensor_parallel_size
        return dist.get_world_size(self.sequence_parallel_process_group)

    @property
    def expert_parallel_size(self) -> int:
        return 1 if self.ep_group is None else dist.get_world_size(self.ep_group)

    def unsupported(self) -> list[str]:
        """The fields set to a feature this release does not build (optimize() refuses them)."""
        out = []
        if self.enable_sequence_parallelism and self.sequence_parallelism_mode not in BUILT_SP_MODES:
            out.append(f"enable_sequence_parallelism (mode {self.sequence_parallelism_mode!r})")
        for name in ("pipeline_stage_manager", "gradient_checkpoint_config", "moe_dp_group"):
            if getattr(self, name) is not None:
                out.append(name)
        if self.fp8_communication:
            out.append("fp8_communication")
        return out
