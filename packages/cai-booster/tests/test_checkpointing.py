"""activation_checkpointing: full, selective and a leading fraction of the blocks give the gradients of no
checkpointing; the activation memory left after forward (the allocator's net bytes, measured by torch.profiler)
and the matmuls run again in backward show what each policy keeps."""

from __future__ import annotations

import copy
import functools
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


class _Fp8Product(torch.autograd.Function):
    """x @ w.T through torch._scaled_mm (unit scales), with a plain bf16 backward: an FP8 linear's forward op."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        one = torch.ones((), device=x.device)
        e4m3 = torch.float8_e4m3fn
        return torch._scaled_mm(x.to(e4m3), w.to(e4m3).t(), scale_a=one, scale_b=one, out_dtype=x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return dy @ w, dy.t() @ x


class _Fp8Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(32, 32, dtype=torch.bfloat16) / 8)

    def forward(self, x):
        return x + torch.tanh(_Fp8Product.apply(x, self.w))


class _CountScaledMm(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._scaled_mm.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_selective_checkpointing_keeps_the_fp8_products(policy: str) -> None:
    # FP8 linears multiply through _scaled_mm on GPUs with FP8 tensor cores: a matmul that selective keeps
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.ModuleList([_Fp8Block() for _ in range(3)]))
    model.forward = lambda x: functools.reduce(lambda h, block: block(h), model[0], x)
    activation_checkpointing(model, policy)
    x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    y = model(x).float().sum()
    with _CountScaledMm() as backward:
        y.backward()
    assert backward.count == (0 if policy == "selective" else 3)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="policy='partial'"):
        activation_checkpointing(_llama(layers=1), "partial")
    with pytest.raises(ValueError, match=re.escape("ratio=1.5 must be in")):
        activation_checkpointing(_llama(layers=1), ratio=1.5)
    with pytest.raises(ValueError, match=re.escape("no nn.ModuleList of repeated blocks")):
        activation_checkpointing(torch.nn.Linear(2, 2))


def _hybrid_losses(policy, ratio: float, offload: float = 0.0) -> list[float]:
    from cai.booster import Booster
    from cai.booster.plugin import HybridParallelConfig, HybridParallelPlugin

    config = HybridParallelConfig(
        tp_size=2,
        precision="fp32",
        gradient_checkpointing=policy,
        gradient_checkpointing_ratio=ratio,
        activation_offload=offload,
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
    assert sum(m.gradient_checkpointing for m in layers) == (
        min(int(ratio * 4), 4 - int(offload * 4)) if policy else 0
    )
    assert sum(m.__dict__.get("_cai_offload", (0, 0, False))[2] for m in layers) == int(offload * 4)
    return losses


def _hybrid_compare() -> None:
    plain = _hybrid_losses(False, 1.0)
    for policy, ratio, offload in (("selective", 1.0, 0.0), ("full", 0.5, 0.0), ("full", 1.0, 0.5)):
        assert_close(torch.tensor(_hybrid_losses(policy, ratio, offload)), torch.tensor(plain), rtol=1e-6, atol=1e-7,
                     name=f"{policy} {ratio} offload {offload}")  # fmt: skip


def test_hybrid_plugin_checkpoints_under_tensor_parallelism() -> None:
    from cai.mesh.testing import run_distributed

    run_distributed(_hybrid_compare, 2)


# ---- activation offload ---------------------------------------------------------------------------------------


def _saved_storage_bytes(model, ids, blocks: int) -> int:
    """Bytes of the distinct storages the first ``blocks`` blocks save for backward (parameters and tensors below
    MIN_BYTES aside): what offloading those blocks must move, counted independently of the offloader."""
    from cai.booster._checkpointing import checkpoint_blocks
    from cai.booster._offload import MIN_BYTES

    seen: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params and t.numel() * t.element_size() >= MIN_BYTES:
            seen[s.data_ptr()] = s.nbytes()
        return t

    handles = []
    for block in checkpoint_blocks(model)[:blocks]:
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        handles.append(block.register_forward_pre_hook(lambda *_, h=hooks: h.__enter__()))
        handles.append(block.register_forward_hook(lambda *_, h=hooks: h.__exit__(None, None, None)))
    model(input_ids=ids, labels=ids).loss.backward()
    for h in handles:
        h.remove()
    model.zero_grad()
    return sum(seen.values())


@pytest.mark.parametrize(
    ("policy", "offload"), [("none", 1.0), ("none", 0.5), ("full", 0.5), ("selective", 0.25)]
)
def test_offload_keeps_the_gradients_and_moves_what_blocks_save(policy: str, offload: float) -> None:
    from cai.booster._checkpointing import checkpoint_blocks

    base = _llama()
    ids = torch.randint(0, 128, (4, 128), generator=torch.Generator().manual_seed(1))
    ref_loss, ref_grads, _, ref_mm = _run(copy.deepcopy(base), ids)
    model = copy.deepcopy(base)
    expected = _saved_storage_bytes(model, ids, int(4 * offload))
    recomputed = activation_checkpointing(model, policy, offload=offload)
    assert recomputed == (0 if policy == "none" else 4 - int(4 * offload))
    offloader = checkpoint_blocks(model)[0].__dict__["_cai_offload"][0]
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: t, lambda t: t
    ):  # an outer hook the blocks' nest in
        loss = model(input_ids=ids, labels=ids).loss
    assert offloader.bytes_to_host == expected > 0 and offloader.bytes_to_device == 0
    with _CountMatmuls() as mm:
        loss.backward()
    assert offloader.bytes_to_device == expected  # each storage back once, shared views included
    assert loss.item() == ref_loss
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, ref_grads[name]), name  # the bytes went to the host and back unchanged
    assert mm.count == ref_mm + (6 * recomputed if policy == "full" else 0)


def test_offloaded_micro_batches_keep_their_own_activations() -> None:
    from cai.booster._checkpointing import checkpoint_blocks

    base = _llama(layers=3)
    gen = torch.Generator().manual_seed(4)
    batches = [torch.randint(0, 128, (2, 64), generator=gen) for _ in range(3)]
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    activation_checkpointing(model, "none", offload=1.0, prefetch=1)
    losses = {}
    for m in (ref, model):  # every forward first, then the backwards, in the same order as a 1F1B warm-up
        outs = [m(input_ids=ids, labels=ids).loss for ids in batches]
        for loss in outs:
            loss.backward()
        losses[m is model] = [loss.item() for loss in outs]
    assert losses[True] == losses[False]
    for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(q.grad, p.grad), name
    offloader = checkpoint_blocks(model)[0].__dict__["_cai_offload"][0]
    assert offloader.bytes_to_device == offloader.bytes_to_host > 0


def test_offload_is_off_in_eval_and_again_when_set_to_zero() -> None:
    from cai.booster._checkpointing import checkpoint_blocks

    model = _llama(layers=2)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(2))
    activation_checkpointing(model, "none", offload=1.0)
    offloader = checkpoint_blocks(model)[0].__dict__["_cai_offload"][0]
    with torch.no_grad():
        model(input_ids=ids)
    model.eval()
    model(input_ids=ids, labels=ids).loss.backward()
    assert offloader.bytes_to_host == 0
    model.train()
    activation_checkpointing(model, "none")
    model(input_ids=ids, labels=ids).loss.backward()
    assert offloader.bytes_to_host == 0 and "_cai_offload" not in checkpoint_blocks(model)[0].__dict__
    with pytest.raises(ValueError, match=re.escape("offload=2.0 must be in")):
        activation_checkpointing(model, offload=2.0)
    with pytest.raises(ValueError, match=re.escape("prefetch=-1 must be >= 0")):
        activation_checkpointing(model, offload=0.5, prefetch=-1)


def _plugin_losses(plugin: str, offload: float) -> tuple[list[float], int]:
    from cai.booster import Booster
    from cai.booster._checkpointing import checkpoint_blocks
    from cai.booster.plugin import GeminiPlugin, LowLevelZeroPlugin

    made = {
        "zero2": lambda: LowLevelZeroPlugin(stage=2, precision="fp32"),
        "gemini": lambda: GeminiPlugin(precision="fp32"),
    }
    booster = Booster(plugin=made[plugin](), device="cpu")
    model = _llama()
    activation_checkpointing(model, "full", ratio=0.5, offload=offload)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    gen = torch.Generator().manual_seed(5 + torch.distributed.get_rank())
    losses = []
    for _ in range(3):
        ids = torch.randint(0, 128, (2, 128), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    spec = checkpoint_blocks(model.unwrap())[0].__dict__.get("_cai_offload")
    return losses, spec[0].bytes_to_device if spec else 0


def _plugins_compare() -> None:
    from cai.booster._checkpointing import checkpoint_blocks

    alone = _llama()  # the bytes a step moves without a plugin: the plugins' parameters must not add to them
    activation_checkpointing(alone, "full", ratio=0.5, offload=0.5)
    ids = torch.randint(0, 128, (2, 128))
    alone(input_ids=ids, labels=ids).loss.backward()
    per_step = checkpoint_blocks(alone)[0].__dict__["_cai_offload"][0].bytes_to_device
    for plugin in ("zero2", "gemini"):
        plain, _ = _plugin_losses(plugin, 0.0)
        offloaded, moved = _plugin_losses(plugin, 0.5)
        assert offloaded == plain, plugin  # the blocks' hooks compose with the plugins' parameter hooks
        assert moved == 3 * per_step > 0, plugin


def test_offload_composes_with_the_zero_and_gemini_plugins() -> None:
    from cai.mesh.testing import run_distributed

    run_distributed(_plugins_compare, 2)


def test_offload_copies_back_ahead_of_backward(monkeypatch) -> None:
    """With prefetch=p, block j's activations start back when the backward of block j + p starts: after block
    j + p + 1's saved tensors are all unpacked and before any of block j + p's (p blocks' backward to hide behind)."""
    from cai.booster._offload import Offloader, _Packed

    events: list[tuple[str, int]] = []
    index_of: dict[int, int] = {}
    pack, to_device, unpack = Offloader.pack, Offloader._to_device, Offloader.unpack

    def logged_pack(self, record, t):
        out = pack(self, record, t)
        if isinstance(out, _Packed):
            index_of[id(out.stored)] = record.index
        return out

    def logged_to_device(self, stored):
        if stored.restored is None:
            events.append(("back", index_of[id(stored)]))
        to_device(self, stored)

    def logged_unpack(self, packed):
        if isinstance(packed, _Packed):
            events.append(("unpack", index_of[id(packed.stored)]))
        return unpack(self, packed)

    monkeypatch.setattr(Offloader, "pack", logged_pack)
    monkeypatch.setattr(Offloader, "_to_device", logged_to_device)
    monkeypatch.setattr(Offloader, "unpack", logged_unpack)
    for prefetch in (0, 1, 2):
        events.clear()
        model = _llama()
        activation_checkpointing(model, "none", offload=1.0, prefetch=prefetch)
        ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(6))
        model(input_ids=ids, labels=ids).loss.backward()
        first_unpack = {j: events.index(("unpack", j)) for j in range(4)}
        last_unpack = {j: len(events) - 1 - events[::-1].index(("unpack", j)) for j in range(4)}
        back = {j: events.index(("back", j)) for j in range(4)}
        for j in range(4):
            ahead = min(j + prefetch, 3)  # the first block whose backward start reaches j
            # j's copy back starts after block ahead + 1's backward is done and before block ahead's begins
            assert back[j] < first_unpack[ahead], (prefetch, j, events)
            assert ahead == 3 or back[j] > last_unpack[ahead + 1], (prefetch, j, events)


