"""Speculative decoding: the acceptance rule on explicit distributions, greedy outputs equal to transformers'
``generate`` with prompt-lookup and draft-model drafters, and no block leaked by revoked drafts."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from cai.infer import InferenceConfig, InferenceEngine, SamplingParams
from cai.infer._speculative import acceptance_probabilities, residual_distribution, verify

VOCAB = 251

PAIRS = [  # (p, q) over four tokens
    ([0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]),
    ([0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5]),  # disjoint: every draft rejected
    ([0.25, 0.25, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25]),  # equal: every draft accepted
    ([0.7, 0.1, 0.1, 0.1], [0.0, 1.0, 0.0, 0.0]),  # a point mass, as prompt lookup proposes
]


@pytest.mark.parametrize(("p", "q"), PAIRS)
def test_acceptance_rule_emits_the_target_distribution_exactly(p, q):
    p, q = torch.tensor(p, dtype=torch.float64), torch.tensor(q, dtype=torch.float64)
    vocab = torch.arange(4).tolist()
    accept = acceptance_probabilities(p.expand(4, 4), q.expand(4, 4), vocab)  # each token as the draft
    # P(emit x) = P(draft x) P(accept x) + P(reject) residual(x)
    reject = 1 - (q * accept).sum()
    emitted = q * accept + reject * residual_distribution(p, q)
    torch.testing.assert_close(emitted, p, rtol=0, atol=1e-12)


def test_verify_samples_the_target_distribution():
    # The sampler itself: draft tokens drawn from q, verified against p; the first emitted token's frequencies
    # match p, and with two drafts so do the second token's given an accepted first one.
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.6, 0.1, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.1, 0.1, 0.7]])
    params = SamplingParams(do_sample=True)
    g = torch.Generator().manual_seed(0)
    n = 2000
    first = torch.zeros(4)
    second = torch.zeros(4)
    drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g) for i in range(2)], 1)
    for d in drafts.tolist():
        out = verify(p.log(), d, q, params, g)
        first[out[0]] += 1
        if out[0] == d[0]:
            second[out[1]] += 1
    torch.testing.assert_close(first / n, p[0], rtol=0, atol=0.04)
    torch.testing.assert_close(second / second.sum(), p[1], rtol=0, atol=0.06)
    # a deterministic drafter (prompt lookup: q is a point mass on the draft) keeps p too
    first.zero_()
    for _ in range(n):
        first[verify(p.log(), [1, 2], None, params, g)[0]] += 1
    torch.testing.assert_close(first / n, p[0], rtol=0, atol=0.04)


def _target(seed: int = 0) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def _first_layer_draft(target: torch.nn.Module) -> torch.nn.Module:
    # A smaller model that often agrees with the target: its first layer, embeddings and head.
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = 1
    draft = transformers.LlamaForCausalLM(config).eval()
    draft.load_state_dict(target.state_dict(), strict=False)
    return draft


def _unrelated_draft() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    torch.manual_seed(3)
    return transformers.LlamaForCausalLM(config).eval()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    motif = torch.randint(0, VOCAB, (5,), generator=g).tolist()
    return [
        motif * 3,  # repeats: prompt lookup finds drafts
        torch.randint(0, VOCAB, (7,), generator=g).tolist(),
        motif + torch.randint(0, VOCAB, (4,), generator=g).tolist() + motif[:3],
        [motif[0]],
    ]


def test_greedy_speculative_decoding_matches_generate():
    target = _target()
    new = 12
    cases = [
        ("lookup", None, {}),
        ("first-layer", _first_layer_draft(target), {}),
        ("unrelated", _unrelated_draft(), {}),
        ("lookup-penalty", None, {"repetition_penalty": 1.3}),
        ("first-layer-penalty", _first_layer_draft(target), {"repetition_penalty": 1.3}),
    ]
    prompts = _prompts()
    references = {}
    rejected = 0
    for name, drafter, extra in cases:
        key = tuple(sorted(extra.items()))
        if key not in references:
            references[key] = [
                target.generate(
                    torch.tensor([p]), max_new_tokens=new, do_sample=False, pad_token_id=0, **extra
                )[0, len(p) :].tolist()
                for p in prompts
            ]
        # A small pool forces preemption while drafts hold blocks; block_size 4 makes drafts cross blocks.
        config = InferenceConfig(
            dtype="fp32", block_size=4, num_blocks=14, max_input_len=16, max_output_len=new, max_batch_size=4
        )
        engine = InferenceEngine(copy.deepcopy(target), None, config)
        engine.enable_spec_dec(drafter, n_spec_tokens=3)
        params = SamplingParams(max_new_tokens=new, ignore_eos=True, **extra)
        engine.add_request(
            [f"r{i}" for i in range(len(prompts))], prompts_token_ids=prompts, sampling_params=params
        )
        outs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out.token_ids
            engine.scheduler.check()
        got = [outs[f"r{i}"] for i in range(len(prompts))]
        assert got == references[key], name
        assert engine.num_free_blocks == 14, name
        if name != "lookup-penalty":  # (the penalty keeps the output from repeating: nothing to look up)
            assert engine.num_drafted > 0, name
        if name not in ("unrelated", "lookup-penalty"):
            assert engine.num_accepted > 0, name  # the verified path accepted drafts, not only rejected them
        rejected += engine.num_drafted - engine.num_accepted
    assert rejected > 0  # some drafts were revoked


def test_sampled_speculative_decoding_with_an_identical_drafter_accepts_everything():
    # p == q at every position (the drafter is the target and processes logits the same way), so every draft
    # is accepted: checks that both sides see the same history, penalties and processors.
    target = _target()
    config = InferenceConfig(
        dtype="fp32", block_size=4, max_input_len=16, max_output_len=10, max_batch_size=2
    )
    engine = InferenceEngine(copy.deepcopy(target), None, config)
    engine.enable_spec_dec(copy.deepcopy(target), n_spec_tokens=3)
    params = SamplingParams(
        max_new_tokens=10,
        do_sample=True,
        temperature=1.5,
        top_k=20,
        repetition_penalty=1.2,
        seed=1,
        ignore_eos=True,
    )
    _, tokens = engine.generate(
        prompts_token_ids=_prompts()[:2], generation_config=params, return_token_ids=True
    )
    assert [len(t) for t in tokens] == [10, 10]
    assert engine.num_drafted > 0 and engine.num_accepted == engine.num_drafted
    assert engine.num_free_blocks == config.total_blocks


def test_logprobs_and_stop_tokens_under_speculative_decoding():
    # Several tokens per step: each still gets its own logprobs row, and a stop token among accepted drafts ends
    # the request there (the drafts after it are dropped).
    target = _target()
    prompts = _prompts()[:1]
    config = InferenceConfig(dtype="fp32", block_size=4, max_input_len=16, max_output_len=10)
    plain = InferenceEngine(copy.deepcopy(target), None, config)
    params = SamplingParams(max_new_tokens=10, logprobs=2, ignore_eos=True)
    (want,) = plain.generate(prompts_token_ids=prompts, generation_config=params, return_token_ids=True)[1]
    for stop in (None, want[4]):
        outs = []
        for spec in (False, True):
            engine = InferenceEngine(copy.deepcopy(target), None, config)
            if spec:
                engine.enable_spec_dec(_first_layer_draft(target), n_spec_tokens=3)
            p = SamplingParams(
                max_new_tokens=10, logprobs=2, ignore_eos=True, stop_token_ids=() if stop is None else (stop,)
            )
            engine.add_request("a", prompts_token_ids=prompts[0], sampling_params=p)
            last = None
            while engine.has_unfinished_requests():
                last = engine.step()[-1]
            outs.append(last)
            if spec:
                assert engine.num_accepted > 0
            assert engine.num_free_blocks == config.total_blocks
        base, spec_out = outs
        assert spec_out.token_ids == base.token_ids
        assert spec_out.finish_reason == base.finish_reason
        assert len(spec_out.logprobs) == len(spec_out.token_ids)
        for a, b in zip(spec_out.logprobs, base.logprobs, strict=True):
            assert a.keys() == b.keys()
            for t in a:
                assert abs(a[t] - b[t]) < 1e-4
    assert base.token_ids == want[: want.index(stop) + 1] and base.finish_reason == "stop"


def test_spec_dec_switches():
    target = _target()
    engine = InferenceEngine(
        target, None, InferenceConfig(dtype="fp32", use_spec_dec=True, max_n_spec_tokens=2)
    )
    assert engine.use_spec_dec and engine.n_spec_tokens == 2
    engine.disable_spec_dec()
    assert not engine.use_spec_dec
    with pytest.raises(ValueError, match="target model itself"):
        engine.enable_spec_dec(target)
    with pytest.raises(ValueError, match="vocabulary has 97 tokens but the target's has 251"):
        engine.enable_spec_dec(
            transformers.LlamaForCausalLM(
                transformers.LlamaConfig(
                    vocab_size=97,
                    hidden_size=16,
                    intermediate_size=32,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                )
            )
        )
    with pytest.raises(NotImplementedError, match="use_glide_drafter"):
        engine.enable_spec_dec(use_glide_drafter=True)
    engine.clear_spec_dec()
    assert engine._drafter is None
