"""Kernels a plugin applies at boost(): GeminiPlugin's Colossal-AI kernel switches turn the model's norms and MLPs
into cai-kernels' fused modules (same Parameters, the same losses as the unpatched model); use_fp8=True on
LowLevelZeroPlugin, GeminiPlugin and HybridParallelPlugin (tp 2) runs the linear layers in FP8 and trains within
FP8's error of fp32."""

from __future__ import annotations

import copy

import pytest
import torch

from cai.booster import Booster
from cai.booster.plugin import GeminiPlugin, LowLevelZeroPlugin
from cai.mesh.testing import assert_close, run_distributed

transformers = pytest.importorskip("transformers")


def _llama():
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _train(model, plugin, steps: int = 3) -> tuple[list[float], set[str], str]:
    booster = Booster(plugin=plugin, device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, *_ = booster.boost(model, opt)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 16), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    module = model.unwrap()
    kinds = {type(m).__name__ for m in module.modules()}
    return losses, kinds, module.config._attn_implementation


def _compare() -> None:
    base = _llama()
    plain = _train(copy.deepcopy(base), GeminiPlugin(precision="fp32"))
    fused = _train(copy.deepcopy(base), GeminiPlugin(precision="fp32", enable_fused_normalization=True))
    flash = _train(copy.deepcopy(base), GeminiPlugin(precision="fp32", enable_all_optimization=True,
                                                     enable_flash_attention=True))  # fmt: skip
    assert "LlamaRMSNorm" in plain[1] and "RMSNorm" not in plain[1] and plain[2] == "eager"
    for losses, kinds, _ in (fused, flash):
        assert {"RMSNorm", "SwiGLUMLP", "FusedLMHead"} <= kinds and "LlamaRMSNorm" not in kinds
        assert_close(torch.tensor(losses), torch.tensor(plain[0]), rtol=1e-5, atol=1e-6, name="losses")
    assert fused[2] == "eager" and flash[2] == "sdpa"


def test_kernel_switches_patch_the_model_and_train_the_same() -> None:
    run_distributed(_compare, 1)


def _fp8_compare() -> None:
    base = _llama()
    ref = _train(copy.deepcopy(base), LowLevelZeroPlugin(stage=2, precision="fp32"), steps=6)[0]
    for plugin in (
        LowLevelZeroPlugin(stage=2, precision="fp32", use_fp8=True),
        GeminiPlugin(precision="fp32", use_fp8=True),
    ):
        losses, kinds, _ = _train(copy.deepcopy(base), plugin, steps=6)
        assert "Fp8Linear" in kinds
        assert_close(torch.tensor(losses), torch.tensor(ref), rtol=0.02, atol=0.0, name=type(plugin).__name__)
        assert losses != ref  # the FP8 matmuls ran


def test_use_fp8_runs_the_linear_layers_in_fp8() -> None:
    run_distributed(_fp8_compare, 1)


def _kept_fp8_compare() -> None:
    # use_fp8 on LowLevelZero keeps each weight in FP8 between steps ([Note: fp8 kept weights]): cai-zero writes the
    # parameters through their flat buffers and must count those writes, or every step after the first would run
    # on the first step's FP8 weights. Layers converted before boost() keep theirs as they are (not kept here).
    from cai.kernels import Fp8Linear, convert_to_fp8

    base = _llama()
    unkept = copy.deepcopy(base)
    convert_to_fp8(unkept)
    ref = _train(unkept, LowLevelZeroPlugin(stage=2, precision="fp32", use_fp8=True), steps=4)[0]
    model = copy.deepcopy(base)
    losses = _train(model, LowLevelZeroPlugin(stage=2, precision="fp32", use_fp8=True), steps=4)[0]
    assert {m.keep_fp8_weight for m in model.modules() if isinstance(m, Fp8Linear)} == {True}
    assert {m.keep_fp8_weight for m in unkept.modules() if isinstance(m, Fp8Linear)} == {False}
    assert losses == ref


@pytest.mark.parametrize("world", [1, 2])
def test_kept_fp8_weights_follow_the_zero_steps(world) -> None:
    run_distributed(_kept_fp8_compare, world)


_TP = dict(make_vocab_size_divisible_by=1)  # the vocabulary of 64 split over 2 ranks as it is


def _hybrid_fp8_compare() -> None:
    from cai.booster.plugin import HybridParallelPlugin
    from cai.shardformer import Linear1D_Col, Linear1D_Row

    base = _llama()
    ref = _train(
        copy.deepcopy(base), HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32", **_TP), steps=6
    )[0]
    plugin = HybridParallelPlugin(
        tp_size=2, pp_size=1, precision="fp32", use_fp8=True, fp8_communication=True, **_TP
    )
    assert plugin.config.zero.fp8_communication  # Colossal-AI's switch: the data-parallel gradients in FP8
    model = copy.deepcopy(base)
    losses, _, _ = _train(model, plugin, steps=6)
    parallel = {n: m for n, m in model.named_modules() if isinstance(m, (Linear1D_Col, Linear1D_Row))}
    # every parallel layer whose local features divide by 16 (k and v hold 8 here), never the output head
    fp8 = {n.split(".")[-1] for n, m in parallel.items() if m.fp8}
    assert fp8 == {"q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}, fp8
    assert_close(torch.tensor(losses), torch.tensor(ref), rtol=0.02, atol=0.0, name="hybrid fp8")
    assert losses != ref  # the FP8 matmuls ran


def test_hybrid_use_fp8_runs_the_tensor_parallel_products_in_fp8() -> None:
    run_distributed(_hybrid_fp8_compare, 2)
