"""Triton kernels for row-wise FP8 quantisation: ``q = fp8(x / scale)``, ``scale = max(amax(|row|), eps) / fp8_max``.

Either layout of ``x`` is read in place: row-major (an activation, a weight) or a transposed view (the operands of
a weight gradient, whose rows are features and whose columns are tokens); ``q`` is written row-major, as
``torch._scaled_mm`` takes it. A scale needs its whole row, so there are two ways to cut the work:

- ``quantize_rows_kernel``: one program owns BLOCK_M whole rows and reads them twice (the amax, then the cast; the
  second pass finds the rows in cache). One launch; used when there are enough row blocks to fill the GPU.
- ``row_amax_kernel`` then ``quantize_split_kernel``: a 2-D grid of (row block, column chunk) programs, the row
  amaxes combined with atomic max into a zeroed buffer. Used for few long rows (a transposed activation of a
  narrow layer has as many rows as features and as many columns as tokens).

The division is IEEE-rounded (``div_rn``) and the quotient is rounded to the FP8 grid (nearest, ties to even) in
fp32 arithmetic before the cast, which then only has exact values to convert: the result is what the torch
expression in ``_fp8._quantize_rowwise_torch`` gives, and the same under the interpreter (whose own float-to-FP8
conversion loses a rounding carry into the exponent: 7.9 becomes 4, not 8) as on the GPU.
"""

import triton
import triton.language as tl


@triton.jit
def _tile(X, rows, cols, M, K, stride_m, stride_k):
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    ptr = X + rows.to(tl.int64)[:, None] * stride_m + cols.to(tl.int64)[None, :] * stride_k
    return tl.load(ptr, mask=mask, other=0.0).to(tl.float32), mask


@triton.jit
def _round_to_grid(v, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """``v`` rounded to the nearest value with MBITS mantissa bits and exponent >= EMIN (subnormals below), ties to
    even: scaled by a power of two so the grid step is 1, rounded by adding and removing 1.5 * 2**23."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    step_exp = tl.maximum(exponent, EMIN) - MBITS
    step = ((step_exp + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - step_exp) << 23).to(tl.float32, bitcast=True)
    r = ((tl.abs(v) * inv_step + 12582912.0) - 12582912.0) * step
    return tl.where(bits < 0, -r, r)


@triton.jit
def _cast_store(Q, x, scale, rows, cols, K, mask):
    if Q.dtype.element_ty == tl.float8e5:
        v = _round_to_grid(tl.math.div_rn(x, scale[:, None]), 2, -14)
    else:  # e4m3fn
        v = _round_to_grid(tl.math.div_rn(x, scale[:, None]), 3, -6)
    tl.store(Q + rows.to(tl.int64)[:, None] * K + cols[None, :], v.to(Q.dtype.element_ty), mask=mask)


@triton.jit
def quantize_rows_kernel(
    X, Q, Scale, M, K, stride_m, stride_k,
    FP8_MAX: tl.constexpr, EPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    amax = tl.zeros((BLOCK_M,), tl.float32)
    k0 = 0
    while k0 < K:  # while loops: the interpreter cannot range() over a runtime bound
        x, _ = _tile(X, rows, k0 + tl.arange(0, BLOCK_K), M, K, stride_m, stride_k)
        amax = tl.maximum(amax, tl.max(tl.abs(x), 1))
        k0 += BLOCK_K
    scale = tl.maximum(amax, EPS) / FP8_MAX
    tl.store(Scale + rows, scale, mask=rows < M)
    k0 = 0
    while k0 < K:
        cols = k0 + tl.arange(0, BLOCK_K)
        x, mask = _tile(X, rows, cols, M, K, stride_m, stride_k)
        _cast_store(Q, x, scale, rows, cols, K, mask)
        k0 += BLOCK_K


@triton.jit
def row_amax_kernel(
    X, Amax, M, K, stride_m, stride_k, CHUNK, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    start = tl.program_id(1) * CHUNK
    amax = tl.zeros((BLOCK_M,), tl.float32)
    k0 = start
    while k0 < start + CHUNK:
        x, _ = _tile(X, rows, k0 + tl.arange(0, BLOCK_K), M, K, stride_m, stride_k)
        amax = tl.maximum(amax, tl.max(tl.abs(x), 1))
        k0 += BLOCK_K
    tl.atomic_max(Amax + rows, amax, mask=rows < M)  # |x| >= 0: the buffer starts at zero


@triton.jit
def quantize_split_kernel(
    X, Q, Amax, Scale, M, K, stride_m, stride_k, CHUNK,
    FP8_MAX: tl.constexpr, EPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    chunk = tl.program_id(1)
    scale = tl.maximum(tl.load(Amax + rows, mask=rows < M, other=0.0), EPS) / FP8_MAX
    tl.store(Scale + rows, scale, mask=(rows < M) & (chunk == 0))
    k0 = chunk * CHUNK
    while k0 < (chunk + 1) * CHUNK:
        cols = k0 + tl.arange(0, BLOCK_K)
        x, mask = _tile(X, rows, cols, M, K, stride_m, stride_k)
        _cast_store(Q, x, scale, rows, cols, K, mask)
        k0 += BLOCK_K
