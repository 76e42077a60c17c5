"""Residual adds inside the norm kernels ([Note: residual adds in the norms]): a pre-norm layer's loss and
gradients equal the unfused layer's, three adds a layer are gone, and every layer of another form, or with other
norms, keeps its own forward."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

from cai.kernels import RMSNorm, is_pre_norm_layer, patch_hf_model  # noqa: E402
from cai.kernels._residual import _FusedResidualForward, fuse_residuals  # noqa: E402

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 8}),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, {"head_dim": 8}),
}


def build(family, seed=0):
    config_cls, model_cls, extra = FAMILIES[family]
    config = config_cls(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **extra)  # fmt: skip
    torch.manual_seed(seed)
    return model_cls(config)


@pytest.fixture(autouse=True)
def restore_rope(monkeypatch):
    # patch_hf_model replaces each family's module-level rotary function; put them back after each test
    import sys

    for family in FAMILIES:
        mod = sys.modules[f"transformers.models.{family}.modeling_{family}"]
        monkeypatch.setattr(mod, "apply_rotary_pos_emb", mod.apply_rotary_pos_emb)


class AddCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.adds = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # adds of two activations (bias and scalar adds are elsewhere or 1-D)
        if func.overloadpacket.__name__ in ("add", "add_") and all(
            isinstance(a, torch.Tensor) and a.dim() == 3 for a in args[:2]
        ):
            self.adds += 1
        return func(*args, **(kwargs or {}))


def _step(model, ids):
    model.zero_grad()
    with AddCounter() as counter:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, counter.adds


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3"])
def test_fused_layers_match_the_unfused_ones(family, impl):
    plain = patch_hf_model(build(family), fused_residual=False)
    fused = copy.deepcopy(plain)
    assert fuse_residuals(fused) == 2
    assert all(
        isinstance(layer.__dict__.get("forward"), _FusedResidualForward) for layer in fused.model.layers
    )
    assert list(fused.state_dict()) == list(plain.state_dict())
    ids = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(1))
    loss, grads, adds = _step(fused, ids)
    want_loss, want_grads, want_adds = _step(plain, ids)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    # Triton: the first forward add and both gradient adds of each layer are inside the norm kernels
    assert want_adds - adds == (3 * 2 if impl == "triton" else 0)


def test_checkpointed_and_copied_layers(impl):
    plain = patch_hf_model(build("llama"), fused_residual=False)
    fused = patch_hf_model(copy.deepcopy(plain))
    ids = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(1))
    want_loss, want_grads, _ = _step(plain, ids)
    fused.gradient_checkpointing_enable()
    loss, grads, _ = _step(fused, ids)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    # a deep copy's layers run their own modules
    twin = copy.deepcopy(fused)
    with torch.no_grad():
        for p in twin.model.layers[0].mlp.parameters():
            p.zero_()
    layer = twin.model.layers[0]
    assert layer.forward.layer is layer
    assert not torch.equal(_step(twin, ids)[0], loss)


def test_other_forms_and_norms_keep_their_forward():
    gemma2 = patch_hf_model(build("gemma2"))  # four norms a layer: another forward
    assert fuse_residuals(gemma2) == 0 and "forward" not in gemma2.model.layers[0].__dict__
    hf_norms = patch_hf_model(build("llama"), rms_norm=False)  # nothing to fold the adds into
    assert not is_pre_norm_layer(hf_norms.model.layers[0])
    assert fuse_residuals(hf_norms) == 0
    assert (
        patch_hf_model(build("llama"), fused_residual=False).model.layers[0].__dict__.get("forward") is None
    )


def test_a_norm_replaced_later_or_positional_arguments_take_the_class_forward():
    plain = patch_hf_model(build("llama"), fused_residual=False)
    fused = patch_hf_model(copy.deepcopy(plain))
    ids = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(1))
    want = _step(plain, ids)[0]

    class OtherNorm(RMSNorm):  # not cai's own type: the fused forward would not know its arguments
        def forward(self, x):
            return super().forward(x)

    for layer in fused.model.layers:
        other = OtherNorm(32, layer.input_layernorm.variance_epsilon)
        other.weight = layer.input_layernorm.weight
        layer.input_layernorm = other
    torch.testing.assert_close(_step(fused, ids)[0], want, rtol=1e-6, atol=0)

    layer = plain.model.layers[0]
    fused_layer = patch_hf_model(copy.deepcopy(plain)).model.layers[0]
    h = torch.randn(2, 7, 32)
    pos = torch.arange(7)[None].expand(2, 7)
    emb = plain.model.rotary_emb(h, pos)
    with torch.no_grad():  # attention_mask given positionally: the class's forward binds it
        torch.testing.assert_close(fused_layer(h, None, pos, position_embeddings=emb),
                                   layer(h, None, pos, position_embeddings=emb))  # fmt: skip
