"""Multi-process training through the Booster: mixed precision under every plugin, and no_sync skipping
communication during gradient accumulation. (fp32 step-by-step parity for every plugin is the parity matrix in
integration-tests/test_parity_matrix.py.)"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from cai.booster import Booster
from cai.booster.plugin import GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin, TorchFSDPPlugin
from cai.mesh.testing import CollectiveCounter, TinyTransformer, make_batch, run_distributed

STEPS = 8


@dataclass(frozen=True, kw_only=True)
class PrecisionCase:
    plugin: str
    precision: str

    @property
    def id(self) -> str:
        return f"{self.plugin}-{self.precision}"


def build(plugin: str, precision: str) -> tuple[Booster, object]:
    if plugin == "ddp":
        return Booster(plugin=TorchDDPPlugin(), mixed_precision=precision, device="cpu"), None
    factory = {
        "fsdp": lambda: TorchFSDPPlugin(precision=precision),
        # Colossal-AI's default initial_scale for ZeRO is 2**32, which skips the first ~30 fp16 steps.
        "zero1": lambda: LowLevelZeroPlugin(stage=1, precision=precision, initial_scale=2**16),
        "zero2": lambda: LowLevelZeroPlugin(stage=2, precision=precision, initial_scale=2**16),
        "gemini": lambda: GeminiPlugin(precision=precision),
    }
    return Booster(plugin=factory[plugin](), device="cpu"), None


def _train(plugin: str, precision: str) -> list[float]:
    booster, _ = build(plugin, precision)
    model = TinyTransformer(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt, *_ = booster.boost(model, opt)
    rank, world = dist.get_rank(), dist.get_world_size()
    ids, labels = make_batch(batch_size=4, seq_len=16, seed=0)
    losses = []
    for _ in range(STEPS):
        x, y = ids.chunk(world)[rank], labels.chunk(world)[rank]
        loss = TinyTransformer.loss(model(x), y)
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    scaler = getattr(opt, "scaler", None)
    if precision == "fp16" and plugin in ("ddp", "fsdp", "zero1", "zero2"):
        assert scaler is not None and scaler.scale > 1, "fp16 must train with a loss scaler"
    if precision == "bf16":
        assert scaler is None, "bf16 never uses a loss scaler"
    return losses


PRECISION_CASES = [
    PrecisionCase(plugin=p, precision=m)
    for p in ("ddp", "fsdp", "zero1", "zero2", "gemini")
    for m in ("bf16", "fp16")
]


@pytest.mark.parametrize("case", PRECISION_CASES, ids=lambda c: c.id)
def test_mixed_precision_trains_close_to_fp32(case: PrecisionCase) -> None:
    low = run_distributed(_train, 2, case.plugin, case.precision)[0]
    ref = run_distributed(_train, 2, case.plugin, "fp32")[0]
    # Same trajectory as fp32 within the precision's rounding, and the loss goes down.
    torch.testing.assert_close(torch.tensor(low), torch.tensor(ref), rtol=3e-2, atol=0)
    assert low[-1] < low[0] - 0.05


def _count_no_sync(plugin: str) -> dict[str, int]:
    booster, _ = build(plugin, "fp32")
    model = TinyTransformer(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, *_ = booster.boost(model, opt)
    ids, labels = make_batch(batch_size=2, seq_len=8, seed=1)
    with CollectiveCounter() as inside, booster.no_sync(model, opt):
        booster.backward(TinyTransformer.loss(model(ids), labels), opt)
    with CollectiveCounter() as outside:
        booster.backward(TinyTransformer.loss(model(ids), labels), opt)
        opt.step()
    return {"inside": len(inside.events), "outside": len(outside.events)}


@pytest.mark.parametrize("plugin", ["zero1", "zero2", "gemini"])
def test_no_sync_skips_gradient_communication(plugin: str) -> None:
    for counts in run_distributed(_count_no_sync, 2, plugin):
        assert counts["inside"] == 0 and counts["outside"] > 0, counts


def _ddp_no_sync_equivalence() -> bool:
    """Under DDP, two micro-steps with no_sync on the first equal one step on the joined batch."""
    booster = Booster(plugin=TorchDDPPlugin(), device="cpu")
    model = TinyTransformer(seed=0)
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ref = TinyTransformer(seed=0)
    ids, labels = make_batch(batch_size=8, seq_len=8, seed=2)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine_ids, mine_labels = ids.chunk(world)[rank], labels.chunk(world)[rank]
    for i, (x, y) in enumerate(zip(mine_ids.chunk(2), mine_labels.chunk(2))):
        ctx = booster.no_sync(model, opt) if i == 0 else torch.enable_grad()
        with ctx:
            booster.backward(TinyTransformer.loss(model(x), y) / 2, opt)
    TinyTransformer.loss(ref(ids), labels).backward()
    for (_, p), (_, q) in zip(model.unwrap().named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    return True


def test_ddp_no_sync_accumulation_matches_the_joined_batch() -> None:
    assert run_distributed(_ddp_no_sync_equivalence, 2) == [True, True]
