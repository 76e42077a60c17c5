"""The schedules composed with what a training step around them needs, on one 4-rank spawn, each case against the
same model trained in one process: gradient clipping by the global norm (tp 2 x pp 2 with tied embeddings, and
pp 2 x dp 2), activation checkpointing per stage under 1F1B and zero-bubble V, tensor parallelism through 1F1B,
and fp16 with cai-zero's loss scaling on pp 2 x dp 2."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch
import torch.distributed as dist

from cai.mesh import ParallelDims
from cai.mesh.testing import assert_close, run_distributed
from cai.pipeline import (
    LocalState,
    OneForwardOneBackwardSchedule,
    PipelineStageManager,
    ZeroBubbleVPipeScheduler,
    build_stages,
    clip_grad_norm_,
)

_spec = importlib.util.spec_from_file_location(
    "_pipeline_stage_tests", pathlib.Path(__file__).with_name("test_stages.py")
)
_st = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _st  # its dataclasses look their module up while being created
_spec.loader.exec_module(_st)

STEPS, M, BATCH = 3, 2, 4
ADAM = dict(
    lr=1e-3, eps=1e-6
)  # see test_hf_schedules.py: eps keeps Adam's first update smooth in the gradient
MAX_NORM = 0.5  # below the tiny Llama's gradient norm (about 3-4), so every step clips


def _batch(step: int) -> dict:
    return _st.batch_for(step, batch=BATCH)


def _criterion(out, _batch):
    return out["loss"]


def _reference(tie: bool, *, clip: bool, checkpointing: bool = False) -> dict:
    torch.manual_seed(0)
    model, _ = _st.tiny("llama", tie)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    opt = torch.optim.AdamW(model.parameters(), **ADAM)
    losses, norms = [], []
    for step in range(STEPS):
        loss = model(**_batch(step)).loss
        loss.backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": model.state_dict()}


def _pieces(pm) -> dict:
    """This rank's blocks of every tensor with their specs (to cut the one-process tensor the same way)."""
    return {k: (s.tensor.detach().clone(), s.spec) for k, s in pm.sharded_state_dict().items()}


