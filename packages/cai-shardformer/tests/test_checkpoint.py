"""Checkpoint round trips of tp models through cai-ckpt: a tp=2 checkpoint loads at tp=4 (with replicated kv
heads), in one process and in `from_pretrained` with equal logits; tp=2 with cai-zero's fp32 masters and Adam
state sharded over the data-parallel axis of a 2 x 2 mesh saves the same Hugging Face layout and loads back, and one
process resumes from it; and a tied embedding under tp=2 with masters is stored once, both ways."""

import importlib.util
import pathlib

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh

import cai.ckpt as ckpt
from cai.mesh.testing import assert_close, run_distributed
from cai.shardformer import ShardConfig, ShardFormer, shard_model, tp_model_state, tp_optimizer_state
from cai.zero import ZeroOptimizer

_spec = importlib.util.spec_from_file_location(
    "_shardformer_policy_tests", pathlib.Path(__file__).with_name("test_policies.py")
)
_tp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tp)

IDS = torch.arange(2 * 8).reshape(2, 8) * 13 % _tp.VOCAB  # the same tokens in every process


def _other_weights(tie: bool = False):
    """A tiny Llama whose weights differ from every saved one, so a load that skips a tensor shows."""
    torch.manual_seed(123)
    model = _tp._tiny("llama", tie=tie)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.5)
    return model


def _save_tp2(path: str):
    model, _ = ShardFormer(ShardConfig()).optimize(_tp._tiny("llama"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # one step: the saved weights are no initialisation
    model(input_ids=IDS, labels=IDS).loss.backward()
    opt.step()
    ckpt.save_model(model, path)
    return _tp.gathered(model)


def _load_tp4(path: str):
    model, _ = ShardFormer(ShardConfig()).optimize(_other_weights())  # 2 kv heads on 4 ranks: replicated
    ckpt.load_model(model, path)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    return _tp.gathered(model), logits


def _one_process_and_from_pretrained(path: str, saved: dict) -> torch.Tensor:
    single = _other_weights()
    ckpt.load_model(single, path)
    assert_close(dict(single.named_parameters()), saved, name="-> one process")
    hf = transformers.LlamaForCausalLM.from_pretrained(path)
    assert hf.config.vocab_size == _tp.VOCAB  # no padding reached the files
    assert_close(dict(hf.named_parameters()), saved, name="-> from_pretrained")
    single.eval()
    with torch.no_grad():
        logits = single(input_ids=IDS).logits
        assert_close(hf(input_ids=IDS).logits, logits, rtol=1e-6, name="from_pretrained logits")
    return logits


def test_tp2_checkpoint_loads_at_tp4_in_one_process_and_from_pretrained(tmp_path):
    path = str(tmp_path / "model")
    saved = run_distributed(_save_tp2, 2, path, timeout=300)[0]
    gathered, tp4_logits = run_distributed(_load_tp4, 4, path, timeout=300)[0]
    assert_close(gathered, saved, name="tp2 -> tp4")
    logits = _one_process_and_from_pretrained(path, saved)
    assert_close(tp4_logits, logits, rtol=1e-5, atol=1e-6, name="tp4 logits")


def _zero_tp(model):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    shard_model(model, mesh)
    opt = ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), model=model, group=mesh["dp"].get_group()
    )
    return mesh, opt


