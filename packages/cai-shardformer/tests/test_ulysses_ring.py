"""The attention-side sequence-parallel modes, all_to_all (Ulysses) and ring_attn, against one process in fp32.

One spawn per world size runs the whole matrix: the two attention kernels against full-sequence SDPA (outputs
and q/k/v gradients), then tiny Llama and Qwen3 trained 5 AdamW steps with each mode (losses, gradients and
parameters every step, eval logits at the end), the collectives each mode issues, and the errors. World 4 adds
tp = 2 x sp = 2.
"""

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers

from cai.mesh.testing import CollectiveCounter, assert_close, run_distributed
from cai.shardformer import ParallelModule, ShardConfig, ShardFormer
from cai.shardformer._ring_attn import (
    _block,
    _block_grad,
    _flash_block,
    _flash_block_grad,
    _merge,
    ring_attention,
    zigzag_indices,
)
from cai.shardformer._ulysses import ulysses_attention
from cai.shardformer.policies.llama import LlamaForCausalLMPolicy

VOCAB, B, H, LAYERS, HEADS, KV = 251, 2, 32, 2, 4, 2
S = 16  # divides by 2 * sp for sp in {2, 4}: the zig-zag split has whole chunks
HEAD_DIM = H // HEADS


@dataclass(frozen=True)
class Case:
    family: str
    mode: str
    tp: int = 1


def _tiny(family: str, heads: int = HEADS, kv: int = KV, hidden: int = H, **extra):
    common = dict(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=64,
    )  # fmt: skip
    common.update(extra)
    torch.manual_seed(0)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if family == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**common))
    if family == "qwen2":  # q, k and v with biases
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    # Qwen3: per-head q/k norms, replicated weights whose gradient each rank sees a part of.
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=hidden // heads, **common))


def _groups(tp: int):
    """(tp group, sp group) on the default group: sp = world / tp, tp the inner (consecutive ranks) axis."""
    world = dist.get_world_size()
    if tp == 1:
        return None, dist.group.WORLD
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("sp", "tp"))
    return mesh.get_group("tp"), mesh.get_group("sp")


def _config(mode: str, tp: int = 1, **kw) -> ShardConfig:
    tp_group, sp_group = _groups(tp)
    return ShardConfig(
        tensor_parallel_process_group=tp_group, enable_tensor_parallelism=tp > 1, enable_sequence_parallelism=True,
        sequence_parallelism_mode=mode, sequence_parallel_process_group=sp_group, **kw,
    )  # fmt: skip


def gathered(model, grads: bool = False) -> dict:
    """Every parameter (or its gradient) as the full tensor under its name (tp shards gathered)."""
    out = {}
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            local = p.grad if grads else p
            full = module.full_tensor(pname, local) if isinstance(module, ParallelModule) else local.detach()
            out[f"{mname}.{pname}" if mname else pname] = full
    return out


def _close(actual: dict, expected: dict, name: str) -> None:
    # As test_policies: 1e-5 relative, absolute floor 1e-5 of the tensor's largest element.
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    for k, e in expected.items():
        assert_close(actual[k], e, rtol=1e-5, atol=1e-5 * float(e.detach().abs().max()), name=f"{name} {k}")


