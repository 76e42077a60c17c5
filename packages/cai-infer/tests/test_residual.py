"""Residual adds carried into the next RMSNorm ([Note: carried residual]): the same logits bit for bit, applied
only to layers of the known pre-norm form with cai-kernels' norms. The norms folded into the merged projections
([Note: norms inside the projections]): the same logits, by the kernel for single rows, and only for attention
modules that use their input for nothing but the projections."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cai.kernels._gemv as gemv_mod
from cai.infer._fuse import fuse_projections
from cai.infer._residual import (
    _PRE_NORM_FORWARD,
    _CarriedLayer,
    _projections_only,
    carry_residuals,
    forward_digest,
)
from cai.kernels import patch_hf_model


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
    assert forward_digest(type(gemma2.get_decoder().layers[0])) != _PRE_NORM_FORWARD
    assert carry_residuals(gemma2) == 0
    gemma = make_model("gemma")  # the pre-norm forward, but (1 + weight) norms that cai-kernels leaves alone
    patch_hf_model(gemma, fused_loss=False)
    assert forward_digest(type(gemma.get_decoder().layers[0])) == _PRE_NORM_FORWARD
    assert carry_residuals(gemma) == 0
    llama = make_model("llama")  # Hugging Face's own norms: nothing to fold the add into
    assert carry_residuals(llama) == 0
    assert not any(
        isinstance(m, _CarriedLayer) for m in (*gemma2.modules(), *gemma.modules(), *llama.modules())
    )


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3"])
def test_norms_inside_the_projections_give_the_same_logits(family, impl, make_model, monkeypatch):
    patched = make_model(family)
    patch_hf_model(patched, fused_loss=False)
    fused = copy.deepcopy(patched)
    assert carry_residuals(fused) == 2 and fuse_projections(fused) == (2, 2)
    assert _projections_only(type(fused.get_decoder().layers[0].self_attn))
    monkeypatch.setenv("CAI_KERNELS_IMPL", impl)  # triton: the kernels through the interpreter
    kinds = []
    real = gemv_mod._launch
    monkeypatch.setattr(
        gemv_mod, "_launch", lambda kind, *a, **kw: kinds.append(kind) or real(kind, *a, **kw)
    )
    gen = torch.Generator().manual_seed(1)
    for ids in (torch.randint(0, 251, (3, 11), generator=gen), torch.randint(0, 251, (1, 1), generator=gen)):
        kinds.clear()
        with torch.no_grad():
            want = patched(ids).logits
            got = fused(ids).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # a single row: per layer the q/k/v and gate/up matmuls with their norms, o_proj, and down with the SwiGLU
        single = impl == "triton" and ids.numel() == 1
        assert sorted(kinds) == (sorted([1, 0, 1, 2] * 2) if single else [])
    assert fused.get_decoder().norm._carry.residual is None


def test_attention_reading_its_input_otherwise_keeps_its_norm():
    class Shapes(nn.Module):
        def forward(self, hidden_states, mask=None):
            b, t = hidden_states.shape[:2]
            return (
                self.q_proj(hidden_states).view(b, t, -1)
                + self.k_proj(hidden_states)
                + self.v_proj(hidden_states)
            )

    class Gated(Shapes):
        def forward(self, hidden_states, mask=None):
            return self.q_proj(hidden_states) * hidden_states.sigmoid()

    class Renamed(Shapes):
        def forward(self, x):
            return self.q_proj(x)

    assert _projections_only(Shapes)
    assert not _projections_only(Gated) and not _projections_only(Renamed)