def _save_and_reload_under_zero(path: str):
    model = _tp._tiny("llama")
    mesh, opt = _zero_tp(model)
    half = IDS[mesh["dp"].get_local_rank()].unsqueeze(0)  # each dp rank its own sample
    opt.backward(model(input_ids=half, labels=half).loss)
    opt.step()
    opt.zero_grad()
    state = tp_model_state(model, opt)
    # The vocabulary padding (251 rows padded to 256 at tp 2: 5 rows on tp rank 1) is never reported: the one
    # rank whose master window holds the end of tp rank 1's lm_head reports a range cut at the last real row.
    masters = opt.model_sharded_state_dict()
    cut = False
    if "lm_head.weight" in masters:
        head = state.sharded_state_dict().get("lm_head.weight")
        assert head is None or head.spec.global_shape == (_tp.VOCAB, _tp.H)
        cut = head is None or head.spec.flat_range[1] < masters["lm_head.weight"].spec.flat_range[1]
    cuts = [None] * 4
    dist.all_gather_object(cuts, cut)
    assert sum(cuts) == 1, cuts
    ckpt.save_model(state, path, config=model.config)
    ckpt.save_optimizer(tp_optimizer_state(model, opt), path + "-optim")
    saved = _tp.gathered(model)
    other = _other_weights()
    _, other_opt = _zero_tp(other)
    ckpt.load_model(tp_model_state(other, other_opt), path)
    ckpt.load_optimizer(tp_optimizer_state(other, other_opt), path + "-optim")
    assert_close(_tp.gathered(other), saved, name="tp2 x zero -> tp2 x zero")
    # The next step from the loaded state (Adam moments and step count included) equals the original's.
    for o, m in ((opt, model), (other_opt, other)):
        o.backward(m(input_ids=half, labels=half).loss)
        o.step()
        o.zero_grad()
    after = _tp.gathered(model)
    assert_close(_tp.gathered(other), after, name="the step after loading")
    dist.barrier()
    return saved, after


def test_tp2_under_zero_saves_hf_layout_and_loads_back(tmp_path):
    path = str(tmp_path / "model")
    saved, after = run_distributed(_save_and_reload_under_zero, 4, path, timeout=300)[0]
    _one_process_and_from_pretrained(path, saved)
    # One process resumes from the tp x ZeRO checkpoint: its step on the whole batch (the two dp samples) is the
    # sharded step.
    single = _other_weights()
    ckpt.load_model(single, path)
    opt = torch.optim.AdamW(single.parameters(), lr=1e-2)
    ckpt.load_optimizer(opt, path + "-optim", model=single)
    single(input_ids=IDS, labels=IDS).loss.backward()
    opt.step()
    _tp._close(dict(single.named_parameters()), after, "one process resumed")


def _tied_tp2_under_zero(path: str, pretrained: str):
    """tp 2 with tied embeddings and cai-zero's masters (dp 1): save, then load `pretrained`, which stores the tied
    weight once with no aliases (as `save_pretrained` writes it)."""
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))

    def build(model):
        shard_model(model, mesh)
        opt = ZeroOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2), model=model, group=mesh["dp"].get_group()
        )
        return model, opt

    model, opt = build(_tp._tiny("llama", tie=True))
    opt.backward(model(input_ids=IDS, labels=IDS).loss)
    opt.step()
    ckpt.save_model(tp_model_state(model, opt), path, config=model.config)
    other, other_opt = build(_other_weights(tie=True))
    ckpt.load_model(tp_model_state(other, other_opt), pretrained)
    assert other.lm_head.weight is other.model.embed_tokens.weight
    return _tp.gathered(model), _tp.gathered(other)


def test_tied_embedding_under_tp_masters_is_stored_once_both_ways(tmp_path):
    path, pretrained = str(tmp_path / "model"), str(tmp_path / "pretrained")
    reference = _other_weights(tie=True)
    reference.save_pretrained(pretrained)
    saved, loaded = run_distributed(_tied_tp2_under_zero, 2, path, pretrained, timeout=300)[0]
    assert_close(loaded, dict(reference.named_parameters()), rtol=0, atol=0, name="save_pretrained -> tp2")
    index = ckpt.CheckpointReader(path)
    assert "lm_head.weight" not in index.weight_map
    assert index.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    single = _other_weights(tie=True)
    ckpt.load_model(single, path)
    assert_close(dict(single.named_parameters()), saved, rtol=0, atol=0, name="tp2 -> one process")
