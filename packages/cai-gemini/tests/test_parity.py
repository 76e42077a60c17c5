"""Multi-process tests: train a sharded model beside a single-process fp32 reference and compare every step."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist

from cai.gemini import ChunkConfig, GeminiConfig, MemoryTracker, shard
from cai.kernels.optim import HybridAdam
from cai.mesh.testing import TinyTransformer, assert_close, make_batch, run_distributed

# [Note: tolerance] With dp > 1 a gradient is a sum of per-rank partial sums, so it differs from the single-process
# one by rounding at the scale of the tensor (elements that nearly cancel, like the key bias of attention whose
# true gradient is zero, differ at their own scale). Adam divides by sqrt(v) + eps and so scales such differences by
# up to lr / eps; eps = 1e-3 keeps that factor at 10. Gradients are compared at rtol relative to each element and
# to the tensor's largest element, parameters relative to the tensor's largest element plus lr * (lr / eps).
# With dp = 1 the runs are bitwise equal and the tolerance is purely relative.
LR, WD, EPS = 1e-2, 0.01, 1e-3


@dataclass(frozen=True, kw_only=True)
class Case:
    name: str
    dp: int
    gemini: dict = field(default_factory=dict)  # GeminiConfig overrides
    chunk_size: int | None = 3000
    steps: int = 10
    tied: bool = False
    frozen: tuple[str, ...] = ()
    budget: tuple[int, int] | None = None  # simulated (device_capacity, non_model_bytes)
    accum: int = 1  # micro-batches per step
    no_sync: bool = False
    rtol: float = 1e-6

    @property
    def id(self) -> str:
        return f"{self.name}-dp{self.dp}"


def build(case: Case) -> tuple[torch.nn.Module, torch.nn.Module]:
    ref = TinyTransformer(tie_embeddings=case.tied)
    for n, p in ref.named_parameters():
        if any(n.startswith(f) for f in case.frozen):
            p.requires_grad_(False)
    return ref, copy.deepcopy(ref)


def global_batch(step: int, micro: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    return make_batch(batch_size=rows, seq_len=16, seed=1000 * step + micro)


def _scale_tol(ref: torch.Tensor, case: Case, step: float = 0.0) -> float:
    # see [Note: tolerance]
    return 0.0 if case.dp == 1 else case.rtol * (float(ref.detach().abs().max()) + step)


def train_and_compare(case: Case) -> dict:
    """Train ``case.steps`` steps sharded and unsharded; compare losses, gradients and parameters every step."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    assert world == case.dp
    ref, model = build(case)
    ref_opt = HybridAdam([p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=WD, eps=EPS)
    opt = HybridAdam([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD, eps=EPS)
    overrides = dict(case.gemini)
    cfg = GeminiConfig(
        precision="fp32", chunk=ChunkConfig(chunk_size=case.chunk_size, min_chunk_size_m=0), **overrides
    )
    tracker = MemoryTracker(*case.budget) if case.budget else None
    gm, gopt = shard(model, opt, config=cfg, device="cpu", memory=tracker)
    rows = 2 * case.dp  # every rank gets two rows of each micro-batch
    losses = []
    for step in range(case.steps):
        loss_sum = 0.0
        # the reference takes every micro-batch of every rank as one large batch
        big = [global_batch(step, micro, rows) for micro in range(case.accum)]
        rl = ref.loss(ref(torch.cat([b[0] for b in big])), torch.cat([b[1] for b in big]))
        rl.backward()
        ref_loss_sum = rl.item()
        for micro in range(case.accum):
            ids, labels = big[micro]
            mine = slice(2 * rank, 2 * rank + 2)
            last = micro == case.accum - 1
            ctx = gm.no_sync() if case.no_sync and not last else _nullctx()
            with ctx:
                loss = gm.module.loss(gm(ids[mine]), labels[mine]) / case.accum
                gopt.backward(loss)
            loss_sum += loss.item()
        t = torch.tensor([loss_sum / world])
        if world > 1:
            dist.all_reduce(t)
        losses.append((t.item(), ref_loss_sum))
        assert_close(
            t,
            torch.tensor([ref_loss_sum]),
            rtol=case.rtol,
            atol=case.rtol * (case.accum > 1),
            name=f"step {step} loss",
        )
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        # with overlap_host_step the host chunks' gradients are consumed during backward: parameters tell
        grads = {} if cfg.overlaps_host_step and cfg.offload_optim_frac else gm.sharded_grads()
        for name, (local, spec) in grads.items():
            expected = spec.cut(ref_grads[name])
            assert_close(
                local,
                expected,
                rtol=case.rtol,
                atol=_scale_tol(ref_grads[name], case),
                name=f"step {step} grad {name}",
            )
        if cfg.max_norm:
            torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], cfg.max_norm)
        ref_opt.step()
        ref_opt.zero_grad()
        gopt.step()
        gopt.zero_grad()
        ref_params = dict(ref.named_parameters())
        for name, (local, spec) in gm.sharded_state_dict().items():
            if name in ref_params:
                expected = spec.cut(ref_params[name].detach())
                assert_close(
                    local,
                    expected,
                    rtol=case.rtol,
                    atol=_scale_tol(ref_params[name], case, LR * LR / EPS),
                    name=f"step {step} {name}",
                )
    report = gm.memory_report()
    report["losses"] = losses
    report["capacity"] = case.budget[0] if case.budget else None
    report["num_chunks"] = len(gm.chunks)
    report["padded_last_pieces"] = padded_last_pieces(gm)
    return report


