"""Tensor-parallel serving at tp 2 on gloo, in one spawn: rank 0 takes the requests (AsyncInferenceEngine, the
LockstepDriver itself, ``cai serve --tp-size 2`` with its FastAPI app driven in process) and rank 1 follows. Greedy
tokens equal transformers' ``generate`` on the unsharded model; both ranks' engines give every request the same
tokens (sampled ones without a seed included); arrivals, an abort, refused requests, the keepalive, a follower that
drifted; every block is back in each rank's pool at the end."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import transformers

from cai.infer import AsyncInferenceEngine, InferenceConfig, InferenceEngine, LockstepDriver, SamplingParams
from cai.mesh.testing import run_distributed

VOCAB = 251
NEW = 8
LENGTHS = (5, 13, 2, 9)
TOO_LONG = [7] * 40  # over max_input_len
# cai serve's options for the engine _config() builds
SERVE_OPTIONS = ["--tp-size", "2", "--dtype", "fp32", "--max-input-len", "32", "--max-output-len", str(NEW)]
SERVE_OPTIONS += ["--block-size", "4", "--num-blocks", "12", "--served-model-name", "tiny"]
# no seed: rank 0 draws one per request
SAMPLED = SamplingParams(do_sample=True, temperature=1.5, max_new_tokens=NEW, ignore_eos=True)


def _model() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # well-separated greedy choices (see conftest.tiny_model)
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def _config() -> InferenceConfig:
    # Fewer batch slots and blocks than the requests at once want: queueing and preemption under arrivals.
    return InferenceConfig(
        dtype="fp32",
        tp_size=2,
        block_size=4,
        num_blocks=12,
        max_num_batched_tokens=8,
        max_batch_size=3,
        max_input_len=32,
        max_output_len=NEW,
    )


def _serve_args(model_dir: str) -> argparse.Namespace:
    from cai.infer._cli_serve import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", model_dir, *SERVE_OPTIONS])


# -- rank 0 ---------------------------------------------------------------------------------------------------
async def _async_requests(engine: InferenceEngine) -> dict:
    """Concurrent streams arriving while others decode, one closed early, one refused, one sampled."""
    server = AsyncInferenceEngine(engine)  # builds the driver itself
    assert server.driver is not None and server.driver.engine is engine
    prompts = _prompts()
    greedy = SamplingParams(max_new_tokens=NEW)
    got: dict = {}
    ready = [asyncio.Event() for _ in prompts]

    async def run(rid: str, prompt: list[int], params: SamplingParams, after=None, signal=None) -> None:
        if after is not None:
            await after.wait()  # arrive once the previous request has decoded a few tokens
        async for out in server.generate(prompt_token_ids=prompt, sampling_params=params, request_id=rid):
            if signal is not None and len(out.token_ids) == 2:
                signal.set()
        got[rid] = out.token_ids

    async def refused() -> str:
        await ready[1].wait()
        stream = server.generate(prompt_token_ids=TOO_LONG, sampling_params=greedy)
        with pytest.raises(ValueError, match="max_input_len=32") as err:
            await stream.__anext__()
        return str(err.value)

    async def leave_early() -> None:
        await ready[0].wait()
        stream = server.generate(
            prompt_token_ids=[9] * 6, sampling_params=SamplingParams(max_new_tokens=NEW, ignore_eos=True)
        )
        async with contextlib.aclosing(stream):
            async for out in stream:
                if len(out.token_ids) == 2:
                    break

    tasks = [run(f"g{i}", p, greedy, ready[i - 1] if i else None, ready[i]) for i, p in enumerate(prompts)]
    try:
        results = await asyncio.gather(
            *tasks, run("s", prompts[2], SAMPLED, ready[2]), refused(), leave_early()
        )
        await run("after", prompts[0], greedy)  # after the refusal and the abort the driver keeps working
    finally:
        server.close()  # rank 1's follow() returns, also when something above failed
    return {
        "greedy": [got[f"g{i}"] for i in range(len(prompts))],
        "after": got["after"],
        "refused": results[-2],
    }


def _direct(driver: LockstepDriver) -> dict:
    """The driver without asyncio: several prompts per call, a call refused as a whole, an abort sent by the
    keepalive while rank 0 is idle."""
    engine, prompt = driver.engine, _prompts()[1]
    with pytest.raises(RuntimeError, match="runs on the ranks other than 0"):
        driver.follow()
    ids = driver.add_request(["m0", "m1"], prompts_token_ids=[prompt, prompt], sampling_params=SAMPLED)
    assert ids == ["m0", "m1"]
    with pytest.raises(ValueError, match="40-token prompt"):
        driver.add_request(["x0", "x1"], prompts_token_ids=[prompt, TOO_LONG])
    assert "x0" not in engine._requests, "a refused call queues none of its prompts"
    while driver.has_unfinished_requests():
        driver.step()
    driver.add_request("k", prompts_token_ids=prompt)
    driver.step()
    driver.step()
    driver.abort_request("k")
    assert not driver.engine.has_unfinished_requests() and driver.has_unfinished_requests()
    assert driver.step() == []  # nothing runs; the abort goes to the followers as a sync
    driver.add_request("k2", prompts_token_ids=prompt)
    driver.abort_request("k2")  # pending while rank 0 is idle: the keepalive sends it
    aborted = time.monotonic()
    time.sleep(1.5)  # the keepalive (0.2 s) has a second of slack on a loaded machine
    return {"aborted": aborted, "closing": time.monotonic()}


def _serve_with_client(model_dir: str, want: list[int]) -> dict:
    """``cai serve --tp-size 2``; uvicorn.run is replaced by an in-process client of the app."""
    import httpx

    args = _serve_args(model_dir)
    seen: dict = {}

    async def client(app) -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://tiny") as http:
            body = {"model": "tiny", "prompt": _prompts()[3], "max_tokens": 4, "temperature": 0}
            greedy, sampled, bad = await asyncio.gather(
                http.post("/v1/completions", json=body),
                http.post("/v1/completions", json={**body, "temperature": 1.0}),  # unseeded sampling
                http.post("/v1/completions", json={**body, "prompt": TOO_LONG}),
            )
            seen["greedy"] = greedy.json()["choices"][0]["text"]
            seen["sampled"] = (sampled.status_code, sampled.json()["usage"]["completion_tokens"])
            seen["bad"] = (bad.status_code, bad.json()["error"]["message"])
            seen["metrics"] = (await http.get("/metrics")).text

    def fake_run(app, **kw) -> None:
        asyncio.run(client(app))

    with mock.patch("uvicorn.run", fake_run):
        assert args.func(args) == 0
    seen["want"] = " ".join(map(str, want[:4]))
    return seen


# -- every rank -----------------------------------------------------------------------------------------------
def _worker(model_dir: str, want_serve: list[int]) -> dict:
    rank = dist.get_rank()
    engine = InferenceEngine(_model(), None, _config())
    torch.manual_seed(100 + rank)  # the ranks' global generators differ: only rank 0's draws may count
    outputs: dict[str, list[int]] = {}  # each request's tokens after its last step, on this rank
    aborts: dict[str, float] = {}
    step, abort = engine.step, engine.abort_request

    def recording_step():
        outs = step()
        outputs.update((o.request_id, o.token_ids) for o in outs)
        return outs

    def recording_abort(rid):
        aborts.setdefault(str(rid), time.monotonic())
        abort(rid)

    engine.step, engine.abort_request = recording_step, recording_abort
    out: dict = {}
    if rank == 0:
        out["async"] = asyncio.run(_async_requests(engine))
        with LockstepDriver(engine, keepalive_s=0.2) as driver:
            out["direct"] = _direct(driver)
        with LockstepDriver(engine, keepalive_s=None) as driver:  # rank 1 drifts here
            driver.add_request("d", prompts_token_ids=[1, 2, 3])
            driver.abort_request("d")
            driver.step()  # a sync: nothing runs
    else:
        with pytest.raises(ValueError, match="tensor-parallel rank 1: requests enter on rank 0 only"):
            AsyncInferenceEngine(engine)
        with pytest.raises(RuntimeError, match="add_request on rank 1"):
            LockstepDriver(engine).add_request(prompts_token_ids=[1, 2])
        LockstepDriver(engine).follow()  # the asyncio phase
        LockstepDriver(engine).follow()  # the direct phase
        engine.add_request("rogue", prompts_token_ids=[1, 2, 3])  # a request rank 0 never sent
        with pytest.raises(
            RuntimeError, match=r"rank 1 drifted from rank 0: .* = \(1, 0, 12\), rank 0 \(0, 0, 12\)"
        ):
            LockstepDriver(engine).follow()
        engine.abort_request("rogue")
        LockstepDriver(engine).follow()  # back in step: rank 0's stop
    engine.scheduler.check()
    out["outputs"] = outputs
    out["aborts"] = aborts
    out["free"] = (engine.num_free_blocks, engine.blocks.num_blocks)
    out["unfinished"] = engine.has_unfinished_requests()
    if rank == 0:
        out["serve"] = _serve_with_client(model_dir, want_serve)
    else:
        args = _serve_args(model_dir)
        assert args.func(args) == 0  # follows until rank 0's server stops
    return out


def _reference(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    ids = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return ids[0, len(prompt) :].tolist()


def test_tp2_serving_through_rank_0(tmp_path):
    pytest.importorskip("fastapi", reason="cai-infer[serve] is not installed")
    model = _model()
    model.save_pretrained(tmp_path / "tiny")
    want = [_reference(model, p) for p in _prompts()]
    ranks = run_distributed(_worker, 2, str(tmp_path / "tiny"), want[3], timeout=120)
    lead, follower = ranks
    assert lead["async"]["greedy"] == want
    assert lead["async"]["after"] == want[0]
    assert "40-token prompt, over max_input_len=32" in lead["async"]["refused"]
    # every request, sampled, aborted and served ones included, got the same tokens on both ranks
    assert lead["outputs"] == follower["outputs"]
    assert len(lead["outputs"]["s"]) == NEW
    assert lead["outputs"]["m0"] != lead["outputs"]["m1"], "the prompts of one call draw seeds of their own"
    assert "x0" not in lead["outputs"] and "k2" not in lead["outputs"]
    # the abort made while rank 0 was idle reached rank 1 through the keepalive, long before the close
    assert follower["aborts"]["k2"] < lead["direct"]["closing"] - 0.5
    for r in ranks:
        assert r["free"][0] == r["free"][1], "blocks leaked"
        assert not r["unfinished"]
    serve = lead["serve"]
    assert serve["greedy"] == serve["want"]
    assert serve["sampled"][0] == 200 and 1 <= serve["sampled"][1] <= 4
    assert serve["bad"][0] == 400 and "max_input_len=32" in serve["bad"][1]
    assert "cai_kv_blocks_used 0" in serve["metrics"]


def test_driver_needs_a_tensor_parallel_engine():
    engine = InferenceEngine(
        _model(), None, InferenceConfig(dtype="fp32", max_input_len=16, max_output_len=4)
    )
    with pytest.raises(ValueError, match="tp_size=1; use the engine directly"):
        LockstepDriver(engine)
    with pytest.raises(ValueError, match="keepalive_s=0"):
        LockstepDriver(engine, keepalive_s=0)
