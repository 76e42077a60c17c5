"""Stages built from a model, composed in order in one process, equal the model: outputs, loss and gradients,
for several families, tied and untied, at 2 and 4 stages; the cost model; and the errors."""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import pytest
import torch
import transformers
from torch import nn

from cai.mesh.testing import assert_close
from cai.pipeline import (
    PipelineLayout,
    balance_layers,
    distribute_layers,
    layout_from_pp_plan,
    partition_by_cost,
    split_model,
)

GPT2_LAYOUT = PipelineLayout(
    base="transformer",
    embeddings=("transformer.wte", "transformer.wpe"),
    layers="transformer.h",
    final=("transformer.ln_f",),
    head=("lm_head",),
)


# Layouts of families whose configs have no base_model_pp_plan (cai-shardformer's policies carry them).
OPT_LAYOUT = PipelineLayout(
    base="model",
    embeddings=("model.decoder.embed_tokens", "model.decoder.embed_positions"),
    layers="model.decoder.layers",
    final=("model.decoder.final_layer_norm",),
    head=("lm_head",),
)
BLOOM_LAYOUT = PipelineLayout(
    base="transformer",
    embeddings=("transformer.word_embeddings", "transformer.word_embeddings_layernorm"),
    layers="transformer.h",
    final=("transformer.ln_f",),
    head=("lm_head",),
)


def tiny(
    family: str, tie: bool, layers: int = 4, vocab: int = 251
) -> tuple[nn.Module, PipelineLayout | None]:
    """A tiny causal LM of ``family`` and the layout to split it with (None: its base_model_pp_plan)."""
    common = dict(vocab_size=vocab, num_attention_heads=4, tie_word_embeddings=tie)
    if family == "gpt2":
        cfg = transformers.GPT2Config(
            n_embd=32, n_layer=layers, n_positions=32, bos_token_id=0, eos_token_id=0, **common
        )
        return transformers.GPT2LMHeadModel(cfg).eval(), GPT2_LAYOUT
    if family == "opt":  # learned positions with an offset, computed from the attention mask
        cfg = transformers.OPTConfig(
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=layers,
            word_embed_proj_dim=32,
            max_position_embeddings=32,
            pad_token_id=0,
            bos_token_id=0,
            eos_token_id=0,
            **common,
        )
        return transformers.OPTForCausalLM(cfg).eval(), OPT_LAYOUT
    if family == "bloom":  # a layer norm after the embedding, ALiBi from the attention mask
        cfg = transformers.BloomConfig(hidden_size=32, n_layer=layers, **common)
        return transformers.BloomForCausalLM(cfg).eval(), BLOOM_LAYOUT
    dec = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_key_value_heads=2, **common
    )
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**dec))
    elif family == "qwen2":  # sliding-window layers after the first two: layer_types must follow the blocks
        cfg = transformers.Qwen2Config(use_sliding_window=True, sliding_window=3, max_window_layers=2, **dec)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif family == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=5, **dec))
    elif family == "qwen3":  # per-head q/k norms
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=8, **dec))
    elif family == "gemma2":  # alternating sliding and full layers, indexed by position in the block list
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(head_dim=8, sliding_window=4, **dec))
    elif family == "mixtral":  # a mixture of experts in every block
        cfg = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **dec)
        model = transformers.MixtralForCausalLM(cfg)
    elif family == "gemma":  # scales the embeddings by sqrt(hidden) inside the model's forward
        model = transformers.GemmaForCausalLM(transformers.GemmaConfig(head_dim=8, **dec))
    else:
        raise ValueError(family)
    return model.eval(), None


def batch_for(seed: int = 0, batch: int = 2, seq: int = 12, vocab: int = 251) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding on one row: the masks must come from the batch on every stage
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": torch.randint(0, vocab, (batch, seq), generator=g),
    }


