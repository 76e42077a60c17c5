"""The state protocol of a tp model: cai-ckpt saves the Hugging Face layout from tp=2 shards, and it loads
back into one process (cai-ckpt and `from_pretrained`) and into a freshly sharded tp=2 model."""

import importlib.util
import pathlib

import torch
import transformers

import cai.ckpt as ckpt
from cai.mesh.testing import assert_close, run_distributed
from cai.shardformer import ShardConfig, ShardFormer

# The tiny models and the gathering helper of the policy tests.
_spec = importlib.util.spec_from_file_location(
    "_shardformer_policy_tests", pathlib.Path(__file__).with_name("test_policies.py")
)
_tp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tp)


def _save_and_reload(path: str):
    model = _tp._tiny("llama")
    model, _ = ShardFormer(ShardConfig()).optimize(model)
    # One step, so the saved weights differ from any fresh initialisation.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, _tp.VOCAB, (2, 8))
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    ckpt.save_model(model, path)
    saved = _tp.gathered(model)
    # Back into a tp=2 model built from other weights.
    torch.manual_seed(123)
    other = _tp._tiny("llama")
    for p in other.parameters():
        torch.nn.init.normal_(p, std=0.5)
    other, _ = ShardFormer(ShardConfig()).optimize(other)
    ckpt.load_model(other, path)
    assert_close(_tp.gathered(other), saved, name="tp2 -> tp2")
    return saved


def test_tp2_checkpoint_loads_in_one_process_and_from_pretrained(tmp_path):
    path = str(tmp_path / "model")
    saved = run_distributed(_save_and_reload, 2, path, timeout=300)[0]
    # Padding never reaches the files: the vocabulary rows are the model's 251.
    single = _tp._tiny("llama")
    ckpt.load_model(single, path)
    assert_close(dict(single.named_parameters()), saved, name="tp2 -> one process")
    hf = transformers.LlamaForCausalLM.from_pretrained(path)
    assert_close(dict(hf.named_parameters()), saved, name="tp2 -> from_pretrained")
    ids = torch.randint(0, _tp.VOCAB, (2, 8))
    with torch.no_grad():
        assert_close(hf(input_ids=ids).logits, single(input_ids=ids).logits, name="logits")
    assert hf.config.vocab_size == _tp.VOCAB
