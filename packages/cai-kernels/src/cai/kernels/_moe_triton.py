"""Triton kernels for the grouped GEMM of mixture-of-experts layers.

Rows of `X` are grouped by expert (expert e owns rows `OFFS[e]:OFFS[e+1]`). Strides are arguments, so one kernel
serves `x @ W[e]^T` (forward) and `dy @ W[e]` (input gradient) by swapping the weight's last two strides.
"""

import triton
import triton.language as tl


@triton.jit
def grouped_mm_kernel(
    X, W, Y, TILE_EXPERT, TILE_ROW, OFFS, N, K,
    sxm, sxk, swe, swk, swn, sym, syn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    # One program: BM rows of one expert (a tile never crosses experts) times BN output columns.
    t = tl.program_id(0)
    e = tl.load(TILE_EXPERT + t).to(tl.int64)
    row0 = tl.load(TILE_ROW + t).to(tl.int64)
    row_end = tl.load(OFFS + e + 1).to(tl.int64)
    rm = row0 + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    # While loops rather than range(): the interpreter (TRITON_INTERPRET=1) cannot index a runtime range.
    k0 = 0
    while k0 < K:
        rk = k0 + tl.arange(0, BK)
        a = tl.load(
            X + rm[:, None] * sxm + rk[None, :] * sxk,
            mask=(rm < row_end)[:, None] & (rk < K)[None, :],
            other=0.0,
        )
        b = tl.load(
            W + e * swe + rk[:, None] * swk + rn[None, :] * swn,
            mask=(rk < K)[:, None] & (rn < N)[None, :],
            other=0.0,
        )
        if UPCAST:  # see UPCAST in _moe.py
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PREC)
        k0 += BK
    mask = (rm < row_end)[:, None] & (rn < N)[None, :]
    tl.store(Y + rm[:, None] * sym + rn[None, :] * syn, acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def grouped_mm_wgrad_kernel(
    DY, X, DW, OFFS, N, K,
    sdym, sdyn, sxm, sxk, sdwe, sdwn, sdwk,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    # dW[e] (N, K) = dY_e^T (N, rows) @ X_e (rows, K); the loop runs over expert e's rows, so an expert with no
    # rows writes zeros (its gradient is zero, not missing).
    e = tl.program_id(0).to(tl.int64)
    start = tl.load(OFFS + e).to(tl.int64)
    end = tl.load(OFFS + e + 1).to(tl.int64)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.program_id(2) * BK + tl.arange(0, BK)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    r0 = start
    while r0 < end:
        rr = r0 + tl.arange(0, BM)
        a = tl.load(
            DY + rr[None, :] * sdym + rn[:, None] * sdyn,
            mask=(rr < end)[None, :] & (rn < N)[:, None],
            other=0.0,
        )
        b = tl.load(
            X + rr[:, None] * sxm + rk[None, :] * sxk, mask=(rr < end)[:, None] & (rk < K)[None, :], other=0.0
        )
        if UPCAST:  # see UPCAST in _moe.py
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PREC)
        r0 += BM
    mask = (rn < N)[:, None] & (rk < K)[None, :]
    tl.store(DW + e * sdwe + rn[:, None] * sdwn + rk[None, :] * sdwk, acc.to(DW.dtype.element_ty), mask=mask)