def _tp_pp_clipped() -> dict:
    """tp 2 x pp 2, tied embeddings, 1F1B, clipping by the global norm."""
    from cai.shardformer import ShardConfig, ShardFormer, load_sharded_state_dict, sharded_state_dict

    mesh = ParallelDims(pp=2, tp=2).build_mesh()
    torch.manual_seed(0)
    model, _ = _st.tiny("llama", True)
    sharded, _ = ShardFormer(ShardConfig(tensor_parallel_process_group=mesh.group("tp"))).optimize(model)
    sharded.eval()
    manager = PipelineStageManager(mesh, "pp")
    pm = build_stages(sharded, manager, local_state=LocalState(sharded_state_dict, load_sharded_state_dict))
    schedule = OneForwardOneBackwardSchedule(manager, num_microbatches=M)
    opt = torch.optim.AdamW(pm.parameters(), **ADAM)
    losses, norms = [], []
    for step in range(STEPS):
        out = schedule.forward_backward_step(pm, iter([_batch(step)]), _criterion, opt)
        pm.sync_shared_params()
        norms.append(clip_grad_norm_(pm, MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(out["loss"].item())
    return {"losses": losses, "norms": norms, "pieces": _pieces(pm)}


def _dp_half(batch: dict, mesh) -> dict:
    rank, size = mesh.coordinate("dp"), mesh.size("dp")
    n = batch["input_ids"].shape[0] // size
    return {k: v[rank * n : (rank + 1) * n] for k, v in batch.items()}


def _counted(forward, calls: list[int]):
    def run(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)

    return run


def _pp_dp_checkpointed(schedule_name: str) -> dict:
    """pp 2 x dp 2, tied embeddings, Hugging Face's activation checkpointing on every stage, clipping; each dp
    replica takes half of the batch and the gradients are averaged over dp by hand (a plain torch optimizer)."""
    mesh = ParallelDims(pp=2, dp=2).build_mesh()
    zbv = schedule_name == "zbv"
    manager = PipelineStageManager(
        mesh, "pp", enable_interleave=zbv, num_model_chunks=2 if zbv else 1, use_zbv=zbv
    )
    torch.manual_seed(0)
    model, _ = _st.tiny("llama", True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # checkpointing is active in training mode only (the tiny Llama has no dropout)
    pm = build_stages(model, manager)
    calls = [0]
    for chunk in pm.chunks:
        for block in chunk.module.model.layers:
            # a wrapped forward, not a hook: module hooks do not fire while a checkpoint recomputes
            block.mlp.forward = _counted(block.mlp.forward, calls)
    blocks = sum(len(chunk.module.model.layers) for chunk in pm.chunks)
    schedule = (
        ZeroBubbleVPipeScheduler(manager, num_microbatch=M)
        if zbv
        else OneForwardOneBackwardSchedule(manager, num_microbatches=M)
    )
    opt = torch.optim.AdamW(pm.parameters(), **ADAM)
    losses, norms = [], []
    dp_group = mesh.group("dp")
    for step in range(STEPS):
        out = schedule.forward_backward_step(pm, iter([_dp_half(_batch(step), mesh)]), _criterion, opt)
        for p in pm.parameters():
            dist.all_reduce(p.grad, group=dp_group)
            p.grad.div_(mesh.size("dp"))
        pm.sync_shared_params()
        norms.append(clip_grad_norm_(pm, MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        loss = out["loss"].clone()
        dist.all_reduce(loss, group=dp_group)
        losses.append(loss.item() / mesh.size("dp"))
    return {
        "losses": losses,
        "norms": norms,
        "pieces": _pieces(pm),
        "block_forwards_per_step": calls[0] / STEPS / (blocks * M),
    }


def _fp16_zero(pp: int) -> dict:
    """fp16 with cai-zero stage 1 and its loss scaling: at pp 2 x dp 2 through 1F1B, or in one process without the
    pipeline (pp 0: the reference; the whole batch at once)."""
    from cai.zero import LossScaleConfig, ZeroConfig, ZeroOptimizer

    mesh = ParallelDims(pp=pp, dp=2).build_mesh() if pp else None
    torch.manual_seed(0)
    model, _ = _st.tiny("llama", False)  # untied: cai-zero keeps gradients in its buckets, not in .grad
    model = model.half()
    batches = [_dp_half(_batch(step), mesh) if pp else _batch(step) for step in range(STEPS)]
    scale = LossScaleConfig(initial_scale=2.0**10)
    cfg = ZeroConfig(stage=1, overlap_comm=False)
    losses = []
    if not pp:
        opt = ZeroOptimizer(
            torch.optim.AdamW(model.parameters(), **ADAM), model=model, config=cfg, loss_scale=scale
        )
        for batch in batches:
            loss = model(**batch).loss
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        pieces = {k: (v.detach().clone(), None) for k, v in model.state_dict().items()}
        scales = opt.loss_scale
    else:
        manager = PipelineStageManager(mesh, "pp")
        pm = build_stages(model, manager)
        schedule = OneForwardOneBackwardSchedule(manager, num_microbatches=M)
        named = pm.global_named_parameters()
        opt = ZeroOptimizer(
            torch.optim.AdamW([p for _, p in named], **ADAM),
            model=named,
            config=cfg,
            loss_scale=scale,
            group=mesh.group("dp"),
            norm_groups=[mesh.group("pp")],  # an overflow on any stage skips the step on all
        )
        for batch in batches:
            out = schedule.forward_backward_step(pm, iter([batch]), _criterion, opt)
            opt.step()
            opt.zero_grad()
            losses.append(out["loss"])
        pieces = _pieces(pm)
        scales = opt.loss_scale
        for i, loss in enumerate(losses):
            dist.all_reduce(loss, group=mesh.group("dp"))
            losses[i] = loss.item() / 2
    return {"losses": losses, "pieces": pieces, "loss_scale": scales}


def _matrix() -> dict:
    out = {"tp2pp2": _tp_pp_clipped()}
    for name in ("1f1b", "zbv"):
        out[f"ckpt {name}"] = _pp_dp_checkpointed(name)
    out["fp16 pp2"] = _fp16_zero(2)
    return out


def _check(
    per_rank: list[dict], case: str, ref: dict, *, rtol: float, atol: float, norms: bool = True
) -> None:
    losses = per_rank[-1][case]["losses"]  # the last pipeline rank computed the loss; every rank has it
    assert losses == pytest.approx(ref["losses"], rel=rtol), case
    if norms:
        for rank in per_rank:  # the same norm on every rank, the one-process model's
            assert rank[case]["norms"] == pytest.approx(ref["norms"], rel=1e-5), case
            assert min(rank[case]["norms"]) > MAX_NORM, case  # clipping was active
    seen = set()
    for rank in per_rank:
        for name, (value, spec) in rank[case]["pieces"].items():
            full = ref["params"][name]
            expected = spec.cut(full) if spec is not None else full
            assert_close(value.float(), expected.float(), rtol=rtol, atol=atol, name=f"{case} {name}")
            seen.add(name)
    assert seen | {"lm_head.weight"} == set(ref["params"]), case


def test_clipping_checkpointing_tp_and_fp16_loss_scaling_match_one_process() -> None:
    per_rank = run_distributed(_matrix, 4, timeout=600)
    clipped = _reference(True, clip=True)
    _check(per_rank, "tp2pp2", clipped, rtol=1e-5, atol=1e-6)
    ref_ckpt = _reference(True, clip=True, checkpointing=True)
    for name in ("1f1b", "zbv"):
        case = f"ckpt {name}"
        _check(per_rank, case, ref_ckpt, rtol=1e-5, atol=1e-6)
        # every block ran its forward again in backward (at least once per micro-batch)
        assert per_rank[0][case]["block_forwards_per_step"] >= 2, case
    # fp16: the same fp16 run with cai-zero, in one process without the pipeline (micro-batches and dp halves only
    # change the summation order: losses to 2e-3; a gradient element near zero whose fp16 sign that order flips
    # moves its weight by up to lr per Adam step, hence 3.5e-3 = 3 steps of lr 1e-3 plus rounding for parameters)
    ref16 = _fp16_zero(0)
    fp16 = {"losses": ref16["losses"], "params": {k: v for k, (v, _) in ref16["pieces"].items()}}
    _check(per_rank, "fp16 pp2", fp16, rtol=2e-3, atol=3.5e-3, norms=False)
    assert all(r["fp16 pp2"]["loss_scale"] == ref16["loss_scale"] for r in per_rank)
