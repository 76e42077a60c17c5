"""HybridParallelPlugin against one process: each layout x {plain, gradient accumulation, clipping}, and the
pipelined layouts with their first stage frozen, 20 AdamW steps of a tiny Llama through ``Booster``, in fp32; and
fp16 with the first stage frozen, whose loss scaler must skip the steps the other stage skips.

The test process trains the one-process reference on the whole global batch (once per model and mode, cached) and
hands it to every rank, which compares inside the worker. Each data-parallel rank gets its own slice of the global batch, so a missing or doubled
data-parallel average fails; tensor, sequence and pipeline ranks of one replica read the same slice. Compared:
the loss and the gradient norm of every step (on every rank; the pipeline broadcasts the loss, the norm sums over
tp x pp x dp), and at the end every parameter assembled from all ranks' pieces of the plugin's checkpoint state (tp
blocks x ZeRO flat ranges x pipeline stages, under the full model's names), so the test also covers what
``save_model`` writes.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from cai.mesh.testing import assert_close, one_thread, run_distributed

transformers = pytest.importorskip("transformers")

from _booster_cases import VOCAB, gathered_params, hybrid_llama  # noqa: E402

STEPS = 20
GLOBAL_BATCH = 8
SEQ = 16
LR = 1e-3
EPS = 1e-4  # see test_parity_matrix.py: keeps Adam's update smooth in gradients near zero
MAX_NORM = 0.05  # below the gradient norm of every step, so clipping is active throughout


@dataclass(frozen=True, kw_only=True)
class Layout:
    name: str
    world: int
    kwargs: tuple[tuple[str, object], ...]  # HybridParallelPlugin keyword arguments
    tied: bool = False

    def plugin_kwargs(self) -> dict:
        return dict(self.kwargs)


LAYOUTS = [
    Layout(name="tp2", world=2, kwargs=(("tp_size", 2), ("pp_size", 1))),
    Layout(name="pp2", world=2, kwargs=(("tp_size", 1), ("pp_size", 2), ("num_microbatches", 2)), tied=True),
    Layout(
        name="tp2-sp-split_gather",
        world=2,
        kwargs=(
            ("tp_size", 2),
            ("pp_size", 1),
            ("enable_sequence_parallelism", True),
            ("sequence_parallelism_mode", "split_gather"),
        ),
    ),
    Layout(
        name="sp2-all_to_all",
        world=2,
        kwargs=(
            ("tp_size", 1),
            ("pp_size", 1),
            ("sp_size", 2),
            ("enable_sequence_parallelism", True),
            ("sequence_parallelism_mode", "all_to_all"),
        ),
    ),
    Layout(
        name="sp2-ring_attn",
        world=2,
        kwargs=(
            ("tp_size", 1),
            ("pp_size", 1),
            ("sp_size", 2),
            ("enable_sequence_parallelism", True),
            ("sequence_parallelism_mode", "ring_attn"),
        ),
    ),
    Layout(
        name="tp2xpp2", world=4, kwargs=(("tp_size", 2), ("pp_size", 2), ("num_microbatches", 2)), tied=True
    ),
    Layout(
        name="pp2xdp2-zero1",
        world=4,
        kwargs=(("tp_size", 1), ("pp_size", 2), ("zero_stage", 1), ("num_microbatches", 2)),
    ),
    Layout(name="tp2xdp2-zero2", world=4, kwargs=(("tp_size", 2), ("pp_size", 1), ("zero_stage", 2))),
    Layout(
        name="pp4-interleaved",
        world=4,
        kwargs=(
            ("tp_size", 1),
            ("pp_size", 4),
            ("pp_style", "interleaved"),
            ("num_model_chunks", 2),
            ("num_microbatches", 4),
        ),
    ),
    Layout(
        name="tp2xpp2xdp2-zero1",
        world=8,
        kwargs=(("tp_size", 2), ("pp_size", 2), ("zero_stage", 1), ("num_microbatches", 2)),
        tied=True,
    ),
]
MODES = ("plain", "accum", "clip")


@dataclass(frozen=True, kw_only=True)
class Case:
    layout: Layout
    mode: str

    @property
    def id(self) -> str:
        return f"{self.layout.name}-{self.mode}"


CASES = [Case(layout=lay, mode=m) for lay in LAYOUTS for m in MODES]
# The first pipeline stage entirely frozen (the embedding and the first half of the blocks): a stage with nothing to
# train still runs the schedule, and the others train as in one process.
CASES += [
    Case(layout=lay, mode="frozen") for lay in LAYOUTS if lay.name in ("pp2", "pp2xdp2-zero1", "tp2xpp2")
]
# enable_all_optimization: cai-kernels' norms with the residual adds, SwiGLU, rotary, shared q/k/v input (and the
# fused loss at tp 1) around each kind of parallel layer; the reference is the plain model.
CASES += [
    Case(layout=lay, mode="kernels")
    for lay in LAYOUTS
    if lay.name in ("tp2", "pp2", "tp2-sp-split_gather", "sp2-all_to_all", "sp2-ring_attn", "tp2xpp2")
]


def freeze(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    if mode == "frozen":
        model.model.embed_tokens.requires_grad_(False)
        for block in model.model.layers[: len(model.model.layers) // 2]:
            block.requires_grad_(False)
    return model


def batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def rows(b: dict[str, torch.Tensor], part: int, parts: int) -> dict[str, torch.Tensor]:
    return {k: v.chunk(parts)[part] for k, v in b.items()}


@functools.cache
def reference_run(tied: bool, mode: str) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """The one-process run, in the test process (cached: each of the six references is trained once per test
    process, not once per rank; callers only read the result), on one thread as the pooled workers are."""
    with one_thread():
        return _reference_run(tied, mode)


def _reference_run(tied: bool, mode: str) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    model = freeze(hybrid_llama(tied), mode)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, eps=EPS)
    micro = 2 if mode == "accum" else 1
    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        for i in range(micro):
            loss = model(**rows(batch(step), i, micro)).loss / micro
            loss.backward()
            total += loss.item()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norms.append(float(torch.nn.utils.get_total_norm(grads)))
        if mode == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def boosted_run(case: Case, reference: tuple[list[float], list[float], dict[str, torch.Tensor]]) -> float:
    from cai.booster import Booster
    from cai.booster.plugin import HybridParallelPlugin

    ref_losses, ref_norms, ref_params = reference
    plugin = HybridParallelPlugin(precision="fp32", max_norm=MAX_NORM if case.mode == "clip" else 0.0,
                                  enable_all_optimization=case.mode == "kernels",
                                  **case.layout.plugin_kwargs())  # fmt: skip
    booster = Booster(plugin=plugin, device="cpu")
    model = freeze(hybrid_llama(case.layout.tied), case.mode)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, eps=EPS)
    model, opt, *_ = booster.boost(model, opt)
    if case.mode == "kernels":
        check_kernels(model.unwrap(), plugin)
    dp, dp_rank = plugin.mesh.size("dp"), plugin.mesh.coordinate("dp")
    micro = 2 if case.mode == "accum" else 1
    losses, norms = [], []
    for step in range(STEPS):
        mine = rows(batch(step), dp_rank, dp)
        total = torch.zeros(())
        for i in range(micro):
            part = rows(mine, i, micro)
            ctx = booster.no_sync(model, opt) if i < micro - 1 else contextlib.nullcontext()
            with ctx:
                if plugin.pp_size > 1:
                    out = booster.execute_pipeline(iter([part]), model, lambda o, _b: o["loss"] / micro, opt)
                    loss = out["loss"]
                else:
                    loss = model(**part).loss / micro
                    booster.backward(loss, opt)
            total += loss.detach()
        norms.append(opt.get_grad_norm())  # before step(), which then clips with the same norm
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total, group=plugin.dp_group)
        losses.append(total.item() / dp)
    assert_close(
        torch.tensor(losses, dtype=torch.float64),
        torch.tensor(ref_losses, dtype=torch.float64),
        rtol=1e-5,
        name=f"{case.id} loss",
    )
    assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, name=f"{case.id} grad norm")
    params = gathered_params(booster, model, set(ref_params))
    assert_close(params, ref_params, rtol=1e-5, atol=1e-7, name=f"{case.id} params")
    return losses[-1]


def check_kernels(model: torch.nn.Module, plugin) -> None:
    """cai-kernels are in place on this rank's part of the model: every decoder layer has the fused-residual forward,
    cai's norms and SwiGLU, the head is fused where it is not vocab-parallel, and rotary is cai's."""
    from cai.kernels import FusedLMHead, RMSNorm, SwiGLUMLP
    from cai.kernels._residual import _FusedResidualForward

    layers = [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    assert layers and all(isinstance(m.__dict__.get("forward"), _FusedResidualForward) for m in layers)
    assert all(isinstance(m.mlp, SwiGLUMLP) and isinstance(m.input_layernorm, RMSNorm) for m in layers)
    # (a pipeline stage without the head holds a placeholder there)
    heads = [m for n, m in model.named_modules() if n.endswith("lm_head") and type(m).__name__ != "_Absent"]
    assert heads or plugin.pp_size > 1
    assert all(isinstance(m, FusedLMHead) == (plugin.tp_size == 1) for m in heads), heads
    modeling = __import__(type(layers[0].self_attn).__module__, fromlist=["x"])
    assert modeling.apply_rotary_pos_emb.__module__ == "cai.kernels._rope"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_hybrid_parity(case: Case) -> None:
    reference = reference_run(case.layout.tied, "plain" if case.mode == "kernels" else case.mode)
    results = run_distributed(boosted_run, case.layout.world, case, reference, timeout=300)
    assert len({round(r, 10) for r in results}) == 1, results


def _misconfigured(what: str) -> str:
    from _booster_cases import tiny_llama

    from cai.booster import Booster
    from cai.booster.plugin import HybridParallelPlugin

    if what == "heads":  # 3 attention heads over tp 2
        model, plugin = tiny_llama(), HybridParallelPlugin(tp_size=2, pp_size=1)
    else:  # 1 decoder block for 2 stages
        model, plugin = (
            hybrid_llama(False, layers=1),
            HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=2),
        )
    try:
        Booster(plugin=plugin, device="cpu").boost(model, torch.optim.AdamW(model.parameters()))
    except (ValueError, NotImplementedError) as err:
        return str(err)
    return "no error"


def test_misconfiguration_fails_at_boost() -> None:
    heads, layers = (run_distributed(_misconfigured, 2, what)[0] for what in ("heads", "layers"))
    assert "num_attention_heads=3 does not divide over tensor_parallel_size=2" in heads, heads
    assert "1 layers cannot fill 2 pipeline slots" in layers, layers


def fp16_frozen_run(pp: int) -> tuple[list[float], list[float], int, float]:
    """fp16 with the first half of the model frozen, on one stage or two (the first then trains nothing): the
    losses, the loss scale after each step, the steps skipped and how far the frozen embedding moved."""
    from cai.booster import Booster
    from cai.booster.plugin import HybridParallelPlugin

    plugin = HybridParallelPlugin(
        precision="fp16",
        tp_size=1,
        pp_size=pp,
        num_microbatches=2 if pp > 1 else None,
        initial_scale=2**22,
        hysteresis=1,
    )
    booster = Booster(plugin=plugin, device="cpu")
    model = freeze(hybrid_llama(False), "frozen")
    frozen = model.model.embed_tokens.weight.detach().clone()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, eps=EPS)
    model, opt, *_ = booster.boost(model, opt)
    losses, scales = [], []
    for _ in range(8):  # one batch again and again: the loss falls once steps apply
        if pp > 1:
            loss = booster.execute_pipeline(iter([batch(0)]), model, lambda o, _b: o["loss"], opt)["loss"]
        else:
            loss = model(**batch(0)).loss
            booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        scales.append(opt.scaler.scale)
    embedding = [p for n, p in model.unwrap().named_parameters() if "embed_tokens" in n]  # on the first stage
    moved = max((float((p - frozen.to(p.dtype)).abs().max()) for p in embedding), default=0.0)
    return losses, scales, opt.scaler.skipped_steps, moved


def test_fp16_with_a_frozen_pipeline_stage_skips_the_steps_one_stage_skips() -> None:
    # The frozen first stage has no gradients of its own, but its loss scaler must take part in the overflow
    # decision of the other stage: both stages skip the same steps and lower the scale as one process does.
    [(ref_losses, ref_scales, ref_skipped, ref_moved)] = run_distributed(fp16_frozen_run, 1, 1)
    results = run_distributed(fp16_frozen_run, 2, 2)
    assert 0 < ref_skipped < 8, (ref_skipped, ref_scales)  # the initial scale overflows, a lower one does not
    assert ref_moved == 0.0
    for losses, scales, skipped, moved in results:
        assert (scales, skipped) == (ref_scales, ref_skipped), (scales, ref_scales)
        assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-2, name="fp16 frozen-stage loss")
        assert moved == 0.0
    assert ref_losses[-1] < ref_losses[0]
