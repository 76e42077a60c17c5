"""Tensor-parallel inference at tp 2 on gloo: greedy tokens equal transformers' ``generate`` on the unsharded model,
for Llama, Qwen2 and a Llama with one kv head (replicated over the ranks), under arrivals, chunked prefill, prefix
sharing and forced preemption, all in one spawn; sampled requests without a seed agree across the ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import transformers
from transformers import GenerationConfig

from cai.infer import InferenceConfig, InferenceEngine, SamplingParams
from cai.mesh.testing import run_distributed

VOCAB = 251
NEW = 8
LENGTHS = (3, 13, 8, 1, 11)
SHARED = 6  # tokens every prompt starts with
# family -> (config class, model class, kv heads); one kv head over 2 ranks is replicated, one per rank
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, 2),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, 2),  # q/k/v biases
    "llama-mqa": (transformers.LlamaConfig, transformers.LlamaForCausalLM, 1),
}


def _model(family: str) -> torch.nn.Module:
    config_cls, model_cls, kv = FAMILIES[family]
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():  # well-separated greedy choices (see conftest.tiny_model)
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(0, VOCAB, (SHARED,), generator=g).tolist()
    return [prefix + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def _config(**kw) -> InferenceConfig:
    # A pool too small for every request at once (preemption), a step budget under the longest prompt (chunked
    # prefill), a batch limit under the number of requests.
    return InferenceConfig(
        dtype="fp32",
        tp_size=2,
        block_size=4,
        num_blocks=10,
        max_num_batched_tokens=6,
        max_batch_size=3,
        max_input_len=32,
        max_output_len=NEW,
        **kw,
    )


def _tp_worker(families: list[str]) -> dict:
    out: dict = {}
    for family in families:
        engine = InferenceEngine(_model(family), None, _config())
        kv = FAMILIES[family][2]
        assert engine.cache.k[0].shape[1] == max(kv // 2, 1), "each rank's cache holds its own kv heads"
        gen = GenerationConfig(max_new_tokens=NEW)
        finished: dict[str, list[int]] = {}
        pending = list(enumerate(_prompts()))
        while pending or engine.has_unfinished_requests():
            if pending:  # one arrival per step, while earlier requests decode
                i, p = pending.pop(0)
                engine.add_request(request_ids=i, prompts_token_ids=p, generation_config=gen)
            finished.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
            engine.scheduler.check()
        out[family] = {
            "greedy": [finished[str(i)] for i in range(len(LENGTHS))],
            "preemptions": engine.scheduler.num_preemptions,
            "hit_tokens": engine.blocks.num_hit_tokens,
            "free": (engine.blocks.num_free, engine.blocks.num_blocks),
        }
    # Sampled requests without a seed: each rank's global RNG differs here, so only the broadcast seed keeps the
    # ranks' tokens (and hence their schedulers) in step.
    torch.manual_seed(100 + dist.get_rank())
    engine = InferenceEngine(_model("llama"), None, _config())
    _, sampled = engine.generate(
        prompts_token_ids=_prompts()[:3],
        generation_config=SamplingParams(do_sample=True, temperature=1.5, max_new_tokens=NEW),
        return_token_ids=True,
    )
    out["sampled"] = sampled
    out["sampled_free"] = (engine.blocks.num_free, engine.blocks.num_blocks)
    try:
        InferenceEngine(_model("llama"), None, InferenceConfig(dtype="fp32", tp_size=4))
    except ValueError as e:
        out["world_error"] = str(e)
    return out


def _reference(family: str) -> list[list[int]]:
    model = _model(family)
    outs = []
    for p in _prompts():
        ids = model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        outs.append(ids[0, len(p) :].tolist())
    return outs


def test_tp2_greedy_matches_generate_on_the_unsharded_model():
    families = list(FAMILIES)
    ranks = run_distributed(_tp_worker, 2, families, timeout=600)
    for family in families:
        want = _reference(family)
        for rank, out in enumerate(ranks):
            got = out[family]
            assert got["greedy"] == want, f"{family} rank {rank}"
            assert got["preemptions"] > 0, "the small pool was meant to force preemption"
            assert got["hit_tokens"] > 0, "later prompts were meant to reuse the shared prefix's blocks"
            assert got["free"][0] == got["free"][1], "blocks leaked"
    assert max(LENGTHS) + SHARED > _config().token_budget  # the longest prompt is prefilled in chunks
    assert ranks[0]["sampled"] == ranks[1]["sampled"]
    assert all(len(t) == NEW for t in ranks[0]["sampled"])
    assert all(r["sampled_free"][0] == r["sampled_free"][1] for r in ranks)
    for r in ranks:
        assert "tp_size=4 but the default process group has 2 ranks" in r["world_error"]


def test_tp_without_a_process_group_is_refused():
    assert not dist.is_initialized()  # the tp tests run their ranks in worker processes
    with pytest.raises(RuntimeError, match=r"tp_size=2 needs torch\.distributed initialized with 2 ranks"):
        InferenceEngine(_model("llama"), None, InferenceConfig(dtype="fp32", tp_size=2))
