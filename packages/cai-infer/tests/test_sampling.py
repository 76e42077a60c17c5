"""Sampling: the masks against transformers' logits processors, seeded sampling against a reference sampler that
recomputes the whole sequence with transformers each step, batch independence, stop tokens, repetition penalty."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from cai.infer import InferenceConfig, InferenceEngine, SamplingParams
from cai.infer._sampling import apply_penalties_and_masks, min_p_mask, top_k_mask, top_p_mask

CONFIG = InferenceConfig(dtype="fp32", block_size=4, max_input_len=32, max_output_len=12)


def _hf_processors(p: SamplingParams) -> list:
    # transformers' generate order: repetition penalty, temperature, top-k, top-p, min-p
    procs = [RepetitionPenaltyLogitsProcessor(p.repetition_penalty)]
    if not p.greedy:
        procs += [TemperatureLogitsWarper(p.temperature)]
        procs += [TopKLogitsWarper(p.top_k)] if p.top_k else []
        procs += [TopPLogitsWarper(p.top_p)] if p.top_p < 1 else []
        procs += [MinPLogitsWarper(p.min_p)] if p.min_p > 0 else []
    return procs


def test_masks_match_transformers():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    ids = torch.zeros(6, 1, dtype=torch.long)
    for k in (1, 5, 50):
        assert torch.equal(top_k_mask(logits, k), TopKLogitsWarper(k)(ids, logits.clone()))
    for p in (0.05, 0.5, 0.9, 0.999):
        assert torch.equal(top_p_mask(logits, p), TopPLogitsWarper(p)(ids, logits.clone()))
    for m in (0.01, 0.2, 1.0):
        assert torch.equal(min_p_mask(logits, m), MinPLogitsWarper(m)(ids, logits.clone()))
    # the most likely token survives every mask
    top = logits.argmax(-1)
    for masked in (top_k_mask(logits, 1), top_p_mask(logits, 1e-6), min_p_mask(logits, 1.0)):
        assert torch.equal(masked.argmax(-1), top) and (masked.isfinite().sum(-1) == 1).all()


def test_penalty_and_processor_chain_match_transformers():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 40, generator=g) * 2
    history = [[1, 2, 2, 39], [0], [5, 6, 7]]
    params = [
        SamplingParams(
            do_sample=True, temperature=0.7, top_k=10, top_p=0.8, min_p=0.05, repetition_penalty=1.3
        ),
        SamplingParams(repetition_penalty=2.0),  # greedy: only the penalty applies
        SamplingParams(do_sample=True, temperature=1.5, repetition_penalty=0.8),
    ]
    got = apply_penalties_and_masks(logits, params, history)
    for i, p in enumerate(params):
        want = logits[i : i + 1].clone()
        for proc in _hf_processors(p):
            want = proc(torch.tensor([history[i]]), want)
        torch.testing.assert_close(got[i : i + 1], want, rtol=0, atol=1e-6)


def _reference_sample(model, prompt: list[int], p: SamplingParams, new: int, stop: set[int]) -> list[int]:
    # Recompute the whole sequence with transformers each step, apply the same processors, draw with the same
    # per-request generator.
    gen = torch.Generator().manual_seed(p.seed)
    seq = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(new):
            logits = model(torch.tensor([seq])).logits[:, -1].float()
            for proc in _hf_processors(p):
                logits = proc(torch.tensor([seq]), logits)
            token = int(torch.multinomial(logits.softmax(-1)[0], 1, generator=gen))
            seq.append(token)
            out.append(token)
            if token in stop:
                break
    return out


SAMPLED = [
    SamplingParams(do_sample=True, temperature=0.9, top_k=20, seed=11),
    SamplingParams(do_sample=True, top_p=0.7, repetition_penalty=1.2, seed=12),
    SamplingParams(do_sample=True, temperature=1.3, min_p=0.1, seed=13),
]


def test_seeded_sampling_matches_reference_sampler_alone_and_batched(make_model, engines):
    model = make_model("llama")
    prompts = [[5, 9, 3], [100, 7, 7, 8, 1, 2, 40], [17]]
    eos = {model.generation_config.eos_token_id}
    want = [_reference_sample(model, pr, p, 8, eos) for pr, p in zip(prompts, SAMPLED, strict=True)]
    engine = InferenceEngine(model, None, CONFIG)
    engines.append(engine)
    # alone, then all three in one batch together with a greedy request: each request's own generator makes its
    # tokens independent of what it is batched with
    for pr, p, w in zip(prompts, SAMPLED, want, strict=True):
        _, got = engine.generate(
            prompts_token_ids=[pr], generation_config=_with_new(p, 8), return_token_ids=True
        )
        assert got == [w]
    for pr, p in zip(prompts, SAMPLED, strict=True):
        engine.add_request(prompts_token_ids=pr, sampling_params=_with_new(p, 8))
    engine.add_request(prompts_token_ids=[1, 2, 3, 4, 5], sampling_params=SamplingParams(max_new_tokens=8))
    _, got = engine.generate(return_token_ids=True)
    assert got[:3] == want
    assert len({tuple(w) for w in want}) == 3


def _with_new(p: SamplingParams, n: int) -> SamplingParams:
    from dataclasses import replace

    return replace(p, max_new_tokens=n)


def test_stop_tokens_end_the_request_and_are_kept(make_model, engines):
    model = make_model("llama")
    engine = InferenceEngine(model, None, CONFIG)
    engines.append(engine)
    prompt = [3, 1, 4, 1, 5]
    _, (free_run,) = engine.generate(
        prompts_token_ids=[prompt], generation_config=SamplingParams(max_new_tokens=8, ignore_eos=True),
        return_token_ids=True,
    )  # fmt: skip
    stop = free_run[3]
    first = free_run.index(stop)
    engine.add_request(
        request_ids="s",
        prompts_token_ids=prompt,
        sampling_params=SamplingParams(max_new_tokens=8, stop_token_ids=(stop,)),
    )
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.token_ids for o in outs] == [
        free_run[: i + 1] for i in range(first + 1)
    ]  # streamed token by token
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert all(not o.finished for o in outs[:-1])


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_repetition_penalty_greedy_matches_generate(make_model, engines, penalty):
    model = make_model("qwen2")
    prompts = [[7, 7, 7, 8], [9, 1, 2, 3, 4, 5, 6]]
    want = []
    for pr in prompts:
        ids = model.generate(
            torch.tensor([pr]), max_new_tokens=10, do_sample=False, repetition_penalty=penalty, pad_token_id=0
        )
        want.append(ids[0, len(pr) :].tolist())
    engine = InferenceEngine(model, None, CONFIG)
    engines.append(engine)
    gen = GenerationConfig(max_new_tokens=10, repetition_penalty=penalty)
    _, got = engine.generate(prompts_token_ids=prompts, generation_config=gen, return_token_ids=True)
    assert got == want


def test_logprobs_match_generates_logits(make_model, engines):
    model = make_model("qwen2")
    prompt = [4, 8, 15, 16, 23, 42]
    ref = model.generate(
        torch.tensor([prompt]), max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    engine = InferenceEngine(model, None, CONFIG)
    engines.append(engine)
    engine.add_request(prompts_token_ids=prompt, sampling_params=SamplingParams(max_new_tokens=5, logprobs=3))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    final = outs[-1]
    assert final.token_ids == ref.sequences[0, len(prompt) :].tolist()
    assert len(final.logprobs) == 5
    for token, lp, logits in zip(final.token_ids, final.logprobs, ref.logits, strict=True):
        want = logits[0].float().log_softmax(-1)
        assert set(lp) == set(want.topk(3).indices.tolist()) | {token}
        for t, v in lp.items():
            assert abs(v - float(want[t])) < 1e-5
