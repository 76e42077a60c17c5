"""Booster and plugin construction: every bad value or combination fails here, with a message that names it."""

from __future__ import annotations

import functools
import re

import pytest
import torch
from torch import nn

from cai.booster import Booster, LossScalerConfig, MixedPrecision, mixed_precision_factory
from cai.booster.plugin import (
    PLUGINS,
    LowLevelZeroConfig,
    LowLevelZeroPlugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)
from cai.zero import ZeroConfig


def raises(match: str):
    return pytest.raises(ValueError, match=re.escape(match))


def test_mixed_precision_with_a_plugin_that_controls_precision() -> None:
    with raises(
        "TorchFSDPPlugin controls precision, so mixed_precision='bf16' would be ignored; pass precision='bf16'"
    ):
        Booster(plugin=TorchFSDPPlugin(), mixed_precision="bf16", device="cpu")
    with raises("plugins that take Booster mixed_precision: TorchDDPPlugin"):
        Booster(plugin=LowLevelZeroPlugin(precision="bf16"), mixed_precision="fp16", device="cpu")
    # the same precision as the plugin's is no conflict (Colossal-AI scripts often pass both)
    booster = Booster(plugin=LowLevelZeroPlugin(precision="bf16"), mixed_precision="bf16", device="cpu")
    assert booster.mixed_precision is None and booster.plugin.precision == "bf16"


def test_unknown_precisions_name_the_supported_ones() -> None:
    with raises("mixed_precision='fp8' is not supported; use one of ['fp32', 'fp16', 'bf16']"):
        Booster(mixed_precision="fp8", device="cpu")
    with raises("LowLevelZeroPlugin: precision 'int8' is not supported; use one of ['fp32', 'fp16', 'bf16']"):
        LowLevelZeroPlugin(precision="int8")
    with raises("TorchFSDPPlugin: precision 'fp64'"):
        TorchFSDPPlugin(precision="fp64")


def test_device_must_be_supported() -> None:
    with raises("TorchDDPPlugin does not run on device 'xla'; it supports ['cpu', 'cuda']"):
        Booster(plugin=TorchDDPPlugin(), device="xla")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_cuda() -> None:
    with raises("device='cuda' but CUDA is not available; use device='cpu'"):
        Booster(device="cuda")


def test_low_level_zero_arguments() -> None:
    with raises("stage=3 is not supported; use 1 or 2 (stage 3 is cai-gemini)"):
        LowLevelZeroPlugin(stage=3)
    # cai-zero's stage 0 (no sharding) is the hybrid parallel plugin's; Colossal-AI's LowLevelZeroPlugin takes 1 or 2
    with raises(
        "LowLevelZeroPlugin: stage=0 is invalid: LowLevelZeroConfig: zero.stage=0 is not supported; use 1 or 2"
    ):
        LowLevelZeroPlugin(stage=0)
    with raises("LowLevelZeroConfig: zero.stage=0 is not supported; use 1 or 2"):
        LowLevelZeroConfig(zero=ZeroConfig(stage=0))
    with raises("norm_type=1.0 is not supported; use norm_type=2.0"):
        LowLevelZeroPlugin(norm_type=1.0)
    assert LowLevelZeroPlugin(fp8_communication=True).zero_config.fp8_communication
    with raises("extra_dp_size=2 is not supported; use 1"):
        LowLevelZeroPlugin(extra_dp_size=2)
    with raises("need 0 < min_scale <= initial_scale <= max_scale"):
        LowLevelZeroPlugin(initial_scale=0.5, min_scale=1)
    p = LowLevelZeroPlugin(stage=2, precision="bf16", max_norm=1.0, reduce_bucket_size_in_m=3)
    assert p.zero_config.stage == 2 and p.zero_config.max_norm == 1.0 and p.zero_config.bucket_size_mb == 12


