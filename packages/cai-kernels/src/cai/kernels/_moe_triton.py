"""Triton kernels for the grouped GEMM of mixture-of-experts layers, autotuned per (N, K).

Rows of `X` are grouped by expert (expert e owns rows `OFFS[e]:OFFS[e+1]`). Strides are arguments, so one kernel
serves `x @ W[e]^T` (forward) and `dy @ W[e]` (input gradient) by swapping the weight's last two strides.

[Note: grouped tiles]
The forward grid has `cdiv(M, BM) + E` row tiles times `cdiv(N, BN)` column tiles: each expert's rows start a
new row tile, so there are at most that many. A program finds the expert owning its row tile from a prefix sum of
per-expert tile counts (one vector of `E` offsets, no host-side tile list, so `BM` can change with the autotuned
config); the programs past the last tile run an empty loop and store nothing. Row tiles are visited `GROUP_M` at
a time for each sweep over the columns, so the weight columns a group reads stay in L2 (the ordering of Triton's
matmul tutorial). The weight-gradient kernel runs one program per (expert, output tile) and loops over that
expert's rows; an expert with no rows stores zeros.

[Note: interpreter loops]
Under TRITON_INTERPRET=1 a runtime loop bound is a one-element array, which `range()` cannot take with numpy 2,
so the interpreter runs `while` loops. Compiled kernels need `for` loops: Triton software-pipelines only those
(the `num_stages` of a config). `INTERPRET` picks the loop at compile time; the body is one shared step function.
"""

import triton
import triton.language as tl

from cai.kernels._dispatch import _interpret


def _forward_configs() -> list[triton.Config]:
    if _interpret():  # one config: the interpreter has nothing to tune and would run every candidate
        return [triton.Config({"BM": 16, "BN": 16, "BK": 16, "GROUP_M": 2}, num_warps=4, num_stages=1)]
    # (BM, BN, BK, num_warps, num_stages): large tiles for Hopper-class GPUs first, smaller for smaller GPUs or
    # narrow layers; a config that needs more shared memory than the device has is skipped by the autotuner.
    tiles = [
        (128, 256, 64, 8, 3),
        (256, 128, 64, 8, 3),
        (128, 128, 64, 8, 4),
        (128, 128, 64, 4, 4),
        (64, 256, 64, 4, 4),
        (128, 64, 64, 4, 4),
        (64, 128, 32, 4, 4),
    ]
    return [
        triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in tiles
    ]


def _wgrad_configs() -> list[triton.Config]:
    if _interpret():
        return [triton.Config({"BN": 16, "BK": 16, "BR": 16, "GROUP_N": 2}, num_warps=4, num_stages=1)]
    # (BN, BK output tile, BR rows per step, num_warps, num_stages).
    tiles = [
        (128, 256, 64, 8, 3),
        (256, 128, 64, 8, 3),
        (128, 128, 64, 8, 4),
        (128, 128, 64, 4, 4),
        (64, 128, 64, 4, 4),
        (128, 128, 32, 4, 4),
    ]
    return [
        triton.Config({"BN": bn, "BK": bk, "BR": br, "GROUP_N": 8}, num_warps=w, num_stages=s)
        for bn, bk, br, w, s in tiles
    ]


@triton.jit
def _forward_step(acc, a_rows, b_cols, row_mask, col_mask, k0, K, sxk, swk,
                  BK: tl.constexpr, EVEN_K: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    rk = k0 + tl.arange(0, BK)
    if EVEN_K:
        a = tl.load(a_rows + rk[None, :] * sxk, mask=row_mask[:, None], other=0.0)
        b = tl.load(b_cols + rk[:, None] * swk, mask=col_mask[None, :], other=0.0)
    else:
        a = tl.load(a_rows + rk[None, :] * sxk, mask=row_mask[:, None] & (rk < K)[None, :], other=0.0)
        b = tl.load(b_cols + rk[:, None] * swk, mask=(rk < K)[:, None] & col_mask[None, :], other=0.0)
    if UPCAST:  # see UPCAST in _moe.py
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PREC)


