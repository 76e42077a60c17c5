"""Triton kernels for SwiGLU: one elementwise pass forward, one backward (silu recomputed)."""

import triton
import triton.language as tl


@triton.jit
def swiglu_fwd_kernel(A, B, C, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    c = a * tl.sigmoid(a) * b
    tl.store(C + offs, c.to(C.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_bwd_kernel(A, B, DC, DA, DB, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    dc = tl.load(DC + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(a)
    silu = a * sig
    # d silu(a) / da = sig * (1 + a * (1 - sig)); silu is recomputed rather than stored.
    da = dc * b * sig * (1.0 + a * (1.0 - sig))
    tl.store(DA + offs, da.to(DA.dtype.element_ty), mask=mask)
    tl.store(DB + offs, (dc * silu).to(DB.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_packed_fwd_kernel(X, C, f, x_row_stride, c_row_stride, BLOCK: tl.constexpr):
    # one program: BLOCK columns of one row; the row of X is [gate | up], f columns each
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < f
    x = X + row * x_row_stride
    a = tl.load(x + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x + f + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(C + row * c_row_stride + cols, (a * tl.sigmoid(a) * b).to(C.dtype.element_ty), mask=mask)
