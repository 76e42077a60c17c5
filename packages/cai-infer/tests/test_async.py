"""AsyncInferenceEngine: concurrent streams get the same tokens as the synchronous engine; leaving a stream early
aborts its request."""

from __future__ import annotations

import asyncio
import contextlib

from cai.infer import AsyncInferenceEngine, InferenceConfig, InferenceEngine, SamplingParams

CONFIG = InferenceConfig(dtype="fp32", block_size=4, max_input_len=32, max_output_len=8)
PROMPTS = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3], [1, 1, 2]]


def test_concurrent_streams_match_the_synchronous_engine(make_model, engines):
    model = make_model("llama")
    sync = InferenceEngine(model, None, CONFIG)
    engines.append(sync)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    _, want = sync.generate(prompts_token_ids=PROMPTS, generation_config=params, return_token_ids=True)

    engine = AsyncInferenceEngine(model, None, CONFIG)
    engines.append(engine.engine)

    async def collect(prompt):
        outs = [out async for out in engine.generate(prompt_token_ids=prompt, sampling_params=params)]
        assert [len(o.token_ids) for o in outs] == list(range(1, 7)) and outs[-1].finished
        return outs[-1].token_ids

    async def leave_early():
        stream = engine.generate(prompt_token_ids=[3, 3, 3], sampling_params=params, request_id="early")
        async with contextlib.aclosing(stream):
            async for out in stream:
                if len(out.token_ids) == 2:
                    break
        assert "early" not in engine.engine._requests  # aborted as the stream closed, blocks freed
        assert not any(s.request_id == "early" for s in engine.engine.scheduler.running)

    async def main():
        results = await asyncio.gather(*(collect(p) for p in PROMPTS), leave_early())
        return results[:3]

    assert asyncio.run(main()) == want
    assert not engine.engine.has_unfinished_requests()
