"""CUDA paths of the engine: captured decode graphs (on by default there), cai-kernels' fused kernels (on request),
the Triton paged attention. Greedy tokens equal transformers' ``generate`` in fp32 under arrivals, chunked prefill,
prefix sharing and preemption; in bf16 the graph replays give the same tokens as the eager engine. Skipped without
CUDA."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from cai.infer import InferenceConfig, InferenceEngine
from cai.infer._residual import _CarriedLayer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NEW = 12
LENGTHS = (3, 13, 8, 1, 17, 6, 30, 2, 9)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(0, 251, (6,), generator=g).tolist()
    return [prefix + torch.randint(0, 251, (n,), generator=g).tolist() for n in LENGTHS]


def _run(engine: InferenceEngine, prompts: list[list[int]]) -> list[list[int]]:
    """One request every step (arrivals while others decode); the outputs in request order."""
    gen = GenerationConfig(max_new_tokens=NEW)
    done: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending:
            i, p = pending.pop(0)
            engine.add_request(request_ids=i, prompts_token_ids=p, generation_config=gen)
        done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    return [done[str(i)] for i in range(len(prompts))]


def _config(dtype: str, **kw) -> InferenceConfig:
    return InferenceConfig(
        dtype=dtype,
        block_size=4,
        num_blocks=40,
        max_num_batched_tokens=12,
        max_batch_size=6,
        max_input_len=40,
        max_output_len=NEW,
        **kw,
    )


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_graphs_match_generate_fp32(family, make_model, engines):
    model = make_model(family).cuda()
    prompts = _prompts()
    want = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        # an explicit mask: from pad_token_id alone, generate would mask the prompt's own 0 tokens as padding
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False, pad_token_id=0
        )
        want.append(out[0, len(p) :].tolist())
    engine = InferenceEngine(model, None, _config("fp32"))
    engines.append(engine)
    assert engine.runner.graphs is not None and engine.runner.graphs.capture, "graphs are the default on CUDA"
    graphs = engine.runner.graphs
    replays = []
    replay = graphs._replay
    graphs._replay = lambda b: replays.append(b) or replay(b)
    assert _run(engine, prompts) == want
    assert replays, "no decode step replayed a graph"
    assert graphs.num_ahead_used > 0, "no greedy decode step was launched ahead of its batch"


def test_graphs_match_eager_bf16(make_model, engines):
    prompts = _prompts()
    outs = {}
    for graphs in (False, None):
        model = make_model("llama").cuda()
        engine = InferenceEngine(model, None, _config("bf16", use_cuda_graph=graphs))
        engines.append(engine)
        assert (engine.runner.graphs is not None) == (graphs is None)
        outs[graphs] = _run(engine, prompts)
    assert outs[None] == outs[False]


def test_fused_kernels_by_default(make_model, engines):
    from cai.infer._fuse import FusedSwiGLUMLP
    from cai.kernels import RMSNorm

    prompts = _prompts()
    plain = InferenceEngine(make_model("llama").cuda(), None, _config("fp32", use_cuda_kernel=False))
    engines.append(plain)
    assert RMSNorm not in {type(m) for m in plain.model.modules()}, "use_cuda_kernel=False keeps HF's modules"
    fused = InferenceEngine(make_model("llama").cuda(), None, _config("fp32"))
    engines.append(fused)
    kinds = {type(m) for m in fused.model.modules()}
    assert RMSNorm in kinds and FusedSwiGLUMLP in kinds, "fused kernels are on by default on CUDA"
    assert any(isinstance(m, _CarriedLayer) for m in fused.model.modules()), (
        "residual adds carried into the norms"
    )
    assert _run(fused, prompts) == _run(plain, prompts)


def test_carried_residual_is_bitwise_in_bf16_with_the_triton_norms(make_model):
    import copy

    from cai.infer._residual import carry_residuals
    from cai.kernels import patch_hf_model

    patched = make_model("llama").to("cuda", torch.bfloat16)
    patch_hf_model(patched, fused_loss=False)
    carried = copy.deepcopy(patched)
    assert carry_residuals(carried) == 2
    ids = torch.randint(0, 251, (3, 11), device="cuda")
    with torch.no_grad():
        assert torch.equal(carried(ids).logits, patched(ids).logits)
