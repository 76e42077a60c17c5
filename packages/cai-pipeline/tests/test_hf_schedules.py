"""The schedules on a tiny Hugging Face Llama cut by ``build_stages`` (tied and untied embeddings) at pp 2, against
the same model trained in one process, and the P2P volume per micro-batch per stage boundary."""

from __future__ import annotations

import pytest
import torch
import transformers

from cai.mesh import ParallelDims
from cai.mesh.testing import assert_close, run_distributed
from cai.pipeline import (
    InterleavedSchedule,
    OneForwardOneBackwardSchedule,
    PipelineStageManager,
    build_stages,
)

STEPS, BATCH, SEQ, VOCAB, HIDDEN, M = 10, 4, 12, 251, 32, 4
# Adam's first update is lr * sign(g): a gradient element near zero, whose sign the micro-batch split's summation
# order can flip, would move by lr. eps well above such elements keeps the update a smooth function of the gradient.
ADAM = dict(lr=1e-3, eps=1e-6)


def _llama(tie: bool) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    return transformers.LlamaForCausalLM(cfg).eval()  # eval: no dropout, as in the one-process reference


def _batches() -> list[dict]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :3] = 0  # left padding: every stage takes its masks from the batch
        out.append(
            {
                "input_ids": ids,
                "attention_mask": mask,
                "labels": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            }
        )
    return out


def _reference(tie: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _llama(tie)
    opt = torch.optim.AdamW(model.parameters(), **ADAM)
    losses = []
    for batch in _batches():
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.named_parameters(remove_duplicate=False)}


def _train(schedule_name: str, tie: bool):
    chunks = 2 if schedule_name == "interleaved" else 1
    mesh = ParallelDims(pp=2).build_mesh()
    manager = PipelineStageManager(mesh, "pp", enable_interleave=chunks > 1, num_model_chunks=chunks)
    pm = build_stages(_llama(tie), manager)
    if chunks == 1:
        schedule = OneForwardOneBackwardSchedule(manager, num_microbatches=M)
    else:
        schedule = InterleavedSchedule(manager, chunks, num_microbatch=M)
    opt = torch.optim.AdamW(pm.parameters(), **ADAM)
    data = iter(_batches())
    losses = []
    for _ in range(STEPS):
        out = schedule.forward_backward_step(pm, data, lambda o, _b: o["loss"], opt)
        pm.sync_shared_params()
        opt.step()
        opt.zero_grad()
        losses.append(out["loss"].item())
    params = {k: s.tensor.detach().clone() for k, s in pm.sharded_state_dict().items()}
    per_mb = {f"{d} to stage {peer}": v // (STEPS * M) for (peer, d), v in schedule.p2p_bytes.items()}
    return losses, params, per_mb


def _matrix():
    return {(s, t): _train(s, t) for s in ("1f1b", "interleaved") for t in (True, False)}


def test_llama_pp2_matches_one_process():
    per_rank = run_distributed(_matrix, 2, timeout=300)
    for (schedule, tie), _ in per_rank[0].items():
        ref_losses, ref_params = _reference(tie)
        where = f"{schedule} tied={tie}"
        for rank in per_rank:
            losses, params, _ = rank[(schedule, tie)]
            assert losses == pytest.approx(ref_losses, rel=1e-5), where
            for name, value in params.items():
                assert_close(value, ref_params[name], rtol=1e-5, atol=1e-6, name=f"{where} {name}")
        names = set(per_rank[0][(schedule, tie)][1]) | set(per_rank[1][(schedule, tie)][1])
        assert names | ({"lm_head.weight"} if tie else set()) == set(ref_params), where
        # per micro-batch and stage boundary: the hidden states forward and their gradient back, fp32, nothing else
        hidden = (BATCH // M) * SEQ * HIDDEN * 4
        crossings = 2 if schedule == "interleaved" else 1  # boundaries each rank sends across, per direction
        print(where, [rank[(schedule, tie)][2] for rank in per_rank])
        assert per_rank[0][(schedule, tie)][2] == {
            "fwd to stage 1": crossings * hidden,
            **({"bwd to stage 1": hidden} if crossings == 2 else {}),
        }, where
