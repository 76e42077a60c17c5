"""HybridParallelPlugin's configuration: Colossal-AI's keywords and defaults, and every misconfiguration refused
when the plugin is built, with a message that names the values and a setting that works."""

from __future__ import annotations

import re

import pytest

from cai.booster.plugin import (
    HybridParallelConfig,
    HybridParallelPlugin,
    MoeHybridParallelConfig,
    MoeHybridParallelPlugin,
    PipelineConfig,
)
from cai.zero import ZeroConfig


def raises(match: str, kind: type[Exception] = ValueError):
    return pytest.raises(kind, match=re.escape(match))


def test_colossal_defaults_and_keywords() -> None:
    cfg = HybridParallelPlugin(tp_size=2, pp_size=2, num_microbatches=4).config
    assert (cfg.precision, cfg.zero.stage, cfg.loss_scale.initial_scale) == ("fp16", 0, 2**16)
    assert cfg.zero.bucket_size_mb == 12 * 4  # zero_bucket_size_in_m counts millions of fp32 elements
    assert cfg.pipeline == PipelineConfig(num_microbatches=4)
    cfg = HybridParallelPlugin(
        tp_size=1, pp_size=2, zero_stage=1, precision="bf16", microbatch_size=1, pp_style="interleaved",
        num_model_chunks=2, max_norm=1.0, num_layers_per_stage=[1, 2, 2, 1],
    ).config  # fmt: skip
    assert (cfg.zero.stage, cfg.zero.max_norm, cfg.pipeline.style) == (1, 1.0, "interleaved")
    assert cfg.pipeline.num_layers_per_stage == (1, 2, 2, 1)
    # Colossal-AI's default mode when sequence parallelism is switched on
    cfg = HybridParallelPlugin(tp_size=1, pp_size=1, sp_size=2, enable_sequence_parallelism=True).config
    assert (cfg.sequence_parallelism_mode, cfg.sp_size) == ("all_to_all", 2)
    everything = HybridParallelPlugin(tp_size=2, pp_size=1, enable_all_optimization=True).config
    assert everything.fused_normalization and everything.fused_kernels and everything.flash_attention
    assert HybridParallelPlugin(tp_size=2, pp_size=1, enable_flash_attention=True).config.flash_attention
    # accepted for compatibility, with no effect (the reasons are in the table)
    HybridParallelPlugin(tp_size=2, pp_size=1, dp_outside=False, overlap_p2p=False)


def _attention_after_boost(flash: bool) -> str:
    import torch
    import transformers

    from cai.booster import Booster

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, attn_implementation="eager",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    plugin = HybridParallelPlugin(
        tp_size=2, pp_size=1, precision="fp32", enable_flash_attention=flash, make_vocab_size_divisible_by=1
    )
    boosted, *_ = Booster(plugin=plugin, device="cpu").boost(model, torch.optim.AdamW(model.parameters()))
    ids = torch.arange(16).reshape(2, 8)
    assert torch.isfinite(boosted(input_ids=ids, labels=ids).loss)
    return boosted.unwrap().config._attn_implementation


def test_enable_flash_attention_moves_eager_attention_to_sdpa() -> None:
    from cai.mesh.testing import run_distributed

    assert run_distributed(_attention_after_boost, 2, True) == ["sdpa", "sdpa"]
    assert run_distributed(_attention_after_boost, 2, False) == ["eager", "eager"]


def test_config_object_and_conflicting_keyword() -> None:
    cfg = HybridParallelConfig(tp_size=2, zero=ZeroConfig(stage=1))
    assert HybridParallelPlugin(config=cfg).config is cfg
    with raises("zero_stage=2 conflicts with config.zero.stage=1"):
        HybridParallelPlugin(config=cfg, zero_stage=2)


