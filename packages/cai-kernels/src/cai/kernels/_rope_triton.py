"""Triton kernel for rotary position embedding (forward and its transpose for backward), q and k in one launch."""

import triton
import triton.language as tl


@triton.jit
def _rotate_heads(X, OUT, x_base, o_base, sxh, sxd, soh, sod, c1, c2, s1, s2, H,
                  HALF, PASS, BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr):  # fmt: skip
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    mask = (h < H)[:, None] & (j < HALF)[None, :]
    xp = X + x_base + h[:, None] * sxh + j[None, :] * sxd
    op = OUT + o_base + h[:, None] * soh + j[None, :] * sod
    x1 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xp + HALF * sxd, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # the transpose of the rotation
        o1 = x1 * c1[None, :] + x2 * s2[None, :]
        o2 = x2 * c2[None, :] - x1 * s1[None, :]
    else:
        o1 = x1 * c1[None, :] - x2 * s1[None, :]
        o2 = x2 * c2[None, :] + x1 * s2[None, :]
    tl.store(op, o1.to(OUT.dtype.element_ty), mask=mask)
    tl.store(op + HALF * sod, o2.to(OUT.dtype.element_ty), mask=mask)
    if BLOCK_PASS > 0:  # partial rotary: dims past the rotary ones are copied unchanged
        p = tl.arange(0, BLOCK_PASS)
        pmask = (h < H)[:, None] & (p < PASS)[None, :]
        xpp = X + x_base + h[:, None] * sxh + (2 * HALF + p[None, :]) * sxd
        opp = OUT + o_base + h[:, None] * soh + (2 * HALF + p[None, :]) * sod
        tl.store(opp, tl.load(xpp, mask=pmask, other=0.0), mask=pmask)


@triton.jit
def rope(Q, K, QO, KO, COS, SIN, T, HQ, HK, HALF, PASS,
         sqb, sqh, sqt, sqd, skb, skh, skt, skd,
         sob, soh, sot, sod, spb, sph, spt, spd, scb, sct, scd,
         BACKWARD: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
         BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr):  # fmt: skip
    # One program per token (b, t): cos/sin are loaded once and applied to every q and k head.
    pid = tl.program_id(0)
    b = (pid // T).to(tl.int64)
    t = (pid % T).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    cbase = COS + b * scb + t * sct
    sbase = SIN + b * scb + t * sct
    c1 = tl.load(cbase + j * scd, mask=jm, other=0.0).to(tl.float32)
    c2 = tl.load(cbase + (HALF + j) * scd, mask=jm, other=0.0).to(tl.float32)
    s1 = tl.load(sbase + j * scd, mask=jm, other=0.0).to(tl.float32)
    s2 = tl.load(sbase + (HALF + j) * scd, mask=jm, other=0.0).to(tl.float32)
    _rotate_heads(Q, QO, b * sqb + t * sqt, b * sob + t * sot, sqh, sqd, soh, sod, c1, c2, s1, s2, HQ,
                  HALF, PASS, BACKWARD, BLOCK_HQ, BLOCK_HALF, BLOCK_PASS)  # fmt: skip
    _rotate_heads(K, KO, b * skb + t * skt, b * spb + t * spt, skh, skd, sph, spd, c1, c2, s1, s2, HK,
                  HALF, PASS, BACKWARD, BLOCK_HK, BLOCK_HALF, BLOCK_PASS)  # fmt: skip
