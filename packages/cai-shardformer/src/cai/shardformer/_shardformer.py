"""The two ways in: Colossal-AI's `ShardFormer(config).optimize(model)` and the plain-torch `shard_model`."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cai.shardformer._config import ShardConfig
from cai.shardformer._norm import fuse_layer_norms
from cai.shardformer._policy import Policy, apply_module_policy
from cai.shardformer._sequence import check_sequence_parallel
from cai.shardformer._sp_attention import ATTENTION_SP_MODES, check_sp_attention, install_sp_attention
from cai.shardformer._state import enable_state_protocol
from cai.shardformer.policies.auto_policy import get_autopolicy


class ShardFormer:
    """Shard a Hugging Face model with a policy (Colossal-AI's `ShardFormer`).

    Example:
        >>> shard_former = ShardFormer(ShardConfig(tensor_parallel_process_group=tp_group))
        >>> model, shared_params = shard_former.optimize(model)
    """

    def __init__(self, shard_config: ShardConfig):
        self.shard_config = shard_config

    def optimize(self, model: nn.Module, policy: Policy | None = None) -> tuple[nn.Module, list]:
        """Shard `model` in place with `policy` (by default the one registered for its class) and return
        `(model, shared_params)`; `shared_params` lists parameters shared between pipeline stages (empty
        without pipeline parallelism). Misconfiguration (heads or vocabulary that do not divide, a feature
        not built yet) raises before any module is changed."""
        cfg = self.shard_config
        unsupported = cfg.unsupported()
        if unsupported:
            raise NotImplementedError(
                f"ShardConfig sets {', '.join(unsupported)}, which cai-shardformer does not build yet; leave "
                f"them at their defaults (tensor parallelism alone works)"
            )
        if policy is None and cfg.expert_parallel_size > 1:
            from cai.shardformer.policies.moe import ExpertParallelPolicy

            policy = ExpertParallelPolicy(get_autopolicy(model) if cfg.tensor_parallel_size > 1 else None)
        policy = get_autopolicy(model) if policy is None else policy
        if (cfg.enable_flash_attention or cfg.enable_all_optimization) and getattr(
            getattr(model, "config", None), "_attn_implementation", None
        ) == "eager":
            model.set_attn_implementation("sdpa")  # torch's SDPA: flash kernels where they apply
        if cfg.enable_sequence_parallelism:
            check_sequence_parallel(cfg, policy)
        policy.set_model(model)
        policy.set_shard_config(cfg)  # runs config_sanity_check
        sp_attention = cfg.enable_sequence_parallelism and cfg.sequence_parallelism_mode in ATTENTION_SP_MODES
        if sp_attention:
            attention = policy.sequence_parallel_attention()
            check_sp_attention(model, cfg, attention, type(policy).__name__)
        model = policy.preprocess()
        shared_params = policy.get_shared_params()
        if cfg.enable_fused_normalization or cfg.enable_all_optimization:
            from cai.kernels import patch_hf_model

            # The norms (with the residual adds they take in) under either switch, the other kernels under
            # enable_all_optimization; each composes with the policies, whose tp layers replace plain Linear
            # modules that SwiGLU and the shared q/k/v input then leave to them. The fused loss only where the head
            # stays whole: a vocab-parallel head computes its own loss from the hidden states.
            everything = cfg.enable_all_optimization
            patch_hf_model(
                model,
                rms_norm=True,
                swiglu=everything,
                rope=everything,
                fused_loss=everything and cfg.tensor_parallel_size == 1,
                shared_qkv=everything,
                fused_residual=True,
                training_forward=everything,
            )
            fuse_layer_norms(model)
        apply_module_policy(model, policy.module_policy(), cfg)
        model = policy.postprocess()
        if sp_attention:
            install_sp_attention(model, cfg, attention)
        if cfg.tensor_parallel_size > 1 or cfg.expert_parallel_size > 1:
            enable_state_protocol(model)  # so cai-ckpt saves the Hugging Face layout from the shards
        return model, shared_params


def shard_model(
    model: nn.Module,
    tp: DeviceMesh | dist.ProcessGroup,
    *,
    policy: Policy | None = None,
    make_vocab_size_divisible_by: int | None = 64,
    parallel_output: bool = True,
) -> nn.Module:
    """Apply tensor parallelism to `model` in place over `tp` and return it.

    Args:
        tp: a process group, a 1-D DeviceMesh, or a DeviceMesh with a "tp" axis (other axes, such as the
            data-parallel one, are left to the caller: compose with FSDP2 on them after this call).
        policy: default the policy registered for the model's class.
        make_vocab_size_divisible_by, parallel_output: as in `ShardConfig`.

    Example:
        >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        >>> shard_model(model, mesh)                     # tp over mesh["tp"]
        >>> fully_shard(model, mesh=mesh["dp"])          # then data parallel on the other axis
    """
    if isinstance(tp, DeviceMesh):
        if tp.ndim == 1:
            group = tp.get_group()
        elif tp.mesh_dim_names and "tp" in tp.mesh_dim_names:
            group = tp.get_group("tp")
        else:
            raise ValueError(
                f"shard_model: a {tp.ndim}-D DeviceMesh with axes {tp.mesh_dim_names} has no 'tp' axis; name one "
                f"axis 'tp' or pass mesh['<axis>']"
            )
    else:
        group = tp
    config = ShardConfig(
        tensor_parallel_process_group=group,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        parallel_output=parallel_output,
    )
    model, _ = ShardFormer(config).optimize(model, policy)
    return model
