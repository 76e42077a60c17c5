"""patch_hf_model on tiny Hugging Face models, compared with the unpatched model in float64."""

import copy
from dataclasses import dataclass

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cai.kernels import FusedLMHead, RMSNorm, SwiGLUMLP, patch_hf_model, trim_training_forward  # noqa: E402


@dataclass(frozen=True, kw_only=True)
class Case:
    arch: str
    tie: bool

    def __str__(self):
        return f"{self.arch}-{'tied' if self.tie else 'untied'}"


def build(case):
    common = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=case.tie)  # fmt: skip
    if case.arch == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))


@pytest.fixture
def restore_rope(monkeypatch):
    # The rotary patch is module-level; put the original functions back after each test.
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2

    for mod in (modeling_llama, modeling_qwen2):
        monkeypatch.setattr(mod, "apply_rotary_pos_emb", mod.apply_rotary_pos_emb)


@pytest.mark.parametrize("case", [Case(arch="llama", tie=False), Case(arch="qwen2", tie=True)], ids=str)
def test_patched_model_matches_original(case, impl, restore_rope):
    torch.manual_seed(0)
    ref = build(case).double()
    ids = torch.randint(0, 61, (2, 6))
    labels = ids.clone()
    labels[0, :3] = -100
    # Reference first: the rotary patch replaces the modeling module's function for every model.
    ref_out = ref(input_ids=ids, labels=labels)
    ref_out.loss.backward()
    ref.eval()
    with torch.no_grad():
        ref_logits = ref(input_ids=ids).logits
    ref.train()

    model = patch_hf_model(copy.deepcopy(ref))
    model.zero_grad()
    assert list(model.state_dict()) == list(ref.state_dict())
    layer = model.model.layers[0]
    assert isinstance(layer.mlp, SwiGLUMLP) and isinstance(layer.input_layernorm, RMSNorm)
    assert isinstance(model.model.norm, RMSNorm) and isinstance(model.lm_head, FusedLMHead)
    modeling = __import__(type(layer.self_attn).__module__, fromlist=["x"])
    assert modeling.apply_rotary_pos_emb.__module__ == "cai.kernels._rope"
    if case.tie:
        assert model.lm_head.weight is model.model.embed_tokens.weight

    out = model(input_ids=ids, labels=labels)
    assert out.logits is None  # never materialised in a training forward with labels
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=1e-6, atol=0)
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, rtol=1e-5, atol=1e-7, msg=name)

    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref_logits, rtol=1e-6, atol=1e-7)
        # Eval with labels keeps the logits (metrics need them).
        assert model(input_ids=ids, labels=labels).logits is not None


@pytest.mark.parametrize("num_items", [None, 9], ids=["mean", "num-items"])
def test_loss_hook_passes_a_non_default_ignore_index(num_items, impl, restore_rope):
    # A caller's ignore_index reaches the model's loss_function through the forward's keyword arguments; the fused
    # loss must mask that value, not -100. Label 7 is an ordinary token id here, so counting it changes the loss.
    torch.manual_seed(2)
    ref = build(Case(arch="llama", tie=False)).double()
    ids = torch.randint(0, 61, (2, 9))
    labels = ids.clone()
    labels[:, ::3] = 7
    kw = {"ignore_index": 7}
    if num_items is not None:
        kw["num_items_in_batch"] = torch.tensor(num_items)
    ref_out = ref(input_ids=ids, labels=labels, **kw)
    ref_out.loss.backward()
    model = patch_hf_model(copy.deepcopy(ref), rope=False)
    model.zero_grad()
    assert isinstance(model.lm_head, FusedLMHead)
    out = model(input_ids=ids, labels=labels, **kw)
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=1e-6, atol=0)
    # the ignored label matters: with the default ignore_index the loss is another number
    assert abs(ref(input_ids=ids, labels=labels).loss.item() - ref_out.loss.item()) > 1e-4
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, rtol=1e-5, atol=1e-7, msg=name)


def test_num_items_in_batch_and_no_labels(impl, restore_rope):
    torch.manual_seed(1)
    ref = build(Case(arch="llama", tie=False))
    model = patch_hf_model(
        patch_hf_model(copy.deepcopy(ref), rope=False), rope=False
    )  # patching twice is a no-op
    assert len(model._forward_pre_hooks) == 2  # the loss's and the training forward's
    ids = torch.randint(0, 61, (2, 7))
    want = ref(input_ids=ids, labels=ids, num_items_in_batch=torch.tensor(20)).loss
    got = model(input_ids=ids, labels=ids, num_items_in_batch=torch.tensor(20)).loss
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # Without labels the forward is unchanged: logits come back.
    torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def _loss_of(model, ids, labels):
    return (
        model(input_ids=ids, decoder_input_ids=ids, labels=labels)
        if model.config.is_encoder_decoder
        else (model(input_ids=ids, labels=labels))
    )


