"""The decoder families beyond the Llama shape (GPT-2, Gemma, Mixtral, OPT, GPT-J, Bloom, Falcon) sharded by their
policies against the same model unsharded in one process, fp32: 5 AdamW steps with losses, gathered gradients and
gathered parameters compared every step (test_policies.py's helpers and tolerances). Every family and variant of one
tp size runs inside one process-group spawn; a failure names its case."""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers

from cai.mesh.testing import CollectiveCounter, assert_close, run_distributed
from cai.shardformer import ParallelModule, ShardConfig, ShardFormer, sharded_state_dict

# test_policies.py's comparison helpers (`gathered`, `_close`), loaded by path: pytest's importlib mode gives test
# modules no importable package.
_spec = importlib.util.spec_from_file_location(
    "_cai_shardformer_policy_tests", Path(__file__).with_name("test_policies.py")
)
_policies = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_policies)
gathered, _close = _policies.gathered, _policies._close

VOCAB = 251  # divides by neither 2 nor 4: the vocabulary is padded
B, S, H, LAYERS, HEADS = 2, 8, 64, 2, 4
LLAMA_SHAPED = ("gemma", "gemma2", "gemma3", "mixtral")
NO_DROPOUT = 0.0  # dropout masks differ per rank until the RNG tracker exists


@dataclass(frozen=True)
class Case:
    family: str
    tie: bool = False  # lm_head shares the embedding's weight
    variant: str = ""  # a family's alternative layout (Falcon's multi_query / new_decoder_architecture, ...)
    kv_heads: int = 2  # Falcon's new_decoder_architecture kv groups
    parallel_output: bool = True  # False: gathered logits and the model's own loss
    kernels: bool = False  # enable_all_optimization: cai-kernels where they apply, around the parallel layers

    @property
    def name(self) -> str:
        parts = [self.family, self.variant, "tied" if self.tie else "untied"]
        extra = ["" if self.parallel_output else "gathered_logits", "kernels" if self.kernels else ""]
        return "-".join(filter(None, [*parts, *extra]))


