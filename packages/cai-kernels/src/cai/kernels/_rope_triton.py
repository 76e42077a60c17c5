"""Triton kernel for rotary position embedding (forward and its transpose for backward), q and k in one launch.

A program handles a tile of BLOCK_T consecutive tokens of one sequence by BLOCK_H heads (of q, or of k: the
second grid axis enumerates q's head blocks, then k's). The tile shape is tuned per layout: when q is
(B, T, H, D) in memory a token's heads are contiguous and one token with all heads is a natural tile; when it
is (B, H, T, D) (the layout of the gradients HF attention returns) consecutive tokens of a head are, and a tile
of several tokens per head keeps each program's reads in long contiguous runs.
"""

import triton
import triton.language as tl


@triton.jit
def _rotate_tile(X, OUT, x_base, o_base, t, tmask, h, sxt, sxh, sxd, sot, soh, sod, c1, c2, s1, s2, H,
                 HALF, PASS, BACKWARD: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 BLOCK_PASS: tl.constexpr):  # fmt: skip
    j = tl.arange(0, BLOCK_HALF)
    mask = tmask[:, None, None] & (h < H)[None, :, None] & (j < HALF)[None, None, :]
    xrow = X + x_base + t[:, None, None] * sxt + h[None, :, None] * sxh
    orow = OUT + o_base + t[:, None, None] * sot + h[None, :, None] * soh
    xp = xrow + j[None, None, :] * sxd
    op = orow + j[None, None, :] * sod
    x1 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xp + HALF * sxd, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # the transpose of the rotation
        o1 = x1 * c1[:, None, :] + x2 * s2[:, None, :]
        o2 = x2 * c2[:, None, :] - x1 * s1[:, None, :]
    else:
        o1 = x1 * c1[:, None, :] - x2 * s1[:, None, :]
        o2 = x2 * c2[:, None, :] + x1 * s2[:, None, :]
    tl.store(op, o1.to(OUT.dtype.element_ty), mask=mask)
    tl.store(op + HALF * sod, o2.to(OUT.dtype.element_ty), mask=mask)
    if BLOCK_PASS > 0:  # partial rotary: dims past the rotary ones are copied unchanged
        p = tl.arange(0, BLOCK_PASS)
        pmask = tmask[:, None, None] & (h < H)[None, :, None] & (p < PASS)[None, None, :]
        xpp = xrow + (2 * HALF + p[None, None, :]) * sxd
        opp = orow + (2 * HALF + p[None, None, :]) * sod
        tl.store(opp, tl.load(xpp, mask=pmask, other=0.0), mask=pmask)


@triton.jit
def rope(Q, K, QO, KO, COS, SIN, T, HQ, HK, HALF, PASS,
         sqb, sqh, sqt, sqd, skb, skh, skt, skd,
         sob, soh, sot, sod, spb, sph, spt, spd, scb, sct, scd,
         BACKWARD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
         BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    hblock = tl.program_id(1)
    n_tblocks = tl.cdiv(T, BLOCK_T)
    b = (pid // n_tblocks).to(tl.int64)
    t = (pid % n_tblocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    t = t.to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    cmask = tmask[:, None] & (j < HALF)[None, :]
    # cos/sin for the tile's tokens, loaded once and applied to every head of the tile.
    coff = b * scb + t[:, None] * sct + j[None, :] * scd
    c1 = tl.load(COS + coff, mask=cmask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + coff + HALF * scd, mask=cmask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + coff, mask=cmask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + coff + HALF * scd, mask=cmask, other=0.0).to(tl.float32)
    n_qblocks = tl.cdiv(HQ, BLOCK_H)
    if hblock < n_qblocks:
        h = hblock * BLOCK_H + tl.arange(0, BLOCK_H)
        _rotate_tile(Q, QO, b * sqb, b * sob, t, tmask, h, sqt, sqh, sqd, sot, soh, sod, c1, c2, s1, s2, HQ,
                     HALF, PASS, BACKWARD, BLOCK_HALF, BLOCK_PASS)  # fmt: skip
    else:
        h = (hblock - n_qblocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        _rotate_tile(K, KO, b * skb, b * spb, t, tmask, h, skt, skh, skd, spt, sph, spd, c1, c2, s1, s2, HK,
                     HALF, PASS, BACKWARD, BLOCK_HALF, BLOCK_PASS)  # fmt: skip
