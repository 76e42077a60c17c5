"""The automatic policy from a model's `base_model_tp_plan`: three decoder families that have a plan and no
cai-shardformer policy (Cohere, Starcoder2, Olmo2) against the same model unsharded in one process, fp32, 5 AdamW
steps; the collectives per layer; the errors for a model with neither a policy nor a plan and for a plan style cai
does not map."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch
import torch.distributed as dist
import transformers

from cai.mesh.testing import CollectiveCounter, run_distributed
from cai.shardformer import ShardConfig, ShardFormer
from cai.shardformer.policies import get_autopolicy
from cai.shardformer.policies.tp_plan import TpPlanPolicy

# The training comparison of the encoder tests.
_spec = importlib.util.spec_from_file_location(
    "_shardformer_encoder_tests", pathlib.Path(__file__).with_name("test_encoders.py")
)
_enc = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _enc  # its dataclasses look their module up; its Case pickles by this name
_spec.loader.exec_module(_enc)
Case, Family = _enc.Case, _enc.Family
VOCAB, B, S = _enc.VOCAB, _enc.B, _enc.S

_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip


def _causal_batch(g):
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = ids.clone()
    labels[0, :2] = -100
    return {"input_ids": ids, "labels": labels}


def _cohere_without_head_plan():
    """Cohere with the lm_head left out of its plan: tied to the vocab-parallel embedding, it must follow it."""
    model = transformers.CohereForCausalLM(transformers.CohereConfig(**_COMMON))
    del model.tp_plan["lm_head"]
    return model


MODELS: dict[str, Family] = {
    # q/k/v/o and gate/up/down colwise/rowwise, embedding_rowwise, tied embedding (Cohere's default), logit scale.
    "cohere": Family(
        lambda: transformers.CohereForCausalLM(transformers.CohereConfig(**_COMMON)), _causal_batch
    ),
    # Biases everywhere, a plain (non-gated) MLP c_fc/c_proj, LayerNorm, embedding_rowwise, untied.
    "starcoder2": Family(
        lambda: transformers.Starcoder2ForCausalLM(
            transformers.Starcoder2Config(**_COMMON, tie_word_embeddings=False, residual_dropout=0.0)
        ),
        _causal_batch,
    ),
    # q/k/v colwise_gather_output (the q/k norms see the whole projection), o rowwise_split_input; the embedding is
    # not in the plan (replicated), the lm_head is.
    "olmo2": Family(
        lambda: transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**_COMMON, tie_word_embeddings=False)),
        _causal_batch,
    ),
    "cohere_tied_unplanned_head": Family(_cohere_without_head_plan, _causal_batch),
}

CASES = [
    *(Case(m, tp) for tp in (2, 4) for m in ("cohere", "starcoder2", "olmo2")),
    Case("cohere_tied_unplanned_head", 2),
]


def _matrix(cases: list[Case]) -> dict[str, str | None]:
    for case in cases:  # no family here has a policy of its own: the plan is what shards it
        assert isinstance(get_autopolicy(MODELS[case.model].build()), TpPlanPolicy)
    return _enc.run_matrix(MODELS, cases)


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
def test_plan_training_matches_unsharded(case, results):
    error = results(case.tp)[case.id]
    assert error is None, error


class _NoPlan(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = transformers.PretrainedConfig()
        self.proj = torch.nn.Linear(4, 4)


def _errors() -> dict[str, str]:
    dist.barrier()  # see test_policies._error
    out = {}
    try:
        ShardFormer(ShardConfig()).optimize(_NoPlan())
    except NotImplementedError as e:
        out["no_plan"] = str(e)
    model = transformers.Starcoder2ForCausalLM(transformers.Starcoder2Config(**_COMMON))
    model.tp_plan["model.layers.*.mlp.c_fc"] = "packed_colwise"
    try:
        ShardFormer(ShardConfig()).optimize(model)
    except NotImplementedError as e:
        out["style"] = str(e)
    gemma2 = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**_COMMON, head_dim=16))
    try:  # its embedding scales in its own forward: replacing it would silently drop the scale
        ShardFormer(ShardConfig()).optimize(gemma2, policy=TpPlanPolicy())
    except NotImplementedError as e:
        out["subclass"] = str(e)
    three_heads = {**_COMMON, "hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 3}
    try:  # through the plan: heads counted from the projection's width and the attention's head_dim
        ShardFormer(ShardConfig()).optimize(
            transformers.CohereForCausalLM(transformers.CohereConfig(**three_heads))
        )
    except ValueError as e:
        out["plan_heads"] = str(e)
    try:  # a hand-written encoder policy
        ShardFormer(ShardConfig()).optimize(
            transformers.BertModel(transformers.BertConfig(**{**three_heads, "num_key_value_heads": None}))
        )
    except ValueError as e:
        out["bert_heads"] = str(e)
    return out


def _count() -> tuple[list, list]:
    torch.manual_seed(0)
    model, _ = ShardFormer(ShardConfig()).optimize(
        transformers.CohereForCausalLM(transformers.CohereConfig(**_COMMON))
    )
    model.train()
    ids = torch.randint(0, VOCAB, (B, S))
    with CollectiveCounter() as fwd:
        loss = model(input_ids=ids, labels=ids).loss
    with CollectiveCounter() as bwd:
        loss.backward()
    return [(e.op, e.nbytes) for e in fwd.events], [(e.op, e.nbytes) for e in bwd.events]


def test_plan_policy_issues_megatrons_collectives():
    """The plan's attention and MLP blocks are tp input regions: two all-reduces of b x s x h per layer forward
    and two backward, as the hand-written policies (plus the embedding's and the vocab-parallel loss's)."""
    fwd, bwd = run_distributed(_count, 2)[0]
    act = ("all_reduce", B * S * _COMMON["hidden_size"] * 4)
    layers = _COMMON["num_hidden_layers"]
    assert fwd.count(act) == 2 * layers + 2, fwd  # + the embedding, + the loss's hidden gradient
    assert bwd == [act] * (2 * layers), bwd


def test_bad_models_fail_at_optimize_with_the_fix():
    """No policy and no plan; a plan style cai does not map; a planned layer whose class has its own forward;
    heads that do not divide (plan and encoder policy)."""
    got = run_distributed(_errors, 2)[0]
    for fragment in ("_NoPlan", "base_model_tp_plan", "policy=", "LlamaForCausalLM"):
        assert fragment in got.get("no_plan", ""), (fragment, got)
    for fragment in ("'packed_colwise'", "model.layers.0.mlp.c_fc", "Starcoder2ForCausalLM", "policy="):
        assert fragment in got.get("style", ""), (fragment, got)
    for fragment in ("model.layers.0.self_attn.k_proj", "3 heads", "tensor_parallel_size=2"):
        assert fragment in got.get("plan_heads", ""), (fragment, got)
    for fragment in ("model.embed_tokens", "Gemma2TextScaledWordEmbedding", "own forward", "policy="):
        assert fragment in got.get("subclass", ""), (fragment, got)
    for fragment in ("BertModel", "num_attention_heads=3", "tensor_parallel_size=2"):
        assert fragment in got.get("bert_heads", ""), (fragment, got)
