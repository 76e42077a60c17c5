"""cai-pipeline's schedules with cai-zero stage 1 on the data-parallel axis (pp 2 x dp 2), against one process.

The zero-bubble V case checks that its deferred weight-gradient pass feeds cai-zero's gradient hooks, and the 1F1B
case that every backward of a step but the last runs inside ``no_sync()`` without changing the result.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from cai.mesh import ParallelDims
from cai.mesh.testing import CollectiveCounter, assert_close, run_distributed
from cai.pipeline import PipelineStageManager, build_schedule
from cai.zero import ZeroConfig, ZeroOptimizer

WIDTH, BLOCKS, BATCH, STEPS, M = 32, 4, 16, 5, 4


class Blocks(nn.Module):
    def __init__(self, blocks: list[nn.Module], first: bool) -> None:
        super().__init__()
        self.blocks, self.first = nn.ModuleList(blocks), first

    def forward(self, hidden, batch):
        h = batch["x"] if self.first else hidden["h"]
        for b in self.blocks:
            h = torch.tanh(b(h)) + h
        return {"h": h}


def _criterion(out, batch):
    return ((out["h"][:, :4] - batch["y"]) ** 2).mean()


def _blocks() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS)]


def _batches():
    g = torch.Generator().manual_seed(1)
    return [
        {"x": torch.randn(BATCH, WIDTH, generator=g), "y": torch.randn(BATCH, 4, generator=g)}
        for _ in range(STEPS)
    ]


def _reference():
    blocks = _blocks()
    model = Blocks(blocks, True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in _batches():
        loss = _criterion(model(None, batch), batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, blocks


def _train():
    mesh = ParallelDims(pp=2, dp=2).build_mesh()
    dp_group, dp_rank = mesh.group("dp"), mesh.coordinate("dp")
    ref_losses, ref_blocks = _reference()
    for name in ("1f1b", "zbv"):
        chunks = 2 if name == "zbv" else 1
        manager = PipelineStageManager(
            mesh, "pp", enable_interleave=chunks > 1, num_model_chunks=chunks, use_zbv=name == "zbv"
        )
        schedule = build_schedule(name, manager, num_microbatches=M)
        lay = schedule.plan(M).layout
        per, blocks, stages, owned = BLOCKS // lay.num_virtual, _blocks(), [], []
        for c in range(chunks):
            v = lay.virtual(manager.stage, c)
            stages.append(Blocks(blocks[v * per : (v + 1) * per], v == 0))
            owned += blocks[v * per : (v + 1) * per]
        model = nn.ModuleList(stages)
        opt = ZeroOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            model=model,
            config=ZeroConfig(stage=1),
            group=dp_group,
        )
        half = BATCH // 2
        for step, batch in enumerate(_batches()):
            mine = {k: v[dp_rank * half : (dp_rank + 1) * half] for k, v in batch.items()}
            with CollectiveCounter() as counter:
                out = schedule.forward_backward_step(model, iter([mine]), _criterion, opt)
            # one data-parallel reduction of the gradients per step, not one per micro-batch
            dp_ranks = tuple(dist.get_process_group_ranks(dp_group))
            reductions = [e for e in counter.events if e.op == "all_reduce" and e.group_ranks == dp_ranks]
            assert len(reductions) == len(opt.buckets), (name, len(reductions), len(opt.buckets))
            opt.step()
            opt.zero_grad()
            loss = out["loss"].detach().clone()
            dist.all_reduce(loss, group=dp_group)
            assert abs(loss.item() / 2 - ref_losses[step]) <= 1e-5 * abs(ref_losses[step]), (name, step)
        for i, b in enumerate(ref_blocks):
            for mb in owned:
                if mb is blocks[i]:
                    assert_close(
                        dict(mb.named_parameters()),
                        dict(b.named_parameters()),
                        rtol=1e-5,
                        atol=1e-6,
                        name=f"{name} block {i}",
                    )
    return True


def test_pipeline_with_zero1_on_dp_matches_one_process():
    assert run_distributed(_train, 4, timeout=300) == [True] * 4
