"""Gradients across the other parallel axes of a hybrid plugin: parameters replicated over a tensor-parallel group
(``replicas``) count once in the global norm, and a weight tied across two pipeline stages (``shared``) takes the
step of its summed gradient. Each case runs on gloo ranks and matches one process in fp32, step by step.

Neither case needs the real tensor- or pipeline-parallel code: the tensor-parallel ranks all-gather the other
ranks' slices as constants (so each rank's gradient of its own slice is the one-process gradient of that slice),
and the two pipeline stages pass activations and their gradients with send / recv.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cai.mesh import ParallelDims
from cai.mesh.testing import CollectiveCounter, assert_close, run_distributed
from cai.zero import ZeroConfig, ZeroOptimizer

LR, EPS = 1e-2, 1e-4  # eps: see test_parity.py
MB = 2  # rows per micro-batch


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=0.01)


def _close(actual: dict, expected: dict, what: str) -> None:
    # a sum over ranks differs from the one-process sum by rounding at the scale of each tensor
    for name, e in expected.items():
        assert_close(actual[name], e, rtol=1e-5, atol=1e-6 * float(e.abs().max()), name=f"{what} {name}")


# ---- replicas: a layer norm replicated over a tensor-parallel group --------------------------------------------
D_IN, D_H, D_OUT, TP_STEPS = 5, 8, 3, 4
TP_MAX_NORM = 0.3  # below every step's norm (checked), so each step is clipped


def _mlp(x, w1, g, beta, w2) -> torch.Tensor:
    """x -> layer_norm(x @ w1.T) @ w2.T; under tp, w1 is split by rows and w2 by columns, the layer norm replicated."""
    return F.layer_norm(x @ w1.T, (D_H,), g, beta) @ w2.T


class _TpRef(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(D_H, D_IN, generator=g) / D_IN**0.5)
        self.g = nn.Parameter(1 + 0.1 * torch.randn(D_H, generator=g))
        self.beta = nn.Parameter(0.1 * torch.randn(D_H, generator=g))
        self.w2 = nn.Parameter(torch.randn(D_OUT, D_H, generator=g) / D_H**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _mlp(x, self.w1, self.g, self.beta, self.w2)


class _TpRank(nn.Module):
    """One tp rank's parameters: its rows of w1, the layer norm whole, its columns of w2 (that order, so that in
    the reversed bucket the layer norm weight straddles the two dp ranks' ranges at stage 2: checked below)."""

    def __init__(self, tp_rank: int, tp: int) -> None:
        super().__init__()
        ref, rows, cols = _TpRef(), D_H // tp, D_H // tp
        self.w1 = nn.Parameter(ref.w1.detach()[tp_rank * rows : (tp_rank + 1) * rows].clone())
        self.g = nn.Parameter(ref.g.detach().clone())
        self.beta = nn.Parameter(ref.beta.detach().clone())
        self.w2 = nn.Parameter(ref.w2.detach()[:, tp_rank * cols : (tp_rank + 1) * cols].clone())


