"""Triton Adam/AdamW over a flat fp32 master shard: the gradient read in its own dtype and the updated parameter
also written in the working dtype, one pass (see [Note: device Adam] in _functional.py)."""

import triton
import triton.language as tl


@triton.jit
def _one_minus_pow(log_beta, step):
    # 1 - beta ** step = -expm1(step * ln beta). 1 - exp(x) would cancel for small |x| (beta2 = 0.999 at step 1
    # keeps three digits of fp32's seven); a Taylor series to x^9 covers |x| < 0.5, where its error is below 1e-9.
    # ln beta = -inf (beta = 0) gives 1.
    x = step * log_beta
    series = x * (1.0 + x / 2 * (1.0 + x / 3 * (1.0 + x / 4 * (1.0 + x / 5 * (1.0 + x / 6 * (1.0 + x / 7 * (
        1.0 + x / 8 * (1.0 + x / 9))))))))  # fmt: skip
    return -tl.where(x > -0.5, series, tl.exp(x) - 1.0)


@triton.jit
def adam_kernel(
    P, G, M, V, OUT, STEP, n, step_value, lr, beta1, beta2, one_minus_beta1, one_minus_beta2, log_beta1, log_beta2,
    eps, weight_decay, inv_scale,
    ADAMW: tl.constexpr, BIAS_CORRECTION: tl.constexpr, STEP_ON_DEVICE: tl.constexpr, HAS_OUT: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # Scalars arrive in fp32; 1 - beta and ln beta come from the host's float64, so that neither is the rounding
    # of a difference taken in fp32 (1 - fp32(0.999) is 1.3e-5 away from 0.001).
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(P + offs, mask=mask, other=0.0)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32) * inv_scale
    m = tl.load(M + offs, mask=mask, other=0.0)
    v = tl.load(V + offs, mask=mask, other=0.0)
    if ADAMW:
        p = p * (1.0 - lr * weight_decay)
    else:
        g = g + weight_decay * p
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    if STEP_ON_DEVICE:
        step = tl.load(STEP).to(tl.float32)
    else:
        step = step_value
    if BIAS_CORRECTION:
        step_size = tl.div_rn(lr, _one_minus_pow(log_beta1, step))
        bc2_sqrt = tl.sqrt_rn(_one_minus_pow(log_beta2, step))
    else:
        step_size = lr
        bc2_sqrt = 1.0
    p = p - step_size * tl.div_rn(m, tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps)
    tl.store(P + offs, p, mask=mask)
    tl.store(M + offs, m, mask=mask)
    tl.store(V + offs, v, mask=mask)
    if HAS_OUT:
        if OUT.dtype.element_ty == tl.bfloat16:
            # round to nearest even by hand: the same bits as the GPU's conversion, and as torch's cast under the
            # Triton interpreter too (which truncates)
            bits = p.to(tl.uint32, bitcast=True)
            bits = tl.where(p == p, bits + 0x7FFF + ((bits >> 16) & 1), 0x7FC00000)
            q = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            q = p.to(OUT.dtype.element_ty)
        tl.store(OUT + offs, q, mask=mask)