def _tiny(case: Case, **overrides):
    t = transformers
    tie = case.tie
    if case.family == "gpt2":
        cfg = t.GPT2Config(
            vocab_size=VOCAB, n_embd=H, n_layer=LAYERS, n_head=HEADS, n_inner=128, n_positions=64,
            resid_pdrop=NO_DROPOUT, embd_pdrop=NO_DROPOUT, attn_pdrop=NO_DROPOUT, tie_word_embeddings=tie,
        )  # fmt: skip
        cls = t.GPT2LMHeadModel
    elif case.family == "opt":  # biases everywhere, fc1/fc2 on the layer itself, a padding_idx embedding
        cfg = t.OPTConfig(
            vocab_size=VOCAB, hidden_size=H, word_embed_proj_dim=H, ffn_dim=128, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, max_position_embeddings=64, dropout=NO_DROPOUT,
            attention_dropout=NO_DROPOUT, activation_dropout=NO_DROPOUT, layerdrop=0.0, tie_word_embeddings=tie,
        )  # fmt: skip
        cls = t.OPTForCausalLM
    elif case.family == "gptj":  # partial rotary, parallel attention and MLP, lm_head with a bias
        cfg = t.GPTJConfig(
            vocab_size=VOCAB, n_embd=H, n_layer=LAYERS, n_head=HEADS, rotary_dim=8, n_inner=128, n_positions=64,
            resid_pdrop=NO_DROPOUT, embd_pdrop=NO_DROPOUT, attn_pdrop=NO_DROPOUT, tie_word_embeddings=tie,
        )  # fmt: skip
        cls = t.GPTJForCausalLM
    elif case.family == "bloom":  # fused qkv interleaved per head, ALiBi per head
        cfg = t.BloomConfig(
            vocab_size=VOCAB, hidden_size=H, n_layer=LAYERS, n_head=HEADS, hidden_dropout=NO_DROPOUT,
            attention_dropout=NO_DROPOUT, tie_word_embeddings=tie,
        )  # fmt: skip
        cls = t.BloomForCausalLM
    elif case.family == "falcon":  # the three query_key_value layouts
        layout = {
            "multi_query": dict(multi_query=True, parallel_attn=True, bias=False),
            "new_arch": dict(new_decoder_architecture=True, num_kv_heads=case.kv_heads, bias=False),
            "mha": dict(multi_query=False, parallel_attn=False, bias=True),
            "mha_alibi": dict(multi_query=False, parallel_attn=False, bias=True, alibi=True),
            "mha_alibi_eager": dict(
                multi_query=False, parallel_attn=False, bias=True, alibi=True, attn_implementation="eager"
            ),
        }[case.variant]
        cfg = t.FalconConfig(
            vocab_size=VOCAB, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
            ffn_hidden_size=128, max_position_embeddings=64, hidden_dropout=NO_DROPOUT,
            attention_dropout=NO_DROPOUT, tie_word_embeddings=tie, **layout,
        )  # fmt: skip
        cls = t.FalconForCausalLM
    elif case.family in LLAMA_SHAPED:  # 2 kv heads (replicated at tp 4)
        common = dict(
            vocab_size=VOCAB, hidden_size=H, intermediate_size=128, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie,
            attention_dropout=NO_DROPOUT,
        )  # fmt: skip
        if case.family == "mixtral":  # 4 experts, top 2, the router's auxiliary loss in the loss
            cfg = t.MixtralConfig(
                **common, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                router_aux_loss_coef=0.1,
            )  # fmt: skip
            cls = t.MixtralForCausalLM
        elif case.family == "gemma":
            cfg, cls = t.GemmaConfig(**common, head_dim=H // HEADS), t.GemmaForCausalLM
        elif case.family == "gemma2":  # soft-capped attention and logits
            cfg, cls = (
                t.Gemma2Config(**common, head_dim=H // HEADS, query_pre_attn_scalar=16),
                t.Gemma2ForCausalLM,
            )
        else:  # per-head q/k norms, sliding and full attention layers
            cfg = t.Gemma3TextConfig(
                **common, head_dim=H // HEADS, query_pre_attn_scalar=16, sliding_window=4
            )
            cls = t.Gemma3ForCausalLM
    else:
        raise ValueError(case.family)
    for key, value in overrides.items():  # the error tests' bad values
        setattr(cfg, key, value)
    torch.manual_seed(0)
    model = cls(cfg)
    # Hugging Face initialises biases and norms to constants: random ones make a wrongly split bias visible, and
    # give the parameter comparison a scale (a zero bias moved by one Adam step is all rounding).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.02)
    return model


def _close_grads(actual: dict, expected: dict, name: str) -> None:
    """`_close`, except for gradients that are zero in exact arithmetic (a key projection's bias: softmax ignores
    a constant added to every score of a query), which hold only rounding of the terms that cancel; those must
    stay below a millionth of the model's largest gradient on both sides."""
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    bound = 1e-6 * max(float(g.abs().max()) for g in expected.values())
    zero = {k for k, g in expected.items() if float(g.abs().max()) < bound}
    for k in zero:
        assert float(actual[k].abs().max()) < bound, f"{name} grad {k}: {actual[k]} is not ~0"
    rest = expected.keys() - zero
    _close({k: actual[k] for k in rest}, {k: expected[k] for k in rest}, f"{name} grad")


def _check_state_blocks(model, ref, case: Case) -> None:
    """The state protocol: every block a rank reports is exactly its cut of the unsharded tensor (the Conv1D
    layers' blocks in their (in, out) orientation); a fused projection reports its rank's row blocks as a list."""
    full = ref.state_dict()
    blocks = sharded_state_dict(model)
    assert blocks.keys() == full.keys()
    for key, entry in blocks.items():
        # [q | k | v]: this rank's heads of each (Falcon multi_query's one k and v head on every rank)
        fused = (case.family == "gpt2" and ".c_attn." in key) or (
            case.variant == "multi_query" and ".query_key_value." in key
        )
        assert isinstance(entry, list) == fused, (key, entry)
        for local, spec in entry if fused else [entry]:
            assert spec.global_shape == tuple(full[key].shape), (key, spec)
            assert torch.equal(local, spec.cut(full[key])), key


def _train(case: Case) -> None:
    ref = _tiny(case)
    config = ShardConfig(parallel_output=case.parallel_output, enable_all_optimization=case.kernels)
    model, shared = ShardFormer(config).optimize(copy.deepcopy(ref))
    assert shared == []
    _check_state_blocks(model, ref, case)
    assert set(model.state_dict()) == set(ref.state_dict())  # the Hugging Face keys
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == case.tie
    # Sharded for real: four projections per layer, the embedding and the lm_head became parallel layers.
    assert sum(isinstance(m, ParallelModule) for m in model.modules()) >= 4 * LAYERS + 2
    # Attention dropout draws from the tp group's per-rank stream (a no-op here: dropout is 0).
    assert sum(hasattr(m, "_cai_rng_fork") for m in model.modules()) == LAYERS
    # eps=1e-4 as in test_policies.py: Adam amplifies rounding of near-zero gradients by lr / eps.
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    ref.train()
    model.train()
    gathered_logits = (
        getattr(ref.config, "final_logit_softcapping", None) is not None or not case.parallel_output
    )
    g = torch.Generator().manual_seed(5)
    for step in range(5):
        ids = torch.randint(0, VOCAB, (B, S), generator=g)
        labels = ids.clone()
        labels[0, :2] = -100
        ref_out = ref(input_ids=ids, labels=labels)
        ref_out.loss.backward()
        out = model(input_ids=ids, labels=labels)
        if gathered_logits:  # soft-capped (Gemma 2, 3) or parallel_output=False: the model's own loss
            assert out.logits.shape == (B, S, VOCAB)
        else:
            assert out.logits is None  # the vocab-parallel loss came from the hidden states
        out.loss.backward()
        assert_close(out.loss, ref_out.loss, rtol=1e-5, name=f"step {step} loss")
        if getattr(ref_out, "aux_loss", None) is not None:  # Mixtral's router load-balancing loss
            assert_close(out.aux_loss, ref_out.aux_loss, rtol=1e-5, name=f"step {step} aux loss")
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        _close_grads(gathered(model, grads=True), ref_grads, f"step {step}")
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
        # Parameters: an element whose gradient is at the level of rounding noise (~1e-7, sums that nearly
        # cancel) moves by lr * noise / eps = 1e-3 * 1e-7 / 1e-4 = 1e-6 per step, differently in the two runs
        # (test_encoders.py: the same floor; seen on Gemma 3's tied embedding at tp 4 on some CPUs).
        _close(gathered(model), dict(ref.named_parameters()), f"step {step} param", floor=2e-6)
    model.eval()
    ref.eval()
    with torch.no_grad():
        ids = torch.randint(0, VOCAB, (B, S), generator=g)
        assert_close(
            model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-6, name="logits"
        )


def _train_all(cases: list[Case]) -> None:
    for case in cases:
        try:
            _train(case)
        except Exception as e:
            raise AssertionError(f"case {case.name}: {type(e).__name__}: {e}") from e


CASES = {
    2: [
        Case("gpt2"), Case("gpt2", tie=True), Case("gemma", tie=True), Case("gemma"), Case("gemma2", tie=True),
        Case("gemma3", tie=True), Case("mixtral"), Case("mixtral", tie=True), Case("opt", tie=True), Case("opt"),
        Case("gptj"), Case("gptj", tie=True, parallel_output=False), Case("bloom"), Case("bloom", tie=True),
        Case("falcon", tie=True, variant="multi_query"), Case("falcon", variant="new_arch"),
        Case("falcon", tie=True, variant="mha"), Case("falcon", variant="mha_alibi"),
        Case("gpt2", kernels=True), Case("gemma2", tie=True, kernels=True), Case("mixtral", kernels=True),
        Case("opt", kernels=True), Case("bloom", kernels=True), Case("falcon", variant="new_arch", kernels=True),
    ],
    4: [
        Case("gpt2", tie=True), Case("gemma", tie=True), Case("gemma3", tie=True), Case("mixtral"),
        Case("opt", tie=True), Case("gptj"), Case("bloom", tie=True), Case("falcon", tie=True, variant="multi_query"),
        Case("falcon", variant="new_arch", kv_heads=4), Case("falcon", tie=True, variant="mha_alibi_eager"),
    ],
}  # fmt: skip


@pytest.mark.parametrize("tp", sorted(CASES))
def test_families_train_like_unsharded(tp):
    run_distributed(_train_all, tp, CASES[tp], timeout=600)


def _base_models(cases: list[Case]) -> None:
    """The decoder stacks alone (`GPT2Model`, `OPTModel`, ...: their own policies, no lm_head): hidden states and
    gradients of one forward and backward as unsharded."""
    for case in cases:
        ref = _tiny(case).base_model
        model, _ = ShardFormer(ShardConfig()).optimize(copy.deepcopy(ref))
        ids = torch.randint(0, VOCAB, (B, S))
        out, ref_out = model(input_ids=ids).last_hidden_state, ref(input_ids=ids).last_hidden_state
        assert_close(out, ref_out, rtol=1e-5, atol=1e-6, name=f"{type(ref).__name__} hidden states")
        out.square().mean().backward()
        ref_out.square().mean().backward()
        _close_grads(
            gathered(model, grads=True), {n: p.grad for n, p in ref.named_parameters()}, type(ref).__name__
        )


def test_decoder_stacks_match_unsharded():
    stacks = [Case(f) for f in ("gpt2", "gemma", "mixtral", "opt", "gptj", "bloom")]
    run_distributed(_base_models, 2, [*stacks, Case("falcon", variant="new_arch")])


def _count() -> tuple[list, list]:
    model, _ = ShardFormer(ShardConfig()).optimize(_tiny(Case("gpt2")))
    model.train()
    ids = torch.randint(0, VOCAB, (B, S))
    with CollectiveCounter() as fwd:
        loss = model(input_ids=ids, labels=ids).loss
    with CollectiveCounter() as bwd:
        loss.backward()
    return fwd.events, bwd.events


def test_gpt2_collectives_per_layer_are_megatrons():
    """GPT-2's fused c_attn and Conv1D layers keep Megatron's count: two all-reduces of b x s x h per layer forward
    (attention and MLP outputs) and two backward (their inputs), plus the embedding's and the loss's."""
    tp = 2
    fwd, bwd = run_distributed(_count, tp)[0]
    act = B * S * H * 4
    fwd_act = [e for e in fwd if e.op == "all_reduce" and e.nbytes == act]
    assert len(fwd_act) == 2 * LAYERS + 2  # 2 per layer + embedding + the loss's hidden gradient
    assert sorted(e.nbytes for e in fwd if e.nbytes != act) == sorted([8, B * S * 4, 3 * B * S * 4])
    assert {e.op for e in fwd} == {"all_reduce"}
    assert [(e.op, e.nbytes) for e in bwd] == [("all_reduce", act)] * (2 * LAYERS)


# kind -> (case, config overrides, expected error type or None, fragments of the message), all at tp 4
ERRORS = {
    "gpt2_heads": (Case("gpt2"), {"n_head": 2}, "ValueError", ["GPT2LMHeadModel", "n_head=2", "tensor_parallel_size=4"]),
    "gpt2_cross_attention": (Case("gpt2"), {"add_cross_attention": True}, "NotImplementedError", ["add_cross_attention=True", "policy="]),
    "opt_ffn": (Case("opt"), {"ffn_dim": 130}, "ValueError", ["ffn_dim=130", "tensor_parallel_size=4"]),
    "bloom_slow_but_exact": (Case("bloom"), {"pretraining_tp": 2, "slow_but_exact": True}, "NotImplementedError", ["slow_but_exact=True", "pretraining_tp=2"]),
    "falcon_kv_groups": (Case("falcon", variant="new_arch"), {}, "ValueError", ["num_kv_heads", "=2", "tensor_parallel_size=4"]),
    "gemma_vocab": (Case("gemma"), {}, "ValueError", ["251", "tp=4", "make_vocab_size_divisible_by"]),
    # The experts stay replicated: an intermediate size that does not divide by tp is no error.
    "mixtral_intermediate": (Case("mixtral"), {"intermediate_size": 130}, None, []),
}  # fmt: skip


def _errors() -> dict:
    # No rank leaves before every rank has joined the group (as test_policies.py's error test).
    dist.barrier()
    out = {}
    for kind, (case, overrides, _, _) in ERRORS.items():
        padding = None if kind == "gemma_vocab" else 64
        try:
            ShardFormer(ShardConfig(make_vocab_size_divisible_by=padding)).optimize(_tiny(case, **overrides))
            out[kind] = None
        except (ValueError, NotImplementedError) as e:
            out[kind] = (type(e).__name__, str(e))
    return out


def test_family_configuration_errors_name_the_values():
    got = run_distributed(_errors, 4)[0]
    for kind, (_, _, want_type, fragments) in ERRORS.items():
        if want_type is None:
            assert got[kind] is None, (kind, got[kind])
            continue
        assert got[kind] is not None, f"{kind}: no error raised"
        assert got[kind][0] == want_type, (kind, got[kind])
        for f in fragments:
            assert f in got[kind][1], (kind, f, got[kind][1])
