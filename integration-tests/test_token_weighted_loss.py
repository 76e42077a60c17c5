"""Token-weighted loss through ``Booster.num_items_in_batch``: on 2 gloo ranks, 2 accumulated micro-batches each,
with padding that differs between sequences, micro-batches and ranks, the step's gradients, the logged loss
(``Booster.mean_loss``: the mean over the data-parallel ranks, equal on every rank) and the trained parameters
equal those of one process whose loss is the mean over every target token of the global batch. Pipelines (pp 2 on 2 ranks, pp 2 x dp 2 on 4) take the count in the
batch and split it into the 2 micro-batches themselves.

Without the count (each micro-batch's own mean, averaged) the same steps differ from that reference: the last test
checks that the comparison can fail.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from cai.mesh.testing import assert_close, run_distributed

pytest.importorskip("transformers")

from _booster_cases import (
    VOCAB,
    gathered_params,
    grad_pieces,
    hybrid_llama,
    make_plugin,
    tiny_llama,
)

STEPS = 3
GLOBAL_BATCH = 8  # 2 ranks x 2 micro-batches x 2 sequences
SEQ = 16
LR = 1e-3
EPS = 1e-4  # see test_parity_matrix.py: keeps Adam's division by sqrt(v) from amplifying rounding
# HybridParallelPlugin layouts on 2 ranks, by name: data parallel with ZeRO-1, and sequence parallel (each rank's
# loss covers its half of every sequence, divided by the whole step's count, and the sp ranks' gradients summed)
HYBRID = {
    "hybrid-dp2-zero1": dict(tp_size=1, pp_size=1, zero_stage=1),
    "hybrid-sp2-all_to_all": dict(
        tp_size=1,
        pp_size=1,
        sp_size=2,
        enable_sequence_parallelism=True,
        sequence_parallelism_mode="all_to_all",
    ),
    # pipelines: the count goes in the batch, the schedule splits it into 2 micro-batches and sums their losses
    "hybrid-pp2": dict(tp_size=1, pp_size=2, num_microbatches=2),
    "hybrid-pp2-dp2-zero1": dict(tp_size=1, pp_size=2, zero_stage=1, num_microbatches=2),
}
WORLD = {"hybrid-pp2-dp2-zero1": 4}


def build(plugin: str) -> torch.nn.Module:
    return hybrid_llama(tied=False, layers=2) if plugin in HYBRID else tiny_llama()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels; each sequence keeps a different number of target tokens (2 to 15 of 15)."""
    g = torch.Generator().manual_seed(2000 + step)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    labels = ids.clone()
    keep = torch.randint(3, SEQ + 1, (GLOBAL_BATCH,), generator=g)
    for i, k in enumerate(keep.tolist()):
        labels[i, k:] = -100
    return ids, labels


def reference(plugin: str) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process, the whole global batch, Hugging Face's loss: the mean over all its target tokens."""
    model = build(plugin)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses, first = [], {}
    for step in range(STEPS):
        ids, labels = batch(step)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            first = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return losses, first, {n: p.detach().clone() for n, p in model.named_parameters()}


