"""The parity matrix: every plugin x data-parallel size {1, 2, 4} x {plain, gradient accumulation, clipping},
20 steps of a tiny Llama through ``Booster`` against the same model trained in one process in fp32.

Each case runs on ``dp`` gloo ranks; every rank also trains the one-process reference on the whole global batch
(cheap at this size, and cached: a pooled worker trains each mode's reference once), so the comparison happens
inside the worker and only the verdict travels back. Every rank
compares the losses, its pieces of the reduced gradients (first and last step) and the parameters assembled from
all ranks' pieces; the model's odd sizes leave padding on the last rank of every flat layout.

``CAI_TEST_DEVICE=cuda`` runs the same matrix with NCCL, one GPU per rank, on 2, 4 and 8 ranks (those the machine
has GPUs for), each rank's reference on its own GPU, with the same tolerances:
``CAI_TEST_DEVICE=cuda python -m pytest integration-tests/test_parity_matrix.py``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from cai.mesh.testing import assert_close, run_distributed

transformers = pytest.importorskip("transformers")

from _booster_cases import (  # noqa: E402
    PLUGINS,
    VOCAB,
    gathered_params,
    grad_pieces,
    last_rank_padding,
    make_plugin,
    tiny_llama,
)

STEPS = 20
GLOBAL_BATCH = 8
SEQ = 16
LR = 1e-3
# Adam divides by sqrt(v) + eps: a gradient element near zero (the prime vocabulary leaves some of them) differs from
# the one-process sum by rounding, which eps = 1e-8 amplifies into parameter differences of ~2e-7 after 20 steps.
# eps = 1e-4 keeps that at rounding / eps of lr per step, so parameters can be compared at 1e-6 relative.
EPS = 1e-4
MAX_NORM = 0.05  # small enough that clipping is active on every step
GRAD_STEPS = (0, STEPS - 1)  # steps whose gradients are compared (the first, and one after 19 updates)


@dataclass(frozen=True, kw_only=True)
class Case:
    plugin: str  # "ddp" | "fsdp" | "zero1" | "zero2" | "gemini"
    dp: int
    mode: str  # "plain" | "accum" | "clip"

    @property
    def id(self) -> str:
        return f"{self.plugin}-dp{self.dp}-{self.mode}"


DEVICE = os.environ.get("CAI_TEST_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"CAI_TEST_DEVICE={DEVICE!r}; use 'cpu' (gloo) or 'cuda' (NCCL, one GPU per rank)")
DP_SIZES = (1, 2, 4) if DEVICE == "cpu" else (2, 4, 8)
CASES = [
    Case(plugin=p, dp=dp, mode=m) for p in PLUGINS for dp in DP_SIZES for m in ("plain", "accum", "clip")
]


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    # Next-token mean cross-entropy; every micro-batch has the same token count, so means of means are exact.
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1)
    )


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


@functools.cache
def reference_run(
    mode: str, micro: int, device: str
) -> tuple[list[float], dict[str, torch.Tensor], list[dict]]:
    """The one-process run (cached: a pooled worker keeps this module between cases; callers only read it)."""
    model = tiny_llama().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses, grads = [], []
    for step in range(STEPS):
        ids = batch(step).to(device)
        total = 0.0
        for chunk in ids.chunk(micro):
            loss = lm_loss(model(chunk).logits, chunk) / micro
            loss.backward()
            total += loss.item()
        if step in GRAD_STEPS:
            grads.append({n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters()})
        if mode == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, full_params(model), grads


def boosted_run(case: Case) -> dict:
    from cai.booster import Booster

    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 on both sides of the comparison
    micro = 2 if case.mode == "accum" else 1
    model = tiny_llama()
    ref_losses, ref_params, ref_grads = reference_run(case.mode, micro, device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    booster = Booster(plugin=make_plugin(case.plugin), device=device)
    model, opt, *_ = booster.boost(model, opt)
    padding = last_rank_padding(case.plugin, model, opt)
    losses = []
    for step in range(STEPS):
        ids = batch(step).chunk(world)[rank].to(device)
        total = torch.zeros((), device=device)
        chunks = ids.chunk(micro)
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            ctx = (
                booster.no_sync(model, opt)
                if not last and booster.plugin.support_no_sync()
                else contextlib.nullcontext()
            )
            with ctx:
                loss = lm_loss(model(chunk).logits, chunk) / micro
                booster.backward(loss, opt)
            total += loss.detach()
        if step in GRAD_STEPS:
            # every rank's pieces of the reduced gradients, before clipping, against the one-process gradients
            want = ref_grads[GRAD_STEPS.index(step)]
            pieces = grad_pieces(case.plugin, model, opt)
            assert pieces, f"rank {rank} holds no gradient piece"
            for name, (local, spec) in pieces.items():
                scale = float(want[name].abs().max())
                assert_close(local.float().cpu(), spec.cut(want[name]), rtol=1e-5, atol=1e-6 * scale,
                             name=f"rank {rank} step {step} grad {name}")  # fmt: skip
        if case.mode == "clip":
            opt.clip_grad_by_norm(MAX_NORM)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    params = gathered_params(booster, model)
    assert_close(
        torch.tensor(losses, dtype=torch.float64),
        torch.tensor(ref_losses, dtype=torch.float64),
        rtol=1e-6,
        atol=1e-7,
        name="loss",
    )
    # 1e-5 relative (the bound every parity matrix uses for parameters): 20 Adam steps turn a last-bit difference in
    # the order of a gradient sum (all-reduce vs one process) into up to ~1e-5 relative on a parameter whose
    # gradient cancels, which a 1e-6 bound catches on some CPUs and not on others.
    assert_close(params, ref_params, rtol=1e-5, atol=1e-7, name="params")
    return {"loss": losses[-1], "padding": padding}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_parity(case: Case) -> None:
    if DEVICE == "cuda" and torch.cuda.device_count() < case.dp:
        pytest.skip(f"needs {case.dp} GPUs, this machine has {torch.cuda.device_count()}")
    backend = "nccl" if DEVICE == "cuda" else "gloo"
    results = run_distributed(boosted_run, case.dp, case, timeout=180, backend=backend)
    assert len({round(r["loss"], 12) for r in results}) == 1
    if case.dp > 1 and case.plugin != "ddp":
        assert results[-1]["padding"] > 0, (
            "the last rank's flat pieces hold no padding: the model divides evenly"
        )
