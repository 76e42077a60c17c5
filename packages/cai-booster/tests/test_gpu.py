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
