"""Triton kernel for attention over a paged KV cache: packed variable-length queries, GQA, causal, sliding window.

One program per (sequence, block of its new tokens, kv head). Its rows are the BLOCK_M tokens times the GROUP
query heads that share the kv head, so a decode step (one token) still fills a tile with the group's heads and
every K/V tile is read once for all of them. Keys are walked in BLOCK_N tiles through the block table with an
online softmax: both products take the cache's dtype as operands (bf16 on the tensor cores for a bf16 cache) and
accumulate in fp32, as do the statistics (an fp32 cache multiplies in full fp32, not tf32). On the GPU the tile loop is software-pipelined.

Split-K (``NUM_SPLITS > 1``, for few long decode sequences that would leave most SMs idle): the key range of a
program is cut into NUM_SPLITS pieces run by separate programs, each writing its unnormalized output, row max and
row sum; the caller combines them (log-sum-exp weights).

Only the head dim, the group, the tile shapes, the split count and the switches are compile-time constants; the
strides and the block-table width change from step to step (they are not specialized on, so a serving engine
compiles a handful of variants once instead of one per batch shape).
"""

import triton
import triton.language as tl

_VARYING = [
    "stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_ot", "stride_oh",
    "stride_bt", "stride_ps", "stride_ms", "stride_mt", "num_kv_heads", "window",
]  # fmt: skip


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, start, last, s, kv_head, K, V, BlockTables, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_bt, row_ok, q_pos, d, d_ok, scaling, window, softcap, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One BLOCK_N tile of keys from ``start`` (of the keys below ``last``) into the online softmax."""
    n = start + tl.arange(0, BLOCK_N)
    n_ok = n < last
    page = tl.load(BlockTables + s * stride_bt + n // PAGE, mask=n_ok, other=0)
    slot = page.to(tl.int64) * PAGE + n % PAGE
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(K + slot[:, None] * stride_kt + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + slot[:, None] * stride_vt + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0)
    qk = (
        tl.dot(q, tl.trans(k), input_precision=PRECISION) * scaling
    )  # (ROWS, BLOCK_N), fp32 accumulation of the cache-dtype operands
    if USE_SOFTCAP:
        qk = softcap * (2.0 * tl.sigmoid(2.0 * qk / softcap) - 1.0)  # softcap * tanh(qk / softcap)
    allowed = row_ok[:, None] & n_ok[None, :] & (n[None, :] <= q_pos[:, None])
    if USE_WINDOW:
        allowed = allowed & (n[None, :] > q_pos[:, None] - window)
    qk = tl.where(allowed, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing allowed yet stays empty
    p = tl.exp(qk - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=_VARYING)
def paged_attention_kernel(
    Q, K, V, Out, BlockTables, QueryStart, NumComputed, PartM, PartL,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_bt,
    stride_ps, stride_ms, stride_mt, num_kv_heads, scaling, window, softcap, NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, PIPELINE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0)
    m_block = tl.program_id(1)
    kv_head = tl.program_id(2) % num_kv_heads
    split = tl.program_id(2) // num_kv_heads
    q_start = tl.load(QueryStart + s)
    n_q = tl.load(QueryStart + s + 1) - q_start
    if m_block * BLOCK_M >= n_q:
        return
    computed = tl.load(NumComputed + s)

    rows = tl.arange(0, ROWS)
    tok = m_block * BLOCK_M + rows // GROUP  # token of each row, within the sequence's new tokens
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_M * GROUP) & (tok < n_q)
    q_pos = computed + tok  # (ROWS,) position in the sequence
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    q_ptr = Q + (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(K.dtype.element_ty)

    last = computed + tl.minimum(n_q, (m_block + 1) * BLOCK_M)  # keys [0, last) can be seen by this block
    lo = computed * 0  # an int32 scalar tensor either way (a loop-carried value keeps one type)
    if USE_WINDOW:
        lo = tl.maximum(computed + m_block * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full((ROWS,), float("-inf"), tl.float32)
    l_i = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, BLOCK_D), tl.float32)
    if NUM_SPLITS > 1:  # this program's share of [lo, last), in whole key tiles
        chunk = tl.cdiv(tl.cdiv(last - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = lo + split * chunk
        last = tl.minimum(last, lo + chunk)
    if PIPELINE:  # a for loop, software-pipelined: the next tile's loads overlap this tile's math
        for start in tl.range(lo, last, BLOCK_N, num_stages=2):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, start, last, s, kv_head, K, V, BlockTables, stride_kt, stride_kh, stride_vt,
                stride_vh, stride_bt, row_ok, q_pos, d, d_ok, scaling, window, softcap, BLOCK_N, PAGE, USE_WINDOW,
                USE_SOFTCAP, PRECISION,
            )  # fmt: skip
    else:  # the interpreter: a range() over loaded bounds does not run there
        start = lo
        while start < last:
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, start, last, s, kv_head, K, V, BlockTables, stride_kt, stride_kh, stride_vt,
                stride_vh, stride_bt, row_ok, q_pos, d, d_ok, scaling, window, softcap, BLOCK_N, PAGE, USE_WINDOW,
                USE_SOFTCAP, PRECISION,
            )  # fmt: skip
            start += BLOCK_N
    o_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS > 1:
        # Out is (splits, T, heads, head_dim) fp32 here: the unnormalized output; row max and sum go beside it
        t_idx = (q_start + tok).to(tl.int64)
        o_ptr = Out + split * stride_ps + t_idx[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr, acc, mask=o_mask)
        part = split.to(tl.int64) * stride_ms + t_idx * stride_mt + head  # PartM/PartL are (splits, T, heads)
        tl.store(PartM + part, m_i, mask=row_ok)
        tl.store(PartL + part, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptr = (
            Out + (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        )
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=o_mask)