def padded_last_pieces(gm) -> int:
    """Chunks whose padding starts inside the last rank's shard: that rank holds parameter elements followed by
    zeros. The odd default sizes of TinyTransformer make this happen; the test asserts it so that it cannot
    silently stop covering the padded last piece."""
    count = 0
    for c in gm.chunks:
        last_lo = (c.world_size - 1) * c.shard_size
        count += c.world_size > 1 and last_lo < c.used < c.chunk_size
    return count


class _nullctx:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


# dp x placement matrix: 10 steps of a small transformer match the reference step by step

PLACEMENTS = {
    "device": {},
    "optim0.5": {"offload_optim_frac": 0.5},  # the host step overlaps backward (the default where exact)
    "optim1.0": {"offload_optim_frac": 1.0, "overlap_host_step": False},
    "param0.5": {"offload_param_frac": 0.5},
    "param1.0": {"offload_param_frac": 1.0, "offload_optim_frac": 1.0},
    "shard0.5": {"shard_param_frac": 0.5},
    "prefetch2": {"max_prefetch": 2, "offload_param_frac": 0.5},
}
CASES = [Case(name=n, dp=dp, gemini=g) for dp in (1, 2, 4) for n, g in PLACEMENTS.items()]
CASES += [
    # The tied weight's two gradient terms (embedding and head) are summed in another order than in one process, and
    # the difference reaches every later step: on an AVX-512 host one element of 33 reached 1.2e-6 of its tensor's
    # largest gradient at step 8 (every other step stays below 0.5e-6), so the tied cases compare at 2e-6.
    Case(name="tied", dp=2, tied=True, rtol=2e-6),
    Case(name="tied-param1.0", dp=4, tied=True, gemini={"offload_param_frac": 1.0}, rtol=2e-6),
    Case(name="frozen", dp=2, frozen=("blocks.0.", "pos.")),
    Case(name="accum", dp=2, accum=2, steps=5),
    Case(name="accum-no-sync", dp=2, accum=3, no_sync=True, steps=5, gemini={"offload_optim_frac": 1.0}),
    Case(name="clip", dp=2, gemini={"max_norm": 0.5}),
    Case(
        name="overlap-no-sync",
        dp=2,
        accum=2,
        no_sync=True,
        steps=5,
        gemini={"offload_optim_frac": 1.0, "overlap_host_step": True},
    ),
]
# auto under a simulated budget: every chunk cannot sit on the device at once, so shards are evicted. The chunks
# differ in size (the embedding and head have chunks of their own, 33 KB gathered, the others 12 to 17 KB).
CASES += [
    Case(name="auto", dp=dp, gemini={"placement_policy": "auto"}, budget=(200_000, 20_000))
    for dp in (1, 2, 4)
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_matches_reference(case: Case) -> None:
    reports = run_distributed(train_and_compare, case.dp, case, timeout=180)
    if case.dp > 1:
        assert reports[-1]["padded_last_pieces"] > 0, "no chunk ends inside the last rank's shard"
    if case.budget:
        for r in reports:
            assert r["peak_device"] <= r["capacity"], r
            assert r["evictions"] > 0 and r["h2d"] > 0, r
