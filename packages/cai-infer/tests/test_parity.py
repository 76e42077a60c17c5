"""Greedy outputs equal transformers' ``generate`` token for token, for four families under every scheduling regime
(a mixed-length batch, requests arriving while others decode, forced preemption, prefix sharing, chunked prefill)
and two more (Qwen3; Gemma2 with soft-capping and alternating sliding windows) under all of them at once; and all
six under all of them at once with decode steps run through the decode graphs' padded buffers (eagerly: the
capture itself needs CUDA, see test_gpu.py), also with cai-kernels' modules, the residual adds carried into the
norms and the rotary in the K/V cache write."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch
from transformers import GenerationConfig

from cai.infer import InferenceConfig, InferenceEngine, SamplingParams, _attention
from cai.infer._residual import _CarriedLayer

NEW = 10
VOCAB = 251  # conftest's tiny models
FAMILIES = ["llama", "qwen2", "mistral", "gemma"]


@dataclass(frozen=True)
class Regime:
    name: str
    block_size: int = 4
    num_blocks: int | None = None  # None: enough for every request at once
    token_budget: int | None = None  # None: whole prompts in one step
    max_batch_size: int = 8
    arrive_every: int = 0  # > 0: add one request every this many steps instead of all at once
    shared_prefix: int = 0  # tokens every prompt starts with
    padded_decode: bool = False  # decode steps through DecodeGraphs' static buffers, padded to sizes 1, 2, 4
    # cai-kernels' modules (torch fallbacks on CPU), residual adds carried into the norms, rotary in the K/V write
    kernels: bool = False


REGIMES = [
    Regime("batch"),
    Regime("arrivals", arrive_every=2, max_batch_size=3),
    Regime("preempt", num_blocks=9),
    Regime("prefix", shared_prefix=9, arrive_every=3),
    Regime("chunked", token_budget=5, max_batch_size=4),
    Regime("all", num_blocks=10, token_budget=6, shared_prefix=6, arrive_every=1, max_batch_size=4),
]
# batches of 5 and 6 decode eagerly (over the largest size), of 3 pad to 4
PADDED = Regime(
    "all-padded",
    num_blocks=12,
    token_budget=8,
    shared_prefix=6,
    arrive_every=1,
    max_batch_size=6,
    padded_decode=True,
)
PADDED_KERNELS = dataclasses.replace(PADDED, name="all-padded-kernels", kernels=True)
# the families whose layers carry the residual and whose rotary cai-kernels patches (gemma's norms differ)
CARRIED = ("llama", "qwen2", "mistral", "qwen3")
LENGTHS = (3, 13, 8, 1, 17, 6)

_references: dict[tuple[str, int], list[list[int]]] = {}


def _prompts(shared: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(0, VOCAB, (shared,), generator=g).tolist()
    return [prefix + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def _reference(tiny_model, family: str, shared: int) -> list[list[int]]:
    # Each prompt alone (no padding) through transformers' generate; cached across regimes.
    key = (family, shared)
    if key not in _references:
        model = tiny_model(family)
        outs = []
        for p in _prompts(shared):
            ids = model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
            outs.append(ids[0, len(p) :].tolist())
        _references[key] = outs
    return _references[key]


CASES = (
    [(f, r) for f in FAMILIES for r in REGIMES]
    + [(f, REGIMES[-1]) for f in ("qwen3", "gemma2")]
    + [(f, PADDED) for f in (*FAMILIES, "qwen3", "gemma2")]
    + [(f, PADDED_KERNELS) for f in (*CARRIED, "gemma")]
)


@pytest.mark.parametrize(("family", "regime"), CASES, ids=[f"{f}-{r.name}" for f, r in CASES])
def test_greedy_matches_generate(family, regime, engines, make_model, monkeypatch):
    config = InferenceConfig(
        dtype="fp32",
        block_size=regime.block_size,
        num_blocks=regime.num_blocks,
        max_num_batched_tokens=regime.token_budget,
        max_batch_size=regime.max_batch_size,
        max_input_len=32,
        max_output_len=NEW,
        use_cuda_kernel=regime.kernels,
    )
    engine = InferenceEngine(make_model(family), None, config)
    engines.append(engine)
    carried = sum(isinstance(m, _CarriedLayer) for m in engine.model.modules())
    assert carried == (2 if regime.kernels and family in CARRIED else 0)
    fused_writes = []  # [Note: rotary in the cache write]: the rotary of every layer runs in the cache write
    fused = _attention.paged_rope_kv_write
    monkeypatch.setattr(_attention, "paged_rope_kv_write", lambda *a: fused_writes.append(1) or fused(*a))
    if regime.padded_decode:
        engine.runner.use_decode_graphs([1, 2, 4], config.max_blocks_per_sequence, capture=False)
        padded = []  # (sequences, size) of each replay
        graphs = engine.runner.graphs
        fill = graphs._fill
        graphs._fill = lambda tables, computed, ids, b: (
            padded.append((len(ids), b)) or fill(tables, computed, ids, b)
        )
    prompts = _prompts(regime.shared_prefix)
    gen = GenerationConfig(max_new_tokens=NEW)
    if regime.arrive_every:
        finished: dict[str, list[int]] = {}
        pending = list(enumerate(prompts))
        steps = 0
        while pending or engine.has_unfinished_requests():
            if pending and steps % regime.arrive_every == 0:
                i, p = pending.pop(0)
                engine.add_request(request_ids=i, prompts_token_ids=p, generation_config=gen)
            finished.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
            engine.scheduler.check()
            steps += 1
        assert (
            steps < len(prompts) * NEW
        )  # requests overlapped: later ones arrived while earlier ones decoded
        got = [finished[str(i)] for i in range(len(prompts))]
    else:
        _, got = engine.generate(prompts_token_ids=prompts, return_token_ids=True, generation_config=gen)
    assert got == _reference(make_model, family, regime.shared_prefix)
    assert bool(fused_writes) == (regime.kernels and family in CARRIED)
    if regime.num_blocks is not None:
        assert engine.scheduler.num_preemptions > 0, "the small pool was meant to force preemption"
    if regime.shared_prefix:
        assert engine.blocks.num_hit_tokens > 0, (
            "later prompts were meant to reuse the shared prefix's blocks"
        )
    if regime.padded_decode:
        assert (3, 4) in padded, f"no decode batch of 3 was padded to 4 (seen: {sorted(set(padded))})"
        assert graphs.num_ahead_used > 0  # greedy decode steps were launched ahead of their batch
    if regime.token_budget is not None:
        assert max(LENGTHS) + regime.shared_prefix > regime.token_budget  # the longest prompt is chunked


def test_steps_launched_ahead_are_dropped_when_the_batch_changes(engines, make_model):
    # [Note: launching ahead]: a request arriving while a step is in flight, and a stop token, change the next
    # batch; the step launched ahead is dropped and the outputs stay those of generate
    config = InferenceConfig(
        dtype="fp32", block_size=4, max_batch_size=4, max_input_len=32, max_output_len=NEW
    )
    engine = InferenceEngine(make_model("llama"), None, config)
    engines.append(engine)
    engine.runner.use_decode_graphs([1, 2, 4], config.max_blocks_per_sequence, capture=False)
    prompts = _prompts(0)[:3]
    want = _reference(make_model, "llama", 0)[:3]
    stop = want[2][3]  # the third request stops at its fourth token
    want[2] = want[2][: want[2].index(stop) + 1]
    finished: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        params = SamplingParams(max_new_tokens=NEW, stop_token_ids=[stop] if i == 2 else [])
        engine.add_request(request_ids=i, prompts_token_ids=p, sampling_params=params)
        for _ in range(4):  # the next request arrives while these decode with a step in flight
            finished.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    assert [finished[str(i)] for i in range(3)] == want
    graphs = engine.runner.graphs
    assert 0 < graphs.num_ahead_used < graphs.num_ahead, (graphs.num_ahead_used, graphs.num_ahead)


def test_a_single_stream_launches_every_decode_step_ahead(engines, make_model):
    # A token that starts a new block gets it a step early (Scheduler._reserve_next), so block boundaries do not stop
    # launching ahead: every decode step but the first is launched ahead and used, and no block is left over.
    config = InferenceConfig(
        dtype="fp32", block_size=4, max_batch_size=1, max_input_len=32, max_output_len=NEW
    )
    engine = InferenceEngine(make_model("llama"), None, config)
    engines.append(engine)
    engine.runner.use_decode_graphs([1], config.max_blocks_per_sequence, capture=False)
    prompt = _prompts(0)[1]  # 13 tokens: decode crosses the blocks at 16, 20 and 24
    _, got = engine.generate(
        prompts_token_ids=[prompt],
        return_token_ids=True,
        generation_config=GenerationConfig(max_new_tokens=NEW),
    )
    assert got == [_reference(make_model, "llama", 0)[1]]
    graphs = engine.runner.graphs
    # the prefill samples the first token, the first decode step the second; each later one was launched ahead
    # except after the step that samples the last token
    assert graphs.num_ahead == graphs.num_ahead_used == NEW - 2, (graphs.num_ahead, graphs.num_ahead_used)
