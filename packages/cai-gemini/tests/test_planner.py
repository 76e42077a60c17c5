"""The memory planner: model-data predictions against the tracker's measured bytes, and advice when nothing fits."""

from __future__ import annotations

import torch

from cai.gemini import ChunkConfig, GeminiConfig, MemoryTracker, TransformerShape, plan, shard
from cai.mesh.testing import TinyTransformer, make_batch

SHAPE = TransformerShape(hidden=32, layers=2, ffn=128, vocab=64, heads=4, kv_heads=4)
GiB = 1024**3


def _train_one_backward(config: GeminiConfig):
    model = TinyTransformer()
    tracker = MemoryTracker()
    gm, gopt = shard(model, torch.optim.Adam(model.parameters()), config=config, device="cpu", memory=tracker)
    ids, labels = make_batch()
    gopt.backward(gm.module.loss(gm(ids), labels))
    return gm, gopt, tracker


def test_predicted_model_data_matches_measured() -> None:
    chunk = ChunkConfig(chunk_size=4096, min_chunk_size_m=0)
    p = plan(TinyTransformer(), 4, 16, GiB, shape=SHAPE, precision="fp32", chunk=chunk)
    for name in ("optimizer on host", "optimizer+params on host"):
        row = p.row(name)
        _, gopt, tracker = _train_one_backward(row.config)
        gopt.step()
        measured = sum(tracker.model_bytes("host", k) for k in ("master", "optim", "grad32", "io"))
        assert measured == row.breakdown["host master+adam+transfer"], (name, measured, row.breakdown)
        on_device = sum(tracker.model_bytes("device", k) for k in ("master", "optim", "grad32"))
        assert on_device == 0, (name, on_device)
        shards = tracker.model_bytes("host", "param_shard")
        assert shards == row.breakdown.get("host parameter shards", 0), (name, shards, row.breakdown)


def test_device_model_data_matches_measured_with_bf16_gradients() -> None:
    chunk = ChunkConfig(chunk_size=4096, min_chunk_size_m=0)
    row = plan(TinyTransformer(), 4, 16, GiB, shape=SHAPE, precision="bf16", chunk=chunk).row("no offload")
    gm, gopt, tracker = _train_one_backward(row.config)
    trained = sum(c.master.numel() for c in gm.chunks if c.master is not None)
    assert tracker.model_bytes("device", "grad_lp") == 2 * trained  # one micro-batch's gradient, in bf16
    assert tracker.model_bytes("device", "grad32") == 0
    gopt.step()
    measured = sum(tracker.model_bytes("device", k) for k in ("master", "optim"))
    assert measured == row.breakdown["master+adam"], (measured, row.breakdown)


def test_table_prints_and_recommends_fastest_fit() -> None:
    p = plan(TinyTransformer(), 4, 16, GiB, shape=SHAPE)
    assert p.recommended is not None and p.recommended.name == "no offload"
    text = str(p)
    assert "optimizer on host" in text and "recommended: no offload" in text


def test_no_fit_says_what_would() -> None:
    # a 3B-like shape on the meta device against 8 GiB at batch 8: nothing fits; the advice names the budget
    # that would and a smaller batch that fits
    shape = TransformerShape(hidden=3072, layers=28, ffn=8192, vocab=128256, heads=24, kv_heads=8)
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(3072, 3072 * 4) for _ in range(20)])
    p = plan(
        model,
        8,
        2048,
        8 * GiB,
        host_budget_bytes=512 * GiB,
        shape=shape,
        chunk=ChunkConfig(chunk_size=64 << 20),
    )
    assert p.recommended is None
    assert "nothing fits" in p.advice and "GiB of device memory" in p.advice and "batch size" in p.advice, (
        p.advice
    )
    bigger = plan(model, 8, 2048, 80 * GiB, shape=shape, chunk=ChunkConfig(chunk_size=64 << 20))
    assert bigger.recommended is not None
    offload = bigger.row("optimizer on host")
    assert offload.device_bytes < bigger.row("no offload").device_bytes < 80 * GiB
    assert isinstance(offload.config, GeminiConfig) and offload.config.offload_optim_frac == 1.0
