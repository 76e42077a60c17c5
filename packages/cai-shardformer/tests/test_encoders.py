"""Encoder and encoder-decoder policies (BERT, T5, ViT, Whisper) against the same model unsharded in one
process, fp32: 5 AdamW steps with losses, gathered gradients and gathered parameters compared every step.

One process group per world size runs the whole matrix of that size (spawning is the expensive part on CPU); each
case is still its own pytest id, reading its result from that run."""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import transformers

from cai.mesh.testing import CollectiveCounter, assert_close, run_distributed
from cai.shardformer import ParallelModule, ShardConfig, ShardFormer

VOCAB = 251  # divides by neither 2 nor 4: the vocabulary is padded
B, S, H, HEADS, LAYERS = 2, 8, 64, 4, 2


@dataclass(frozen=True)
class Case:
    model: str  # a key of MODELS
    tp: int

    @property
    def id(self) -> str:
        return f"{self.model}-tp{self.tp}"


@dataclass(frozen=True)
class Family:
    build: Callable[[], torch.nn.Module]
    batch: Callable[[torch.Generator], dict]  # the forward's keyword arguments
    loss: Callable[[object], torch.Tensor] = lambda out: out.loss


def _bert_config():
    return transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=128,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
    )  # fmt: skip


def _bert_batch(g):
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, -3:] = 0  # padding in the second sequence
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "token_type_ids": (torch.arange(S) >= S // 2).long().expand(B, S),
    }


def _mlm_labels(g):
    labels = torch.randint(0, VOCAB, (B, S), generator=g)
    labels[torch.rand(B, S, generator=g) < 0.5] = -100
    return labels


def _probe(t: torch.Tensor) -> torch.Tensor:
    """`t` against a fixed random direction: a loss whose gradient is not zero in exact arithmetic (mean(h**2)
    after a final RMSNorm of unit weight is constant, and its gradient pure rounding)."""
    w = torch.randn(t.shape, generator=torch.Generator().manual_seed(7))
    return (t * w).mean()


def _hidden_loss(out):
    """A loss over every output of a headless model, so every parameter gets a gradient."""
    loss = _probe(out.last_hidden_state)
    for extra in ("pooler_output", "encoder_last_hidden_state"):
        if getattr(out, extra, None) is not None:
            loss = loss + _probe(getattr(out, extra))
    return loss


MODELS: dict[str, Family] = {
    "bert": Family(lambda: transformers.BertModel(_bert_config()), lambda g: _bert_batch(g), _hidden_loss),
    "bert_cls": Family(
        lambda: transformers.BertForSequenceClassification(_bert_config()),
        lambda g: {**_bert_batch(g), "labels": torch.randint(0, 3, (B,), generator=g)},
    ),
    "bert_mlm": Family(
        lambda: transformers.BertForMaskedLM(_bert_config()),
        lambda g: {**_bert_batch(g), "labels": _mlm_labels(g)},
    ),
    "bert_pretraining": Family(
        lambda: transformers.BertForPreTraining(_bert_config()),
        lambda g: {**_bert_batch(g), "labels": _mlm_labels(g), "next_sentence_label": torch.tensor([0, 1])},
    ),
}


def _t5_config(**kw):
    return transformers.T5Config(
        vocab_size=VOCAB, d_model=H, d_kv=H // HEADS, d_ff=128, num_layers=LAYERS, num_decoder_layers=LAYERS,
        num_heads=HEADS, relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0, **kw,
    )  # fmt: skip


def _t5_batch(g):
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, -3:] = 0
    return {"input_ids": ids, "attention_mask": mask}


MODELS.update(
    {
        # relu feed-forward; decoder self-attention is causal, cross-attention reads the encoder output.
        "t5": Family(
            lambda: transformers.T5Model(_t5_config()),
            lambda g: {**_t5_batch(g), "decoder_input_ids": torch.randint(0, VOCAB, (B, S - 2), generator=g)},
            _hidden_loss,
        ),
        # gated-gelu feed-forward, lm_head tied to the shared embedding (T5's default), its own loss.
        "t5_gen": Family(
            lambda: transformers.T5ForConditionalGeneration(_t5_config(feed_forward_proj="gated-gelu")),
            lambda g: {**_t5_batch(g), "labels": _mlm_labels(g)[:, : S - 2].contiguous()},
        ),
        "t5_encoder": Family(
            lambda: transformers.T5EncoderModel(_t5_config()),
            _t5_batch,
            _hidden_loss,
        ),
    }
)


