"""The layout-independent state protocol (``cai.mesh.ShardedState`` / ``ShardedOptimizerState``), checked the same
way against every class that implements it.

Each implementation trains two steps on two gloo ranks, reports its pieces, and a second instance built from other
weights loads them back through ``load_sharded_state_dict``: its pieces must then equal the first one's bit for
bit. Optimizers also round-trip their param groups, and refuse groups that hold other parameter names. A new
sharded class (a tensor- or pipeline-parallel module) adds one ``Impl`` line to ``IMPLS``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist

from cai.mesh import LocalShard, ShardedOptimizerState, ShardedState, assemble
from cai.mesh.testing import TinyTransformer, make_batch, run_distributed

Step = Callable[[int], None]


def _zero_optimizer(seed: int) -> tuple[Any, Step]:
    from cai.zero import ZeroConfig, ZeroOptimizer

    model = TinyTransformer(seed=seed)
    zo = ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        model=model,
        config=ZeroConfig(stage=2, bucket_size_mb=0.01),
    )

    def step(s: int) -> None:
        ids, labels = make_batch(batch_size=4, seed=s)
        zo.backward(model.loss(model(ids), labels))
        zo.step()
        zo.zero_grad()

    return zo, step


def _gemini(seed: int) -> tuple[Any, Any, Step]:
    from cai.gemini import ChunkConfig, GeminiConfig, shard

    model = TinyTransformer(seed=seed)
    cfg = GeminiConfig(precision="fp32", chunk=ChunkConfig(chunk_size=3000, min_chunk_size_m=0))
    gm, gopt = shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=cfg, device="cpu")

    def step(s: int) -> None:
        ids, labels = make_batch(batch_size=4, seed=s)
        gopt.backward(gm.module.loss(gm(ids), labels))
        gopt.step()
        gopt.zero_grad()

    return gm, gopt, step


def _gemini_model(seed: int) -> tuple[Any, Step]:
    gm, _, step = _gemini(seed)
    return gm, step


def _gemini_optimizer(seed: int) -> tuple[Any, Step]:
    _, gopt, step = _gemini(seed)
    return gopt, step


def _shardformer_model(seed: int) -> tuple[Any, Step]:
    """A tiny Llama at tp 2 (vocabulary 251 padded to 256: the padding never appears in a piece)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from cai.shardformer import ShardConfig, ShardFormer

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=251, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    model, _ = ShardFormer(ShardConfig()).optimize(LlamaForCausalLM(config))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(s: int) -> None:
        ids = torch.randint(0, 251, (2, 8), generator=torch.Generator().manual_seed(s))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    return model, step


@dataclass(frozen=True, kw_only=True)
class Impl:
    name: str
    build: Callable[[int], tuple[Any, Step]]  # seed -> (the object under test, one training step)
    optimizer: bool  # implements ShardedOptimizerState, not only ShardedState


IMPLS = [
    Impl(name="zero-optimizer", build=_zero_optimizer, optimizer=True),
    Impl(name="gemini-model", build=_gemini_model, optimizer=False),
    Impl(name="gemini-optimizer", build=_gemini_optimizer, optimizer=True),
    Impl(name="shardformer-tp-model", build=_shardformer_model, optimizer=False),
]


def _copy(pieces: dict[str, LocalShard]) -> dict[str, LocalShard]:
    return {k: LocalShard(v.tensor.detach().cpu().clone(), v.spec) for k, v in pieces.items()}


def _full_tensors(pieces: dict[str, LocalShard]) -> dict[str, torch.Tensor]:
    """Every rank's pieces put together into full tensors (a stand-in for a checkpoint)."""
    everyone: list[dict[str, LocalShard]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, pieces)
    by_name: dict[str, list[LocalShard]] = {}
    for rank_pieces in everyone:
        for name, piece in rank_pieces.items():
            by_name.setdefault(name, []).append(piece)
    return {name: assemble(ps) for name, ps in by_name.items()}


def _round_trip(impl: Impl) -> None:
    obj, step = impl.build(0)
    assert isinstance(obj, ShardedOptimizerState if impl.optimizer else ShardedState)
    for s in range(2):
        step(s)
    saved = _copy(obj.sharded_state_dict())
    assert saved, f"{impl.name} reports no state after two steps"
    full = _full_tensors(saved)

    other, _ = impl.build(1)  # other weights, no state yet: only the load can make it match
    other.load_sharded_state_dict(lambda name, spec, dtype: spec.cut(full[name]).to(dtype))
    loaded = other.sharded_state_dict()
    assert sorted(loaded) == sorted(saved), impl.name
    for name, piece in saved.items():
        assert loaded[name].spec == piece.spec, name
        assert torch.equal(loaded[name].tensor.detach().cpu(), piece.tensor), name

    if impl.optimizer:
        groups = obj.param_groups_state()
        json.dumps(groups)  # JSON-able as written to a checkpoint
        for g in other.param_groups:
            g["lr"] = 0.5
        other.load_param_groups_state(groups)
        assert other.param_groups_state() == groups
        renamed = [{**g, "params": [f"other.{n}" for n in g["params"]]} for g in groups]
        with pytest.raises(ValueError, match="param group 0 holds other parameters than the saved one"):
            other.load_param_groups_state(renamed)
        with pytest.raises(ValueError, match="the checkpoint has 2 param groups but the optimizer has 1"):
            other.load_param_groups_state(groups + groups)


@pytest.mark.parametrize("impl", IMPLS, ids=lambda impl: impl.name)
def test_state_protocol_round_trip(impl: Impl) -> None:
    run_distributed(_round_trip, 2, impl, timeout=300)
