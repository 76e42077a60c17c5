"""Dropout under tp: equal masks on replicated activations, different masks on parallel ones, and a tp=2 Llama
with attention dropout matching one process whose masks are replayed from the tracker's seeds."""

import contextlib
import copy
import importlib.util
import pathlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cai.mesh.testing import assert_close, run_distributed
from cai.shardformer import (
    DropoutForParallelInput,
    DropoutForReplicatedInput,
    RNGStatesTracker,
    ShardConfig,
    ShardFormer,
    get_rng_tracker,
)
from cai.shardformer._dropout import PARALLEL, REPLICATED, parallel_seed

_spec = importlib.util.spec_from_file_location(
    "_shardformer_policy_tests", pathlib.Path(__file__).with_name("test_policies.py")
)
_tp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tp)


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _replay_tracker(seed: int, tp: int) -> RNGStatesTracker:
    """One process's copy of every tp rank's streams."""
    ref = RNGStatesTracker()
    ref.add(REPLICATED, seed)
    for r in range(tp):
        ref.add(f"{PARALLEL}-{r}", parallel_seed(seed, r))
    return ref


def _layer_masks():
    rank, tp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100 + rank)  # the global RNG differs per rank: the tracker must not depend on it
    replicated = DropoutForReplicatedInput.from_native_module(torch.nn.Dropout(0.5))
    parallel = DropoutForParallelInput.from_native_module(torch.nn.Dropout(0.5))
    tracker = get_rng_tracker()
    assert replicated.tracker is tracker is parallel.tracker  # one tracker per tp group
    ref = _replay_tracker(tracker.seeds[REPLICATED], tp)
    x = torch.ones(4, 64)
    before = torch.get_rng_state()
    for _ in range(2):  # the streams advance: the second draw is a new mask, replayed as well
        rep = _gather(replicated(x))
        par = _gather(parallel(x))
        assert all(torch.equal(rep[0], m) for m in rep[1:]), "replicated masks differ across tp ranks"
        assert not any(torch.equal(par[0], m) for m in par[1:]), "parallel masks are equal across tp ranks"
        with ref.fork(REPLICATED):
            assert torch.equal(rep[0], F.dropout(x, 0.5))
        for r in range(tp):
            with ref.fork(f"{PARALLEL}-{r}"):
                assert torch.equal(par[r], F.dropout(x, 0.5))
    assert torch.equal(torch.get_rng_state(), before), "tracked dropout consumed the global RNG"
    replicated.eval()
    assert replicated(x) is x


@contextlib.contextmanager
def _replayed_attention_dropout(ref: RNGStatesTracker, tp: int):
    """Inside, F.dropout on attention probabilities (B, heads, S, S) draws each rank's heads from that rank's
    replayed PARALLEL stream, as the tp model does on its local heads."""
    native = F.dropout

    def dropout(x, p=0.5, training=True, inplace=False):
        if not training or p == 0.0:
            return x
        assert x.dim() == 4, x.shape  # Llama's only dropout is on the attention probabilities
        parts = []
        for r, chunk in enumerate(x.chunk(tp, dim=1)):
            with ref.fork(f"{PARALLEL}-{r}"):
                parts.append(native(chunk.contiguous(), p, training=True))
        return torch.cat(parts, dim=1)

    F.dropout = dropout
    try:
        yield
    finally:
        F.dropout = native


def _train_with_attention_dropout():
    tp = dist.get_world_size()
    ref = _tp._tiny("llama")
    ref.config.attention_dropout = 0.3
    for layer in ref.model.layers:
        layer.self_attn.attention_dropout = 0.3
    ref.set_attn_implementation("eager")  # dropout as F.dropout on the probabilities, replayable
    model = copy.deepcopy(ref)
    model, _ = ShardFormer(ShardConfig()).optimize(model)
    replay = _replay_tracker(get_rng_tracker().seeds[REPLICATED], tp)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    g = torch.Generator().manual_seed(5)
    losses = []
    for step in range(3):
        ids = torch.randint(0, _tp.VOCAB, (_tp.B, _tp.S), generator=g)
        with _replayed_attention_dropout(replay, tp):
            ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert_close(loss, ref_loss, rtol=1e-5, name=f"step {step} loss")
        _tp._close(
            _tp.gathered(model, grads=True), {n: p.grad for n, p in ref.named_parameters()}, f"{step} grad"
        )
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
        losses.append(loss.item())
    # The dropout is really on (without it the same weights give another loss), and it draws from the tracker,
    # not the global RNG, under SDPA (dropout inside the fused op) as under eager.
    ids = torch.randint(0, _tp.VOCAB, (_tp.B, _tp.S), generator=g)
    with torch.no_grad():
        for impl in ("eager", "sdpa"):
            model.set_attn_implementation(impl)
            before = torch.get_rng_state()
            on = model(input_ids=ids, labels=ids).loss
            assert torch.equal(torch.get_rng_state(), before), (
                f"{impl}: attention dropout used the global RNG"
            )
            model.eval()
            off = model(input_ids=ids, labels=ids).loss
            model.train()
            assert (on - off).abs() > 1e-3, (impl, on, off)
    return losses


def test_tracked_dropout_masks_and_attention_dropout_parity():
    run_distributed(_layer_masks, 2)
    run_distributed(_train_with_attention_dropout, 2, timeout=300)
