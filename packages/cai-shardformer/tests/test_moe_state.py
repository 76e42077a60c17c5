"""The state protocol of an expert-parallel model: cai-ckpt saves the Hugging Face layout (experts by global index)
from ep=2 shards, and it loads back into a fresh ep=2 model, into one process and through `from_pretrained`."""

import importlib.util
import pathlib

import torch
import transformers

import cai.ckpt as ckpt
from cai.mesh.testing import assert_close, run_distributed
from cai.shardformer import ExpertParallelExperts, ShardConfig, ShardFormer

# The tiny MoE models of the expert-parallel parity tests.
_spec = importlib.util.spec_from_file_location(
    "_shardformer_moe_tests", pathlib.Path(__file__).with_name("test_moe.py")
)
_moe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_moe)


def _gathered(model) -> dict:
    out = {}
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            full = (
                module.full_tensor(pname) if isinstance(module, ExpertParallelExperts) else p.detach().clone()
            )
            out[f"{mname}.{pname}"] = full
    return out


def _save_and_reload(path: str):
    cfg = ShardConfig(enable_tensor_parallelism=False, ep_group=torch.distributed.group.WORLD)
    model, _ = ShardFormer(cfg).optimize(_moe._tiny("mixtral"))
    # One step, so the saved weights differ from any fresh initialisation.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, _moe.VOCAB, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    ckpt.save_model(model, path)
    saved = _gathered(model)
    assert saved["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == _moe.EXPERTS
    torch.manual_seed(123)
    other = _moe._tiny("mixtral")
    for p in other.parameters():
        torch.nn.init.normal_(p, std=0.5)
    other, _ = ShardFormer(cfg).optimize(other)
    ckpt.load_model(other, path)
    assert_close(_gathered(other), saved, name="ep2 -> ep2")
    return saved


def test_ep2_checkpoint_loads_in_one_process_and_from_pretrained(tmp_path):
    path = str(tmp_path / "model")
    saved = run_distributed(_save_and_reload, 2, path, timeout=300)[0]
    single = _moe._tiny("mixtral")
    ckpt.load_model(single, path)
    assert_close(dict(single.named_parameters()), saved, name="ep2 -> one process")
    hf = transformers.MixtralForCausalLM.from_pretrained(path)
    assert_close(dict(hf.named_parameters()), saved, name="ep2 -> from_pretrained")
