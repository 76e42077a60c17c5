"""Colossal-AI's plugin keyword arguments map onto the typed configs (plugin/_compat.py), and every error about
one of them names it and the value the user passed."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from cai.booster.plugin import (
    GeminiPlugin,
    HybridParallelPlugin,
    LowLevelZeroConfig,
    LowLevelZeroPlugin,
    MoeHybridParallelPlugin,
)
from cai.booster.plugin._compat import GEMINI_ARGS, HYBRID_ARGS, LOW_LEVEL_ZERO_ARGS, MOE_HYBRID_ARGS
from cai.gemini import ChunkConfig, GeminiConfig
from cai.gemini import LossScaleConfig as GeminiLossScale
from cai.zero import LossScaleConfig as ZeroLossScale
from cai.zero import ZeroConfig

# Colossal-AI's constructor signatures (names and defaults), as its documentation gives them.
COLOSSAL_LOW_LEVEL_ZERO = dict(
    stage=1, precision="fp16", initial_scale=2**32, min_scale=1, growth_factor=2, backoff_factor=0.5,
    growth_interval=1000, hysteresis=2, max_scale=2**32, max_norm=0.0, norm_type=2.0, reduce_bucket_size_in_m=12,
    communication_dtype=None, overlap_communication=True, overlap_allgather=False, cpu_offload=False,
    master_weights=True, verbose=False, cast_inputs=True, fp8_communication=False, use_fp8=False, extra_dp_size=1,
)  # fmt: skip
COLOSSAL_GEMINI = dict(
    chunk_config_dict=None, chunk_init_device=None, placement_policy="static", enable_gradient_accumulation=False,
    max_prefetch=0, shard_param_frac=1.0, offload_optim_frac=0.0, offload_param_frac=0.0,
    warmup_non_model_data_ratio=0.8, steady_cuda_cap_ratio=0.9, precision="fp16", master_weights=True,
    pin_memory=False, force_outputs_fp32=False, strict_ddp_mode=False, search_range_m=32, hidden_dim=None,
    min_chunk_size_m=32, memstats=None, gpu_margin_mem_ratio=0.0, initial_scale=2**16, min_scale=1, growth_factor=2,
    backoff_factor=0.5, growth_interval=1000, hysteresis=2, max_scale=2**32, max_norm=0.0, norm_type=2.0, tp_size=1,
    extra_dp_size=1, enable_all_optimization=False, enable_fused_normalization=False, enable_flash_attention=False,
    enable_sequence_parallelism=False, enable_jit_fused=False, enable_async_reduce=True, use_fp8=False,
    verbose=False, fp8_communication=False,
)  # fmt: skip


def raises(exc: type[Exception], *parts: str):
    return pytest.raises(exc, match="".join(f"(?=.*{re.escape(p)})" for p in parts))


@pytest.mark.parametrize(
    ("args", "signature", "cai_own"),
    [
        (LOW_LEVEL_ZERO_ARGS, COLOSSAL_LOW_LEVEL_ZERO, set()),
        (GEMINI_ARGS, COLOSSAL_GEMINI, {"overlap_host_step"}),
    ],
    ids=["zero", "gemini"],
)
def test_every_colossal_name_is_in_exactly_one_table(args, signature, cai_own) -> None:
    rejected = [n for r in args.rejected for n in r.names]
    tables = [*args.mapped, *args.ignored, *args.plugin, *rejected]
    assert len(tables) == len(set(tables)), "a name is in two tables"
    assert set(tables) == set(signature) | cai_own


@pytest.mark.parametrize(
    ("cls", "signature"), [(LowLevelZeroPlugin, COLOSSAL_LOW_LEVEL_ZERO), (GeminiPlugin, COLOSSAL_GEMINI)]
)
def test_colossal_defaults_spelled_out_equal_no_arguments(cls, signature) -> None:
    assert cls(**signature).config == cls().config


# HybridParallelPlugin's and MoeHybridParallelPlugin's parameter order, as Colossal-AI's documentation gives it.
_HYBRID_NAMES = (
    "tp_size pp_size sp_size precision zero_stage enable_all_optimization enable_fused_normalization "
    "enable_flash_attention enable_jit_fused enable_sequence_parallelism sequence_parallelism_mode parallel_output "
    "num_microbatches microbatch_size initial_scale min_scale growth_factor backoff_factor growth_interval "
    "hysteresis max_scale max_norm broadcast_buffers ddp_bucket_cap_mb find_unused_parameters check_reduction "
    "gradient_as_bucket_view static_graph zero_bucket_size_in_m cpu_offload communication_dtype "
    "overlap_communication custom_policy pp_style num_model_chunks scheduler_nodes num_layers_per_stage "
    "gradient_checkpoint_config enable_metadata_cache make_vocab_size_divisible_by dp_outside overlap_p2p "
    "overlap_allgather fp8_communication use_fp8 inner_ring_size"
)
COLOSSAL_HYBRID_ORDER = _HYBRID_NAMES.split()
COLOSSAL_MOE_ORDER = [
    *COLOSSAL_HYBRID_ORDER[:2], "ep_size", *COLOSSAL_HYBRID_ORDER[2:40], "moe_dp_outside",
    *COLOSSAL_HYBRID_ORDER[41:45],
]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "order"),
    [
        (LOW_LEVEL_ZERO_ARGS, list(COLOSSAL_LOW_LEVEL_ZERO)),
        (GEMINI_ARGS, list(COLOSSAL_GEMINI)),
        (HYBRID_ARGS, COLOSSAL_HYBRID_ORDER),
        (MOE_HYBRID_ARGS, COLOSSAL_MOE_ORDER),
    ],
    ids=["zero", "gemini", "hybrid", "moe"],
)
def test_positional_arguments_follow_colossal_order(args, order) -> None:
    assert list(args.positional) == order


@pytest.mark.parametrize(
    ("cls", "signature"), [(LowLevelZeroPlugin, COLOSSAL_LOW_LEVEL_ZERO), (GeminiPlugin, COLOSSAL_GEMINI)]
)
def test_colossal_arguments_by_position_equal_by_keyword(cls, signature) -> None:
    assert cls(*signature.values()).config == cls(**signature).config
    assert LowLevelZeroPlugin(2, "bf16").config == LowLevelZeroPlugin(stage=2, precision="bf16").config
    with raises(TypeError, f"{cls.__name__}() takes at most {len(signature)} positional arguments"):
        cls(*signature.values(), None)
    with raises(TypeError, f"{cls.__name__}() got multiple values for", repr(next(iter(signature)))):
        cls(next(iter(signature.values())), **{next(iter(signature)): next(iter(signature.values()))})


def test_hybrid_arguments_by_position() -> None:
    by_position = HybridParallelPlugin(2, 1, None, "bf16", 1)
    assert (
        by_position.config
        == HybridParallelPlugin(tp_size=2, pp_size=1, precision="bf16", zero_stage=1).config
    )
    moe = MoeHybridParallelPlugin(1, 1, 2, None, "bf16", 1)
    assert (
        moe.config
        == MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, precision="bf16", zero_stage=1).config
    )


def test_chunk_config_dict_as_colossal_search_returns_it() -> None:
    nested = GeminiPlugin(chunk_config_dict={4: {"chunk_size": 1 << 20, "keep_gathered": False}})
    assert nested.config == GeminiPlugin(chunk_config_dict={"chunk_size": 1 << 20}).config
    assert nested.config.chunk.chunk_size == 1 << 20
    # what the search returns for a model smaller than one chunk: every chunk kept gathered
    small = GeminiPlugin(chunk_config_dict={1: {"chunk_size": 4096, "keep_gathered": True}})
    assert small.config == GeminiPlugin(chunk_config_dict={"chunk_size": 4096}, shard_param_frac=0.0).config
    assert GeminiPlugin(chunk_config_dict={"keep_gathered": True}, shard_param_frac=0.0).config == (
        GeminiPlugin(shard_param_frac=0.0).config
    )


def test_low_level_zero_script_maps_onto_the_config() -> None:
    plugin = LowLevelZeroPlugin(
        stage=2,
        precision="bf16",
        reduce_bucket_size_in_m=6,
        overlap_communication=False,
        cpu_offload=True,
        max_norm=1.0,
        communication_dtype=torch.float32,
        initial_scale=2**10,
        cast_inputs=False,
        verbose=True,
    )
    # reduce_bucket_size_in_m counts millions of fp32 elements: 6 M x 4 bytes = 24 MiB
    zero = ZeroConfig(
        stage=2,
        bucket_size_mb=24,
        comm_dtype=torch.float32,
        overlap_comm=False,
        cpu_offload=True,
        max_norm=1.0,
    )
    scale = ZeroLossScale(initial_scale=2**10, max_scale=2**32)
    assert plugin.config == LowLevelZeroConfig(
        zero=zero, precision="bf16", loss_scale=scale, cast_inputs=False
    )
    assert plugin.stage == 2 and plugin.precision == "bf16" and plugin.zero_config is plugin.config.zero


def test_low_level_zero_defaults_are_colossal_ai_s() -> None:
    c = LowLevelZeroPlugin().config
    assert (c.zero.stage, c.precision, c.zero.bucket_size_mb, c.zero.overlap_comm) == (1, "fp16", 48, True)
    assert (c.loss_scale.initial_scale, c.loss_scale.max_scale) == (2**32, 2**32)
    # the typed config keeps cai's own defaults
    assert LowLevelZeroConfig() == LowLevelZeroConfig(
        zero=ZeroConfig(), precision="bf16", loss_scale=ZeroLossScale()
    )


def test_gemini_script_maps_onto_the_config() -> None:
    plugin = GeminiPlugin(
        precision="bf16",
        placement_policy="static",
        offload_optim_frac=1.0,
        shard_param_frac=1.0,
        initial_scale=2**16,
        max_norm=1.0,
        chunk_config_dict={"chunk_size": 1 << 20},
        hidden_dim=64,
        pin_memory=True,
        max_prefetch=2,
        enable_gradient_accumulation=True,
        enable_async_reduce=False,
        strict_ddp_mode=True,
    )
    expected = GeminiConfig(
        precision="bf16",
        offload_optim_frac=1.0,
        max_norm=1.0,
        chunk=ChunkConfig(chunk_size=1 << 20, hidden_dim=64),
        pin_memory=True,
        max_prefetch=2,
        loss_scale=GeminiLossScale(initial_scale=2**16),
        overlap_host_step=False,  # enable_gradient_accumulation=True: plain repeated backward accumulates
    )
    assert plugin.config == expected and plugin.precision == "bf16"
    assert GeminiPlugin().config == GeminiConfig(precision="fp16")  # Colossal-AI's default precision


def test_config_is_taken_as_given_and_agreeing_keywords_are_allowed() -> None:
    config = GeminiConfig(offload_optim_frac=1.0, overlap_host_step=True)
    assert GeminiPlugin(config=config).config is config
    assert GeminiPlugin(config=config, precision="bf16", verbose=True).config is config
    zero = LowLevelZeroConfig(zero=ZeroConfig(stage=2, bucket_size_mb=48), precision="fp32")
    assert LowLevelZeroPlugin(config=zero, stage=2, reduce_bucket_size_in_m=12).config is zero


def test_config_and_a_conflicting_keyword() -> None:
    with raises(ValueError, "GeminiPlugin: precision='fp16' conflicts with config.precision='bf16'"):
        GeminiPlugin(config=GeminiConfig(), precision="fp16")
    with raises(
        ValueError,
        "LowLevelZeroPlugin: reduce_bucket_size_in_m=12 conflicts with config.zero.bucket_size_mb=25.0",
    ):
        LowLevelZeroPlugin(config=LowLevelZeroConfig(), reduce_bucket_size_in_m=12)
    with raises(ValueError, "stage=1 conflicts with config.zero.stage=2"):
        LowLevelZeroPlugin(config=LowLevelZeroConfig(), stage=1)
    with raises(ValueError, "tp_size=2 is not supported"):  # rejected names are checked with config= too
        GeminiPlugin(config=GeminiConfig(), tp_size=2)


def test_wrong_config_type_and_unknown_keywords() -> None:
    with raises(TypeError, "LowLevelZeroPlugin: config=ZeroConfig(...) is not a LowLevelZeroConfig"):
        LowLevelZeroPlugin(config=ZeroConfig())
    with raises(TypeError, "LowLevelZeroConfig: zero={'stage': 2} is not a cai.zero.ZeroConfig"):
        LowLevelZeroConfig(zero={"stage": 2})
    with raises(
        TypeError,
        "GeminiPlugin() got unexpected keyword arguments 'ofload_optim_frac'",
        "'offload_optim_frac'",
    ):
        GeminiPlugin(ofload_optim_frac=1.0)


def _bad_value(ok):
    if isinstance(ok, bool):
        return not ok
    return {None: "stats", 1: 2, 2.0: 1.0, 0.0: 0.5}[ok]


@pytest.mark.parametrize(
    ("args", "cls"),
    [(LOW_LEVEL_ZERO_ARGS, LowLevelZeroPlugin), (GEMINI_ARGS, GeminiPlugin)],
    ids=["zero", "gemini"],
)
def test_every_rejected_name_raises_with_its_value_and_the_fix(args, cls) -> None:
    for row in args.rejected:
        name = row.names[0]
        bad = _bad_value(row.ok)
        with raises(ValueError, f"{args.owner}: {name}={bad!r}", "not supported", row.fix):
            cls(**{name: bad})
        cls(**{n: row.ok for n in row.names})  # the accepted value is fine


@pytest.mark.parametrize(
    ("cls", "kwargs", "named"),
    [
        (LowLevelZeroPlugin, {"reduce_bucket_size_in_m": -1}, "reduce_bucket_size_in_m=-1 must be > 0 (millions of elements"),
        (LowLevelZeroPlugin, {"reduce_bucket_size_in_m": 0}, "reduce_bucket_size_in_m=0 must be > 0"),
        (LowLevelZeroPlugin, {"communication_dtype": torch.int8}, "communication_dtype=torch.int8 is invalid"),
        (LowLevelZeroPlugin, {"max_norm": -1.0}, "max_norm=-1.0 is invalid"),
        (LowLevelZeroPlugin, {"stage": 3}, "stage=3 is invalid"),
        (LowLevelZeroPlugin, {"growth_factor": 0.5}, "growth_factor=0.5 is invalid"),
        (LowLevelZeroPlugin, {"hysteresis": 0}, "hysteresis=0 is invalid"),
        (GeminiPlugin, {"offload_optim_frac": 1.5}, "offload_optim_frac=1.5 is invalid"),
        (GeminiPlugin, {"placement_policy": "cuda"}, "placement_policy='cuda' is invalid"),
        (GeminiPlugin, {"chunk_config_dict": {2: {"chunk_size": 8, "keep_gathered": True}, 4: {"chunk_size": 8}}}, "chunk_config_dict={2: {'chunk_size': 8, 'keep_gathered': True}, 4: {'chunk_size': 8}} has keep_gathered both True and False"),
        (GeminiPlugin, {"chunk_config_dict": {"chunk_size": 8, "keep_gathered": True}, "shard_param_frac": 0.5}, "chunk_config_dict={'chunk_size': 8, 'keep_gathered': True} and shard_param_frac=0.5 disagree"),
        (GeminiPlugin, {"chunk_config_dict": {"keep_gathered": True}, "placement_policy": "auto"}, "chunk_config_dict={'keep_gathered': True}, placement_policy='auto' are invalid"),
        (GeminiPlugin, {"chunk_config_dict": {2: {"chunk_size": 8}, 4: {"chunk_size": 16}}}, "chunk_config_dict={2: {'chunk_size': 8}, 4: {'chunk_size': 16}} has chunk sizes [8, 16] for different dp degrees"),
        (GeminiPlugin, {"chunk_config_dict": {"chunk_size": 8, "hidden_dim": 4}}, "chunk_config_dict={'chunk_size': 8, 'hidden_dim': 4} has keys ['hidden_dim'] that are not supported"),
        (GeminiPlugin, {"search_range_m": -1}, "search_range_m=-1 is invalid"),
        (GeminiPlugin, {"initial_scale": 0.5, "min_scale": 1}, "initial_scale=0.5, min_scale=1 are invalid"),
        (GeminiPlugin, {"precision": "fp8"}, "precision='fp8' is invalid"),
    ],
)  # fmt: skip
def test_validation_errors_name_the_colossal_argument_and_the_value_given(cls, kwargs, named) -> None:
    with raises(ValueError, f"{cls.__name__}: {named}"):
        cls(**kwargs)


def test_bucket_size_error_speaks_in_the_users_units() -> None:
    with pytest.raises(ValueError) as info:
        LowLevelZeroPlugin(reduce_bucket_size_in_m=-1)
    assert "reduce_bucket_size_in_m=-1" in str(info.value)
    assert "bucket_size_mb" not in str(info.value) and "-4" not in str(info.value)


def test_configs_are_frozen() -> None:
    plugin = LowLevelZeroPlugin(stage=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plugin.config.precision = "bf16"  # type: ignore[misc]