def _tp_full(own: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The full tensor: this rank's slice (differentiable) between the other ranks' slices (constants)."""
    parts = [torch.empty_like(own) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, own.detach().contiguous(), group=group)
    parts[dist.get_rank(group)] = own
    return torch.cat(parts, dim=dim)


def _tp_batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, D_IN, generator=g), torch.randn(rows, D_OUT, generator=g)


@dataclass(frozen=True, kw_only=True)
class TpCase:
    stage: int
    dp: int = 2
    tp: int = 2

    @property
    def id(self) -> str:
        return f"zero{self.stage}-dp{self.dp}-tp{self.tp}"


def _train_tp(case: TpCase) -> dict:
    mesh = ParallelDims(dp=case.dp, tp=case.tp).build_mesh()
    tp_group, tp_rank, dp_rank = mesh.group("tp"), mesh.coordinate("tp"), mesh.coordinate("dp")
    model = _TpRank(tp_rank, case.tp)
    opt = ZeroOptimizer(
        _adamw(model.parameters()),
        model=model,
        config=ZeroConfig(stage=case.stage, max_norm=TP_MAX_NORM),
        group=mesh.group("dp"),
        norm_groups=[tp_group],
        replicas={"g": case.tp, "beta": case.tp},
    )
    (b,) = opt.buckets
    g_slot = next(s for s in b.slots if s.name == "g")
    straddles = b.lo < g_slot.offset + g_slot.numel and g_slot.offset < b.hi < g_slot.offset + g_slot.numel
    out = {"norms": [], "params": [], "straddles": straddles, "tp_rank": tp_rank}
    for step in range(TP_STEPS):
        x, y = _tp_batch(step, case.dp * MB)
        rows = slice(dp_rank * MB, (dp_rank + 1) * MB)
        w1, w2 = _tp_full(model.w1, 0, tp_group), _tp_full(model.w2, 1, tp_group)
        opt.backward(F.mse_loss(_mlp(x[rows], w1, model.g, model.beta, w2), y[rows]))
        out["norms"].append(opt.grad_norm().item())
        opt.step()
        opt.zero_grad()
        out["params"].append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def _reference_tp(dp: int) -> dict:
    model = _TpRef()
    opt = _adamw(model.parameters())
    out = {"norms": [], "params": [], "replicated_share": []}
    for step in range(TP_STEPS):
        x, y = _tp_batch(step, dp * MB)
        F.mse_loss(model(x), y).backward()
        sq = {n: float(p.grad.square().sum()) for n, p in model.named_parameters()}
        out["replicated_share"].append((sq["g"] + sq["beta"]) / sum(sq.values()))
        out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), TP_MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        out["params"].append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


TP_CASES = [TpCase(stage=2), TpCase(stage=0)]


@pytest.mark.parametrize("case", TP_CASES, ids=lambda c: c.id)
def test_replicated_parameters_count_once_in_the_norm_and_clipping(case: TpCase) -> None:
    ref = _reference_tp(case.dp)
    # the layer norm carries enough of the norm that counting it tp times would be far outside the tolerance,
    # and every step is clipped
    assert min(ref["replicated_share"]) > 0.01, ref["replicated_share"]
    assert min(ref["norms"]) > TP_MAX_NORM, ref["norms"]
    results = run_distributed(_train_tp, case.dp * case.tp, case)
    if case.stage == 2:
        assert any(r["straddles"] for r in results), "the layer norm weight lies inside one dp rank's range"
    rows, cols = D_H // case.tp, D_H // case.tp
    for rank, got in enumerate(results):
        t = got["tp_rank"]
        assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5), f"rank {rank} norms"
        for step in range(TP_STEPS):
            full = ref["params"][step]
            want = {
                "w1": full["w1"][t * rows : (t + 1) * rows],
                "g": full["g"],
                "beta": full["beta"],
                "w2": full["w2"][:, t * cols : (t + 1) * cols],
            }
            _close(got["params"][step], want, f"rank {rank} step {step}")


# ---- shared: a tied embedding on the first and last of two pipeline stages ---------------------------------------
VOCAB, HID, SEQ, PP_STEPS = (
    11,
    5,
    4,
    4,
)  # 55 elements of the tied weight: padding on the last dp rank at stage 1/2


def _embedding() -> torch.Tensor:
    return torch.randn(VOCAB, HID, generator=torch.Generator().manual_seed(1))


def _linear(seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(HID, HID)


class _PpRef(nn.Module):
    """ids -> embed -> residual tanh(a) -> residual tanh(b) -> logits through the tied embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Parameter(_embedding())
        self.a, self.b = _linear(2), _linear(3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed[ids]
        h = torch.tanh(self.a(h)) + h
        h = torch.tanh(self.b(h)) + h
        return h @ self.embed.T


class _Stage0(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HID)
        self.embed.weight.data.copy_(_embedding())
        self.a = _linear(2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return torch.tanh(self.a(h)) + h


class _Stage1(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b = _linear(3)
        self.head = nn.Linear(
            HID, VOCAB, bias=False
        )  # the last stage's copy of the tied weight, by another name
        self.head.weight.data.copy_(_embedding())

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.b(h)) + h)


def _pp_batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return torch.randint(0, VOCAB, (rows, SEQ), generator=g), torch.randint(
        0, VOCAB, (rows, SEQ), generator=g
    )


def _lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


@dataclass(frozen=True, kw_only=True)
class PpCase:
    stage: int
    accum: int = 1
    max_norm: float = 0.0
    norm_first: bool = False  # call grad_norm() before step(): the shared sum must still happen once
    dp: int = 2
    debug: bool = False  # the debug checks on: the copies are compared after every step
    corrupt: bool = False  # with debug: stage 1's master copy is changed before the last step

    @property
    def id(self) -> str:
        clip = f"-clip{self.max_norm}" if self.max_norm else ""
        return (
            f"zero{self.stage}-pp2-dp{self.dp}-accum{self.accum}{clip}"
            + ("-norm-first" if self.norm_first else "")
            + ("-debug" if self.debug else "")
        )


def _train_pp(case: PpCase) -> dict:
    mesh = ParallelDims(pp=2, dp=case.dp).build_mesh()
    pp_group, stage = mesh.group("pp"), mesh.coordinate("pp")
    model = _Stage0() if stage == 0 else _Stage1()
    tied = "embed.weight" if stage == 0 else "head.weight"
    opt = ZeroOptimizer(
        _adamw(model.parameters()),
        model=model,
        config=ZeroConfig(stage=case.stage, max_norm=case.max_norm),
        group=mesh.group("dp"),
        norm_groups=[pp_group],
        replicas={tied: 2},  # both stages hold the summed gradient
        shared={tied: pp_group},
    )
    alone = next(b for b in opt.buckets if any(s.name == tied for s in b.slots))
    out = {"stage": stage, "alone": len(alone.slots) == 1, "norms": [], "params": [], "sums": []}
    with mock.patch("cai.zero._optimizer.debug_checks_on", lambda: case.debug):
        _train_pp_steps(case, mesh, model, opt, alone, out)
    return out


def _train_pp_steps(case: PpCase, mesh, model, opt, alone, out: dict) -> None:
    stage, dp_rank = mesh.coordinate("pp"), mesh.coordinate("dp")
    peer = next(r for r in mesh.ranks("pp") if r != dist.get_rank())
    for step in range(PP_STEPS):
        ids, labels = _pp_batch(step, case.dp * case.accum * MB)
        with CollectiveCounter() as cc:
            for i in range(case.accum):
                c = i * case.dp + dp_rank
                rows = slice(c * MB, (c + 1) * MB)
                sync = contextlib.nullcontext() if i == case.accum - 1 else opt.no_sync()
                with sync:
                    if stage == 0:
                        h = model(ids[rows])
                        dist.send(h.detach(), peer)
                        grad = torch.empty_like(h)
                        dist.recv(grad, peer)
                        opt.backward(h, gradient=grad)
                    else:
                        h = torch.empty(MB, SEQ, HID)
                        dist.recv(h, peer)
                        h.requires_grad_(True)
                        loss = _lm_loss(model(h), labels[rows]) / case.accum
                        opt.backward(loss)
                        dist.send(h.grad, peer)
            if case.norm_first or case.max_norm:
                out["norms"].append(opt.grad_norm().item())
            if case.corrupt and stage == 1 and step == PP_STEPS - 1:
                alone.master.add_(1e-3)
            opt.step()
        opt.zero_grad()
        # the shared gradient's sums over the pp group: its fp32 shard, all-reduced (scalar norms are 4 bytes)
        pp_ranks = tuple(mesh.ranks("pp"))
        out["sums"].append(
            sum(
                1
                for e in cc.events
                if e.op == "all_reduce" and e.group_ranks == pp_ranks and e.nbytes == alone.shard * 4
            )
        )
        # the debug checks' comparison: the copy's whole working bucket gathered over the pp group
        gathered = alone.padded * alone.working.element_size() * 2
        checks = [e for e in cc.events if e.op == "all_gather" and e.group_ranks == pp_ranks]
        assert [e.nbytes for e in checks] == ([gathered] if case.debug else []), checks
        out["params"].append({n: p.detach().clone() for n, p in model.named_parameters()})


def _reference_pp(case: PpCase) -> dict:
    model = _PpRef()
    opt = _adamw(model.parameters())
    out = {"norms": [], "params": []}
    for step in range(PP_STEPS):
        ids, labels = _pp_batch(step, case.dp * case.accum * MB)
        _lm_loss(model(ids), labels).backward()  # a mean over equal micro-batches: the mean of theirs
        if case.max_norm:
            out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), case.max_norm).item())
        elif case.norm_first:
            out["norms"].append(float(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm()))
        opt.step()
        opt.zero_grad()
        out["params"].append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


