"""Single-process logic tests: chunk-size search, packing, configuration checks, tensor states, memory tracking."""

from __future__ import annotations

import pytest
import torch

from cai.gemini import ChunkConfig, GeminiConfig, MemoryTracker, search_chunk_size, shard
from cai.gemini._chunk import _TRANSITIONS, TensorState
from cai.gemini._search import pack
from cai.mesh.testing import TinyTransformer, make_batch

M = 1024**2


def test_pack_in_order_with_oversized_param() -> None:
    assert pack([3, 3, 3, 10, 2], 6) == [[0, 1], [2], [3], [4]]


@pytest.mark.parametrize(
    ("numels", "kwargs", "size", "waste"),
    [
        # eight hidden x hidden matrices: the smallest size that holds a whole number of them wastes nothing
        ([1024 * 1024] * 8, dict(search_range_m=2, search_interval=1024, min_chunk_size_m=1), 1 * M, 0),
        # 3 x 1.5M: a 3M chunk holds two with nothing left; the third leaves 1.5M of its chunk unused
        (
            [3 * M // 2] * 3,
            dict(search_range_m=4, search_interval=M // 2, min_chunk_size_m=1),
            int(1.5 * M),
            0,
        ),
        # 2M then 1M, 1M: 2M chunks waste nothing
        ([2 * M, M, M], dict(search_range_m=1, search_interval=M // 4, min_chunk_size_m=0.5), 2 * M, 0),
        # 3M, 1M, 3M, 1M: 4M chunks hold (3M, 1M) twice with no waste; smaller sizes leave gaps
        ([3 * M, M, 3 * M, M], dict(search_range_m=2, search_interval=M // 2, min_chunk_size_m=1), 4 * M, 0),
    ],
)
def test_search_known_sizes(numels: list[int], kwargs: dict, size: int, waste: int) -> None:
    result = search_chunk_size(numels, **kwargs)
    assert (result.chunk_size, result.waste) == (size, waste), str(result)


def test_search_reports_waste_and_rounds_to_world() -> None:
    numels = [1000, 3000, 2000, 500]
    r = search_chunk_size(
        numels, search_range_m=0.01, search_interval=100, min_chunk_size_m=0.001, world_size=4
    )
    assert r.chunk_size % 4 == 0
    groups = pack(numels, r.chunk_size)
    used = [sum(numels[i] for i in g) for g in groups]
    assert r.waste == sum(max(r.chunk_size, u) - u for u in used) and r.num_chunks == len(groups)
    assert 0 <= r.waste_frac < 1 and "waste" in str(r)


def test_small_group_stays_gathered_and_exlarge_filtered() -> None:
    r = search_chunk_size([100, 200], min_chunk_size_m=1, world_size=2)
    assert r.keep_gathered and r.chunk_size == 300
    # one huge embedding must not set the chunk size for the rest
    numels = [M // 4] * 30 + [64 * M]
    filtered = search_chunk_size(numels, search_range_m=0, search_interval=M // 4, min_chunk_size_m=0)
    unfiltered = search_chunk_size(
        numels, search_range_m=0, search_interval=M // 4, min_chunk_size_m=0, filter_exlarge_params=False
    )
    assert filtered.chunk_size == M // 4 and unfiltered.chunk_size == 64 * M


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(placement_policy="cuda"), "placement_policy"),
        (dict(precision="fp8"), "precision"),
        (dict(offload_optim_frac=1.5), "offload_optim_frac=1.5"),
        (dict(shard_param_frac=0.5, offload_param_frac=0.5), "shard_param_frac=1.0"),
        (dict(placement_policy="auto", offload_optim_frac=0.5), "placement_policy='static'"),
        (dict(max_prefetch=-1), "max_prefetch"),
        (dict(norm_type=1.0), "norm_type"),
    ],
)
def test_config_errors_name_the_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        GeminiConfig(**kwargs)
    with pytest.raises(ValueError, match="chunk_size"):
        ChunkConfig(chunk_size=0)


def test_state_transitions_are_the_documented_ones() -> None:
    assert TensorState.COMPUTE in _TRANSITIONS[TensorState.FREE]
    assert TensorState.HOLD_AFTER_BWD in _TRANSITIONS[TensorState.READY_FOR_REDUCE]
    assert TensorState.FREE not in _TRANSITIONS[TensorState.READY_FOR_REDUCE]  # gradients are never dropped
    assert set(_TRANSITIONS) == set(TensorState)


def test_rejects_unsupported_optimizer() -> None:
    model = TinyTransformer()
    with pytest.raises(TypeError, match="SGD is not supported"):
        shard(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            config=GeminiConfig(precision="fp32"),
            device="cpu",
        )


def test_released_chunks_hold_no_memory_and_params_keep_identity() -> None:
    model = TinyTransformer()
    weight = model.blocks[0].up.weight
    tracker = MemoryTracker()
    cfg = GeminiConfig(
        precision="fp32", offload_param_frac=1.0, chunk=ChunkConfig(chunk_size=3000, min_chunk_size_m=0)
    )
    gm, _ = shard(model, None, config=cfg, device="cpu", memory=tracker)
    assert gm.module.blocks[0].up.weight is weight
    assert weight.untyped_storage().nbytes() == 0  # released after construction
    assert tracker.model_bytes("device", "gathered") == sum(
        c.chunk_size * 4 for c in gm.chunks if c.keep_gathered
    )
    ids, _ = make_batch()
    with torch.no_grad():
        gm(ids)
    assert weight.untyped_storage().nbytes() == 0  # inference releases everything at the end
    assert tracker.moved["h2d"] > 0


@pytest.mark.parametrize("max_prefetch", [0, 1, 2])
def test_prefetch_keeps_a_bounded_window_gathered(max_prefetch: int, monkeypatch) -> None:
    # Parameters on the host: every chunk is gathered when used and released after. The recorded order visits a
    # chunk more than once (a block's weights are read in turns), so chunks prefetched earlier and not yet used must
    # count against the window, or each access would gather one more until the whole model was on the device.
    from cai.gemini._chunk import Chunk

    model = TinyTransformer(layers=6)
    cfg = GeminiConfig(
        precision="fp32", offload_param_frac=1.0, offload_optim_frac=1.0, max_prefetch=max_prefetch,
        chunk=ChunkConfig(chunk_size=3000, min_chunk_size_m=0),
    )  # fmt: skip
    gm, gopt = shard(model, torch.optim.Adam(model.parameters()), config=cfg, device="cpu")
    most = [0]
    gather = Chunk.gather

    def counting(self, *args, **kwargs):
        gather(self, *args, **kwargs)
        most[0] = max(most[0], sum(c.gathered for c in gm.chunks if not c.keep_gathered))

    monkeypatch.setattr(Chunk, "gather", counting)
    ids, labels = make_batch()
    for _ in range(3):  # the first step records the order; prefetching starts in the second
        gopt.backward(gm.module.loss(gm(ids), labels))
        gopt.step()
        gopt.zero_grad()
    releasable = sum(not c.keep_gathered for c in gm.chunks)
    assert releasable >= 6, releasable
    # the chunks in use (a module's weights can span two) plus the prefetch window
    assert most[0] <= 2 + max_prefetch, (most[0], releasable)


def test_bf16_and_fp16_train_single_process() -> None:
    for precision in ("bf16", "fp16"):
        model = TinyTransformer()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        cfg = GeminiConfig(
            precision=precision, offload_optim_frac=1.0, chunk=ChunkConfig(min_chunk_size_m=0.001)
        )
        gm, gopt = shard(model, opt, config=cfg, device="cpu")
        losses = []
        for step in range(8):
            ids, labels = make_batch(seed=step % 2)
            loss = gm.module.loss(gm(ids), labels)
            gopt.backward(loss)
            gopt.step()
            gopt.zero_grad()
            losses.append(loss.item())
        assert losses[-1] < losses[0] - 0.5, (precision, losses)
        assert gm.chunks[0].full.dtype == cfg.working_dtype and gm.chunks[0].master.dtype == torch.float32


def test_fp16_overflow_skips_step_and_backs_off() -> None:
    from cai.gemini import LossScaleConfig

    model = TinyTransformer()
    cfg = GeminiConfig(
        precision="fp16",
        chunk=ChunkConfig(min_chunk_size_m=0.001),
        loss_scale=LossScaleConfig(initial_scale=2.0**10, hysteresis=1),
    )
    gm, gopt = shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=cfg, device="cpu")
    before = gm.state_dict()
    ids, labels = make_batch()
    gopt.backward(gm.module.loss(gm(ids), labels) * float("inf"))
    gopt.step()
    assert gopt.skipped_steps == 1 and gm.loss_scale == 2.0**9
    for k, v in gm.state_dict().items():
        assert torch.equal(v, before[k]), k
    gopt.zero_grad()
    gopt.backward(gm.module.loss(gm(ids), labels))
    gopt.step()
    assert gopt.skipped_steps == 1 and not torch.equal(gm.state_dict()["head.weight"], before["head.weight"])


def test_bf16_gradient_stays_in_working_precision_and_updates_exactly() -> None:
    """One micro-batch's gradient is kept in bf16 (no fp32 gradient buffer exists) and the update it produces is
    bitwise the update from the same gradient in fp32; a second micro-batch moves the sum to fp32."""
    import copy

    from cai.kernels.optim import adam_update

    model = TinyTransformer().to(torch.bfloat16)
    ref = copy.deepcopy(model)
    masters = {n: p.detach().float().clone() for n, p in ref.named_parameters()}
    moments = {n: (torch.zeros_like(m), torch.zeros_like(m)) for n, m in masters.items()}
    cfg = GeminiConfig(precision="bf16", chunk=ChunkConfig(min_chunk_size_m=0.001))
    gm, gopt = shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=cfg, device="cpu")
    for step in range(1, 4):
        ids, labels = make_batch(seed=step)
        gopt.backward(gm.module.loss(gm(ids), labels))
        assert all(
            c.grad32 is None and c.grad_lp.dtype == torch.bfloat16 for c in gm.chunks if c.master is not None
        )
        gopt.step()
        gopt.zero_grad()
        ref.zero_grad()
        ref.loss(ref(ids), labels).backward()
        for n, p in ref.named_parameters():
            m, v = moments[n]
            adam_update(masters[n], p.grad.float(), m, v, step=step, lr=1e-2, weight_decay=0.01)
            p.data.copy_(masters[n])
    got = gm.state_dict()
    for n, master in masters.items():
        assert torch.equal(got[n], master), n

    ids, labels = make_batch(seed=9)
    for _ in range(2):  # plain accumulation: the second backward folds both into fp32
        gopt.backward(gm.module.loss(gm(ids), labels))
    assert all(c.grad_lp is None and c.grad32_valid for c in gm.chunks if c.master is not None)


def test_model_and_optimizer_are_freed_with_their_last_reference() -> None:
    import gc
    import weakref

    model = TinyTransformer()
    cfg = GeminiConfig(
        offload_optim_frac=1.0, overlap_host_step=True, chunk=ChunkConfig(min_chunk_size_m=0.001)
    )
    gm, gopt = shard(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=cfg, device="cpu")
    ids, labels = make_batch()
    gopt.backward(gm.module.loss(gm(ids), labels))
    gopt.step()
    refs = [weakref.ref(gm), weakref.ref(gopt), weakref.ref(gm.chunks[0].master)]
    del gm, gopt, model  # the wrapped module needs its GeminiModel (its hooks gather the chunks): both go
    gc.collect()
    assert [r() for r in refs] == [None, None, None]  # the parameters' hooks did not keep the chunks alive


def test_fp16_loss_scale_is_saved_and_resumed() -> None:
    """An fp16 run's loss scale and skipped-step count survive ``state_dict``/``load_state_dict``: a resumed run
    goes on with the backed-off scale, not the initial one."""
    from cai.gemini import LossScaleConfig

    def build():
        cfg = GeminiConfig(
            precision="fp16",
            chunk=ChunkConfig(min_chunk_size_m=0.001),
            loss_scale=LossScaleConfig(initial_scale=2.0**10, hysteresis=1),
        )
        model = TinyTransformer()
        return shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=cfg, device="cpu")

    gm, gopt = build()
    ids, labels = make_batch()
    for _ in range(2):  # two overflowing steps: the scale backs off twice
        gopt.backward(gm.module.loss(gm(ids), labels) * float("inf"))
        gopt.step()
        gopt.zero_grad()
    gopt.backward(gm.module.loss(gm(ids), labels))
    gopt.step()
    assert gm.loss_scale == 2.0**8 and gopt.skipped_steps == 2
    saved = gopt.state_dict()
    assert saved["loss_scaler"]["scale"] == 2.0**8

    gm2, gopt2 = build()
    assert gm2.loss_scale == 2.0**10
    gopt2.load_state_dict(saved)
    assert gm2.loss_scale == 2.0**8 and gopt2.skipped_steps == 2
    assert gopt2.scaler.state_dict() == gopt.scaler.state_dict()


def test_overlapped_host_step_is_the_default_where_exact() -> None:
    assert GeminiConfig().overlaps_host_step
    assert not GeminiConfig(max_norm=1.0).overlaps_host_step
    assert not GeminiConfig(precision="fp16").overlaps_host_step
    assert not GeminiConfig(overlap_host_step=False).overlaps_host_step


def test_overlapped_host_step_refuses_a_second_backward_and_the_norm() -> None:
    """By default host chunks are updated during backward: a second synchronised backward before step() and
    reading or clipping the norm afterwards would be silently wrong, so each raises naming the fixes."""
    model = TinyTransformer()
    cfg = GeminiConfig(precision="fp32", offload_optim_frac=1.0, chunk=ChunkConfig(min_chunk_size_m=0.001))
    gm, gopt = shard(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=cfg, device="cpu")
    ids, labels = make_batch()
    gopt.backward(gm.module.loss(gm(ids), labels))
    with pytest.raises(RuntimeError, match=r"second synchronised backward.*no_sync.*overlap_host_step=False"):
        gopt.backward(gm.module.loss(gm(ids), labels))
    with pytest.raises(ValueError, match=r"clip_grad_norm_.*pass max_norm"):
        gopt.clip_grad_norm_(1.0)
    with pytest.raises(ValueError, match=r"grad_norm.*overlap_host_step=None"):
        gopt.grad_norm()
    gopt.step()
    gopt.zero_grad()
    with gm.no_sync():  # accumulation the overlapped step allows
        gopt.backward(gm.module.loss(gm(ids), labels))
    gopt.backward(gm.module.loss(gm(ids), labels))
    gopt.step()


def test_overlapped_host_step_needs_the_static_policy() -> None:
    assert not GeminiConfig(placement_policy="auto").overlaps_host_step
    with pytest.raises(ValueError, match="overlap_host_step=True needs placement_policy='static'"):
        GeminiConfig(placement_policy="auto", overlap_host_step=True)
