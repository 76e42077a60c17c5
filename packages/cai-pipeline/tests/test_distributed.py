"""Stages on gloo ranks: the stage manager's coordinates, training with tied embeddings across the first and last
stage (one set of values, equal to the one-process model after every step) under the 1F1B, interleaved and V
layouts, and checkpoints: pp2 saves the Hugging Face layout, which loads at pp4, in one process and in
``from_pretrained``."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import transformers

import cai.ckpt as ckpt
from cai.mesh import ParallelDims
from cai.mesh.testing import assert_close, run_distributed
from cai.pipeline import LocalState, PipelineStageManager, build_stages, split_model
from cai.pipeline._manager import slot_of

# The tiny models and batches of the one-process tests.
_spec = importlib.util.spec_from_file_location(
    "_pipeline_stage_tests", pathlib.Path(__file__).with_name("test_stages.py")
)
_st = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _st  # its dataclasses look their module up while being created
_spec.loader.exec_module(_st)

STEPS = 3
LR = 0.05


@dataclass(frozen=True)
class Layout:
    name: str
    chunks: int = 1
    zbv: bool = False


LAYOUTS = (Layout("1f1b"), Layout("interleaved", 2), Layout("v", 2, True))


def _manager(mesh, layout: Layout) -> PipelineStageManager:
    return PipelineStageManager(
        mesh, "pp", enable_interleave=layout.chunks > 1, num_model_chunks=layout.chunks, use_zbv=layout.zbv
    )


def _step(model, manager: PipelineStageManager, batch: dict) -> float | None:
    """One micro-batch through every slot in order and back, with blocking sends between ranks (the schedules'
    job; here only to drive the stages). Returns the loss on the rank of the last slot."""
    S, C = manager.num_stages, manager.num_model_chunks
    owner = {slot_of(r, c, S, C, manager.use_zbv): (r, c) for r in range(S) for c in range(C)}
    ranks = manager.pg_mesh.ranks("pp")
    me, n = manager.stage, S * C
    ins, outs, loss = {}, {}, None
    for s in range(n):
        r, c = owner[s]
        if r != me:
            continue
        hidden = None
        if s > 0:
            prev = owner[s - 1][0]
            if prev == me:
                x = outs[s - 1]["hidden_states"].detach()
            else:
                x = torch.empty(*batch["input_ids"].shape, model.config.hidden_size)
                dist.recv(x, src=ranks[prev])
            ins[s] = x.requires_grad_()
            hidden = {"hidden_states": x}
        outs[s] = model.chunks[c](hidden, batch)
        if s == n - 1:
            loss = outs[s]["loss"]
        elif owner[s + 1][0] != me:
            dist.send(outs[s]["hidden_states"].detach().contiguous(), dst=ranks[owner[s + 1][0]])
    for s in reversed(range(n)):
        r, c = owner[s]
        if r != me:
            continue
        if s == n - 1:
            loss.backward()
        else:
            nxt = owner[s + 1][0]
            if nxt == me:
                grad = ins[s + 1].grad
            else:
                grad = torch.empty_like(outs[s]["hidden_states"])
                dist.recv(grad, src=ranks[nxt])
            outs[s]["hidden_states"].backward(grad)
        if s > 0 and owner[s - 1][0] != me:
            dist.send(ins[s].grad.contiguous(), dst=ranks[owner[s - 1][0]])
    return None if loss is None else loss.item()


def _train(family: str, tie: bool, mesh, layout: Layout) -> dict:
    torch.manual_seed(0)
    model, lay = _st.tiny(family, tie)
    manager = _manager(mesh, layout)
    pm = build_stages(model, manager, layout=lay)
    opt = torch.optim.SGD([p for _, p in pm.global_named_parameters()], lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        losses.append(_step(pm, manager, _st.batch_for(step)))
        pm.sync_shared_params()
        opt.step()
    params = {}
    for chunk in pm.chunks:
        for name, p in chunk.global_named_parameters():
            params[f"slot{chunk.slot}:{name}"] = p.detach().clone()
    return {"losses": losses, "params": params}


def _reference(family: str, tie: bool) -> dict:
    torch.manual_seed(0)
    model, _ = _st.tiny(family, tie)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(**_st.batch_for(step)).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": dict(model.named_parameters(remove_duplicate=False))}


ONE_F_ONE_B, INTERLEAVED, V = LAYOUTS
# The schedules' own tests train Llama under 1F1B and interleaved; these add the V layout (the tied weight shared by
# rank 0's two chunks) and GPT-2 (position embeddings on the first stage only).
TRAIN_CASES = [
    ("llama", True, ONE_F_ONE_B),
    ("llama", True, INTERLEAVED),
    ("llama", True, V),
    ("llama", False, V),
    ("gpt2", True, INTERLEAVED),
    ("gpt2", False, ONE_F_ONE_B),
]
DP_CASES = [("llama", True, ONE_F_ONE_B)]


def _train_matrix(pp: int, dp: int) -> list[dict]:
    mesh = ParallelDims(pp=pp, dp=dp).build_mesh()
    cases = TRAIN_CASES if dp == 1 else DP_CASES
    return [_train(f, t, mesh, lay) for f, t, lay in cases]


def _check_training(results: list[list[dict]], cases, pp: int) -> None:
    for i, (family, tie, layout) in enumerate(cases):
        ref = _reference(family, tie)
        where = f"{family} tied={tie} {layout.name} pp{pp}"
        merged: dict[str, torch.Tensor] = {}
        losses = None
        for rank_results in results:
            r = rank_results[i]
            merged.update(r["params"])
            if r["losses"][0] is not None:
                losses = r["losses"]
        assert losses == pytest.approx(ref["losses"], rel=1e-5), where
        seen = set()
        for key, value in merged.items():
            name = key.split(":", 1)[1]
            seen.add(name)
            assert_close(value, ref["params"][name], rtol=1e-5, atol=1e-6, name=f"{where} {key}")
        assert seen == set(ref["params"]) or (tie and seen | {"lm_head.weight"} == set(ref["params"])), where
        if tie and not layout.zbv:
            # One set of values: the head's copy on the last stage equals the embedding on the first.
            embed = "transformer.wte.weight" if family == "gpt2" else "model.embed_tokens.weight"
            first = merged[f"slot0:{embed}"]
            last = merged[f"slot{pp * layout.chunks - 1}:lm_head.weight"]
            assert torch.equal(first, last), where


def test_training_with_tied_embeddings_matches_one_process() -> None:
    results = run_distributed(_train_matrix, 2, 2, 1, timeout=300)
    _check_training(results, TRAIN_CASES, 2)


def test_tied_embeddings_with_data_parallel_replicas() -> None:
    # pp 2 x dp 2: each data-parallel replica sums its tied gradients over its own first-last group.
    results = run_distributed(_train_matrix, 4, 2, 2, timeout=300)
    _check_training(results, DP_CASES, 2)


def _save(cases: list[tuple[str, bool]]) -> None:
    mesh = ParallelDims(pp=2).build_mesh()
    manager = PipelineStageManager(mesh, "pp")
    for path, tie in cases:
        torch.manual_seed(7)
        model, _ = _st.tiny("llama", tie)
        ckpt.save_model(
            build_stages(model, manager), path, size_per_shard=0.01
        )  # several files: each rank writes some


def _load_pp4(cases: list[tuple[str, bool]]) -> list[dict]:
    mesh = ParallelDims(pp=4).build_mesh()
    manager = PipelineStageManager(mesh, "pp")
    assert manager.stage == dist.get_rank() and manager.prev_rank == (dist.get_rank() - 1) % 4
    out = []
    for path, tie in cases:
        torch.manual_seed(99)  # other weights than the saved ones
        model, _ = _st.tiny("llama", tie)
        pm = build_stages(model, manager)
        ckpt.load_model(pm, path)
        out.append({k: s.tensor.clone() for k, s in pm.sharded_state_dict().items()})
        if tie and manager.is_last_stage():
            out[-1]["lm_head.weight (copy)"] = pm.chunks[0].module.lm_head.weight.detach().clone()
    return out


def test_checkpoint_pp2_loads_at_pp4_in_one_process_and_from_pretrained(tmp_path) -> None:
    cases = [(str(tmp_path / "tied"), True), (str(tmp_path / "untied"), False)]
    run_distributed(_save, 2, cases)
    per_rank = run_distributed(_load_pp4, 4, cases, timeout=300)
    for i, (path, tie) in enumerate(cases):
        torch.manual_seed(7)
        saved, _ = _st.tiny("llama", tie)
        expected = saved.state_dict()
        # The Hugging Face layout: global layer indices, a tied weight stored once.
        index = ckpt.CheckpointReader(pathlib.Path(path), index_name="model.safetensors.index.json").names()
        assert {n for n in expected if not (tie and n == "lm_head.weight")} <= set(index)
        assert "model.layers.3.mlp.up_proj.weight" in index
        # pp4: every rank holds its layers under their full names, with the saved values.
        loaded: dict[str, torch.Tensor] = {}
        for rank_out in per_rank:
            loaded.update(rank_out[i])
        if tie:
            assert_close(loaded.pop("lm_head.weight (copy)"), expected["model.embed_tokens.weight"])
        assert set(loaded) == {n for n in expected if not (tie and n == "lm_head.weight")}
        assert_close(loaded, {n: expected[n] for n in loaded}, rtol=0, atol=0, name=f"pp4 {path}")
        # One process, through cai-ckpt and through from_pretrained.
        torch.manual_seed(99)
        one, _ = _st.tiny("llama", tie)
        ckpt.load_model(one, path)
        assert_close(one.state_dict(), expected, rtol=0, atol=0, name=f"one process {path}")
        hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        assert_close(hf.state_dict(), expected, rtol=0, atol=0, name=f"from_pretrained {path}")
        batch = _st.batch_for()
        assert_close(hf(**batch).logits, saved(**batch).logits, rtol=1e-6)


def _tp_pp_save(path: str) -> tuple[float, float]:
    from cai.shardformer import ShardConfig, ShardFormer, load_sharded_state_dict, sharded_state_dict

    mesh = ParallelDims(pp=2, tp=2).build_mesh()
    torch.manual_seed(7)
    model, _ = _st.tiny("llama", True)
    batch = _st.batch_for()
    expected = model(**batch).loss.item()
    sharded, _ = ShardFormer(ShardConfig(tensor_parallel_process_group=mesh.group("tp"))).optimize(model)
    sharded.eval()
    # The tp model's two stages composed on this rank give the unsharded loss.
    first, last = (split_model(sharded, slot=s, num_slots=2) for s in range(2))
    got = last(first(None, batch), batch)["loss"].item()
    state = LocalState(sharded_state_dict, load_sharded_state_dict)
    pm = build_stages(sharded, PipelineStageManager(mesh, "pp"), local_state=state)
    ckpt.save_model(pm, path)  # each rank's tp block of its stage's tensors
    return expected, got


def test_tp2_pp2_stages_save_the_hugging_face_layout(tmp_path) -> None:
    path = str(tmp_path / "tp2pp2")
    for expected, got in run_distributed(_tp_pp_save, 4, path, timeout=300):
        assert got == pytest.approx(expected, rel=1e-6)
    torch.manual_seed(7)
    saved, _ = _st.tiny("llama", True)
    torch.manual_seed(99)
    one, _ = _st.tiny("llama", True)
    ckpt.load_model(one, path)
    assert_close(one.state_dict(), saved.state_dict(), rtol=0, atol=0, name="tp2 x pp2 -> one process")


def _manager_checks() -> dict:
    out = {}
    mesh = ParallelDims(pp=4).build_mesh()
    m = PipelineStageManager(mesh, "pp", enable_interleave=True, num_model_chunks=2)
    out["interleaved"] = (
        m.stage_indices,
        m.get_stage_index(m.distribute_layers(16)),
        m.next_rank,
        m.prev_rank,
    )
    v = PipelineStageManager(mesh, "pp", enable_interleave=True, num_model_chunks=2, use_zbv=True)
    firsts = []
    for c in range(2):
        with v.switch_model_chunk_id(c):
            firsts.append((v.is_first_stage(), v.is_last_stage()))
    out["v"] = (v.stage_indices, firsts, v.is_last_stage(ignore_chunk=True))
    mesh2 = ParallelDims(pp=2, dp=2).build_mesh()
    m2 = PipelineStageManager(mesh2, "pp")
    group = m2.init_process_group_by_stages([0, 1])
    out["pp2dp2"] = (m2.stage, mesh2.ranks("pp"), dist.get_process_group_ranks(group))
    return out


def test_manager_on_a_mesh() -> None:
    res = run_distributed(_manager_checks, 4)
    # Interleaved: chunk c of rank r holds slot c*4 + r; 16 layers over 8 slots, 2 each.
    for r in range(4):
        slots, ranges, nxt, prv = res[r]["interleaved"]
        assert slots == [r, r + 4]
        assert ranges == [(2 * r, 2 * r + 2), (2 * (r + 4), 2 * (r + 4) + 2)]
        assert (nxt, prv) == ((r + 1) % 4, (r - 1) % 4)
        vslots, firsts, last_rank = res[r]["v"]
        assert vslots == [r, 7 - r]
        # Under V, rank 0 holds the first slot (chunk 0) and the last one (chunk 1).
        assert firsts == ([(True, False), (False, True)] if r == 0 else [(False, False), (False, False)])
        assert last_rank == (r == 3)
    # pp is the outer axis: pipeline groups are {0, 2} and {1, 3}; the first-last group follows dp.
    for r in range(4):
        stage, pp_ranks, group = res[r]["pp2dp2"]
        assert stage == r // 2 and pp_ranks == [r % 2, r % 2 + 2] and group == pp_ranks


def test_manager_errors() -> None:
    class _Mesh:  # only what the constructor reads
        def size(self, axis):
            return 2

        def coordinate(self, axis):
            return 0

        def group(self, axis):
            return None

        def ranks(self, axis):
            return [0, 1]

    with pytest.raises(ValueError, match=r"num_model_chunks=2 needs enable_interleave=True"):
        PipelineStageManager(_Mesh(), "pp", num_model_chunks=2)
    with pytest.raises(ValueError, match=r"use_zbv=True needs num_model_chunks=2"):
        PipelineStageManager(_Mesh(), "pp", enable_interleave=True, num_model_chunks=3, use_zbv=True)
    with pytest.raises(ValueError, match=r"pipeline_axis 'pipe' is not one of"):
        PipelineStageManager(_Mesh(), "pipe")
    m = PipelineStageManager(_Mesh(), "pp", num_layers_per_stage=[3, 2])
    assert m.distribute_layers(5) == [3, 2]
    with pytest.raises(ValueError, match=r"sums to 5 but the model has 6 layers"):
        m.distribute_layers(6)
    m2 = PipelineStageManager(_Mesh(), 0, enable_interleave=True, num_model_chunks=2)
    with pytest.raises(RuntimeError, match=r"say which chunk"):
        m2.is_first_stage()
