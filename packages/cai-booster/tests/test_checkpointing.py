"""activation_checkpointing: full, selective and a leading fraction of the blocks give the gradients of no
checkpointing; the activation memory left after forward (the allocator's net bytes, measured by torch.profiler)
and the matmuls run again in backward show what each policy keeps."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from cai.booster import activation_checkpointing
from cai.mesh.testing import TinyTransformer, assert_close, make_batch

transformers = pytest.importorskip("transformers")

POLICIES = [("full", 1.0), ("selective", 1.0), ("full", 0.5), ("selective", 0.5)]


def _llama(layers: int = 4):
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=384, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (
            torch.ops.aten.mm.default,
            torch.ops.aten.addmm.default,
            torch.ops.aten.bmm.default,
        )
        return func(*args, **(kwargs or {}))


def _run(model, ids) -> tuple[float, dict[str, torch.Tensor], int, int]:
    """Loss, gradients, net bytes allocated by forward (what it leaves for backward) and backward's matmuls."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = model(input_ids=ids, labels=ids).loss
    kept = sum(e.self_cpu_memory_usage for e in prof.events())
    with _CountMatmuls() as mm:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.item(), grads, kept, mm.count


def test_policies_keep_the_gradients_and_trade_memory_for_recompute() -> None:
    base = _llama()
    ids = torch.randint(0, 128, (4, 128), generator=torch.Generator().manual_seed(1))
    ref_loss, ref_grads, ref_kept, ref_mm = _run(copy.deepcopy(base), ids)
    got = {}
    for policy, ratio in POLICIES:
        model = copy.deepcopy(base)
        assert activation_checkpointing(model, policy, ratio=ratio) == int(4 * ratio)
        loss, grads, kept, mm = _run(model, ids)
        assert loss == ref_loss
        for name, g in grads.items():
            assert_close(g, ref_grads[name], rtol=1e-6, atol=1e-7, name=f"{policy} {ratio} grad {name}")
        got[policy, ratio] = (kept, mm)
    # a block's forward matmuls run again: q, k, v, o, gate, up; not down, whose output backward does not need
    # (torch's non-reentrant recompute stops after the last tensor it must rebuild)
    recomputed = 6
    full, selective, half = got["full", 1.0], got["selective", 1.0], got["full", 0.5]
    assert full[1] == ref_mm + 4 * recomputed
    assert half[1] == ref_mm + 2 * recomputed
    assert selective[1] == ref_mm and got["selective", 0.5][1] == ref_mm  # no matmul is recomputed
    # what forward leaves for backward: full keeps block inputs only, selective the matmul and attention outputs
    assert full[0] < 0.1 * ref_kept
    assert 0.25 * ref_kept < selective[0] < 0.7 * ref_kept
    assert 0.35 * ref_kept < half[0] < 0.65 * ref_kept
    assert got["selective", 0.5][0] > selective[0]


def test_off_again_and_eval_runs_plainly() -> None:
    model = _llama(layers=2)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(2))
    activation_checkpointing(model, "selective")
    assert activation_checkpointing(model, "none") == 0
    _, _, _, mm = _run(model, ids)
    ref = _llama(layers=2)
    assert mm == _run(ref, ids)[3]
    activation_checkpointing(model, "full")
    model.eval()
    with _CountMatmuls() as fwd, torch.no_grad():
        model(input_ids=ids)
    assert (
        fwd.count == 2 * 7 + 2
    )  # no recompute in eval: each block's 7 matmuls, the rotary table and the head


def test_a_plain_module_list_model_is_checkpointed_in_place() -> None:
    torch.manual_seed(0)
    base = TinyTransformer()
    ids, labels = make_batch()
    model = copy.deepcopy(base)
    blocks = activation_checkpointing(model, "selective")
    assert blocks == len(model.blocks) and type(model.blocks[0]).__name__ == type(base.blocks[0]).__name__
    assert list(model.state_dict()) == list(base.state_dict())
    for m in (base, model):
        m.loss(m(ids), labels).backward()
    for (name, p), q in zip(base.named_parameters(), model.parameters(), strict=True):
        assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7, name=name)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="policy='partial'"):
        activation_checkpointing(_llama(layers=1), "partial")
    with pytest.raises(ValueError, match=re.escape("ratio=1.5 must be in")):
        activation_checkpointing(_llama(layers=1), ratio=1.5)
    with pytest.raises(ValueError, match=re.escape("no nn.ModuleList of repeated blocks")):
        activation_checkpointing(torch.nn.Linear(2, 2))


def _hybrid_losses(policy, ratio: float) -> list[float]:
    from cai.booster import Booster
    from cai.booster.plugin import HybridParallelConfig, HybridParallelPlugin

    config = HybridParallelConfig(
        tp_size=2, precision="fp32", gradient_checkpointing=policy, gradient_checkpointing_ratio=ratio
    )
    model = _llama()
    booster = Booster(plugin=HybridParallelPlugin(config=config), device="cpu")
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    gen = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, 128, (2, 64), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    layers = [m for m in model.unwrap().modules() if type(m).__name__ == "LlamaDecoderLayer"]
    assert sum(m.gradient_checkpointing for m in layers) == (int(ratio * 4) if policy else 0)
    return losses


def _hybrid_compare() -> None:
    plain = _hybrid_losses(False, 1.0)
    for policy, ratio in (("selective", 1.0), ("full", 0.5)):
        assert_close(torch.tensor(_hybrid_losses(policy, ratio)), torch.tensor(plain), rtol=1e-6, atol=1e-7,
                     name=f"{policy} {ratio}")  # fmt: skip


def test_hybrid_plugin_checkpoints_under_tensor_parallelism() -> None:
    from cai.mesh.testing import run_distributed

    run_distributed(_hybrid_compare, 2)
