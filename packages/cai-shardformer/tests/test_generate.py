"""Generation on a tp=2 Llama: greedy decoding with the KV cache gives the unsharded model's tokens, and the
logits of every decoding step match."""

import copy
import importlib.util
import pathlib

import torch

from cai.mesh.testing import assert_close, run_distributed
from cai.shardformer import ShardConfig, ShardFormer

_spec = importlib.util.spec_from_file_location(
    "_shardformer_policy_tests", pathlib.Path(__file__).with_name("test_policies.py")
)
_tp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tp)


def _generate():
    ref = _tp._tiny("llama")
    model, _ = ShardFormer(ShardConfig()).optimize(copy.deepcopy(ref))
    prompt = torch.randint(0, _tp.VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    kw = dict(
        max_new_tokens=12, do_sample=False, use_cache=True, return_dict_in_generate=True, output_logits=True,
        pad_token_id=0,
    )  # fmt: skip
    ref.eval()
    model.eval()
    with torch.no_grad():
        want = ref.generate(prompt, **kw)
        got = model.generate(prompt, **kw)
    assert got.past_key_values is not None and got.past_key_values.get_seq_length() == 5 + 12 - 1
    # The cache holds this rank's kv heads only: 2 kv heads over tp 2.
    assert got.past_key_values.layers[0].keys.shape[1] == 1
    assert torch.equal(got.sequences, want.sequences), (got.sequences, want.sequences)
    for step, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
        assert a.shape == (2, _tp.VOCAB)
        assert_close(a, b, rtol=1e-5, atol=1e-5, name=f"decode step {step} logits")
    return got.sequences


def test_greedy_generation_with_kv_cache_matches_unsharded():
    seqs = run_distributed(_generate, 2, timeout=300)
    assert torch.equal(seqs[0], seqs[1])
