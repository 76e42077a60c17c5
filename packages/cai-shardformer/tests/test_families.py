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
import transformers

from cai.mesh.testing import CollectiveCounter, assert_close, run_distributed
from cai.shardformer import ParallelModule, ShardConfig, ShardFormer

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
NO_DROPOUT = 0.0  # dropout masks differ per rank until the RNG tracker exists


@dataclass(frozen=True)
class Case:
    family: str
    tie: bool = False  # lm_head shares the embedding's weight
    variant: str = ""  # a family's alternative layout (Falcon's multi_query / new_decoder_architecture, ...)

    @property
    def name(self) -> str:
        return "-".join(filter(None, [self.family, self.variant, "tied" if self.tie else "untied"]))


def _tiny(case: Case):
    t = transformers
    tie = case.tie
    if case.family == "gpt2":
        cfg = t.GPT2Config(
            vocab_size=VOCAB, n_embd=H, n_layer=LAYERS, n_head=HEADS, n_inner=128, n_positions=64,
            resid_pdrop=NO_DROPOUT, embd_pdrop=NO_DROPOUT, attn_pdrop=NO_DROPOUT, tie_word_embeddings=tie,
        )  # fmt: skip
        cls = t.GPT2LMHeadModel
    else:
        raise ValueError(case.family)
    torch.manual_seed(0)
    model = cls(cfg)
    # Hugging Face initialises biases and norms to constants: random ones make a wrongly split bias visible, and
    # give the parameter comparison a scale (a zero bias moved by one Adam step is all rounding).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.02)
    return model


def _train(case: Case) -> None:
    ref = _tiny(case)
    model, shared = ShardFormer(ShardConfig()).optimize(copy.deepcopy(ref))
    assert shared == []
    assert set(model.state_dict()) == set(ref.state_dict())  # the Hugging Face keys
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == case.tie
    # Sharded for real: four projections per layer, the embedding and the lm_head became parallel layers.
    assert sum(isinstance(m, ParallelModule) for m in model.modules()) >= 4 * LAYERS + 2
    # eps=1e-4 as in test_policies.py: Adam amplifies rounding of near-zero gradients by lr / eps.
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    ref.train()
    model.train()
    g = torch.Generator().manual_seed(5)
    for step in range(5):
        ids = torch.randint(0, VOCAB, (B, S), generator=g)
        labels = ids.clone()
        labels[0, :2] = -100
        ref_out = ref(input_ids=ids, labels=labels)
        ref_out.loss.backward()
        out = model(input_ids=ids, labels=labels)
        assert out.logits is None  # the vocab-parallel loss came from the hidden states
        out.loss.backward()
        assert_close(out.loss, ref_out.loss, rtol=1e-5, name=f"step {step} loss")
        _close(
            gathered(model, grads=True), {n: p.grad for n, p in ref.named_parameters()}, f"step {step} grad"
        )
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
        _close(gathered(model), dict(ref.named_parameters()), f"step {step} param")
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
    2: [Case("gpt2"), Case("gpt2", tie=True)],
    4: [Case("gpt2", tie=True)],
}


@pytest.mark.parametrize("tp", sorted(CASES))
def test_families_train_like_unsharded(tp):
    run_distributed(_train_all, tp, CASES[tp], timeout=600)


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