def test_fsdp_arguments() -> None:
    with raises(
        "sharding_strategy 'HYBRID_SHARD' is not supported; use one of ['FULL_SHARD', 'SHARD_GRAD_OP']"
    ):
        TorchFSDPPlugin(sharding_strategy="HYBRID_SHARD")
    with raises("auto_wrap_policy=<built-in function len> is not supported; FSDP2 shards whole submodules"):
        TorchFSDPPlugin(auto_wrap_policy=len)
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={nn.Linear, nn.Embedding})
    assert TorchFSDPPlugin(auto_wrap_policy=policy).config.wrap_module_names == ("Embedding", "Linear")
    assert TorchFSDPPlugin(auto_wrap_policy=ModuleWrapPolicy({nn.Linear})).config.wrap_module_names == (
        "Linear",
    )
    with raises("auto_wrap_policy wraps ['Linear'], wrap_module_names=['Block']; give one of them"):
        TorchFSDPPlugin(auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), wrap_module_names=("Block",))
    with raises("sharding_strategy='SHARD_GRAD_OP' conflicts with reshard_after_forward=True"):
        TorchFSDPPlugin(sharding_strategy="SHARD_GRAD_OP", reshard_after_forward=True)
    assert TorchFSDPPlugin(sharding_strategy="SHARD_GRAD_OP").config.reshard_after_forward is False

    from torch.distributed.fsdp import MixedPrecision

    bf16 = TorchFSDPPlugin(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16)).config
    assert (bf16.precision, bf16.reduce_precision) == ("bf16", "fp32")  # reduce_dtype=None: fp32 reductions
    both = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    assert TorchFSDPPlugin(mixed_precision=both).config.reduce_precision == "bf16"
    with raises("precision='fp16' conflicts with mixed_precision.param_dtype (bf16)"):
        TorchFSDPPlugin(mixed_precision=both, precision="fp16")
    with raises("mixed_precision.buffer_dtype is an FSDP1 option"):
        TorchFSDPPlugin(
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
        )
    with raises("param_dtype and reduce_dtype must be torch.float32, torch.bfloat16, torch.float16 or None"):
        TorchFSDPPlugin(mixed_precision=MixedPrecision(param_dtype=torch.float64))


def test_ddp_arguments() -> None:
    with raises("TorchDDPPlugin: fp8_communication=True is not supported"):
        TorchDDPPlugin(fp8_communication=True)
    with raises("bucket_cap_mb 0 must be > 0"):
        TorchDDPPlugin(bucket_cap_mb=0)


def test_execute_pipeline_names_the_plugins_that_support_it() -> None:
    booster = Booster(device="cpu")
    with raises("TorchDDPPlugin has no pipeline parallelism; plugins that support it: HybridParallelPlugin"):
        booster.execute_pipeline(iter([]), None, None)


def test_capabilities_are_declared_and_consistent() -> None:
    for cls in PLUGINS:
        plugin = cls(precision="fp32") if cls.CONTROLS_PRECISION else cls()
        caps = plugin.capabilities
        assert set(caps.precisions) <= {"fp32", "fp16", "bf16"}
        assert "cpu" in caps.devices
        assert caps.no_sync == cls.NO_SYNC == plugin.support_no_sync()
        assert caps.lora == cls.LORA == plugin.support_lora()
        assert caps.control_precision == cls.CONTROLS_PRECISION
        assert plugin.supported_precisions() == list(caps.precisions)


def test_lora_on_a_plugin_without_lora() -> None:
    booster = Booster(plugin=TorchFSDPPlugin(), device="cpu")
    with raises(
        "TorchFSDPPlugin does not support LoRA; use one of the plugins that do (TorchDDPPlugin, LowLevelZeroPlugin"
    ):
        booster.enable_lora(torch.nn.Linear(2, 2), lora_config=object())


def test_precision_configs() -> None:
    assert mixed_precision_factory("fp16_naive") == MixedPrecision(precision="fp16")
    assert mixed_precision_factory("bf16").dtype == torch.bfloat16
    assert not mixed_precision_factory("bf16").uses_scaler
    with raises("backoff_factor 1.5 must be in (0, 1)"):
        LossScalerConfig(backoff_factor=1.5)
    with raises("MixedPrecision: precision 'fp4'"):
        MixedPrecision(precision="fp4")


def test_prefix_is_rejected_with_the_fix() -> None:
    booster = Booster(device="cpu")
    with raises("prefix='x' is not supported; checkpoint file names are fixed, use prefix=None"):
        booster.save_model(None, "/nonexistent", prefix="x")


def test_gemini_overlap_host_step_reaches_the_config_and_is_checked() -> None:
    from cai.booster.plugin import GeminiPlugin

    plugin = GeminiPlugin(precision="bf16", offload_optim_frac=1.0, overlap_host_step=True)
    assert plugin.config.overlap_host_step and plugin.config.offload_optim_frac == 1.0
    with raises("overlap_host_step=True"):
        GeminiPlugin(precision="fp16", offload_optim_frac=1.0, overlap_host_step=True)
    # the default: overlapped wherever exact; Colossal-AI's accumulation switch turns it off
    assert GeminiPlugin(precision="bf16", offload_optim_frac=1.0).config.overlaps_host_step
    assert not GeminiPlugin(offload_optim_frac=1.0).config.overlaps_host_step  # Colossal-AI's fp16 default
    accumulating = GeminiPlugin(precision="bf16", offload_optim_frac=1.0, enable_gradient_accumulation=True)
    assert not accumulating.config.overlaps_host_step
    with raises("enable_gradient_accumulation=True conflicts with overlap_host_step=True"):
        GeminiPlugin(precision="bf16", overlap_host_step=True, enable_gradient_accumulation=True)
