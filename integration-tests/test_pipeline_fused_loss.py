"""cai-kernels' fused linear cross-entropy (``patch_hf_model``) on the last stage of cai-pipeline's zero-bubble V
schedule, against the same patched model trained in one process.

The V schedule splits each micro-batch's backward into an input-gradient pass (B) and a weight-gradient pass (W)
through one retained graph, so the fused loss's backward runs twice on the same saved gradients; its first call
scales them in place ([Note: fused CE backward scaling]) and the second must still give the weight gradient.
"""

from __future__ import annotations

import pytest
import torch

from cai.mesh import ParallelDims
from cai.mesh.testing import assert_close, run_distributed
from cai.pipeline import PipelineStageManager, build_schedule, build_stages

transformers = pytest.importorskip("transformers")

from _booster_cases import VOCAB, hybrid_llama  # noqa: E402

STEPS, BATCH, SEQ, MICRO = 4, 8, 16, 4
ADAM = dict(lr=1e-3, eps=1e-4)  # eps: see test_hf_schedules.py in cai-pipeline


def _model() -> torch.nn.Module:
    from cai.kernels import patch_hf_model
    from cai.kernels._hf import FusedLMHead

    model = patch_hf_model(
        hybrid_llama(tied=False, layers=4).train()
    )  # the fused loss is the training forward's
    assert isinstance(model.lm_head, FusedLMHead)
    return model


def _batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), **ADAM)
    losses = []
    for batch in _batches():
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(reference) -> None:
    from cai.kernels._fused_ce import _FusedLinearCE

    ref_losses, ref_params = reference
    calls = []
    backward = _FusedLinearCE.backward
    _FusedLinearCE.backward = staticmethod(lambda ctx, g: calls.append(1) or backward(ctx, g))
    manager = PipelineStageManager(
        ParallelDims(pp=2).build_mesh(), "pp", enable_interleave=True, num_model_chunks=2, use_zbv=True
    )
    pm = build_stages(_model(), manager)
    schedule = build_schedule("zbv", manager, num_microbatches=MICRO)
    opt = torch.optim.AdamW(pm.parameters(), **ADAM)
    data = iter(_batches())
    losses = []
    for _ in range(STEPS):
        out = schedule.forward_backward_step(pm, data, lambda o, _b: o["loss"], opt)
        opt.step()
        opt.zero_grad()
        losses.append(out["loss"].item())
    _FusedLinearCE.backward = staticmethod(backward)
    holds_head = any(n.startswith("lm_head") for n, _ in pm.global_named_parameters())
    # B and W both run through the fused loss's backward, for every micro-batch
    assert len(calls) == (2 * STEPS * MICRO if holds_head else 0), (len(calls), holds_head)
    assert losses == pytest.approx(ref_losses, rel=1e-5), (losses, ref_losses)
    for name, p in pm.global_named_parameters():
        assert_close(p, ref_params[name], rtol=1e-5, atol=1e-6, name=f"stage {manager.stage} {name}")


def test_fused_loss_under_the_split_backward_of_the_v_schedule() -> None:
    run_distributed(_train, 2, _reference(), timeout=300)