def _vit_config():
    return transformers.ViTConfig(
        hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=128, image_size=16,
        patch_size=4, num_channels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
    )  # fmt: skip


def _pixels(g):
    return {"pixel_values": torch.randn(B, 3, 16, 16, generator=g)}


MODELS.update(
    {
        "vit": Family(lambda: transformers.ViTModel(_vit_config()), _pixels, _hidden_loss),
        "vit_cls": Family(
            lambda: transformers.ViTForImageClassification(_vit_config()),
            lambda g: {**_pixels(g), "labels": torch.randint(0, 3, (B,), generator=g)},
        ),
    }
)


def _whisper_config():
    return transformers.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, d_model=H, encoder_layers=LAYERS, decoder_layers=LAYERS,
        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_source_positions=8, max_target_positions=16, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        pad_token_id=0, decoder_start_token_id=1, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip


def _features(g):
    # 16 frames: the stride-2 convolution makes the 8 encoder positions of max_source_positions.
    return {"input_features": torch.randn(B, 8, 16, generator=g)}


MODELS.update(
    {
        "whisper": Family(
            lambda: transformers.WhisperModel(_whisper_config()),
            lambda g: {**_features(g), "decoder_input_ids": torch.randint(1, VOCAB, (B, S), generator=g)},
            _hidden_loss,
        ),
        "whisper_gen": Family(
            lambda: transformers.WhisperForConditionalGeneration(_whisper_config()),
            lambda g: {**_features(g), "labels": _mlm_labels(g)},
        ),
    }
)


def gathered(model, grads: bool = False) -> dict:
    """Every parameter (or its gradient) as the full unpadded tensor, by its first name; a parameter tied to a
    parallel layer's (BERT's `cls.predictions.bias`) is gathered through that layer."""
    owner = {
        id(p): (m, n)
        for m in model.modules()
        if isinstance(m, ParallelModule)
        for n, p in m.named_parameters(recurse=False)
    }
    out = {}
    for key, p in model.named_parameters():
        if grads and not p.requires_grad:
            continue  # frozen (Whisper's encoder position embedding)
        local = p.grad if grads else p
        if id(p) in owner:
            module, name = owner[id(p)]
            out[key] = module.full_tensor(name, local)
        else:
            out[key] = local.detach().clone()
    return out


def _close(actual: dict, expected: dict, name: str, floor: float = 1e-9) -> None:
    """The rule of test_policies._close (1e-5 relative, absolute floor 1e-5 of the tensor's largest element),
    with a floor of 1e-9: the attention key bias has a gradient that is exactly zero (softmax does not change when
    a query's scores all move by the same amount), so its computed value is rounding noise around 1e-13."""
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    for k, e in expected.items():
        atol = max(1e-5 * float(e.abs().max()), floor)
        assert_close(actual[k], e, rtol=1e-5, atol=atol, name=f"{name} {k}")


def _aliases(model) -> set[str]:
    """The names under which a parameter appears a second time (ties)."""
    return {n for n, _ in model.named_parameters(remove_duplicate=False)} - set(
        dict(model.named_parameters())
    )