@triton.autotune(configs=_forward_configs(), key=["N", "K"])
@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BK"] == 0})
@triton.jit
def grouped_mm_kernel(
    X, W, Y, OFFS, E, M, N, K,
    sxm, sxk, swe, swk, swn, sym, syn,
    E_POW2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    # One program: BM rows of one expert (a tile never crosses experts) times BN output columns.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM) + E
    num_n = tl.cdiv(N, BN)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    # The expert owning row tile pid_m (see [Note: grouped tiles]); e == E past the last tile.
    ar = tl.arange(0, E_POW2)
    starts = tl.load(OFFS + ar, mask=ar < E, other=0)
    ends = tl.load(OFFS + 1 + ar, mask=ar < E, other=0)
    tiles = (ends - starts + BM - 1) // BM
    last = tl.cumsum(tiles, 0)  # one past each expert's last tile
    e = tl.sum((last <= pid_m).to(tl.int32), 0)
    hit = ar == e
    row_end = tl.sum(tl.where(hit, ends, 0), 0)
    row0 = tl.sum(tl.where(hit, starts + (pid_m - (last - tiles)) * BM, 0), 0)
    rm = row0 + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    row_mask = rm < row_end
    col_mask = rn < N
    a_rows = X + rm[:, None] * sxm
    b_cols = W + e.to(tl.int64) * swe + rn[None, :] * swn
    k_end = tl.where(e < E, K, 0)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if INTERPRET:  # see [Note: interpreter loops]
        k0 = 0
        while k0 < k_end:
            acc = _forward_step(
                acc, a_rows, b_cols, row_mask, col_mask, k0, K, sxk, swk, BK, EVEN_K, PREC, UPCAST
            )
            k0 += BK
    else:
        for k0 in range(0, k_end, BK):
            acc = _forward_step(
                acc, a_rows, b_cols, row_mask, col_mask, k0, K, sxk, swk, BK, EVEN_K, PREC, UPCAST
            )
    mask = row_mask[:, None] & col_mask[None, :]
    tl.store(Y + rm[:, None] * sym + rn[None, :] * syn, acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _wgrad_step(acc, DY, X, r0, end, rn, rk, N, K, sdym, sdyn, sxm, sxk,
                BR: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    rr = r0 + tl.arange(0, BR)
    a = tl.load(
        DY + rr[None, :] * sdym + rn[:, None] * sdyn, mask=(rr < end)[None, :] & (rn < N)[:, None], other=0.0
    )
    b = tl.load(
        X + rr[:, None] * sxm + rk[None, :] * sxk, mask=(rr < end)[:, None] & (rk < K)[None, :], other=0.0
    )
    if UPCAST:  # see UPCAST in _moe.py
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PREC)


@triton.autotune(configs=_wgrad_configs(), key=["N", "K"])
@triton.jit
def grouped_mm_wgrad_kernel(
    DY, X, DW, OFFS, N, K,
    sdym, sdyn, sxm, sxk, sdwe, sdwn, sdwk,
    BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, GROUP_N: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    # dW[e] (N, K) = dY_e^T (N, rows) @ X_e (rows, K), one (BN, BK) tile per program, looping over e's rows.
    pid = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64)
    num_n = tl.cdiv(N, BN)
    num_k = tl.cdiv(K, BK)
    per_group = GROUP_N * num_k
    first_n = (pid // per_group) * GROUP_N
    size_n = tl.minimum(num_n - first_n, GROUP_N)
    pid_n = first_n + (pid % per_group) % size_n
    pid_k = (pid % per_group) // size_n
    start = tl.load(OFFS + e).to(tl.int64)
    end = tl.load(OFFS + e + 1).to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = pid_k * BK + tl.arange(0, BK)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    if INTERPRET:  # see [Note: interpreter loops]
        r0 = start
        while r0 < end:
            acc = _wgrad_step(acc, DY, X, r0, end, rn, rk, N, K, sdym, sdyn, sxm, sxk, BR, PREC, UPCAST)
            r0 += BR
    else:
        for r0 in range(start, end, BR):
            acc = _wgrad_step(acc, DY, X, r0, end, rn, rk, N, K, sdym, sdyn, sxm, sxk, BR, PREC, UPCAST)
    mask = (rn < N)[:, None] & (rk < K)[None, :]
    tl.store(DW + e * sdwe + rn[:, None] * sdwn + rk[None, :] * sdwk, acc.to(DW.dtype.element_ty), mask=mask)