@dataclass(frozen=True)
class Case:
    family: str
    tie: bool
    pp: int

    def __str__(self) -> str:
        return f"{self.family}-{'tied' if self.tie else 'untied'}-pp{self.pp}"


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "mixtral", "gpt2", "opt", "bloom")
CASES = [Case(f, t, pp) for f, t, pp in itertools.product(FAMILIES, (False, True), (2, 4))]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_stages_compose_to_the_model(case: Case) -> None:
    torch.manual_seed(0)
    model, layout = tiny(case.family, case.tie)
    batch = batch_for()
    ref = model(**batch)
    ref.loss.backward()
    stages = [
        split_model(copy.deepcopy(model), slot=s, num_slots=case.pp, layout=layout) for s in range(case.pp)
    ]

    hidden = None
    for stage in stages:
        hidden = stage(hidden, batch)
    assert_close(hidden["logits"], ref.logits, rtol=1e-6, atol=1e-6)
    assert_close(hidden["loss"], ref.loss, rtol=1e-6, atol=1e-6)
    hidden["loss"].backward()

    full = dict(model.named_parameters(remove_duplicate=False))
    grads: dict[str, torch.Tensor] = {}
    owners: dict[str, list[int]] = {}
    for i, stage in enumerate(stages):
        for name, p in stage.global_named_parameters():
            # A tied weight's two copies (embedding on the first stage, head on the last) add up to the full gradient.
            key = stage.tied.get(name, name)
            grads[key] = grads[key] + p.grad if key in grads else p.grad.clone()
            owners.setdefault(key, []).append(i)
    expected = {n: p.grad for n, p in model.named_parameters()}
    assert set(grads) == set(expected)
    assert_close(grads, expected, rtol=1e-5, atol=1e-7)
    # Every parameter lives on exactly one stage, except a tied weight (first and last stage).
    embed = f"{layout.embeddings[0] if layout else 'model.embed_tokens'}.weight"
    for name, ranks in owners.items():
        assert ranks == ([0, case.pp - 1] if case.tie and name == embed else ranks[:1]), (name, ranks)
    assert full["lm_head.weight"] is full[embed] if case.tie else True
    # Each stage holds only its own blocks, and not the others' embeddings or head.
    sizes = distribute_layers(4, case.pp)
    for i, stage in enumerate(stages):
        assert len(stage.blocks) == sizes[i]
        n_embed = sum(1 for n, _ in stage.global_named_parameters() if n == embed)
        assert n_embed == (1 if i == 0 else 0)


def test_interleaved_slots_compose_and_v_shares_tied_weight() -> None:
    """Eight slots of an 8-block model (2 stages x 4 chunks) compose; keep_tied shares the tied weight."""
    torch.manual_seed(0)
    model, _ = tiny("llama", True, layers=8)
    batch = batch_for(1)
    ref = model(**batch)
    source = copy.deepcopy(model)
    stages = [split_model(source, slot=s, num_slots=8, keep_tied=True) for s in range(8)]
    hidden = None
    for stage in stages:
        hidden = stage(hidden, batch)
    assert_close(hidden["loss"], ref.loss, rtol=1e-6)
    assert [stage.layer_range for stage in stages] == [(i, i + 1) for i in range(8)]
    assert stages[7].module.lm_head.weight is stages[0].module.model.embed_tokens.weight


def test_layout_from_pp_plan() -> None:
    model, _ = tiny("llama", False)
    assert layout_from_pp_plan(model) == PipelineLayout(
        base="model",
        embeddings=("model.embed_tokens",),
        layers="model.layers",
        final=("model.norm",),
        head=("lm_head",),
    )
    base = layout_from_pp_plan(model.model)  # a base model alone: no head, its own base
    assert base == PipelineLayout(embeddings=("embed_tokens",), layers="layers", final=("norm",))
    batch = {k: v for k, v in batch_for().items() if k != "labels"}
    ref = model.model(**batch).last_hidden_state
    stages = [split_model(copy.deepcopy(model.model), slot=s, num_slots=2) for s in range(2)]
    assert_close(stages[1](stages[0](None, batch), batch)["hidden_states"], ref, rtol=1e-6)


def test_distribute_layers_puts_the_remainder_in_the_middle() -> None:
    assert distribute_layers(8, 4) == [2, 2, 2, 2]
    assert distribute_layers(10, 4) == [2, 3, 3, 2]
    assert distribute_layers(9, 4) == [2, 2, 3, 2]
    assert distribute_layers(7, 2) == [3, 4]