def _kernels() -> None:
    """ring_attention (zig-zag causal, and non-causal) and ulysses_attention against SDPA on the full sequence,
    with grouped-query heads (4:2, 4:4, 6:1 and, for Ulysses at sp 4, kv heads replicated)."""
    rank, sp = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(1)
    for heads, kv in ((4, 2), (4, 4), (8, 1)):
        q = torch.randn(B, heads, S, HEAD_DIM, generator=g, requires_grad=True)
        k = torch.randn(B, kv, S, HEAD_DIM, generator=g, requires_grad=True)
        v = torch.randn(B, kv, S, HEAD_DIM, generator=g, requires_grad=True)
        dout = torch.randn(B, heads, S, HEAD_DIM, generator=g)
        chunk = S // sp
        contiguous = torch.arange(rank * chunk, (rank + 1) * chunk)
        runs = [("ring causal", True, zigzag_indices(S, rank, sp)), ("ring full", False, contiguous)]
        if heads % sp == 0:
            runs.append(("ulysses causal", True, contiguous))
        for name, causal, idx in runs:
            q.grad = k.grad = v.grad = None
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            ref.backward(dout)
            local = [t.detach()[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
            fn = ulysses_attention if name.startswith("ulysses") else ring_attention
            out = fn(*local, group, causal=causal)
            out.backward(dout[:, :, idx])
            tag = f"{name} sp{sp} {heads}:{kv}"
            assert_close(out, ref.detach()[:, :, idx], rtol=1e-5, atol=1e-6, name=f"{tag} out")
            for t, full, what in zip(local, (q, k, v), "qkv"):
                assert_close(t.grad, full.grad[:, :, idx], rtol=1e-5, atol=1e-6, name=f"{tag} d{what}")


def _train(case: Case) -> None:
    ref = _tiny(case.family)
    model, shared = ShardFormer(_config(case.mode, case.tp)).optimize(copy.deepcopy(ref))
    assert shared == []
    assert (
        model.config._attn_implementation
        == {"all_to_all": "cai_ulysses", "ring_attn": "cai_ring_attn"}[case.mode]
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-4)  # eps: see test_policies
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    ref.train()
    model.train()
    g = torch.Generator().manual_seed(5)
    tag = f"{case.family} {case.mode} tp{case.tp} sp{dist.get_world_size() // case.tp}"
    for step in range(5):
        ids = torch.randint(0, VOCAB, (B, S), generator=g)
        labels = ids.clone()
        labels[0, :3] = -100  # ignored targets on one shard only: the global count must divide the sum
        # The last step accumulates two micro-batches: the second backward's gradients are reduced over the sp
        # group on top of the first's, already reduced.
        for rows in [slice(0, 1), slice(1, B)] if step == 4 else [slice(0, B)]:
            ref_loss = ref(input_ids=ids[rows], labels=labels[rows]).loss
            ref_loss.backward()
            out = model(input_ids=ids[rows], labels=labels[rows])
            assert out.logits is None  # training with labels: the loss only, no logits gathered
            out.loss.backward()
            assert_close(out.loss, ref_loss, rtol=1e-5, name=f"{tag} step {step} loss")
        _close(
            gathered(model, grads=True),
            {n: p.grad for n, p in ref.named_parameters()},
            f"{tag} step {step} grad",
        )
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
        _close(gathered(model), dict(ref.named_parameters()), f"{tag} step {step} param")
    model.eval()
    ref.eval()
    with torch.no_grad():  # logits gathered back into the input's token order
        assert_close(
            model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-6, name=f"{tag} logits"
        )


def _counts(mode: str) -> None:
    """all_to_all: four all-to-alls per attention forward (q, k, v in; out back) and four backward. ring_attn:
    sp - 1 hops of the K/V block per attention forward. Both: one all-reduce of the loss forward, one flat
    all-reduce of every parameter's gradient backward, nothing else."""
    sp = dist.get_world_size()
    model, _ = ShardFormer(_config(mode)).optimize(_tiny("llama"))
    model.train()
    ids = torch.randint(0, VOCAB, (B, S))
    with CollectiveCounter() as fwd:
        loss = model(input_ids=ids, labels=ids).loss
    with CollectiveCounter() as bwd:
        loss.backward()
    t = S // sp
    q_bytes = B * HEADS * t * HEAD_DIM * 4
    kv_bytes = B * max(KV, sp) * t * HEAD_DIM * 4  # kv heads repeated up to sp when fewer (Ulysses)
    loss_reduce = [("all_reduce", 4)]
    if mode == "all_to_all":
        per_layer = [
            ("all_to_all_single", q_bytes),
            *[("all_to_all_single", kv_bytes)] * 2,
            ("all_to_all_single", q_bytes),
        ]
        assert [(e.op, e.nbytes) for e in fwd.events] == per_layer * LAYERS + loss_reduce, fwd.events
        assert sum(e.op == "all_to_all_single" for e in bwd.events) == 4 * LAYERS
    else:
        hop = 2 * B * KV * t * HEAD_DIM * 4  # K and V in one buffer
        per_layer = [("isend", hop), ("irecv", hop)] * (sp - 1)
        assert [(e.op, e.nbytes) for e in fwd.events] == per_layer * LAYERS + loss_reduce, fwd.events
        # backward: K/V travel sp - 1 hops, their gradient accumulators sp hops (back to their owner)
        assert sum(e.op == "isend" for e in bwd.events) == (2 * sp - 1) * LAYERS
    grads = [e for e in bwd.events if e.op == "all_reduce"]
    assert [e.nbytes for e in grads] == [
        sum(p.numel() * 4 for p in model.parameters())
    ]  # one flat all-reduce
    assert {e.op for e in bwd.events} <= {"all_reduce", "all_to_all_single", "isend", "irecv"}


def _errors() -> None:
    sp = dist.get_world_size()
    model, _ = ShardFormer(_config("all_to_all")).optimize(_tiny("llama"))
    ids = torch.randint(0, VOCAB, (B, 2 * sp + 1))
    with pytest.raises(
        ValueError, match=rf"sequence length is {2 * sp + 1}; pad the batch to a multiple of {sp}"
    ):
        model(input_ids=ids, labels=ids)
    model, _ = ShardFormer(_config("ring_attn")).optimize(_tiny("llama"))
    ids = torch.randint(0, VOCAB, (B, 3 * sp))
    with pytest.raises(ValueError, match=rf"2 \* sp = {2 * sp} chunks, but the sequence length is {3 * sp}"):
        model(input_ids=ids, labels=ids)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, -2:] = 0
    with pytest.raises(ValueError, match="the attention_mask has zeros"):
        model(input_ids=torch.randint(0, VOCAB, (B, S)), attention_mask=mask)
    # Heads that do not divide by sp: refused at optimize() for all_to_all, before the model changes ...
    odd = _tiny("llama", heads=3, kv=1, hidden=24)
    with pytest.raises(ValueError, match=rf"num_attention_heads=3 does not divide by tp=1 x sp={sp}"):
        ShardFormer(_config("all_to_all")).optimize(odd)
    assert odd.config._attn_implementation == "sdpa"
    # ... while ring_attn has no head constraint (3 query heads on 1 kv head): one step against one process.
    ref = copy.deepcopy(odd)
    model, _ = ShardFormer(_config("ring_attn")).optimize(odd)
    ids = torch.randint(0, VOCAB, (B, S))
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert_close(loss, ref_loss, rtol=1e-5, name="ring_attn 3 heads loss")
    _close(
        gathered(model, grads=True), {n: p.grad for n, p in ref.named_parameters()}, "ring_attn 3 heads grad"
    )

    # A policy that does not name its attention modules cannot take these modes: refused at optimize().
    class NoSequenceParallel(LlamaForCausalLMPolicy):
        def sequence_parallel_attention(self):
            return None

    with pytest.raises(
        NotImplementedError, match="NoSequenceParallel does not support sequence_parallelism_mode"
    ):
        ShardFormer(_config("ring_attn")).optimize(_tiny("llama"), NoSequenceParallel())
    # A sliding window shorter than the sequence would need a windowed mask across shards: refused.
    model, _ = ShardFormer(_config("all_to_all")).optimize(_tiny("mistral", sliding_window=S // 2))
    with pytest.raises(ValueError, match=rf"sliding_window={S // 2} is shorter than the sequence \({S}\)"):
        model(input_ids=torch.randint(0, VOCAB, (B, S)))


def _matrix(cases: list[Case]) -> None:
    _kernels()
    for case in cases:
        _train(case)
    for mode in ("all_to_all", "ring_attn"):
        _counts(mode)
    _errors()


FAMILY_MODES = [Case(f, m) for f in ("llama", "qwen3") for m in ("all_to_all", "ring_attn")]


@pytest.mark.parametrize("world", [2, 4], ids=["sp2", "sp4"])
def test_sequence_parallel_matches_one_process(world):
    """sp = world with tp = 1, Llama and Qwen3 in both modes; at world 2 also Mistral and Qwen2, at world 4
    tp = 2 x sp = 2."""
    if world == 2:  # the other two Llama-shaped policies, once each
        cases = [*FAMILY_MODES, Case("mistral", "ring_attn"), Case("qwen2", "all_to_all")]
    else:
        cases = [*FAMILY_MODES, *(Case("llama", m, tp=2) for m in ("all_to_all", "ring_attn"))]
    run_distributed(_matrix, world, cases, timeout=600)


def test_sp_mode_without_sequence_group():
    for mode in ("all_to_all", "ring_attn"):
        with pytest.raises(
            ValueError, match=rf"sequence_parallelism_mode='{mode}' runs on its own.*pass the sp group"
        ):
            ShardConfig(enable_sequence_parallelism=True, sequence_parallelism_mode=mode)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ring_attention_flash_blocks_on_cuda():
    """The flash-kernel blocks (bf16 on CUDA) composed as one rank's ring steps: queries of a late chunk see an
    earlier kv chunk fully and their own causally; merged by log-sum-exp, and each block's backward from the
    merged output and lse. Against fp32 attention over the union of the keys, and the fp32 math blocks."""
    g = torch.Generator(device="cuda").manual_seed(0)
    b, kv, groups, t, d = 2, 2, 3, 128, 64

    def rand(*shape):
        return torch.randn(*shape, generator=g, device="cuda").bfloat16()

    q, k1, v1, k2, v2, dout = (
        rand(b, kv, groups, t, d),
        rand(b, kv, t, d),
        rand(b, kv, t, d),
        rand(b, kv, t, d),
        rand(b, kv, t, d),
        rand(b, kv, groups, t, d),
    )
    scale = d**-0.5
    ref_in = [x.float().requires_grad_() for x in (q, k1, v1, k2, v2)]
    rq, rk1, rv1, rk2, rv2 = ref_in
    keys = torch.cat([rk1, rk2], 2).repeat_interleave(groups, 1)
    values = torch.cat([rv1, rv2], 2).repeat_interleave(groups, 1)
    mask = torch.ones(t, 2 * t, dtype=torch.bool, device="cuda")
    mask[:, t:] = torch.ones(t, t, dtype=torch.bool, device="cuda").tril()
    ref = F.scaled_dot_product_attention(rq.flatten(1, 2), keys, values, attn_mask=mask, scale=scale)
    ref.backward(dout.float().flatten(1, 2))
    for name, block, block_grad in (
        ("flash", _flash_block, _flash_block_grad),
        ("math", _block, _block_grad),
    ):
        o1, l1 = block(q, k1, v1, scale, False)
        o2, l2 = block(q, k2, v2, scale, True)
        out, lse = _merge(o1, l1, o2, l2)
        out = out.bfloat16()
        assert_close(out.float().flatten(1, 2), ref.detach(), rtol=2e-2, atol=2e-2, name=f"{name} out")
        dq1, dk1, dv1 = block_grad(q, k1, v1, dout, out, lse, scale, False)
        dq2, dk2, dv2 = block_grad(q, k2, v2, dout, out, lse, scale, True)
        for got, want, what in (
            (dq1 + dq2, rq.grad, "dq"),
            (dk1, rk1.grad, "dk1"),
            (dv1, rv1.grad, "dv1"),
            (dk2, rk2.grad, "dk2"),
            (dv2, rv2.grad, "dv2"),
        ):
            assert_close(got, want, rtol=2e-2, atol=2e-2, name=f"{name} {what}")
