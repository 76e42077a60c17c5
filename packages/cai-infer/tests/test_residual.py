"""Residual adds carried into the next RMSNorm ([Note: carried residual]): the same logits bit for bit, applied
only to layers of the known pre-norm form with cai-kernels' norms."""

from __future__ import annotations

import copy

import pytest
import torch

from cai.infer._residual import _CarriedLayer, carry_residuals
from cai.kernels import patch_hf_model
from cai.kernels._residual import PRE_NORM_FORWARD, forward_digest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3"])
def test_carried_residual_gives_the_same_logits(family, dtype, make_model):
    patched = make_model(family).to(dtype)
    patch_hf_model(patched, fused_loss=False)
    carried = copy.deepcopy(patched)
    assert carry_residuals(carried) == 2
    assert all(isinstance(layer, _CarriedLayer) for layer in carried.get_decoder().layers)
    ids = torch.randint(0, 251, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = patched(ids).logits
        got = carried(ids).logits
        again = carried(ids).logits  # nothing of the first forward is left in the carry
    assert torch.equal(got, want) and torch.equal(again, want)
    assert carried.get_decoder().norm._carry.residual is None


def test_layers_of_another_form_or_with_other_norms_are_left_alone(make_model):
    gemma2 = make_model("gemma2")  # four norms a layer: another forward
    patch_hf_model(gemma2, fused_loss=False)
    assert forward_digest(type(gemma2.get_decoder().layers[0])) != PRE_NORM_FORWARD
    assert carry_residuals(gemma2) == 0
    gemma = make_model("gemma")  # the pre-norm forward, but (1 + weight) norms that cai-kernels leaves alone
    patch_hf_model(gemma, fused_loss=False)
    assert forward_digest(type(gemma.get_decoder().layers[0])) == PRE_NORM_FORWARD
    assert carry_residuals(gemma) == 0
    llama = make_model("llama")  # Hugging Face's own norms: nothing to fold the add into
    assert carry_residuals(llama) == 0
    assert not any(
        isinstance(m, _CarriedLayer) for m in (*gemma2.modules(), *gemma.modules(), *llama.modules())
    )
