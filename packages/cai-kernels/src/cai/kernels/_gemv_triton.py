"""Triton kernel for one row times a weight matrix (``y = x @ W.T``), optionally with the RMSNorm or the SwiGLU that
produces ``x`` folded in (see [Note: decode GEMV] in ``_gemv.py``)."""

import triton
import triton.language as tl

PLAIN, RMS_NORM, SWIGLU = 0, 1, 2


@triton.jit
def gemv_kernel(
    X,  # (K,), or (2K,) [gate | up] for SWIGLU
    R,  # (K,) the residual added to X before the norm (RMS_NORM with HAS_RES)
    H,  # (K,) where program 0 stores X + R (RMS_NORM with HAS_RES)
    G,  # (K,) the norm's weight (RMS_NORM)
    W,  # (N, K), rows contiguous
    B,  # (N,) bias (HAS_BIAS)
    Y,  # (N,)
    N,
    eps,
    K: tl.constexpr,  # a compile-time constant: a model has few, and a runtime loop bound fails in the interpreter
    PROLOGUE: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # one program: BLOCK_N output rows, the whole K; products are summed per lane and reduced once at the end
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    w_rows = W + rn.to(tl.int64)[:, None] * K
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        if PROLOGUE == 2:  # silu(gate) * up, rounded to the activation dtype as the unfused kernel stores it
            a = tl.load(X + rk, mask=kmask, other=0.0).to(tl.float32)
            b = tl.load(X + K + rk, mask=kmask, other=0.0).to(tl.float32)
            x = (a * tl.sigmoid(a) * b).to(X.dtype.element_ty).to(tl.float32)
        elif PROLOGUE == 1:  # RMSNorm: the mean square is summed on the way and applied to the dot products
            h = tl.load(X + rk, mask=kmask, other=0.0)
            if HAS_RES:
                h = (h.to(tl.float32) + tl.load(R + rk, mask=kmask, other=0.0).to(tl.float32)).to(
                    X.dtype.element_ty
                )
                if pid == 0:
                    tl.store(H + rk, h, mask=kmask)
            hf = h.to(tl.float32)
            sumsq += hf * hf
            x = hf * tl.load(G + rk, mask=kmask, other=0.0).to(tl.float32)
        else:
            x = tl.load(X + rk, mask=kmask, other=0.0).to(tl.float32)
        if EVEN_K:
            w = tl.load(w_rows + rk[None, :], mask=nmask[:, None], other=0.0)
        else:
            w = tl.load(w_rows + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if PROLOGUE == 1:
        y = y * tl.rsqrt(tl.sum(sumsq, axis=0) / K + eps)
    if HAS_BIAS:
        y += tl.load(B + rn, mask=nmask, other=0.0).to(tl.float32)
    tl.store(Y + rn, y.to(Y.dtype.element_ty), mask=nmask)
