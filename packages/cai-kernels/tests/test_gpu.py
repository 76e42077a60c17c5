"""Compiled Triton kernels on a CUDA device at realistic sizes (skipped without a GPU), plus the tuner."""

import pytest
import torch
import torch.nn.functional as F

from cai.kernels import _tune, apply_rotary_pos_emb, fused_linear_cross_entropy, layer_norm, rms_norm, swiglu

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.fixture(autouse=True)
def auto(monkeypatch):
    monkeypatch.delenv("CAI_KERNELS_FALLBACK", raising=False)
    monkeypatch.setenv("CAI_KERNELS_IMPL", "auto")


@pytest.mark.parametrize("n", [4096, 5120, 1000])
def test_norms_bf16_against_fp64(n):
    x = torch.randn(3000, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn_like(x, requires_grad=True)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y, _ = layer_norm(x, w, b, 1e-5, residual=r)
    assert "_NormFunction" in type(y.grad_fn).__name__
    dy = torch.randn_like(y)
    y.backward(dy)
    leaves = [t.detach().double().requires_grad_() for t in (x, r, w, b)]
    ref = F.layer_norm(leaves[0] + leaves[1], (n,), leaves[2], leaves[3], 1e-5)
    ref.backward(dy.double())
    assert rel_err(y, ref) < 2e-2
    for t, tr in zip((x, r, w, b), leaves):
        assert rel_err(t.grad, tr.grad) < 2e-2
    xr = x.detach().requires_grad_()
    y2 = rms_norm(xr, w.detach(), 1e-6)
    ref2 = F.rms_norm(xr.detach().double(), (n,), w.detach().double(), 1e-6)
    assert rel_err(y2, ref2) < 2e-2


def test_swiglu_rope_and_flce():
    a = torch.randn(4096, 3000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn_like(a, requires_grad=True)
    c = swiglu(a, b)
    assert rel_err(c, F.silu(a.double()) * b.double()) < 2e-2
    q = torch.randn(2, 64, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(2, 64, 2, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    cos, sin = torch.randn(2, 64, 128, device="cuda"), torch.randn(2, 64, 128, device="cuda")
    qo, _ = apply_rotary_pos_emb(q, k, cos, sin)
    x1, x2 = q.double().chunk(2, -1)
    want = q.double() * cos[:, None].double() + torch.cat((-x2, x1), -1) * sin[:, None].double()
    assert rel_err(qo, want) < 2e-2
    h = torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(32000, 512, device="cuda") * 0.05).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, 32000, (1000,), device="cuda")
    y[::7] = -100
    loss = fused_linear_cross_entropy(h, w, y)
    loss.backward()
    hd, wd = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = F.cross_entropy(hd @ wd.T, y)
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-2 * ref.item()
    assert rel_err(h.grad, hd.grad) < 3e-2 and rel_err(w.grad, wd.grad) < 3e-2


def test_tuner_times_candidates_once():
    calls = []
    x = torch.zeros(1, device="cuda")

    def run(cfg):
        calls.append(cfg)
        x.add_(1)

    first = _tune.pick(("test", 1), ["a", "b"], run, x.device)
    assert first in ("a", "b") and set(calls) == {"a", "b"}
    calls.clear()
    assert _tune.pick(("test", 1), ["a", "b"], run, x.device) == first and not calls


def test_patched_tiny_llama_bf16_matches_unpatched(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

    from cai.kernels import patch_hf_model

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config).cuda().to(torch.bfloat16)
    ids = torch.randint(0, 1000, (2, 128), device="cuda")
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    model = patch_hf_model(transformers.LlamaForCausalLM(config).cuda().to(torch.bfloat16))
    model.load_state_dict(ref.state_dict())
    assert all("forward" in layer.__dict__ for layer in model.model.layers)  # the residual adds in the norms
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert out.logits is None
    assert abs(out.loss.item() - ref_loss.item()) < 2e-2 * ref_loss.item()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert rel_err(p.grad, ref_params[name].grad) < 0.1, name


def test_fp8_scaled_mm_matches_the_emulation_and_trains_a_linear(monkeypatch):
    from cai.kernels import Fp8Linear, _fp8, fp8_matmul, quantize_rowwise
    from cai.kernels._fp8 import _quantize_rowwise_torch

    monkeypatch.setattr(_fp8, "_graph_shapes", set())  # earlier tests in the process may have taken the six

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9")
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    qa, sa = quantize_rowwise(a)
    qb, sb = quantize_rowwise(b)
    # the Triton quantiser (whole rows a program, and rows split over programs) is bitwise torch's
    for x in (a, b.t(), torch.randn(4096, 64, device="cuda", dtype=torch.bfloat16, generator=g).t()):
        for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            q, s = quantize_rowwise(x, dtype)
            q_ref, s_ref = _quantize_rowwise_torch(x, dtype)
            assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    emulated = (qa.float() * sa) @ (qb.float() * sb).t()
    got = fp8_matmul(a, b, torch.bfloat16)  # torch._scaled_mm with row-wise scales
    assert got.dtype == torch.bfloat16 and rel_err(got, emulated) < 1e-2  # accumulation order and bf16 output
    lin = torch.nn.Linear(512, 384, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.Linear(512, 384, device="cuda", dtype=torch.bfloat16)
    ref.load_state_dict(lin.state_dict())
    lin.__class__ = Fp8Linear
    x = torch.randn(4, 64, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x8 = x.detach().clone().requires_grad_(True)
    dy = torch.randn(4, 64, 384, device="cuda", dtype=torch.bfloat16)
    (ref(x) * dy).sum().backward()
    (lin(x8) * dy).sum().backward()
    for got, want in ((x8.grad, x.grad), (lin.weight.grad, ref.weight.grad)):
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 0.1
    # that linear ran as two compiled bodies ([Note: fp8 host time]); the eager path (Triton quantiser, the same
    # _scaled_mm calls) gives the same products
    assert _fp8._graph_shapes == {(256, 512, 384)} and not _fp8._compile_failed
    x2, dy2 = x8.detach().reshape(-1, 512), dy.reshape(-1, 384)
    _fp8._cache.clear()
    eager = [
        fp8_matmul(x2, lin.weight, torch.bfloat16),
        fp8_matmul(dy2, lin.weight.t(), torch.bfloat16, a_dtype=_fp8.GRAD_DTYPE),
        fp8_matmul(dy2.t(), x2.t(), torch.bfloat16, a_dtype=_fp8.GRAD_DTYPE),
    ]
    compiled = [
        _fp8._in_graph(_fp8._forward_body, x2, lin.weight)[0],
        *_fp8._in_graph(_fp8._backward_body, dy2, lin.weight, x2),
    ]
    for got, want in zip(compiled, eager, strict=True):
        assert rel_err(got, want) < 1e-3
    # the tensor-wise recipe (the layer's default): _scaled_mm with one scale an operand against its emulation
    y, *saved = _fp8._in_graph(_fp8._forward_tensorwise, x2, lin.weight)
    compiled = [y, *_fp8._in_graph(_fp8._backward_tensorwise, dy2, lin.weight, *saved)]
    y, *saved = _fp8._forward_tensorwise(x2, lin.weight, product=_fp8._emulated_product)
    emulated = [y, *_fp8._backward_tensorwise(dy2, lin.weight, *saved, product=_fp8._emulated_product)]
    for got, want in zip(compiled, emulated, strict=True):
        assert rel_err(got, want) < 1e-2


def test_rope_kv_write_is_bitwise_rotary_then_kv_write_on_decode_shapes():
    # Llama-3-8B decode and prefill shapes (32 query heads, 8 kv heads, head dim 128) in bf16, q/k/v as slices of
    # one merged projection: the fused kernel gives the rotary kernel followed by the K/V write, bit for bit
    from cai.kernels import paged_kv_write, paged_rope_kv_write

    g = torch.Generator(device="cuda").manual_seed(5)
    for T in (1, 8, 512):
        merged = torch.randn(T, (32 + 16) * 128, device="cuda", dtype=torch.bfloat16, generator=g)
        query, key, value = (x.view(T, -1, 128) for x in merged.split([32 * 128, 8 * 128, 8 * 128], dim=-1))
        angles = torch.arange(T, device="cuda")[:, None] * torch.rand(64, device="cuda", generator=g)[None]
        cos, sin = (torch.cat([f(angles)] * 2, -1).bfloat16() for f in (torch.cos, torch.sin))
        slots = torch.randperm(4 * T, device="cuda", generator=g)[:T]
        caches = [torch.zeros(4 * T, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        got = paged_rope_kv_write(query, key, value, cos, sin, caches[0], caches[1], slots)
        q4, k4 = apply_rotary_pos_emb(
            query.transpose(0, 1)[None], key.transpose(0, 1)[None], cos[None], sin[None]
        )
        paged_kv_write(k4[0].transpose(0, 1), value, caches[2], caches[3], slots)
        assert torch.equal(got, q4[0].transpose(0, 1))
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_fused_ce_backward_does_not_wait_for_the_device():
    # [Note: fused CE backward scaling]: the upstream gradient is applied on the device, never read on the host,
    # so the backward can be queued while the forward still runs.
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (
        (0.02 * torch.randn(32000, 512, device="cuda", generator=g)).bfloat16().requires_grad_()
    )  # logits ~ 0.5
    y = torch.randint(0, 32000, (4096,), device="cuda", generator=g)
    loss = fused_linear_cross_entropy(h, w, y) * 0.5
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ref_h, ref_w = (t.detach().float().requires_grad_() for t in (h, w))
    (F.cross_entropy(ref_h @ ref_w.T, y) * 0.5).backward()
    for got, ref in ((h.grad, ref_h.grad), (w.grad, ref_w.grad)):  # test_fused_ce.py's bf16 bound
        assert float((got.float() - ref).abs().max()) <= 3e-2 * float(ref.abs().max())
