"""Parallel layers at tp 2 and 4 against the unsharded layer in fp32: outputs, input gradients, weight
gradients, state-dict keys and padding."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cai.mesh.testing import CollectiveCounter, assert_close, run_distributed
from cai.shardformer import (
    Embedding1D,
    FusedLinear1D_Col,
    Linear1D_Col,
    Linear1D_Row,
    VocabParallelEmbedding1D,
    VocabParallelLMHead1D,
    vocab_parallel_cross_entropy,
)
from cai.shardformer._layout import take_rows

RTOL = 1e-5
B, S, H = 2, 8, 16


def _compare_grads(layer, native, rtol=RTOL):
    for name, p in native.named_parameters():
        local = getattr(layer, name)
        assert_close(layer.full_tensor(name), p, rtol=rtol, name=f"{name} (gathered)")
        assert_close(layer.full_tensor(name, local.grad), p.grad, rtol=rtol, atol=1e-6, name=f"{name}.grad")


def _local_cols(full, layer):
    """This rank's slice of the last dim of a column layer's full output."""
    mine = layer.pieces("weight", dist.get_rank())
    return take_rows(full, mine, layer.weight.shape[0], full.dim() - 1)


def _col(case):
    tp, rank = dist.get_world_size(), dist.get_rank()
    native = nn.Linear(H, 3 * H // 2, bias=True)
    x = torch.randn(B, S, H)
    g = torch.randn(B, S, 3 * H // 2)
    ref_x = x.clone().requires_grad_()
    ref = native(ref_x)
    ref.backward(g)
    kw = {"gather_output": case == "gather"}
    sp = case in ("split_gather", "ring")
    if sp:
        kw["seq_parallel_mode"] = case
    layer = Linear1D_Col.from_native_module(copy.deepcopy(native), None, **kw)
    assert set(layer.state_dict()) == set(native.state_dict())
    xin = x.chunk(tp, dim=1)[rank] if sp else x
    xin = xin.clone().requires_grad_()
    out = layer(xin)
    if case == "gather":
        assert_close(out, ref, rtol=RTOL, atol=1e-6, name="out")
        out.backward(g)
    else:
        assert_close(out, _local_cols(ref, layer), rtol=RTOL, atol=1e-6, name="out")
        out.backward(_local_cols(g, layer))
    want_gx = ref_x.grad.chunk(tp, dim=1)[rank] if sp else ref_x.grad
    assert_close(xin.grad, want_gx, rtol=RTOL, atol=1e-6, name="x.grad")
    _compare_grads(layer, native)


def _row(case):
    tp, rank = dist.get_world_size(), dist.get_rank()
    native = nn.Linear(H, H // 2, bias=True)
    x = torch.randn(B, S, H)
    g = torch.randn(B, S, H // 2)
    ref_x = x.clone().requires_grad_()
    ref = native(ref_x)
    ref.backward(g)
    kw = {"input_is_parallel": case != "replicated_input"}
    if case in ("split_gather", "ring"):
        kw["seq_parallel_mode"] = case
    layer = Linear1D_Row.from_native_module(copy.deepcopy(native), None, **kw)
    assert set(layer.state_dict()) == set(native.state_dict())
    xin = x if case == "replicated_input" else x.chunk(tp, dim=-1)[rank]
    xin = xin.clone().requires_grad_()
    with CollectiveCounter() as cc:
        out = layer(xin)
    if case in ("split_gather", "ring"):
        assert_close(out, ref.chunk(tp, dim=1)[rank], rtol=RTOL, atol=1e-6, name="out")
        out.backward(g.chunk(tp, dim=1)[rank])
        if case == "ring":  # t - 1 sends of one output chunk (see [Note: ring steps])
            chunk = B * (S // tp) * (H // 2) * 4
            assert [(e.op, e.nbytes) for e in cc.events] == [("irecv", chunk), ("isend", chunk)] * (tp - 1)
        else:
            assert cc.count("reduce_scatter_tensor") == 1 and cc.count() == 1
    else:
        assert_close(
            out, ref, rtol=RTOL, atol=1e-6, name="out"
        )  # the bias is added once, after the all-reduce
        out.backward(g)
        assert cc.count("all_reduce") == 1 and cc.count() == 1
    want_gx = ref_x.grad if case == "replicated_input" else ref_x.grad.chunk(tp, dim=-1)[rank]
    assert_close(xin.grad, want_gx, rtol=RTOL, atol=1e-6, name="x.grad")
    _compare_grads(layer, native)


def _fused_qkv(case):
    """q of 4 heads, k and v of `kv` heads, head dim 4, in one fused Linear (or k alone)."""
    kv = {"qkv_mha": 4, "qkv_gqa": 2, "qkv_mqa": 1, "k_gqa": 2}[case]
    d, nh = 4, 4
    sizes = [nh * d, kv * d, kv * d]
    native = nn.Linear(H, kv * d if case == "k_gqa" else sum(sizes), bias=True)
    x = torch.randn(B, S, H)
    ref_x = x.clone().requires_grad_()
    ref = native(ref_x)
    if case == "k_gqa":
        layer = Linear1D_Col.from_native_module(copy.deepcopy(native), None, num_heads=kv)
    else:
        layer = FusedLinear1D_Col.from_native_module(
            copy.deepcopy(native), None, split_sizes=sizes, num_heads=[nh, kv, kv]
        )
    # The upstream gradient of a replicated head is this rank's share of the work (its query heads): the
    # reference's gradient is the sum of those shares over the ranks that hold the head.
    g_local = [torch.randn(B, S, layer.weight.shape[0], generator=torch.Generator().manual_seed(7 + r))
               for r in range(dist.get_world_size())]  # fmt: skip
    g_ref = torch.zeros_like(ref)
    for r, gr in enumerate(g_local):
        for p in layer.pieces("weight", r):
            g_ref[..., p.global_ : p.global_ + p.length] += gr[..., p.local : p.local + p.length]
    ref.backward(g_ref)
    xin = x.clone().requires_grad_()
    out = layer(xin)
    assert_close(out, _local_cols(ref, layer), rtol=RTOL, atol=1e-6, name="out")
    out.backward(g_local[dist.get_rank()])
    assert_close(xin.grad, ref_x.grad, rtol=RTOL, atol=1e-6, name="x.grad")
    _compare_grads(layer, native)


def _vocab(case):
    tp, rank = dist.get_world_size(), dist.get_rank()
    vocab = 251  # divisible by neither 2 nor 4: padded to 256 with make_vocab_size_divisible_by=8
    ids = torch.randint(0, vocab, (B, S))
    if case == "embedding":
        native = nn.Embedding(vocab, H, padding_idx=3)
        ids[0, 0] = 3
        layer = VocabParallelEmbedding1D.from_native_module(
            copy.deepcopy(native), None, make_vocab_size_divisible_by=8
        )
        assert layer.padded_vocab == 256
    elif case == "embedding_dim":
        native = nn.Embedding(vocab, H)
        layer = Embedding1D.from_native_module(copy.deepcopy(native), None)
    else:
        native = nn.Linear(H, vocab, bias=case == "head_bias")
        layer = VocabParallelLMHead1D.from_native_module(copy.deepcopy(native), None, gather_output=True, make_vocab_size_divisible_by=8)  # fmt: skip
    sd = layer.state_dict()
    assert set(sd) == set(native.state_dict())
    if isinstance(layer, (VocabParallelEmbedding1D, VocabParallelLMHead1D)):
        # See [Note: vocabulary padding]: padding rows never appear in the state dict, and it loads back.
        assert sd["weight"].shape[0] == layer.vocab_real_rows
        assert (layer.vocab_real_rows < layer.vocab_per_rank) == (rank == tp - 1)  # only the last rank pads
        assert_close(
            sd["weight"],
            native.weight[layer.vocab_start_index : layer.vocab_start_index + layer.vocab_real_rows],
        )
        layer.load_state_dict({k: v.clone() for k, v in sd.items()})
    if case.startswith("head"):
        x = torch.randn(B, S, H)
        ref_x, xin = x.clone().requires_grad_(), x.clone().requires_grad_()
        g = torch.randn(B, S, vocab)
        ref = native(ref_x)
        ref.backward(g)
        out = layer(xin)
        assert_close(out, ref, rtol=RTOL, atol=1e-6, name="logits")
        out.backward(g)
        assert_close(xin.grad, ref_x.grad, rtol=RTOL, atol=1e-6, name="x.grad")
    else:
        g = torch.randn(B, S, H)
        ref = native(ids)
        ref.backward(g)
        out = layer(ids)
        assert_close(out, ref, rtol=RTOL, atol=1e-6, name="out")
        out.backward(g)
    _compare_grads(layer, native)


def _cross_entropy(case):
    vocab = 251
    native = nn.Linear(H, vocab, bias=False)
    x = torch.randn(B, S, H)
    labels = torch.randint(0, vocab, (B, S))
    labels[0, :3] = -100
    ref_x = x.clone().requires_grad_()
    ref = F.cross_entropy(native(ref_x).flatten(0, 1), labels.flatten(), ignore_index=-100)
    ref.backward()
    layer = VocabParallelLMHead1D.from_native_module(
        copy.deepcopy(native), None, make_vocab_size_divisible_by=8
    )
    xin = x.clone().requires_grad_()
    with CollectiveCounter() as cc:
        loss = vocab_parallel_cross_entropy(xin, layer, labels)
    loss.backward()
    assert_close(loss, ref, rtol=RTOL, name="loss")
    assert_close(xin.grad, ref_x.grad, rtol=RTOL, atol=1e-7, name="x.grad")
    _compare_grads(layer, native)
    # Never gathers the logits: per-token statistics and the hidden gradient are the only traffic.
    assert cc.count("all_gather_into_tensor") == 0 and cc.count("all_gather") == 0
    assert max(e.nbytes for e in cc.events) == B * S * H * 4  # grad of hidden; logits would be B*S*V*4


CASES = {
    "col_gather": (_col, "gather"),
    "col_local": (_col, "local"),
    "col_split_gather": (_col, "split_gather"),
    "col_ring": (_col, "ring"),
    "row_parallel_input": (_row, "parallel_input"),
    "row_replicated_input": (_row, "replicated_input"),
    "row_split_gather": (_row, "split_gather"),
    "row_ring": (_row, "ring"),
    "qkv_mha": (_fused_qkv, "qkv_mha"),
    "qkv_gqa": (_fused_qkv, "qkv_gqa"),
    "qkv_mqa": (_fused_qkv, "qkv_mqa"),
    "k_gqa": (_fused_qkv, "k_gqa"),
    "vocab_embedding": (_vocab, "embedding"),
    "embedding_dim": (_vocab, "embedding_dim"),
    "lm_head": (_vocab, "head"),
    "lm_head_bias": (_vocab, "head_bias"),
    "cross_entropy": (_cross_entropy, "ce"),
}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_layer_matches_unsharded(case, tp):
    fn, arg = CASES[case]
    run_distributed(fn, tp, arg)


def _gate_up():
    """A fused [gate; up] projection keeps each rank's gate rows next to its own up rows."""
    native = nn.Linear(H, 2 * 8, bias=False)
    layer = FusedLinear1D_Col.from_native_module(copy.deepcopy(native), None, split_sizes=[8, 8])
    gate, up = layer(torch.ones(1, H)).chunk(2, dim=-1)
    tp, rank = dist.get_world_size(), dist.get_rank()
    ref_gate, ref_up = native(torch.ones(1, H)).chunk(2, dim=-1)
    assert_close(gate, ref_gate.chunk(tp, -1)[rank], rtol=RTOL)
    assert_close(up, ref_up.chunk(tp, -1)[rank], rtol=RTOL)


