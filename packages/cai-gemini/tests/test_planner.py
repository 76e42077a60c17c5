"""The memory planner: model-data predictions against the bytes really allocated, and advice when nothing fits."""

from __future__ import annotations

import gc

import pytest
import torch

from cai.gemini import ChunkConfig, GeminiConfig, TransformerShape, plan, shard
from cai.mesh.testing import TinyTransformer, make_batch

SHAPE = TransformerShape(hidden=32, layers=2, ffn=128, vocab=64, heads=4, kv_heads=4)
GiB = 1024**3


CHUNK = ChunkConfig(chunk_size=4096, min_chunk_size_m=0)
# Allocation happens a chunk at a time: a prediction may be off by at most one chunk of fp32 (16 KiB, 2% here).
TOLERANCE = 4 * CHUNK.chunk_size


class NewStorages:
    """Bytes of tensor storage allocated since construction and still alive, found by walking every live tensor.

    Independent of cai-gemini's own accounting: it sees whatever the code really allocated. Everything alive at
    construction is held until ``close()``, so no freed address is reused by a new buffer and counted as old.
    """

    def __init__(self) -> None:
        gc.collect()
        self._before = self._live()

    @staticmethod
    def _live() -> dict[int, torch.UntypedStorage]:
        out = {}
        for obj in gc.get_objects():
            # type(), not isinstance(): some module proxies warn when their __class__ is read
            if issubclass(type(obj), torch.Tensor) and not obj.is_meta:
                storage = obj.untyped_storage()
                try:
                    out[storage.data_ptr()] = storage
                except RuntimeError:  # a fake tensor (kept by a compiled graph of another test): no memory
                    continue
        return out

    def bytes(self) -> int:
        gc.collect()
        return sum(s.nbytes() for ptr, s in self._live().items() if ptr not in self._before)

    def close(self) -> None:
        self._before.clear()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("placement", ["no offload", "optimizer on host", "optimizer+params on host"])
def test_predicted_model_data_matches_allocated(precision: str, placement: str) -> None:
    row = plan(TinyTransformer(), 4, 16, GiB, shape=SHAPE, precision=precision, chunk=CHUNK).row(placement)
    b = row.breakdown
    wbytes = {"fp32": 4, "bf16": 2}[precision]
    params = b.get("parameter shards", 0) + b.get("host parameter shards", 0)
    optimizer = b.get("master+adam", 0) + b.get("host master+adam+transfer", 0)
    # one micro-batch's gradient stays in the working precision on the device (master+adam is 12 bytes per
    # trained element) unless the optimizer is on the host, where it lands in the transfer buffer counted above
    grad = wbytes * b["master+adam"] // 12 if "master+adam" in b else 0

    model = TinyTransformer()
    ids, labels = make_batch()
    new = NewStorages()
    gm, gopt = shard(model, torch.optim.Adam(model.parameters()), config=row.config, device="cpu")
    built = new.bytes()
    gopt.backward(gm.module.loss(gm(ids), labels))
    backward = new.bytes()
    gopt.step()
    stepped = new.bytes()
    new.close()
    assert abs(stepped - (params + optimizer + grad)) <= TOLERANCE, (stepped, params, optimizer, grad, b)
    if grad:  # backward adds exactly that gradient: bf16 under bf16, no fp32 copy with one micro-batch
        assert abs(backward - built - grad) <= TOLERANCE, (built, backward, grad)


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