def train_and_compare(fam: Family, case_id: str) -> None:
    """Shard a copy of `fam.build()` with the default policy and train both 5 AdamW steps, comparing losses,
    gathered gradients and gathered parameters every step."""
    torch.manual_seed(0)
    ref = fam.build()
    with torch.no_grad():
        # Hugging Face starts biases (and LayerNorm shifts) at zero; a trained model's are not, and a bias added
        # on every rank instead of once would go unseen at zero.
        for p in ref.parameters():
            if not p.any():
                p.normal_(0.0, 0.02)
    model = copy.deepcopy(ref)
    model, _ = ShardFormer(ShardConfig()).optimize(model)
    assert set(model.state_dict()) == set(ref.state_dict())  # the Hugging Face keys
    assert any(isinstance(m, ParallelModule) for m in model.modules())
    assert _aliases(model) == _aliases(ref)  # tied weights stay tied
    # The state protocol reports every Hugging Face key with its global shape (a tied shard under each name).
    state = model.sharded_state_dict()
    assert {k: v.spec.global_shape for k, v in state.items()} == {
        k: v.shape for k, v in ref.state_dict().items()
    }
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-4)  # eps: see test_policies._train
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    ref.train()
    model.train()
    g = torch.Generator().manual_seed(5)
    for step in range(5):
        batch = fam.batch(g)
        ref_loss = fam.loss(ref(**batch))
        ref_loss.backward()
        loss = fam.loss(model(**batch))
        loss.backward()
        assert_close(loss, ref_loss, rtol=1e-5, name=f"{case_id} step {step} loss")
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
        _close(gathered(model, grads=True), ref_grads, f"{case_id} step {step} grad")
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
        # Parameters: an element whose gradient is at the level of rounding noise (~1e-7, sums that nearly
        # cancel) moves by lr * noise / eps = 1e-3 * 1e-7 / 1e-4 = 1e-6 per step, differently in the two runs.
        _close(gathered(model), dict(ref.named_parameters()), f"{case_id} step {step} param", floor=2e-6)


def run_matrix(models: dict[str, Family], cases: list[Case]) -> dict[str, str | None]:
    """Every case on this process group; a failing case records its traceback and the next one runs (a
    mismatch or an error is found on every rank alike, so the ranks stay in step)."""
    results = {}
    for case in cases:
        try:
            train_and_compare(models[case.model], case.id)
            results[case.id] = None
        except Exception:
            results[case.id] = traceback.format_exc()
    return results


def _matrix(cases: list[Case]) -> dict[str, str | None]:
    return run_matrix(MODELS, cases)


# Every family at tp 2 and 4; the head classes of one family share its layer policy, so each runs at one size
# (the suite's time budget): the lighter heads at 2, the full models (pretraining heads, tied lm_heads) at 4.
CASES = [
    *(Case(m, 2) for m in ("bert", "bert_cls", "bert_mlm", "t5", "t5_encoder", "vit", "whisper")),
    *(Case(m, 4) for m in ("bert_pretraining", "t5_gen", "vit_cls", "whisper_gen")),
]
assert {c.model for c in CASES} == set(MODELS)


@pytest.fixture(scope="module")
def results(request):
    """Case id -> None or the failure, from one process group per world size running the selected cases."""
    selected = [
        item.callspec.params["case"]
        for item in request.session.items
        if item.module is request.module and "case" in getattr(getattr(item, "callspec", None), "params", {})
    ]
    cache: dict[int, dict] = {}

    def get(tp: int) -> dict:
        if tp not in cache:
            cache[tp] = run_distributed(_matrix, tp, [c for c in selected if c.tp == tp], timeout=600)[0]
        return cache[tp]

    return get


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_training_matches_unsharded(case, results):
    error = results(case.tp)[case.id]
    assert error is None, error


def _count_bert() -> tuple[list, list]:
    torch.manual_seed(0)
    model, _ = ShardFormer(ShardConfig()).optimize(transformers.BertModel(_bert_config()))
    model.train()
    batch = _bert_batch(torch.Generator().manual_seed(0))
    with CollectiveCounter() as fwd:
        loss = _hidden_loss(model(**batch))
    with CollectiveCounter() as bwd:
        loss.backward()
    return [(e.op, e.nbytes) for e in fwd.events], [(e.op, e.nbytes) for e in bwd.events]


def test_bert_issues_megatrons_collectives():
    """Two all-reduces of b x s x h per encoder layer forward (attention output, MLP output) and two backward
    (the attention region's input, the intermediate layer's input), plus the word embedding's forward one."""
    fwd, bwd = run_distributed(_count_bert, 2)[0]
    act = ("all_reduce", B * S * H * 4)
    assert fwd == [act] * (2 * LAYERS + 1), fwd
    assert bwd == [act] * (2 * LAYERS), bwd