def test_fused_gate_up_keeps_halves_together():
    run_distributed(_gate_up, 2)


def _bad_heads():
    try:
        Linear1D_Col.from_native_module(nn.Linear(H, 12), None, num_heads=3)
    except ValueError as e:
        return str(e)


def _vocab_only_padding():
    try:
        VocabParallelEmbedding1D.from_native_module(
            nn.Embedding(10, H), None, make_vocab_size_divisible_by=64
        )
    except ValueError as e:
        return str(e)


def test_errors_name_the_values():
    assert "3 heads" in run_distributed(_bad_heads, 2)[0] and "tp=2" in run_distributed(_bad_heads, 2)[0]
    msg = run_distributed(_vocab_only_padding, 2)[0]
    assert "10" in msg and "make_vocab_size_divisible_by=64" in msg


def _fp8_column():
    """With enable_fp8 a column layer's slice is the unsharded FP8 layer's, exactly: the scales cover the whole
    input features either way. Ring sequence parallelism has no FP8 path and says so."""
    from cai.kernels import fp8_linear
    from cai.shardformer import enable_fp8

    torch.manual_seed(0)
    native = nn.Linear(H, 2 * H, bias=False)
    x = torch.randn(B, S, H)
    ref = fp8_linear(x, native.weight, recipe="rowwise")
    model = nn.ModuleDict({"proj": Linear1D_Col.from_native_module(copy.deepcopy(native), None)})
    model["lm_head"] = Linear1D_Col.from_native_module(copy.deepcopy(native), None)
    assert (
        enable_fp8(model) == 1 and model["proj"].fp8 and not model["lm_head"].fp8
    )  # the head stays as it is
    layer = model["proj"]
    assert torch.equal(layer(x), _local_cols(ref, layer))
    # evaluation multiplies in the working dtype
    assert not torch.equal(layer.eval()(x), _local_cols(ref, layer))
    # split_gather: the gathered sequence in FP8, backward through the re-gather of the kept slice
    sp = Linear1D_Col.from_native_module(copy.deepcopy(native), None, seq_parallel_mode="split_gather")
    assert enable_fp8(nn.ModuleDict({"proj": sp})) == 1
    mine = x.chunk(dist.get_world_size(), dim=1)[dist.get_rank()].clone().requires_grad_()
    out = sp(mine)
    assert torch.equal(out, _local_cols(ref, sp))
    out.sum().backward()
    assert mine.grad is not None and sp.weight.grad is not None
    ring = nn.ModuleDict(
        {"proj": Linear1D_Col.from_native_module(nn.Linear(H, 2 * H), None, seq_parallel_mode="ring")}
    )
    try:
        enable_fp8(ring)
    except ValueError as e:
        return str(e)


def test_fp8_column_layer_quantises_as_unsharded():
    assert "use sequence_parallelism_mode='split_gather' with FP8" in run_distributed(_fp8_column, 2)[0]
