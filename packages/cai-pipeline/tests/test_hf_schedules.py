"""Every schedule on tiny Hugging Face models cut by ``build_stages``, against the same model trained in one process.

The matrix: pp 2 and 4 x GPipe, 1F1B, interleaved (2 chunks) and zero-bubble V x pp and 2 * pp micro-batches x
Llama and Qwen2 (sliding-window attention on every block after the first two, so each stage must build the masks
of its own blocks' types) x tied and untied embeddings. Each configuration trains 10 AdamW steps on pooled gloo
ranks; every rank compares its losses and its parameters with the one-process run (computed once per model in each
worker) and the P2P volume with one hidden-state tensor per micro-batch, stage boundary and direction.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import pathlib
import sys
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from cai.mesh import ParallelDims
from cai.mesh.testing import assert_close, run_distributed
from cai.pipeline import PipelineStageManager, build_schedule, build_stages


def _stage_tests():
    """test_stages.py, for its ``tiny`` models and ``batch_for`` (shared with test_composition.py)."""
    name = "_pipeline_stage_tests"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, pathlib.Path(__file__).with_name("test_stages.py")
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look their module up while being created
        spec.loader.exec_module(module)
    return sys.modules[name]


_st = _stage_tests()

# 8 blocks fill pp 4 x 2 chunks; a batch of 8 splits into 2, 4 and 8 micro-batches. HIDDEN is tiny()'s width.
STEPS, LAYERS, BATCH, SEQ, HIDDEN = 10, 8, 8, 8, 32
# Adam divides each element by its own gradient's size, so an element whose gradient is near zero (a sum of terms
# that nearly cancel) moves by lr * g / (|g| + eps): a rounding error dg of the micro-batch split's summation order
# moves it by up to lr * dg / eps. Measured here: at step 1 an embedding element's gradient of -7.70e-6 is
# -7.69e-6 when the batch is split in two (its row's largest gradient is 0.07, so dg = 1.5e-8 is fp32 rounding), and
# with eps = 1e-6 or 1e-5 the element ends 10 steps 1.7e-6 to 3.9e-6 away from the one-process run, in one process
# with plain gradient accumulation as well. eps = 1e-4 bounds that amplification by 10 (the worst element is then at
# a third of the tolerance) and is still below three quarters of the nonzero gradient elements (median 4e-4).
ADAM = dict(lr=1e-3, eps=1e-4)
RTOL, ATOL = 1e-5, 1e-6


@dataclass(frozen=True)
class Case:
    family: str
    tie: bool
    pp: int
    schedule: str  # a build_schedule name
    microbatches: int

    @property
    def chunks(self) -> int:
        return 2 if self.schedule in ("interleaved", "zbv") else 1

    def __str__(self) -> str:
        tie = "tied" if self.tie else "untied"
        return f"{self.family}-{tie}-pp{self.pp}-{self.schedule}-m{self.microbatches}"


CASES = [
    Case(family=f, tie=t, pp=pp, schedule=s, microbatches=k * pp)
    for f, t, pp, s, k in itertools.product(
        ("llama", "qwen2"), (True, False), (2, 4), ("gpipe", "1f1b", "interleaved", "zbv"), (1, 2)
    )
]


def _model(family: str, tie: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return _st.tiny(family, tie, layers=LAYERS)[0]  # in eval mode: no dropout, as in the one-process run


def _batches() -> list[dict]:
    return [_st.batch_for(100 + step, batch=BATCH, seq=SEQ) for step in range(STEPS)]


@functools.cache
def _reference(family: str, tie: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final parameters of the model trained in one process (cached: each worker computes it once)."""
    model = _model(family, tie)
    opt = torch.optim.AdamW(model.parameters(), **ADAM)
    losses = []
    for batch in _batches():
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.named_parameters(remove_duplicate=False)}


def _train_and_compare(case: Case) -> float:
    """Train ``case`` on this rank, check it against the one-process run; return the worst loss relative error."""
    ref_losses, ref_params = _reference(case.family, case.tie)
    zbv = case.schedule == "zbv"
    manager = PipelineStageManager(
        ParallelDims(pp=case.pp).build_mesh(),
        "pp",
        enable_interleave=case.chunks > 1,
        num_model_chunks=case.chunks,
        use_zbv=zbv,
    )
    pm = build_stages(_model(case.family, case.tie), manager)
    schedule = build_schedule(case.schedule, manager, num_microbatches=case.microbatches)
    opt = torch.optim.AdamW(pm.parameters(), **ADAM)
    data = iter(_batches())
    losses = []
    for _ in range(STEPS):
        # the loss is the last virtual stage's: pipeline rank pp - 1, or rank 0 at the bottom of the V
        out = schedule.forward_backward_step(pm, data, lambda o, _b: o["loss"], opt)
        pm.sync_shared_params()
        opt.step()
        opt.zero_grad()
        losses.append(out["loss"].item())

    rank = manager.stage
    where = f"{case} rank {rank}"
    assert losses == pytest.approx(ref_losses, rel=RTOL), f"{where}: {losses} != {ref_losses}"
    mine = pm.global_named_parameters()
    for name, p in mine:
        assert_close(p, ref_params[name], rtol=RTOL, atol=ATOL, name=f"{where} {name}")
    # Every parameter lives on exactly one rank (a tied head's copy on the last stage under the head's name; under
    # the V both ends are on rank 0, which holds the weight once).
    names: list[list[str]] = [[] for _ in range(case.pp)]
    dist.all_gather_object(names, [n for n, _ in mine])
    held = [n for rank_names in names for n in rank_names]
    assert len(held) == len(set(held)), (
        f"{where}: held twice: {[n for n, c in Counter(held).items() if c > 1]}"
    )
    missing = set(ref_params) - set(held) - ({"lm_head.weight"} if case.tie and zbv else set())
    assert not missing and set(held) <= set(ref_params), f"{where}: missing {missing}"

    # P2P per micro-batch and stage boundary: the hidden states forward and their gradient back, fp32, nothing else.
    rank_of = {manager.slot(c, s): s for s in range(case.pp) for c in range(case.chunks)}
    hidden = (BATCH // case.microbatches) * SEQ * HIDDEN * 4
    expected: Counter[tuple[int, str]] = Counter()
    for slot in manager.stage_indices:
        for direction, peer_slot in (("fwd", slot + 1), ("bwd", slot - 1)):
            peer = rank_of.get(peer_slot, rank)  # no neighbour, or one on this rank: nothing is sent
            if peer != rank:
                expected[(peer, direction)] += hidden * STEPS * case.microbatches
    assert schedule.p2p_bytes == dict(expected), (
        f"{where}: P2P bytes (to stage, direction) {schedule.p2p_bytes}, expected {dict(expected)} "
        f"({hidden} per micro-batch and crossing)"
    )
    return max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_schedule_matches_one_process(case: Case) -> None:
    worst = run_distributed(_train_and_compare, case.pp, case, timeout=300)
    print(f"{case}: worst loss relative error per rank {worst}")
