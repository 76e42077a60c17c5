"""Attention of packed variable-length queries over a paged KV cache (prefill chunks and decode in one call)."""

from __future__ import annotations

import torch

from cai.kernels._dispatch import use_triton


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    num_computed: torch.Tensor,
    block_size: int,
    max_query_len: int,
    max_context_len: int,
    scaling: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached context.

    Args:
        query: (T, heads, head_dim), the new tokens of S sequences packed one after another (no padding).
        k_cache, v_cache: (num_blocks * block_size, kv_heads, head_dim); slot ``b * block_size + i`` holds offset
            ``i`` of block ``b``. The new tokens' K/V must already be written. ``heads`` is a multiple of
            ``kv_heads`` (GQA).
        block_tables: (S, max_blocks) integer block ids of each sequence (padding entries may hold any valid id).
        query_start: (S + 1,) offsets of each sequence's tokens in ``query`` (``query_start[-1] == T``).
        num_computed: (S,) tokens of each sequence cached before its new ones; the new token i sits at position
            ``num_computed[s] + i`` and sees positions up to its own.
        max_query_len, max_context_len: the largest new-token count and ``num_computed + new`` over the batch
            (host ints, so no device sync is needed to size the launch).
        scaling: the softmax scale (usually ``head_dim ** -0.5``).
        sliding_window: a query at position p sees positions > p - sliding_window only (None: all).
        softcap: ``softcap * tanh(scores / softcap)`` before the softmax (None: off).
        num_splits: Triton only: split each program's keys over this many programs and combine (split-K), for
            decode batches too small to fill the GPU. None: chosen from the batch and the GPU's SM count.

    Returns:
        (T, heads, head_dim) in ``query``'s dtype. Scores and softmax are fp32.
    """
    if use_triton(query):
        return _paged_attention_triton(
            query, k_cache, v_cache, block_tables, query_start, num_computed, block_size, max_query_len,
            max_context_len, scaling, sliding_window, softcap, num_splits,
        )  # fmt: skip
    return _paged_attention_torch(
        query, k_cache, v_cache, block_tables, query_start, num_computed, block_size, max_query_len,
        max_context_len, scaling, sliding_window, softcap,
    )  # fmt: skip


def paged_kv_write(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write each token's key and value into its cache slot: ``k_cache[slots[t]] = key[t]`` and the same for v, in
    one kernel on CUDA (Triton) for both.

    Args:
        key, value: (T, kv_heads, head_dim), any strides with the last dimension contiguous.
        k_cache, v_cache: (slots, kv_heads, head_dim), contiguous.
        slots: (T,) integer cache slots.
    """
    T, heads, head_dim = key.shape
    if T == 0:
        return
    if not use_triton(key) or key.stride(-1) != 1 or value.stride(-1) != 1:
        k_cache[slots] = key.to(k_cache.dtype)
        v_cache[slots] = value.to(v_cache.dtype)
        return
    import triton

    from cai.kernels._paged_attention_triton import kv_write_kernel

    kv_write_kernel[(T, heads)](
        key, value, k_cache, v_cache, slots,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), k_cache.stride(0), k_cache.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip


def paged_rope_kv_write(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Rotary embedding and the K/V cache write in one kernel on CUDA (Triton): rotates each token's query into a
    new tensor, which it returns, and its key into the cache, and copies its value there (``k_cache[slots[t]] =
    rotate(key[t])``, ``v_cache[slots[t]] = value[t]``). The rotation is :func:`apply_rotary_pos_emb`'s (Hugging
    Face's ``x * cos + rotate_half(x) * sin`` over the first ``R`` dims, in fp32), so the result is what that
    function followed by :func:`paged_kv_write` gives, bit for bit.

    Args:
        query: (T, heads, head_dim); key, value: (T, kv_heads, head_dim); any strides with the last dim contiguous.
        cos, sin: (T, R), each token's rotary values (``R`` even, at most head_dim).
        k_cache, v_cache: (slots, kv_heads, head_dim), contiguous, in query's dtype.
        slots: (T,) integer cache slots.

    Returns:
        (T, heads, head_dim) the rotated query, contiguous, in query's dtype.
    """
    T, heads, head_dim = query.shape
    r = cos.shape[-1]
    fused = (
        use_triton(query)
        and T > 0
        and query.dtype == k_cache.dtype == v_cache.dtype
        and all(t.stride(-1) == 1 for t in (query, key, value, cos, sin))
        and cos.stride() == sin.stride()
    )
    if not fused:
        from cai.kernels._rope import apply_rotary_pos_emb

        # (1, heads, T, head_dim) views: apply_rotary_pos_emb's layout
        q4, k4 = apply_rotary_pos_emb(
            query.transpose(0, 1)[None], key.transpose(0, 1)[None], cos[None], sin[None]
        )
        paged_kv_write(k4[0].transpose(0, 1), value, k_cache, v_cache, slots)
        return q4[0].transpose(0, 1).contiguous()
    import triton

    from cai.kernels._paged_attention_triton import rope_kv_write_kernel

    out = torch.empty(T, heads, head_dim, dtype=query.dtype, device=query.device)
    half, rest = r // 2, head_dim - r
    rope_kv_write_kernel[(T, heads + key.shape[1])](
        query, key, value, out, k_cache, v_cache, cos, sin, slots,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), cos.stride(0), heads, half, rest,
        BLOCK_HALF=triton.next_power_of_2(half), BLOCK_PASS=triton.next_power_of_2(rest) if rest else 0,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
    return out


def _paged_attention_torch(
    query, k_cache, v_cache, block_tables, query_start, num_computed, block_size, max_q, max_ctx, scaling, window,
    softcap,
):  # fmt: skip
    # Pads to (S, Q) queries and (S, C) context positions, gathers each sequence's K/V through its block table,
    # groups the query heads of each kv head.
    _, nh, hd = query.shape
    S = num_computed.shape[0]
    nkv = k_cache.shape[1]
    g = nh // nkv
    dev = query.device
    q_len = query_start[1:] - query_start[:-1]  # (S,)
    ar_q = torch.arange(max_q, device=dev)
    query_valid = ar_q[None, :] < q_len[:, None]  # (S, Q)
    query_index = torch.where(query_valid, query_start[:-1, None] + ar_q[None, :], 0)
    query_pos = num_computed[:, None] + ar_q[None, :]  # (S, Q)
    ar_c = torch.arange(max_ctx, device=dev)
    pages = block_tables.long().gather(
        1, (ar_c // block_size).clamp(max=block_tables.shape[1] - 1).expand(S, -1)
    )
    context_slots = pages * block_size + ar_c % block_size  # (S, C)

    allowed = ar_c[None, None, :] <= query_pos[:, :, None]  # (S, Q, C)
    if window is not None:
        allowed &= ar_c[None, None, :] > query_pos[:, :, None] - window
    # padding queries see position 0 only, so their softmax stays finite (their output is dropped)
    allowed = torch.where(query_valid[:, :, None], allowed, (ar_c == 0)[None, None, :])

    q = query[query_index].view(S, max_q, nkv, g, hd).permute(0, 2, 3, 1, 4)  # (S, nkv, g, Q, hd)
    k = k_cache[context_slots].permute(0, 2, 1, 3).unsqueeze(2)  # (S, nkv, 1, C, hd)
    v = v_cache[context_slots].permute(0, 2, 1, 3).unsqueeze(2)  # (S, nkv, 1, C, hd)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scaling  # (S, nkv, g, Q, C)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    out = scores.softmax(-1) @ v.float()  # (S, nkv, g, Q, hd)
    out = out.permute(0, 3, 1, 2, 4).reshape(S, max_q, nh, hd)
    return out[query_valid].to(query.dtype)  # (T, nh, hd): valid queries are in token order


def _auto_splits(query: torch.Tensor, programs: int, max_q: int, max_ctx: int) -> int:
    # Split-K only pays for decode batches that leave SMs idle (two programs an SM hide each other's load
    # latency), down to 48 keys a split: on an H200, one sequence of 512-1024 keys over 8 kv heads took 10.0-11.9 us
    # with 8-16 splits against 12.2-15.5 us with the 4 that 128 keys a split allowed (bench_paged_attention.py
    # --shapes 1x512,1x768,1x1024; --sweep found the same).
    if max_q != 1 or query.device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(query.device).multi_processor_count
    want = max(1, min(2 * sms // max(programs, 1), max_ctx // 48, 16))
    return 1 << (want.bit_length() - 1)  # a power of two: each split count is its own compiled kernel


def _key_tile(head_dim: int, max_q: int, max_ctx: int, splits: int) -> int:
    # Measured on an H200 (examples/benchmarks/bench_paged_attention.py --sweep, 8B decode shapes): 64 keys a
    # tile, except 128 where a decode program walks 256 keys or more of a split.
    if head_dim > 128:
        return 32
    return 128 if max_q == 1 and splits > 1 and max_ctx // splits >= 256 else 64


def _paged_attention_triton(
    query, k_cache, v_cache, block_tables, query_start, num_computed, block_size, max_q, max_ctx, scaling, window,
    softcap, num_splits, *, block_n=None, num_warps=None, stages=3,
):  # fmt: skip
    # block_n, num_warps, stages: launch parameters, for benchmarks that sweep them (None: the static choice)
    import triton

    from cai.kernels._paged_attention_triton import combine_splits_kernel, paged_attention_kernel

    T, nh, hd = query.shape
    S = num_computed.shape[0]
    nkv = k_cache.shape[1]
    group = nh // nkv
    if k_cache.stride(2) != 1 or v_cache.stride(2) != 1 or query.stride(2) != 1:
        raise ValueError("paged_attention needs the head dim contiguous in query, k_cache and v_cache")
    # Rows of a program are BLOCK_M tokens x the group's heads; at least 16 rows (tl.dot's minimum).
    rows_wanted = 64 if max_q > 1 else 16
    block_m = max(1, rows_wanted // group)
    rows = max(16, triton.next_power_of_2(block_m * group))
    m_blocks = triton.cdiv(max_q, block_m)
    splits = num_splits or _auto_splits(query, S * m_blocks * nkv, max_q, max_ctx)
    out = torch.empty_like(query)
    if splits > 1:  # the kernel writes (T, nh, splits, ...) partials; the combine writes `out`
        dest = torch.empty(T, nh, splits, hd, dtype=torch.float32, device=query.device)
        part_m = torch.empty(T, nh, splits, dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
    else:
        dest, part_m, part_l = out, out, out  # the partial buffers are unused
    block_d = max(16, triton.next_power_of_2(hd))
    extra = {} if num_warps is None else {"num_warps": num_warps}
    paged_attention_kernel[(S, m_blocks, nkv * splits)](
        query, k_cache, v_cache, dest, block_tables, query_start, num_computed, part_m, part_l,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0), nkv, scaling, window or 0, softcap or 1.0,
        NUM_SPLITS=splits, GROUP=group, HEAD_DIM=hd, BLOCK_D=block_d, BLOCK_M=block_m, ROWS=rows,
        BLOCK_N=block_n or _key_tile(hd, max_q, max_ctx, splits), PAGE=block_size, USE_WINDOW=window is not None,
        USE_SOFTCAP=softcap is not None, PIPELINE=query.device.type == "cuda", STAGES=stages,
        PRECISION="ieee" if k_cache.dtype == torch.float32 else None, **extra,
    )  # fmt: skip
    if splits > 1:
        combine_splits_kernel[(T, nh)](
            dest, part_m, part_l, out, out.stride(0), out.stride(1), nh, NUM_SPLITS=splits,
            BLOCK_S=triton.next_power_of_2(splits), HEAD_DIM=hd, BLOCK_D=block_d, num_warps=1,
        )  # fmt: skip
    return out