@pytest.mark.parametrize("arch", ["gemma2-softcap", "t5"])
def test_fused_loss_only_where_the_head_output_is_the_loss_input(arch):
    # [Note: where the head's output goes] Gemma 2 soft-caps its logits before self.loss_function and T5 computes
    # its own CrossEntropyLoss: a deferred head would hand either the hidden states, and the loss would be wrong
    # without an error. These keep their head; the loss and gradients are the unpatched model's.
    from cai.kernels._hf import head_feeds_loss

    torch.manual_seed(3)
    if arch == "t5":
        config = transformers.T5Config(vocab_size=61, d_model=32, d_kv=8, num_heads=4, d_ff=48, num_layers=2,
                                       decoder_start_token_id=0, dropout_rate=0.0)  # fmt: skip
    else:
        config = transformers.Gemma2Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                           final_logit_softcapping=3.0)  # fmt: skip
    ref = (
        transformers.AutoModelForCausalLM.from_config(config)
        if arch != "t5"
        else (transformers.T5ForConditionalGeneration(config))
    )
    ref = ref.double().train()
    ids = torch.randint(0, 61, (2, 6))
    ref_loss = _loss_of(ref, ids, ids)
    ref_loss.loss.backward()
    model = patch_hf_model(copy.deepcopy(ref), rope=False)
    model.zero_grad()
    assert not head_feeds_loss(type(model)) and type(model.lm_head) is torch.nn.Linear
    out = _loss_of(model, ids, ids)
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref_loss.loss, rtol=1e-6, atol=0)
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, rtol=1e-5, atol=1e-7, msg=name)
    # the families that pass their head's output straight to the loss keep the fused loss
    assert all(
        head_feeds_loss(getattr(transformers, n))
        for n in ("LlamaForCausalLM", "OPTForCausalLM", "FalconForCausalLM", "GPT2LMHeadModel")
    )


def test_flags_leave_parts_alone(restore_rope):
    model = patch_hf_model(build(Case(arch="llama", tie=False)), rms_norm=False, swiglu=False, rope=False,
                           fused_loss=False, training_forward=False)  # fmt: skip
    assert not hasattr(model, "_cai_trimmed_forward") and not model._forward_pre_hooks
    assert type(model.model.norm).__name__ == "LlamaRMSNorm"
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"
    assert type(model.lm_head) is torch.nn.Linear


def test_training_forward_builds_no_cache_and_tests_only_positions_it_was_given(monkeypatch, restore_rope):
    # [Note: packed-sequence check] A training forward gets use_cache=False unless the caller asks, and without
    # positions, mask or cache it answers transformers' packed-sequence test itself (that test reads the device from
    # the host); positions the caller passes, and evaluation, are tested as before, and the losses are unchanged.
    from cai.kernels import _forward

    torch.manual_seed(2)
    ref = build(Case(arch="llama", tie=False)).double()
    model = patch_hf_model(copy.deepcopy(ref))
    ids = torch.randint(0, 61, (2, 8))
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * 2)  # two sequences packed in each row
    with torch.no_grad():
        # Without a cache (as the trimmed forward runs) transformers masks packed sequences apart; with one it does not.
        want_own = ref(input_ids=ids, labels=ids, use_cache=False).loss
        want_packed = ref(input_ids=ids, labels=ids, position_ids=packed, use_cache=False).loss
    assert (want_own - want_packed).abs() > 1e-3  # the packed positions change the loss

    calls = []
    original = _forward._packed_check_original

    def counted(position_ids):
        calls.append(position_ids.shape)
        return original(position_ids)

    monkeypatch.setattr(_forward, "_packed_check_original", counted)
    own = model(input_ids=ids, labels=ids)
    assert own.past_key_values is None and not calls
    torch.testing.assert_close(own.loss, want_own, rtol=1e-6, atol=0)
    torch.testing.assert_close(model(input_ids=ids, labels=ids, position_ids=packed).loss, want_packed,
                               rtol=1e-6, atol=0)  # fmt: skip
    assert len(calls) == 1
    assert model(input_ids=ids, labels=ids, use_cache=True).past_key_values is not None  # asked for: kept
    with pytest.raises(IndexError):  # a forward that raises leaves nothing behind
        model(input_ids=ids + 61)
    assert model._cai_position_tokens == [] and not _forward._OWN_POSITIONS.get()
    model.eval()
    with torch.no_grad():
        assert model(input_ids=ids).past_key_values is not None  # evaluation keeps its cache
        torch.testing.assert_close(model(input_ids=ids, labels=ids, use_cache=False).loss, want_own,
                                   rtol=1e-6, atol=0)  # fmt: skip
    assert (
        len(calls) == 2
    )  # only the uncached evaluation tested its positions (with a cache there is no test)
    assert trim_training_forward(model) and len(model._forward_pre_hooks) == 2  # installing again: a no-op
    assert not trim_training_forward(torch.nn.Linear(2, 2))
