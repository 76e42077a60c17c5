"""CUDA paths of cai-booster against the same model on the same GPU: activation offload on its side stream.
Skipped without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch

from cai.booster import activation_checkpointing
from cai.booster._checkpointing import checkpoint_blocks

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _llama(layers: int):
    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=512, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=1024,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).train()


def test_offload_frees_device_memory_and_keeps_the_gradients() -> None:
    base = _llama(layers=6)
    ids = torch.randint(0, 1024, (4, 512), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    results = {}
    for offload in (0.0, 0.5):
        model = copy.deepcopy(base)
        activation_checkpointing(model, "none", offload=offload)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = model(input_ids=ids, labels=ids).loss
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # processes the side stream's events: memory it read counts as free only then
        kept = torch.cuda.memory_allocated() - before
        loss.backward()
        torch.cuda.synchronize()
        grads = {n: p.grad for n, p in model.named_parameters()}
        offloader = checkpoint_blocks(model)[0].__dict__.get("_cai_offload")
        moved = offloader[0].bytes_to_host if offloader else 0
        results[offload] = (loss.item(), grads, kept, moved)
    ref_loss, ref_grads, ref_kept, _ = results[0.0]
    loss, grads, kept, moved = results[0.5]
    assert loss == ref_loss
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[name]), name  # same kernels, same bytes back from the host
    assert moved > 0.3 * ref_kept  # half the blocks hold most of what forward keeps (the head's logits aside)
    assert kept <= ref_kept - 0.9 * moved  # and their device copies were released


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_compiled_checkpointed_blocks_keep_the_gradients_and_only_the_block_inputs(
    step_saving, fp8: bool
) -> None:
    # Compiled checkpointed blocks ([Note: compiled blocks]; bf16: the checkpoint traced with the block, FP8: the
    # checkpoint around the graph) on Inductor's CUDA backend: the gradients of the compiled uncheckpointed blocks
    # (the same graph's arithmetic; FP8 products on FP8 tensor cores), and what forward leaves for backward no
    # more than eager checkpointing leaves. The recompute is fused differently
    # from the forward, so its roundings differ: the bound is the larger of a fixed one and what eager
    # checkpointing (other kernels, the same products) differs by from the compiled blocks.
    from cai.booster import compile_blocks
    from cai.kernels import convert_to_fp8, fp8_tensor_cores

    if fp8 and not fp8_tensor_cores(torch.device("cuda")):
        pytest.skip("no FP8 tensor cores")
    base = _llama(layers=4)
    base.config.use_cache = False
    if fp8:
        convert_to_fp8(base)
    ids = torch.randint(0, 1024, (4, 512), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    results = {}
    for kind in ("compiled", "eager checkpointed", "compiled checkpointed"):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        if kind != "compiled":
            activation_checkpointing(model, "full")
        if kind != "eager checkpointed":
            compile_blocks(model)
        step_saving(model, ids)  # compiles
        model.zero_grad(set_to_none=True)
        loss, kept = step_saving(model, ids)
        results[kind] = (loss, {n: p.grad.float() for n, p in model.named_parameters()}, kept)
    ref_loss, ref_grads, ref_kept = results["compiled"]
    loss, grads, kept = results["compiled checkpointed"]
    _, eager_grads, eager_kept = results["eager checkpointed"]
    assert loss == pytest.approx(ref_loss, rel=1e-3)
    floor = 2e-2 if fp8 else 1e-2
    for name, g in grads.items():
        bound = max(floor, 1.5 * _rel(eager_grads[name], ref_grads[name]))
        assert _rel(g, ref_grads[name]) <= bound, (name, _rel(g, ref_grads[name]), bound)
    assert kept <= eager_kept + 2**20, (kept, eager_kept)  # each block's references to the rotary tables
    assert kept < 0.5 * ref_kept, (kept, ref_kept)