def test_sizes_that_do_not_fit_the_world() -> None:
    with raises("tp (3)"):
        HybridParallelConfig(tp_size=3, pp_size=1).dims(world_size=4)
    with raises("tp_size=0 must be a positive int"):
        HybridParallelPlugin(tp_size=0, pp_size=1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tp_size=1, pp_size=2, zero_stage=2, num_microbatches=2), "zero_stage=2 with pp_size=2"),
        (dict(tp_size=1, pp_size=2), "pp_size=2 needs num_microbatches or microbatch_size"),
        (dict(tp_size=1, pp_size=2, num_microbatches=2, microbatch_size=1), "not both"),
        (dict(tp_size=1, pp_size=2, num_microbatches=2, pp_style="gpipe"), "pp_style='gpipe'"),
        (
            dict(tp_size=1, pp_size=2, num_microbatches=2, pp_style="interleaved"),
            "needs num_model_chunks >= 2",
        ),
        (dict(tp_size=1, pp_size=2, num_microbatches=2, pp_style="zbv", num_model_chunks=3), "== 2"),
        (dict(tp_size=1, pp_size=1, pp_style="interleaved", num_model_chunks=2), "needs pp_size > 1"),
        (dict(tp_size=1, pp_size=1, sp_size=2), "sp_size=2 without sequence parallelism"),
        (
            dict(
                tp_size=1,
                pp_size=1,
                enable_sequence_parallelism=True,
                sequence_parallelism_mode="split_gather",
            ),
            "splits the sequence over the tp group, but tp_size=1",
        ),
        (
            dict(
                tp_size=2,
                pp_size=1,
                sp_size=2,
                enable_sequence_parallelism=True,
                sequence_parallelism_mode="ring",
            ),
            "sp_size=2 would be a second axis",
        ),
        (dict(tp_size=2, pp_size=1, sequence_parallelism_mode="ring"), "enable_sequence_parallelism=False"),
        (dict(tp_size=2, pp_size=1, precision="fp8"), "fp8"),
        (dict(tp_size=2, pp_size=1, scheduler_nodes=[1]), "scheduler_nodes=[1] is not supported"),
        (dict(tp_size=2, pp_size=1, zero_bucket_size_in_m=0), "zero_bucket_size_in_m=0 must be > 0"),
    ],
)
def test_misconfiguration_is_refused_at_construction(kwargs: dict, message: str) -> None:
    with raises(message):
        HybridParallelPlugin(**kwargs)


def test_unknown_keyword_suggests_the_close_one() -> None:
    with raises("'tp_sise' (did you mean 'tp_size'?)", TypeError):
        HybridParallelPlugin(tp_sise=2, pp_size=1)


def test_checkpoint_config_maps_to_policy_and_ratio() -> None:
    class GradientCheckpointConfig:  # Colossal-AI's, by its attributes
        def __init__(self, ratio: float) -> None:
            self.gradient_checkpointing_ratio = ratio
            self.num_ckpt_layers_per_stage = None

    cfg = HybridParallelPlugin(
        tp_size=2, pp_size=1, gradient_checkpoint_config=GradientCheckpointConfig(0.5)
    ).config
    assert (cfg.gradient_checkpointing, cfg.gradient_checkpointing_ratio) == ("full", 0.5)
    assert HybridParallelPlugin(tp_size=2, pp_size=1).config.gradient_checkpointing is False
    with raises("gradient_checkpointing_ratio=1.5"):
        HybridParallelPlugin(tp_size=2, pp_size=1, gradient_checkpoint_config=GradientCheckpointConfig(1.5))
    per_stage = GradientCheckpointConfig(0.0)
    per_stage.num_ckpt_layers_per_stage = [2, 1]
    with raises("num_ckpt_layers_per_stage"):
        HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=2, gradient_checkpoint_config=per_stage)
    with raises("gradient_checkpointing='some'"):
        HybridParallelConfig(gradient_checkpointing="some")


def test_moe_plugin_keywords_and_sizes() -> None:
    cfg = MoeHybridParallelPlugin(tp_size=2, pp_size=1, ep_size=4, zero_stage=1, moe_dp_outside=False).config
    assert (cfg.ep_size, cfg.tp_size, cfg.zero.stage) == (4, 2, 1)
    with raises("ep (3)"):
        MoeHybridParallelConfig(ep_size=3).dims(world_size=4)
    with raises("ep_size=0 must be a positive int"):
        MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=0)
    with raises("sp_size=2 (a sequence-parallel axis of its own) is not supported with experts"):
        MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, sp_size=2, enable_sequence_parallelism=True)
