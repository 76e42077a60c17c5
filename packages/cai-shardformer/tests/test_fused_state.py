"""Checkpoints of fused projections whose tp rank holds several row blocks of one tensor: GPT-2's `c_attn` (its
heads of q, of k and of v) and Falcon multi_query's `query_key_value` (its q heads, and the one k and v head that
every rank replicates). A tp=2 checkpoint holds the Hugging Face layout: it loads at tp=4, in one process and in
`from_pretrained`, with equal logits. Both families run in one spawn per world size."""

import importlib.util
import pathlib
import sys

import pytest
import torch

import cai.ckpt as ckpt
from cai.mesh.testing import assert_close, run_distributed
from cai.shardformer import ShardConfig, ShardFormer, sharded_state_dict, tp_model_state

_spec = importlib.util.spec_from_file_location(
    "_shardformer_family_tests", pathlib.Path(__file__).with_name("test_families.py")
)
_fam = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _fam  # its dataclasses look their module up while the class is built
_spec.loader.exec_module(_fam)

CASES = {
    "gpt2": _fam.Case("gpt2", tie=True),  # the tied lm_head is stored once
    "falcon_multi_query": _fam.Case("falcon", variant="multi_query"),
}
FUSED = {
    "gpt2": "transformer.h.0.attn.c_attn.weight",
    "falcon_multi_query": "transformer.h.0.self_attention.query_key_value.weight",
}
IDS = torch.arange(2 * 8).reshape(2, 8) * 13 % _fam.VOCAB  # the same tokens in every process


def _other_weights(case):
    """The family's tiny model with weights unlike every saved one, so a load that skips a block shows."""
    model = _fam._tiny(case)
    torch.manual_seed(123)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.1)
    return model


def _logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _save_tp2(paths: dict[str, str]) -> dict:
    out = {}
    for name, case in CASES.items():
        model, _ = ShardFormer(ShardConfig()).optimize(_fam._tiny(case))
        pieces = sharded_state_dict(model)[FUSED[name]]
        assert isinstance(pieces, list) and len(pieces) == 3, (name, pieces)  # [q; k; v] blocks of this rank
        # Under a flat optimizer shard (tp x ZeRO) a flat range of the local tensor would cross those blocks.
        with pytest.raises(NotImplementedError, match=f"{FUSED[name]}: a fused projection"):
            tp_model_state(model, None).sharded_state_dict()
        opt = torch.optim.AdamW(
            model.parameters(), lr=1e-2
        )  # one step: the saved weights are no initialisation
        model(input_ids=IDS, labels=IDS).loss.backward()
        opt.step()
        ckpt.save_model(model, paths[name])
        out[name] = (_fam.gathered(model), _logits(model))
    return out


def _load_tp4(paths: dict[str, str]) -> dict:
    out = {}
    for name, case in CASES.items():
        model, _ = ShardFormer(ShardConfig()).optimize(_other_weights(case))
        ckpt.load_model(model, paths[name])
        out[name] = (_fam.gathered(model), _logits(model))
    return out


def test_fused_projection_tp2_checkpoint_loads_at_tp4_one_process_and_from_pretrained(tmp_path):
    paths = {name: str(tmp_path / name) for name in CASES}
    saved = run_distributed(_save_tp2, 2, paths, timeout=300)[0]
    tp4 = run_distributed(_load_tp4, 4, paths, timeout=300)[0]
    for name, case in CASES.items():
        params, tp2_logits = saved[name]
        single = _other_weights(case)
        ckpt.load_model(single, paths[name])
        assert_close(dict(single.named_parameters()), params, name=f"{name}: tp2 -> one process")
        hf = type(single).from_pretrained(paths[name])
        assert hf.config.vocab_size == _fam.VOCAB  # no padding reached the files
        assert_close(dict(hf.named_parameters()), params, name=f"{name}: tp2 -> from_pretrained")
        logits = _logits(single)
        assert_close(_logits(hf), logits, rtol=1e-6, name=f"{name}: from_pretrained logits")
        assert_close(tp2_logits, logits, rtol=1e-5, atol=1e-6, name=f"{name}: tp2 logits")
        tp4_params, tp4_logits = tp4[name]
        assert_close(tp4_params, params, name=f"{name}: tp2 -> tp4")
        assert_close(tp4_logits, logits, rtol=1e-5, atol=1e-6, name=f"{name}: tp4 logits")
