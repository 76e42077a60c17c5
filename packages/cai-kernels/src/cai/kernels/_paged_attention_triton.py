"""Triton kernel for attention over a paged KV cache: packed variable-length queries, GQA, causal, sliding window.

One program per (sequence, block of its new tokens, kv head). Its rows are the BLOCK_M tokens times the GROUP
query heads that share the kv head, so a decode step (one token) still fills a tile with the group's heads and
every K/V tile is read once for all of them. Keys are walked in BLOCK_N tiles through the block table with an
online softmax: both products take the cache's dtype as operands (bf16 on the tensor cores for a bf16 cache) and
accumulate in fp32, as do the statistics (an fp32 cache multiplies in full fp32, not tf32). On the GPU the tile loop is software-pipelined.

Split-K (``NUM_SPLITS > 1``, for few long decode sequences that would leave most SMs idle): the key range of a
program is cut into NUM_SPLITS pieces run by separate programs, each writing its unnormalized output, row max and
row sum into (tokens, heads, splits, ...) buffers; ``combine_splits_kernel`` merges them (log-sum-exp weights) in
one launch.

Specialization: the strides of the query, the cache and the outputs are specialized on (Triton compiles a variant
per "is 1 / divisible by 16" pattern of each, which is what lets it vectorize the K/V loads into 16-byte
accesses), and they are fixed for a model (the query's head stride is tokens x head_dim, divisible by 16 for
every head_dim of 16 or more). The block-table width and the window are not: the width changes from step to step,
and a serving engine would otherwise compile a new variant every few steps.
"""

import triton
import triton.language as tl

_VARYING = ["stride_bt", "window"]


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
    num_kv_heads, scaling, window, softcap, NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, PIPELINE: tl.constexpr, STAGES: tl.constexpr,
    PRECISION: tl.constexpr,
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
        for start in tl.range(lo, last, BLOCK_N, num_stages=STAGES):
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
        # Out is (T, heads, splits, head_dim) fp32 here: the unnormalized output; PartM/PartL (T, heads, splits)
        # hold the row max and sum
        row = ((q_start + tok).to(tl.int64) * (num_kv_heads * GROUP) + head) * NUM_SPLITS + split
        tl.store(Out + row[:, None] * HEAD_DIM + d[None, :], acc, mask=o_mask)
        tl.store(PartM + row, m_i, mask=row_ok)
        tl.store(PartL + row, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptr = (
            Out + (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        )
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=o_mask)


@triton.jit
def combine_splits_kernel(
    Part, PartM, PartL, Out, stride_ot, stride_oh, num_heads, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One (token, head) row: the splits' outputs weighted by exp(m_split - m_max), over the weighted sums. A
    split that saw no key has m = -inf and weight 0."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    sp_ok = sp < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    row = (t.to(tl.int64) * num_heads + h) * NUM_SPLITS
    m = tl.load(PartM + row + sp, mask=sp_ok, other=float("-inf"))
    row_sum = tl.load(PartL + row + sp, mask=sp_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    part = tl.load(
        Part + (row + sp)[:, None] * HEAD_DIM + d[None, :], mask=sp_ok[:, None] & d_ok[None, :], other=0.0
    )
    denom = tl.maximum(tl.sum(w * row_sum, 0), 1.1754943508222875e-38)  # the smallest normal fp32
    out = tl.sum(w[:, None] * part, 0) / denom
    tl.store(Out + t.to(tl.int64) * stride_ot + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d_ok)


@triton.jit
def kv_write_kernel(
    K, V, KC, VC, SLOTS,
    k_tok, k_head, v_tok, v_head, c_slot, c_head,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # one program: token t's key and value of kv head h into their cache slot
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(SLOTS + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < HEAD_DIM
    k = tl.load(K + t * k_tok + h * k_head + d, mask=mask)
    v = tl.load(V + t * v_tok + h * v_head + d, mask=mask)
    dst = slot * c_slot + h * c_head + d
    tl.store(KC + dst, k.to(KC.dtype.element_ty), mask=mask)
    tl.store(VC + dst, v.to(VC.dtype.element_ty), mask=mask)


@triton.jit
def rope_kv_write_kernel(
    Q, K, V, QO, KC, VC, COS, SIN, SLOTS,
    q_tok, q_head, k_tok, k_head, v_tok, v_head, o_tok, o_head, c_slot, c_head, cs_tok,
    num_q_heads, HALF, PASS,
    BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One program: token t's query head h rotated into QO (h < num_q_heads), or its key head h - num_q_heads
    rotated and its value head copied into their cache slot. The rotation is rope_triton's, in fp32."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    c1 = tl.load(COS + t * cs_tok + j, mask=jm, other=0.0).to(tl.float32)
    c2 = tl.load(COS + t * cs_tok + HALF + j, mask=jm, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + t * cs_tok + j, mask=jm, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + t * cs_tok + HALF + j, mask=jm, other=0.0).to(tl.float32)
    if h < num_q_heads:
        src = Q + t * q_tok + h * q_head
        dst = QO + t * o_tok + h * o_head
    else:
        kh = h - num_q_heads
        slot = tl.load(SLOTS + t).to(tl.int64)
        src = K + t * k_tok + kh * k_head
        dst = KC + slot * c_slot + kh * c_head
        d = tl.arange(0, BLOCK_D)
        dm = d < HEAD_DIM
        v = tl.load(V + t * v_tok + kh * v_head + d, mask=dm)
        tl.store(VC + slot * c_slot + kh * c_head + d, v.to(VC.dtype.element_ty), mask=dm)
    x1 = tl.load(src + j, mask=jm, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + j, mask=jm, other=0.0).to(tl.float32)
    tl.store(dst + j, (x1 * c1 - x2 * s1).to(dst.dtype.element_ty), mask=jm)
    tl.store(dst + HALF + j, (x2 * c2 + x1 * s2).to(dst.dtype.element_ty), mask=jm)
    if BLOCK_PASS > 0:  # partial rotary: the dims past the rotary ones unchanged
        p = tl.arange(0, BLOCK_PASS)
        pm = p < PASS
        tl.store(dst + 2 * HALF + p, tl.load(src + 2 * HALF + p, mask=pm).to(dst.dtype.element_ty), mask=pm)
