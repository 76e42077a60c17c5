"""A cai policy exported as a torch `parallelize_module` plan: applied by torch on gloo at tp=2 it trains a tiny
Llama exactly as one process does; what torch's styles cannot express is refused. Also the plain-torch
`shard_model` with a process group."""

import copy
import importlib.util
import pathlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from cai.mesh.testing import assert_close, run_distributed
from cai.shardformer import shard_model, tp_plan

_spec = importlib.util.spec_from_file_location(
    "_shardformer_policy_tests", pathlib.Path(__file__).with_name("test_policies.py")
)
_tp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tp)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


def _torch_tp_matches_one_process():
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    ref = _tp._tiny("llama")
    model = copy.deepcopy(ref)
    plan = tp_plan(model, mesh)
    assert isinstance(plan["model.layers.1.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["model.layers.0.mlp.down_proj"], RowwiseParallel)
    assert isinstance(plan["model.embed_tokens"], RowwiseParallel)
    # q k v o gate up down and the attention and MLP input regions per layer, embedding, lm_head
    assert len(plan) == 9 * _tp.LAYERS + 2
    parallelize_module(model, mesh, plan)
    assert isinstance(model.model.layers[0].self_attn.k_proj.weight, DTensor)
    # Another way in on the same ranks: cai's own layers over a process group.
    cai_model = shard_model(copy.deepcopy(ref), dist.group.WORLD)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    g = torch.Generator().manual_seed(5)
    for step in range(3):
        ids = torch.randint(0, _tp.VOCAB, (_tp.B, _tp.S), generator=g)
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        with CommDebugMode() as fwd:
            loss = model(input_ids=ids, labels=ids).loss
        with CommDebugMode() as bwd:
            loss.backward()
        if step == 0:
            # Megatron's count under torch's collectives: 2 all-reduces per layer each way, plus the embedding's
            # forward, the lm_head's input gradient and its logits gathered.
            counts = [
                {str(op).split(".")[-1]: n for op, n in m.get_comm_counts().items()} for m in (fwd, bwd)
            ]
            n = 2 * _tp.LAYERS + 1
            assert counts == [{"all_reduce": n, "all_gather_into_tensor": 1}, {"all_reduce": n}], counts
        assert_close(_full(loss), ref_loss, rtol=1e-5, name=f"step {step} loss")
        if step == 0:
            cai_loss = cai_model(input_ids=ids, labels=ids).loss
            assert_close(cai_loss, ref_loss, rtol=1e-5, name="shard_model(process group) loss")
        grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        _tp._close(grads, {n: p.grad for n, p in ref.named_parameters()}, f"step {step} grad")
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
        params = {n: _full(p) for n, p in model.named_parameters()}
        _tp._close(params, dict(ref.named_parameters()), f"step {step} param")


def _refusals():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    out = {}
    for name, model in [
        ("replicated kv heads", _tp._tiny("llama", kv_heads=1)),
        ("tied", _tp._tiny("llama", tie=True)),
        ("per-head norms", _tp._tiny("qwen3")),
    ]:
        with pytest.raises(NotImplementedError) as err:
            tp_plan(model, mesh)
        out[name] = str(err.value)
    no_tp = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "x"))
    for fn in (tp_plan, shard_model):
        with pytest.raises(ValueError, match="has no 'tp' axis") as err:
            fn(_tp._tiny("llama"), no_tp)
        out[f"{fn.__name__} mesh"] = str(err.value)
    dist.barrier()
    return out


def test_exported_plan_trains_like_one_process_under_torch_tp():
    run_distributed(_torch_tp_matches_one_process, 2, timeout=300)
    errors = run_distributed(_refusals, 2)[0]
    assert "1 heads" in errors["replicated kv heads"] and "tp=2" in errors["replicated kv heads"]
    assert "tied" in errors["tied"]
    assert "parameter hooks" in errors["per-head norms"]
    assert "('dp', 'x')" in errors["tp_plan mesh"] and "('dp', 'x')" in errors["shard_model mesh"]
