"""Paged attention (Triton kernel and torch fallback) against dense attention per sequence."""

from __future__ import annotations

import os

import pytest
import torch

from cai.kernels import apply_rotary_pos_emb, paged_attention, paged_kv_write, paged_rope_kv_write

PAGE = 4


def _reference(query, k_cache, v_cache, tables, starts, computed, scaling, window, softcap):
    nh = query.shape[1]
    out = torch.empty_like(query)
    for s in range(len(computed)):
        q0, q1, c = starts[s], starts[s + 1], computed[s]
        ctx = c + q1 - q0
        pos = torch.arange(ctx)
        slots = torch.tensor(tables[s])[pos // PAGE] * PAGE + pos % PAGE
        k = k_cache[slots].repeat_interleave(nh // k_cache.shape[1], dim=1)  # (ctx, nh, hd)
        v = v_cache[slots].repeat_interleave(nh // v_cache.shape[1], dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[q0:q1].double(), k.double()) * scaling
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        qpos = torch.arange(c, ctx)[:, None]
        allowed = pos[None, :] <= qpos
        if window is not None:
            allowed &= pos[None, :] > qpos - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).to(query.dtype)
    return out


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,window,softcap",
    [(4, 4, 16, None, None), (8, 2, 24, None, None), (4, 1, 16, 5, None), (6, 2, 16, None, 30.0)],
)
def test_paged_attention_matches_dense(impl, heads, kv_heads, head_dim, window, softcap):
    if impl == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        # CPU tensors reach Triton only through its interpreter; cai-infer's GPU tests run the kernels on CUDA
        pytest.skip("the Triton kernels on CPU tensors need TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(heads * 100 + head_dim)
    # (cached tokens, new tokens):
    # decode steps, a prefill from zero, a chunk in the middle, a decode over 3 key tiles (split-K splits it)
    shapes = [(7, 1), (0, 9), (5, 6), (0, 1), (150, 1)]
    num_blocks = 64
    perm = torch.randperm(num_blocks, generator=g).tolist()  # blocks scattered over the pool
    tables, used = [], 0
    for c, n in shapes:
        nb = -(-(c + n) // PAGE)
        tables.append(perm[used : used + nb])
        used += nb
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = [0]
    for _, n in shapes:
        starts.append(starts[-1] + n)
    k_cache = torch.randn(num_blocks * PAGE, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks * PAGE, kv_heads, head_dim, generator=g)
    query = torch.randn(starts[-1], heads, head_dim, generator=g)
    computed = [c for c, _ in shapes]
    scaling = head_dim**-0.5
    kwargs = dict(
        block_tables=block_tables, query_start=torch.tensor(starts, dtype=torch.int32),
        num_computed=torch.tensor(computed, dtype=torch.int32), block_size=PAGE,
        max_query_len=max(n for _, n in shapes), max_context_len=max(c + n for c, n in shapes), scaling=scaling,
        sliding_window=window, softcap=softcap,
    )  # fmt: skip
    want = _reference(query, k_cache, v_cache, tables, starts, computed, scaling, window, softcap)
    torch.testing.assert_close(paged_attention(query, k_cache, v_cache, **kwargs), want, rtol=1e-5, atol=1e-5)
    if impl == "triton":  # split-K: each program's keys over 3 programs, combined by log-sum-exp weights
        got = paged_attention(query, k_cache, v_cache, num_splits=3, **kwargs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # the layout transformers hands over: (1, heads, T, hd) transposed to (T, heads, hd)
        query_t = query.transpose(0, 1).contiguous().transpose(0, 1)
        for splits in (1, 2):
            got = paged_attention(query_t, k_cache, v_cache, num_splits=splits, **kwargs)
            assert got.stride() == query_t.stride()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [8, 80])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kv_write_puts_each_token_in_its_slot(impl, head_dim, dtype, device):
    # the keys as attention hands them over: (1, kv_heads, T, head_dim) viewed as (T, kv_heads, head_dim)
    g = torch.Generator().manual_seed(3)
    T, kv_heads, slots = 5, 3, 40
    key = torch.randn(1, kv_heads, T, head_dim, generator=g).to(device, dtype)[0].transpose(0, 1)
    value = torch.randn(1, kv_heads, T, head_dim, generator=g).to(device, dtype)[0].transpose(0, 1)
    where = torch.tensor([7, 0, 39, 12, 13], device=device)
    k_cache, v_cache = (torch.zeros(slots, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(2))
    paged_kv_write(key, value, k_cache, v_cache, where)
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    k_ref[where], v_ref[where] = key, value
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize(
    ("head_dim", "rot"), [(8, 8), (80, 80), (80, 32)], ids=["d8", "d80", "d80-partial32"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_kv_write_is_rotary_then_kv_write(impl, head_dim, rot, dtype, device):
    # q, k and v as slices of one merged projection (the serving layout), GQA, partial rotary; the fused call gives
    # apply_rotary_pos_emb then paged_kv_write bit for bit
    g = torch.Generator().manual_seed(4)
    T, heads, kv_heads, slots = 5, 6, 2, 40
    merged = torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=g).to(device, dtype)
    q, k, v = merged.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    query, key, value = (x.view(T, -1, head_dim) for x in (q, k, v))
    angles = torch.arange(T)[:, None] * torch.rand(rot // 2, generator=g)[None]
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(device, dtype) for f in (torch.cos, torch.sin))
    where = torch.tensor([7, 0, 39, 12, 13], device=device)
    k_cache, v_cache = (torch.zeros(slots, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(2))
    got = paged_rope_kv_write(query, key, value, cos, sin, k_cache, v_cache, where)

    q4, k4 = apply_rotary_pos_emb(
        query.transpose(0, 1)[None], key.transpose(0, 1)[None], cos[None], sin[None]
    )
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    paged_kv_write(k4[0].transpose(0, 1), value, k_ref, v_ref, where)
    assert got.is_contiguous() and torch.equal(got, q4[0].transpose(0, 1))
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert not torch.equal(k_ref[where][:, :, :rot], key[:, :, :rot].to(dtype))  # the keys were rotated