@pytest.fixture(scope="module")
def kernel_llama():
    """A Llama patched with cai-kernels' Triton functions (norms, rotary, the gate/up/SwiGLU function, the fused
    loss; here through the Triton interpreter), a batch, and its run without checkpointing: the reference both
    policies are held to, run once."""
    from cai.kernels import patch_hf_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        mp.setenv("CAI_KERNELS_IMPL", "triton")
        base = patch_hf_model(_llama(layers=2))
        # 2 x 16 tokens: every kernel runs a program per token (row) in the interpreter; the fused loss is still
        # one chunk and GQA (4 query heads on 2 KV heads) is kept
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
        ref = _run(copy.deepcopy(base), ids)
    return base, ids, ref


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_policies_keep_the_gradients_of_a_model_with_cai_kernels(
    policy: str, kernel_llama, monkeypatch
) -> None:
    # cai-kernels' Triton functions recomputed under the checkpoint
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("CAI_KERNELS_IMPL", "triton")
    base, ids, (ref_loss, ref_grads, _, ref_mm) = kernel_llama
    model = copy.deepcopy(base)
    activation_checkpointing(model, policy)
    loss, grads, _, mm = _run(model, ids)
    assert loss == ref_loss
    for name, g in grads.items():
        assert_close(g, ref_grads[name], rtol=1e-6, atol=1e-7, name=f"{policy} grad {name}")
    assert mm == ref_mm + (2 * 6 if policy == "full" else 0)