def _brute_force(costs: list[float], slots: int, first: float, last: float) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), slots - 1):
        bounds = [0, *cuts, len(costs)]
        loads = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
        loads[0] += first
        loads[-1] += last
        best = min(best, max(loads))
    return best


def test_partition_by_cost_is_optimal() -> None:
    g = torch.Generator().manual_seed(0)
    for n, slots in [(6, 2), (7, 3), (9, 4), (5, 5)]:
        costs = (torch.rand(n, generator=g) + 0.1).tolist()
        first, last = torch.rand(2, generator=g).tolist()
        counts = partition_by_cost(costs, slots, first=first, last=last)
        assert sum(counts) == n and min(counts) >= 1
        bounds = [0, *itertools.accumulate(counts)]
        loads = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
        loads[0] += first
        loads[-1] += last
        assert max(loads) == pytest.approx(_brute_force(costs, slots, first, last))


def test_balance_layers_lightens_first_and_last_stage() -> None:
    # A large vocabulary: the embedding (parameters) and the head (parameters and FLOPs) weigh several blocks.
    model, _ = tiny("llama", False, layers=12, vocab=4000)
    counts = balance_layers(model, 4, seq_len=16)
    assert sum(counts) == 12
    assert counts[0] < counts[1] and counts[-1] < counts[2], counts
    # With a tiny vocabulary the pieces weigh little and the split is even.
    small, _ = tiny("llama", False, layers=12, vocab=8)
    assert balance_layers(small, 4, seq_len=16) == [3, 3, 3, 3]
    # The counts are a valid split.
    stage = split_model(model, slot=0, num_slots=4, layers_per_stage=counts)
    assert len(stage.blocks) == counts[0]


def test_errors_name_the_values() -> None:
    model, _ = tiny("llama", False)
    with pytest.raises(ValueError, match=r"4 layers cannot fill 5 pipeline slots"):
        split_model(model, slot=0, num_slots=5)
    with pytest.raises(ValueError, match=r"layers_per_stage \[1, 2\] sums to 3 but the model has 4 layers"):
        split_model(model, slot=0, num_slots=2, layers_per_stage=[1, 2])
    with pytest.raises(ValueError, match=r"has 3 entries but the pipeline has 2 slots"):
        split_model(model, slot=0, num_slots=2, layers_per_stage=[1, 2, 1])
    with pytest.raises(ValueError, match=r"slot 2 is outside \[0, 2\)"):
        split_model(model, slot=2, num_slots=2)
    gpt2, _ = tiny("gpt2", False)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel: its config has no base_model_pp_plan"):
        split_model(gpt2, slot=0, num_slots=2)
    partial = PipelineLayout(
        base="transformer", embeddings=("transformer.wte",), layers="transformer.h", head=("lm_head",)
    )
    with pytest.raises(ValueError, match=r"transformer.wpe.weight.*belong to no piece"):
        split_model(gpt2, slot=0, num_slots=2, layout=partial)
    with pytest.raises(ValueError, match=r"lie outside the base model 'transformer'"):
        PipelineLayout(base="transformer", layers="h")
    stage = split_model(model, slot=1, num_slots=2)
    with pytest.raises(
        ValueError, match=r"expected the previous stage's \{'hidden_states': \.\.\.\}, got None"
    ):
        stage(None, batch_for())


def test_activation_checkpointing_recomputes_with_the_received_input() -> None:
    """Under Hugging Face's gradient checkpointing a block's recomputation must see the received hidden states,
    not the placeholder path (Gemma scales it)."""
    torch.manual_seed(0)
    model, _ = tiny("gemma", False)
    batch = batch_for()
    model(**batch).loss.backward()
    piped = copy.deepcopy(model)
    piped.zero_grad()
    piped.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    piped.train()
    first, last = (split_model(piped, slot=s, num_slots=2) for s in range(2))
    sent = first(None, batch)["hidden_states"]
    received = sent.detach().requires_grad_()
    last({"hidden_states": received}, batch)["loss"].backward()
    sent.backward(received.grad)
    assert_close(
        {n: p.grad for n, p in piped.named_parameters()},
        {n: p.grad for n, p in model.named_parameters()},
        rtol=1e-5,
        atol=1e-7,
    )
