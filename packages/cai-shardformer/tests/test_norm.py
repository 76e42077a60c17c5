"""enable_fused_normalization on a LayerNorm model: every nn.LayerNorm becomes cai-kernels' LayerNorm with the
same Parameters, and the model's loss, gradients and logits equal the Hugging Face norm's (torch fallback and the
Triton kernel in the interpreter)."""

import copy

import pytest
import torch
import transformers

from cai.kernels import LayerNorm
from cai.mesh.testing import assert_close
from cai.shardformer import Policy, ShardConfig, ShardFormer


class _NoSharding(Policy):
    """Only what optimize() does besides tp: the fused-normalization swap."""

    def config_sanity_check(self):
        pass

    def preprocess(self):
        return self.model

    def module_policy(self):
        return {}

    def postprocess(self):
        return self.model


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_fused_layer_norm_matches_hf(impl, monkeypatch):
    monkeypatch.setenv("CAI_KERNELS_IMPL", impl)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=251, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    ref = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():  # non-trivial affine parameters, so a dropped weight or bias would show
        for m in ref.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    model = copy.deepcopy(ref)
    config = ShardConfig(enable_tensor_parallelism=False, enable_fused_normalization=True)
    model, _ = ShardFormer(config).optimize(model, _NoSharding())
    norms = [n for n, m in model.named_modules() if isinstance(m, LayerNorm)]
    assert len(norms) == 2 * 2 + 1  # ln_1, ln_2 per block and ln_f
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in model.modules())
    assert list(model.state_dict()) == list(ref.state_dict())  # same keys, same order
    assert model.transformer.ln_f.eps == ref.transformer.ln_f.eps
    ref.eval()
    model.eval()  # no dropout: the two models see the same activations
    ids = torch.randint(0, 251, (2, 12))
    ref_out = ref(input_ids=ids, labels=ids)
    out = model(input_ids=ids, labels=ids)
    ref_out.loss.backward()
    out.loss.backward()
    assert_close(out.logits, ref_out.logits, rtol=1e-5, atol=1e-5, name="logits")
    assert_close(out.loss, ref_out.loss, rtol=1e-6, name="loss")
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name, g in ref_grads.items():
        assert_close(grads[name], g, rtol=1e-4, atol=1e-6 * float(g.abs().max()), name=name)
