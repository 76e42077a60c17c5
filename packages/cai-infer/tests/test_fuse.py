"""Merged projections ([Note: fused projections]): the same logits as the model before merging, one matmul where
attention calls q, k and v in order, and a correct slice wherever it does not."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from cai.infer._fuse import FusedSwiGLUMLP, _Slice, fuse_projections
from cai.kernels import patch_hf_model

# gemma's MLP is GeLU-gated: its attention is merged, its MLP left alone
FAMILIES = {"llama": (2, 2), "qwen2": (2, 2), "qwen3": (2, 2), "gemma": (2, 0), "mistral": (2, 2)}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("patched", [False, True], ids=["hf", "cai-kernels"])
def test_merged_model_gives_the_same_logits(family: str, patched: bool, make_model, monkeypatch) -> None:
    model = make_model(family)
    if patched:
        patch_hf_model(model, fused_loss=False)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    before = sum(p.numel() for p in model.parameters())
    assert fuse_projections(model) == FAMILIES[family]
    assert sum(p.numel() for p in model.parameters()) == before  # merged, not duplicated
    fallbacks = []
    own = _Slice._own
    monkeypatch.setattr(_Slice, "_own", lambda self, x: fallbacks.append(self.part) or own(self, x))
    with torch.no_grad():
        out = model(input_ids=ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert not fallbacks  # k and v came from the merged matmul
    if FAMILIES[family][1]:
        assert sum(isinstance(m, FusedSwiGLUMLP) for m in model.modules()) == 2


def test_slices_called_out_of_order_compute_their_own() -> None:
    attn = nn.Module()
    attn.q_proj, attn.k_proj, attn.v_proj = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)
    ref = {n: getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")}
    x, other = torch.randn(3, 8), torch.randn(3, 8)
    want = {n: m(x).detach() for n, m in ref.items()}
    holder = nn.Module()
    holder.attn = attn
    assert fuse_projections(holder) == (1, 0)
    with torch.no_grad():
        assert torch.allclose(attn.v_proj(x), want["v_proj"], atol=1e-6)  # v before q: its own rows
        assert torch.allclose(attn.q_proj(other), ref["q_proj"](other), atol=1e-6)
        assert torch.allclose(attn.k_proj(x), want["k_proj"], atol=1e-6)  # not the input q saw
        assert torch.allclose(attn.q_proj(x), want["q_proj"], atol=1e-6)
        assert torch.allclose(attn.k_proj(x), want["k_proj"], atol=1e-6)
        assert torch.allclose(attn.v_proj(x), want["v_proj"], atol=1e-6)
    assert attn.q_proj.merged.last is None  # v let the input and output go


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_single_rows_take_the_gemv_kernel(impl, make_model, monkeypatch) -> None:
    import cai.kernels._gemv as gemv_mod

    device = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU the kernel runs through TRITON_INTERPRET
    if impl == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.fail("the Triton case needs a GPU or TRITON_INTERPRET=1 (nox -s tests sets it)")
    model = make_model("llama").to(device)
    ids = torch.randint(0, model.config.vocab_size, (1, 1), generator=torch.Generator().manual_seed(0)).to(
        device
    )
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    fuse_projections(model)
    monkeypatch.setenv("CAI_KERNELS_IMPL", impl)
    launches = []
    real = gemv_mod._launch
    monkeypatch.setattr(
        gemv_mod, "_launch", lambda x, w, *a: launches.append(tuple(w.shape)) or real(x, w, *a)
    )
    with torch.no_grad():
        out = model(input_ids=ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    h, layers = model.config.hidden_size, model.config.num_hidden_layers
    if impl == "triton":  # per layer q/k/v, o, gate/up and down; then the output projection
        assert len(launches) == 4 * layers + 1 and launches[-1] == (model.config.vocab_size, h)
    else:
        assert launches == []