def boosted(plugin: str, weighted: bool) -> bool:
    from cai.booster import Booster
    from cai.booster.plugin import HybridParallelPlugin

    want_losses, want_grads, want_params = reference(plugin)
    model = build(plugin)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    if plugin in HYBRID:
        hybrid = HybridParallelPlugin(precision="fp32", **HYBRID[plugin])
        rank, world = hybrid.mesh.coordinate("dp"), hybrid.mesh.size("dp")
        booster = Booster(plugin=hybrid, device="cpu")
    else:
        rank, world = dist.get_rank(), dist.get_world_size()
        booster = Booster(plugin=make_plugin(plugin), device="cpu")
    model, opt, *_ = booster.boost(model, opt)
    pipeline = getattr(booster.plugin, "pp_size", 1) > 1
    matched = True
    for step in range(STEPS):
        ids, labels = (t.chunk(world)[rank] for t in batch(step))
        loss = torch.zeros(())
        if pipeline:  # the schedule splits the rank's batch into its 2 micro-batches
            mine = {"input_ids": ids, "labels": labels}
            if weighted:
                mine["num_items_in_batch"] = booster.num_items_in_batch([mine])
            loss += booster.execute_pipeline(iter([mine]), model, lambda o, _b: o["loss"], opt)["loss"]
        else:
            micro = [
                {"input_ids": i, "labels": lab} for i, lab in zip(ids.chunk(2), labels.chunk(2), strict=True)
            ]
            n = booster.num_items_in_batch(micro)
            for i, mb in enumerate(micro):
                first = i == 0 and booster.plugin.support_no_sync()
                with booster.no_sync(model, opt) if first else contextlib.nullcontext():
                    out = model(**mb, num_items_in_batch=n) if weighted else model(**mb)
                    booster.backward(out.loss if weighted else out.loss / len(micro), opt)
                loss += out.loss.detach() if weighted else out.loss.detach() / len(micro)
        # each rank's loss is its part of the step's token mean: their mean over the dp ranks is the whole mean,
        # logged alike on every rank (tensor-, sequence- and pipeline-parallel ranks included)
        logged = booster.mean_loss(loss)
        every = [torch.zeros(()) for _ in range(dist.get_world_size())]
        dist.all_gather(every, logged)
        assert all(torch.equal(x, logged) for x in every), f"step {step}: logged losses differ: {every}"
        if weighted:
            got = logged.double()
            want = torch.tensor(want_losses[step], dtype=torch.float64)
            assert_close(got, want, rtol=1e-5, name=f"step {step} loss")
        if (
            step == 0 and plugin not in HYBRID
        ):  # gradients where the plugin's pieces are read; all: parameters
            for name, (local, spec) in grad_pieces(plugin, model, opt).items():
                want = spec.cut(want_grads[name])
                if weighted:
                    assert_close(local.float(), want, rtol=1e-5, atol=1e-7, name=f"rank {rank} grad {name}")
                else:
                    matched &= torch.allclose(local.float(), want, rtol=1e-5, atol=1e-7)
        opt.step()
        opt.zero_grad()
    params = gathered_params(booster, model, set(want_params))
    if weighted:
        assert_close(params, want_params, rtol=1e-5, atol=1e-7, name="params")
    return matched


@pytest.mark.parametrize("plugin", ["ddp", "fsdp", "zero2", "gemini", *HYBRID])
def test_token_weighted_steps_match_the_global_token_mean(plugin: str) -> None:
    run_distributed(boosted, WORLD.get(plugin, 2), plugin, True, timeout=180)


def test_per_micro_batch_means_do_not_match_it() -> None:
    # the same comparison without the count: uneven padding makes the mean of means another loss
    assert not any(run_distributed(boosted, 2, "zero2", False, timeout=180))


def test_counts_labels_shift_labels_and_tensors() -> None:
    from cai.booster import Booster

    booster = Booster(device="cpu")
    labels = torch.tensor([[1, 2, -100, 4], [5, -100, -100, -100]])
    n = booster.num_items_in_batch([{"labels": labels}, {"shift_labels": labels}, labels[:1]])
    # shifted: [2, -100, 4] and [-100, -100, -100] -> 2; as given -> 4; the first row shifted -> 2
    assert n.item() == 8.0 and n.dtype == torch.float32
    with pytest.raises(ValueError, match="neither 'labels' nor 'shift_labels'"):
        booster.num_items_in_batch([{"input_ids": labels}])
    with pytest.raises(TypeError, match="a micro-batch is a list"):
        booster.num_items_in_batch([[1, 2]])


def test_mean_loss_outside_a_process_group_is_a_detached_fp32_copy() -> None:
    from cai.booster import Booster

    booster = Booster(device="cpu")
    loss = torch.tensor(2.5, dtype=torch.bfloat16, requires_grad=True)
    got = booster.mean_loss(loss)
    assert got.dtype == torch.float32 and not got.requires_grad and got.item() == 2.5
    got += 1  # a copy: the caller's loss is untouched
    assert loss.item() == 2.5
    with pytest.raises(ValueError, match="one-element loss tensor, got \\(2,\\)"):
        booster.mean_loss(torch.ones(2))