PP_CASES = [
    PpCase(stage=1),
    PpCase(stage=2, accum=2, norm_first=True),
    PpCase(stage=1, max_norm=0.5),
    PpCase(stage=2, max_norm=0.5, norm_first=True),
    PpCase(stage=0, accum=2, max_norm=0.5),
    PpCase(stage=2, dp=1, debug=True),
]


@pytest.mark.parametrize("case", PP_CASES, ids=lambda c: c.id)
def test_shared_weight_on_two_stages_steps_with_the_summed_gradient(case: PpCase) -> None:
    ref = _reference_pp(case)
    if case.max_norm:
        assert min(ref["norms"]) > case.max_norm, ref["norms"]  # every step is clipped
    results = run_distributed(_train_pp, 2 * case.dp, case)
    for rank, got in enumerate(results):
        assert got["alone"], f"rank {rank}: the tied weight shares its bucket"
        assert got["sums"] == [1] * PP_STEPS, f"rank {rank}: shared sums per step {got['sums']}"
        assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5), f"rank {rank} norms"
        names = {"embed.weight": "embed", "a.weight": "a.weight", "a.bias": "a.bias"}
        if got["stage"] == 1:
            names = {"head.weight": "embed", "b.weight": "b.weight", "b.bias": "b.bias"}
        for step in range(PP_STEPS):
            want = {mine: ref["params"][step][theirs] for mine, theirs in names.items()}
            _close(got["params"][step], want, f"rank {rank} (stage {got['stage']}) step {step}")


def test_the_debug_checks_catch_copies_of_a_shared_weight_that_differ() -> None:
    # the same run as the -debug case, with one copy's master moved before the last step
    with pytest.raises(Exception, match=r"copies of shared parameter '(embed|head)\.weight' differ"):
        run_distributed(_train_pp, 2, PpCase(stage=2, dp=1, debug=True, corrupt=True))
