"""A model saved by cai-ckpt loads with ``transformers`` ``from_pretrained`` as is, and back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import cai.ckpt as ck
from cai.mesh.testing import run_distributed

transformers = pytest.importorskip("transformers")


def tiny_llama(tie: bool, seed: int = 0):
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).float().eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_from_pretrained_gives_identical_logits(tmp_path, tie):
    model = tiny_llama(tie)
    ck.save_model(model, tmp_path / "m", size_per_shard=0.02)  # several shards, config.json from model.config
    assert len(list((tmp_path / "m").glob("model-*-of-*.safetensors"))) > 1
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m").float().eval()
    assert type(loaded) is type(model)
    with torch.no_grad():
        assert torch.equal(loaded(_ids()).logits, model(_ids()).logits)
    if tie:
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_bf16_export_and_hf_directory_back_into_cai(tmp_path):
    model = tiny_llama(False)
    ck.save_model(model, tmp_path / "bf16", dtype=torch.bfloat16)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    for (n, p), q in zip(model.named_parameters(), loaded.parameters()):
        assert torch.equal(p.to(torch.bfloat16), q), n
    # the reverse direction: a directory written by save_pretrained loads with cai-ckpt
    model.save_pretrained(tmp_path / "hf")
    back = tiny_llama(False, seed=3)
    ck.load_model(back, tmp_path / "hf", verify=True)
    with torch.no_grad():
        assert torch.equal(back(_ids()).logits, model(_ids()).logits)


def _save_from_zero(path: str) -> torch.Tensor:
    from cai.zero import ZeroConfig, ZeroOptimizer

    model = tiny_llama(True)
    opt = ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        model=model,
        config=ZeroConfig(stage=2, bucket_size_mb=0.01),
    )
    for s in range(2):
        ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(s))
        opt.backward(model(ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()

    class View:
        sharded_state_dict = opt.model_sharded_state_dict

    ck.save_model(View(), path, config=model.config, size_per_shard=0.02)
    with torch.no_grad():
        return model(_ids()).logits


def test_zero_sharded_save_loads_with_from_pretrained(tmp_path: Path):
    logits = run_distributed(_save_from_zero, 2, str(tmp_path / "z"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "z").float().eval()
    with torch.no_grad():
        assert torch.equal(loaded(_ids()).logits, logits[0])
