"""Communication volume, fp16 overflow, resharding dp=4 -> dp=2, and parameters that get no gradient."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cai.mesh import LocalShard, ShardSpec, assemble
from cai.mesh._collectives import FP8_BLOCK
from cai.mesh.testing import CollectiveCounter, TinyTransformer, assert_close, make_batch, run_distributed
from cai.zero import LossScaleConfig, ZeroConfig, ZeroOptimizer

MODEL = dict(vocab_size=64, hidden=32, layers=2, heads=4, max_seq=32)
BUCKET_MB = 3000 * 4 / 2**20
LR, EPS = 1e-3, 1e-4  # eps: see test_parity.py


def _model() -> TinyTransformer:
    model = TinyTransformer(**MODEL)
    for block in model.blocks:  # see test_parity.py: their key part has a gradient of pure rounding noise
        block.qkv.bias.requires_grad_(False)
    return model


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=LR, eps=EPS, weight_decay=0.01
    )


def _rows(rank: int, micro: int, dp: int, mb: int) -> slice:
    c = micro * dp + rank
    return slice(c * mb, (c + 1) * mb)


def _reference(steps: int, batch: int) -> list[dict[str, torch.Tensor]]:
    model = _model()
    opt = _adamw(model)
    out = []
    for step in range(steps):
        ids, labels = make_batch(batch_size=batch, seq_len=16, vocab_size=64, seed=step)
        TinyTransformer.loss(
            model(ids), labels
        ).backward()  # every row has 15 labels: chunk means average to this
        opt.step()
        opt.zero_grad()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


# ---- communication volume -------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class CommCase:
    stage: int
    accum: int
    bf16_fp32_comm: bool = False  # bf16 parameters reduced in fp32

    @property
    def id(self) -> str:
        return f"zero{self.stage}-accum{self.accum}" + ("-bf16-fp32comm" if self.bf16_fp32_comm else "")


def _count_step(case: CommCase) -> dict:
    model = _model()
    comm = None
    if case.bf16_fp32_comm:
        model, comm = model.to(torch.bfloat16), torch.float32
    cfg = ZeroConfig(stage=case.stage, bucket_size_mb=BUCKET_MB, comm_dtype=comm)
    opt = ZeroOptimizer(_adamw(model), model=model, config=cfg)
    ids, labels = make_batch(batch_size=2 * case.accum * 2, seq_len=16, vocab_size=64, seed=0)
    with CollectiveCounter() as cc:
        for i in range(case.accum):
            rows = _rows(dist.get_rank(), i, 2, 2)
            with opt.no_sync() if i < case.accum - 1 else contextlib.nullcontext():
                opt.backward(TinyTransformer.loss(model(ids[rows]), labels[rows]) / case.accum)
        opt.step()
    return {"events": [(e.op, e.nbytes) for e in cc.events]}


def _expected_buckets(model: nn.Module, bucket_numel: int, world_size: int) -> list[int]:
    """Padded lengths of the buckets ZeroConfig asks for, from the parameter sizes alone: trainable parameters in
    reverse registration order (the order backward produces their gradients), a new bucket whenever the next one
    would overflow ``bucket_numel`` elements, each bucket zero-padded to a multiple of the world size (1 for stage
    0, whose buckets are not split)."""
    sizes, current = [], 0
    for p in reversed([p for p in model.parameters() if p.requires_grad]):
        if current and current + p.numel() > bucket_numel:
            sizes.append(current)
            current = 0
        current += p.numel()
    sizes.append(current)
    return [-(-n // world_size) * world_size for n in sizes]


COMM_CASES = [CommCase(stage=s, accum=k) for s in (0, 1, 2) for k in (1, 4)] + [
    CommCase(stage=2, accum=1, bf16_fp32_comm=True)
]


@pytest.mark.parametrize("case", COMM_CASES, ids=lambda c: c.id)
def test_one_reduction_and_one_gather_of_the_padded_parameters(case: CommCase) -> None:
    # BUCKET_MB is 3000 elements of the 4-byte reduction dtype (fp32 parameters, or bf16 reduced in fp32)
    world = 1 if case.stage == 0 else 2
    buckets = _expected_buckets(_model(), int(BUCKET_MB * 2**20) // 4, world_size=world)
    assert 1 < len(buckets) < 20, buckets  # the model spans several buckets, so the count means something
    got = run_distributed(_count_step, 2, case)[0]
    ops = {}
    for op, nbytes in got["events"]:
        n, b = ops.get(op, (0, 0))
        ops[op] = (n + 1, b + nbytes)
    reduce_op = "reduce_scatter_tensor" if case.stage == 2 else "all_reduce"
    # stage 0 copies the updated masters into the working parameters on every rank: nothing to gather
    assert set(ops) == ({reduce_op} if case.stage == 0 else {reduce_op, "all_gather_into_tensor"}), ops
    param_bytes = 2 if case.bf16_fp32_comm else 4
    # one reduction per bucket per optimizer step whatever the accumulation (no_sync defers it), fp32 in every
    # case, and one all-gather of the updated working parameters
    assert ops[reduce_op] == (len(buckets), sum(buckets) * 4), (ops, buckets)
    if case.stage > 0:
        assert ops["all_gather_into_tensor"] == (len(buckets), sum(buckets) * param_bytes), (ops, buckets)


# ---- fp16 overflow ------------------------------------------------------------------------------------------------
def _fp16_run(seeds: list[int], inject_at: int | None, stage: int) -> dict:
    model = _model().half()
    opt = ZeroOptimizer(
        _adamw(model),
        model=model,
        config=ZeroConfig(stage=stage, bucket_size_mb=BUCKET_MB),
        loss_scale=LossScaleConfig(),
    )
    rank = dist.get_rank()
    for step, seed in enumerate(seeds):
        ids, labels = make_batch(batch_size=4, seq_len=16, vocab_size=64, seed=seed)
        loss = TinyTransformer.loss(model(ids[rank * 2 : rank * 2 + 2]), labels[rank * 2 : rank * 2 + 2])
        if step == inject_at and rank == 1:
            loss = loss * float("inf")  # one rank's gradients overflow: every rank must skip
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    steps = {float(s["step"]) for s in opt.state.values()}
    return {
        "params": {n: p.detach().float().clone() for n, p in model.named_parameters()},
        "scale": opt.loss_scale,
        "overflows": opt.scaler.overflow_count,
        "steps": steps,
    }


@pytest.mark.parametrize("stage", [0, 2], ids=lambda s: f"zero{s}")
def test_fp16_overflow_skips_exactly_that_step_and_recovers(stage: int) -> None:
    hit = run_distributed(_fp16_run, 2, [0, 1, 2, 3, 4], inject_at=2, stage=stage)
    clean = run_distributed(_fp16_run, 2, [0, 1, 3, 4], inject_at=None, stage=stage)
    for r in (0, 1):
        assert hit[r]["overflows"] == 1 and clean[r]["overflows"] == 0
        assert hit[r]["steps"] == {4.0}  # the optimizer state never saw the skipped step
        assert hit[r]["scale"] == clean[r]["scale"] == 2.0**16  # hysteresis 2: one overflow does not back off
        assert_close(hit[r]["params"], clean[r]["params"], rtol=0.0, atol=0.0, name=f"rank {r}")


# ---- resharding -------------------------------------------------------------------------------------------------
def _train_and_save(steps: int) -> dict:
    rank, dp = dist.get_rank(), dist.get_world_size()
    model = _model()
    opt = ZeroOptimizer(_adamw(model), model=model, config=ZeroConfig(stage=2, bucket_size_mb=BUCKET_MB))
    for step in range(steps):
        ids, labels = make_batch(batch_size=8, seq_len=16, vocab_size=64, seed=step)
        rows = _rows(rank, 0, dp, 8 // dp)
        opt.backward(TinyTransformer.loss(model(ids[rows]), labels[rows]))
        opt.step()
        opt.zero_grad()

    def cpu(d):
        return {k: (v.tensor.detach().clone(), v.spec) for k, v in d.items()}

    return {"model": cpu(opt.model_sharded_state_dict()), "optim": cpu(opt.sharded_state_dict()),
            "groups": opt.param_groups_state(), "full": opt.state_dict()}  # fmt: skip


def _load_and_continue(full: dict, groups: list, start: int, steps: int) -> list:
    rank, dp = dist.get_rank(), dist.get_world_size()
    model = _model()
    model.embed.weight.data.normal_()  # garbage: everything must come from the checkpoint
    opt = ZeroOptimizer(_adamw(model), model=model, config=ZeroConfig(stage=2, bucket_size_mb=BUCKET_MB / 3))

    def read(name: str, spec: ShardSpec, dtype: torch.dtype) -> torch.Tensor:
        return spec.cut(full[name]).to(dtype)

    opt.load_model_sharded_state_dict(read)
    opt.load_sharded_state_dict(read)
    opt.load_param_groups_state(groups)
    out = []
    for step in range(start, start + steps):
        ids, labels = make_batch(batch_size=8, seq_len=16, vocab_size=64, seed=step)
        rows = _rows(rank, 0, dp, 8 // dp)
        opt.backward(TinyTransformer.loss(model(ids[rows]), labels[rows]))
        opt.step()
        opt.zero_grad()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def test_state_saved_at_dp4_continues_identically_at_dp2() -> None:
    saved = run_distributed(_train_and_save, 4, 3)
    pieces: dict[str, list] = {}
    for rank_state in saved:
        for part in ("model", "optim"):
            for name, (tensor, spec) in rank_state[part].items():
                pieces.setdefault(name, []).append(LocalShard(tensor, spec))
    full = {name: assemble(p) for name, p in pieces.items()}
    assert "blocks.0.qkv.bias" in full and "blocks.0.qkv.bias.exp_avg" not in full  # frozen: weights only
    assert full["head.weight.step"].item() == 3.0
    for rank_state in saved:  # the gathered full state agrees with the assembled pieces on every rank
        for pname, entry in rank_state["full"]["state"].items():
            for key, tensor in entry.items():
                assert torch.equal(tensor, full[f"{pname}.{key}"]), f"{pname}.{key}"
    got = run_distributed(_load_and_continue, 2, full, saved[0]["groups"], 3, 3)[0]
    ref = _reference(6, 8)
    for i, step in enumerate(range(3, 6)):
        assert_close(got[i], ref[step], rtol=1e-6, atol=1e-7, name=f"params after step {step}")


# ---- parameters without gradients -----------------------------------------------------------------------------
class _WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tiny = _model()
        torch.manual_seed(5)
        self.aux = nn.Linear(32, 32)  # used on rank 0 only (with weight 0), so rank 1 never gets its gradient


def _train_with_unused(steps: int) -> dict:
    rank = dist.get_rank()
    model = _WithUnused()
    opt = ZeroOptimizer(_adamw(model), model=model, config=ZeroConfig(stage=2, bucket_size_mb=BUCKET_MB))
    for step in range(steps):
        ids, labels = make_batch(batch_size=4, seq_len=16, vocab_size=64, seed=step)
        for i in range(2):
            rows = _rows(rank, 0, 2, 2)
            with opt.no_sync() if i == 0 else contextlib.nullcontext():
                loss = TinyTransformer.loss(model.tiny(ids[rows]), labels[rows]) / 2
                if rank == 0:
                    loss = loss + 0.0 * model.aux(torch.ones(32)).sum()
                opt.backward(loss)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.tiny.named_parameters()}


def test_unused_and_frozen_parameters_neither_hang_nor_break_buckets() -> None:
    got = run_distributed(_train_with_unused, 2, 3, timeout=60)
    ref = _reference(3, 4)[-1]
    for r in (0, 1):
        assert_close(got[r], ref, rtol=1e-6, atol=1e-7, name=f"rank {r}")


# ---- gradient norm over extra groups ---------------------------------------------------------------------------
def _norms_with_extra_group() -> tuple[float, float, float, float]:
    rank = dist.get_rank()
    model = _model()
    opt = ZeroOptimizer(_adamw(model), model=model, config=ZeroConfig(stage=2, bucket_size_mb=BUCKET_MB))
    ids, labels = make_batch(batch_size=4, seq_len=16, vocab_size=64, seed=0)
    opt.backward(TinyTransformer.loss(model(ids[rank * 2 : rank * 2 + 2]), labels[rank * 2 : rank * 2 + 2]))
    # A stand-in for a tensor-parallel group whose ranks hold other parameters: here both ranks of the group
    # hold the same pieces, so their squared norms add up to twice the data-parallel one.
    extra = dist.new_group([0, 1])
    plain = opt.grad_norm().item()
    with_extra = opt.grad_norm(extra_groups=[extra]).item()
    clipped_from = opt.clip_grad_norm(plain / 4).item()
    return plain, with_extra, clipped_from, opt.grad_norm().item()


def test_grad_norm_sums_over_extra_groups_and_clips() -> None:
    for plain, with_extra, clipped_from, after in run_distributed(_norms_with_extra_group, 2):
        assert with_extra == pytest.approx(plain * 2**0.5, rel=1e-6)
        assert clipped_from == pytest.approx(plain, rel=1e-6)
        assert after == pytest.approx(plain / 4, rel=1e-5)


# ---- FP8 communication ------------------------------------------------------------------------------------------
def _fp8_train(stage: int, fp8: bool, steps: int) -> dict:
    torch.manual_seed(0)
    model = _model()
    opt = ZeroOptimizer(
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, eps=EPS),
        model=model,
        config=ZeroConfig(stage=stage, bucket_size_mb=BUCKET_MB, fp8_communication=fp8),
    )
    losses, events = [], []
    for step in range(steps):
        ids, labels = make_batch(batch_size=4, seq_len=16, vocab_size=64, seed=step % 4)
        rows = _rows(dist.get_rank(), 0, 2, 2)
        with CollectiveCounter() if step == 0 else contextlib.nullcontext() as cc:
            loss = TinyTransformer.loss(model(ids[rows]), labels[rows])
            opt.backward(loss)
            opt.step()
        if cc is not None:
            events = [(e.op, e.nbytes) for e in cc.events]
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / 2)
    return {"losses": losses, "events": events}


@pytest.mark.parametrize("stage", [1, 2])
def test_fp8_gradients_move_a_quarter_of_the_bytes_and_train_alike(stage: int) -> None:
    # fp32 parameters: every gradient value one byte instead of four, plus a 4-byte scale a block of FP8_BLOCK
    steps, world = 25, 2
    exact = run_distributed(_fp8_train, 2, stage, False, steps)[0]
    fp8 = run_distributed(_fp8_train, 2, stage, True, steps)[0]
    buckets = _expected_buckets(_model(), int(BUCKET_MB * 2**20) // 4, world_size=world)
    ops: dict[str, list[int]] = {}
    for op, nbytes in fp8["events"]:
        ops.setdefault(op, []).append(nbytes)
    blocks = [-(-(n // world) // FP8_BLOCK) for n in buckets]  # per rank's slice of each bucket
    wire = [
        world * b * (FP8_BLOCK + 4) for b in blocks
    ]  # a byte a value (padded to whole blocks), a scale a block
    # the gradient: an all-to-all of each rank's slices (stage 1 then gathers the sums back, in FP8 too); the
    # updated parameters are gathered in fp32
    assert sorted(ops["all_to_all_single"]) == sorted(wire), ops
    fp32_params = [4 * n for n in buckets]
    gathered = fp32_params + (wire if stage == 1 else [])
    assert sorted(ops["all_gather_into_tensor"]) == sorted(gathered), ops
    assert set(ops) == {"all_to_all_single", "all_gather_into_tensor"}, ops
    # the same loss band after 25 steps of AdamW
    first, last = exact["losses"][0], exact["losses"][-1]
    assert last < 0.7 * first, exact["losses"]
    assert fp8["losses"][0] == first  # the first forward runs before any communication
    assert abs(fp8["losses"][-1] - last) <= 0.03 * last, (fp8["losses"][-1], last)
