"""Triton kernel for one row times a weight matrix, ``y = x @ W.T`` (see [Note: decode GEMV] in ``_gemv.py``)."""

import triton
import triton.language as tl


@triton.jit
def gemv_kernel(
    X,  # (K,)
    W,  # (N, K), rows contiguous
    B,  # (N,) bias (HAS_BIAS)
    Y,  # (N,)
    N,
    K: tl.constexpr,  # a compile-time constant: a model has few, and a runtime loop bound fails in the interpreter
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # one program: BLOCK_N output rows over the whole K; products are summed per lane and reduced once at the end
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    w_rows = W + rn.to(tl.int64)[:, None] * K
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        x = tl.load(X + rk, mask=kmask, other=0.0).to(tl.float32)
        if EVEN_K:
            w = tl.load(w_rows + rk[None, :], mask=nmask[:, None], other=0.0)
        else:
            w = tl.load(w_rows + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(B + rn, mask=nmask, other=0.0).to(tl.float32)
    tl.store(Y + rn, y.to(Y.dtype.element_ty), mask=nmask)
