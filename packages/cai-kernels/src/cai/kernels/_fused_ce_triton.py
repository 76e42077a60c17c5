"""Triton kernels for the fused linear cross-entropy: per-row softmax statistics, then the logit gradient
written in place over the logits chunk (so the chunk buffer is the only vocabulary-sized allocation)."""

import triton
import triton.language as tl


@triton.jit
def ce_stats_kernel(
    LOGITS, LABELS, MAX_OUT, SUMEXP_OUT, TARGET_OUT, SUMX_OUT,
    V, stride_row, vocab_start, ignore_index,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    base = LOGITS + row.to(tl.int64) * stride_row
    label = tl.load(LABELS + row)
    local = label - vocab_start
    is_local = (label != ignore_index) & (local >= 0) & (local < V)
    cols = tl.arange(0, BLOCK_V)
    # Online sum-exp against a running row maximum (a scalar): one exp per logit plus one per block, where a
    # per-lane maximum would need two per logit (the SFU work then rivals the memory time of the read).
    m_row = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), axis=0)
    se = tl.zeros([BLOCK_V], tl.float32)
    sx = tl.zeros([BLOCK_V], tl.float32)
    # A while loop rather than range(): the interpreter (TRITON_INTERPRET=1) cannot index a runtime range.
    start = 0
    while start < V:
        offs = start + cols
        mask = offs < V
        x = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m_row, tl.max(x, axis=0))
        # While every logit seen is -inf (a -inf bias), shift by 0 instead of -inf, so no inf - inf appears.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        se = se * tl.exp(m_row - shift) + tl.exp(x - shift)
        m_row = m_new
        sx += tl.where(mask, x, 0.0)
        start += BLOCK_V
    se_row = tl.sum(se, axis=0)
    tl.store(MAX_OUT + row, m_row)
    tl.store(SUMEXP_OUT + row, se_row)
    tl.store(SUMX_OUT + row, tl.sum(sx, axis=0))
    safe = tl.where(is_local, local, 0)
    tgt = tl.load(base + safe).to(tl.float32)
    tl.store(TARGET_OUT + row, tl.where(is_local, tgt, 0.0))


@triton.jit
def ce_grad_kernel(
    LOGITS, LABELS, LSE, SCALE,
    V, stride_row, vocab_start, ignore_index, smooth_over_v, one_minus_smooth, two_z,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    # grad_j = scale * (softmax_j * (1 + 2 z lse) - (1 - eps) [j == y] - eps / V), written over the logits.
    row = tl.program_id(0)
    base = LOGITS + row.to(tl.int64) * stride_row
    label = tl.load(LABELS + row)
    local = tl.where(label != ignore_index, label - vocab_start, -1)
    lse = tl.load(LSE + row)
    scale = tl.load(SCALE + row)
    coef = 1.0 + two_z * lse
    cols = tl.arange(0, BLOCK_V)
    start = 0
    while start < V:
        offs = start + cols
        mask = offs < V
        x = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) * coef - smooth_over_v
        g = tl.where(offs == local, g - one_minus_smooth, g) * scale
        tl.store(base + offs, g.to(LOGITS.dtype.element_ty), mask=mask)
        start += BLOCK_V
