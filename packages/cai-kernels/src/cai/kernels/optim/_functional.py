"""One Adam/AdamW update of flat tensors: the native CPU kernel, a Triton kernel on the GPU, or torch's fused/foreach
kernels.

[Note: device Adam]
A flat fp32 master shard on the GPU with a low-precision gradient took three passes with torch's kernels: the
gradient cast to fp32 (torch's fused Adam wants one dtype), the fused update, and the cast of the new values into the
working parameters. The Triton kernel reads the gradient in its own dtype and writes the working-dtype copy (``out``)
in the same pass: 28 bytes an element for a bf16 gradient and a bf16 copy, where the three passes moved 40. Its
arithmetic is torch's fused Adam's in fp32, with ``1 - beta`` and ``ln beta`` taken in float64 on the host and the bias
corrections ``1 - beta ** step`` computed in the kernel (the step may be a device tensor, read without a host sync)
as ``-expm1(step * ln beta)``: fp32 then keeps their digits at small steps (``1 - fp32(0.999)`` is 1.3e-5 away from
0.001, relatively). Division and square roots are rounded as IEEE's, as in torch's kernels.
"""

from __future__ import annotations

import math

import torch

from cai.kernels._dispatch import use_triton
from cai.kernels.optim._loader import native_adam

_NATIVE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _scalar_step(step: int | float | torch.Tensor) -> float:
    return float(step.item()) if isinstance(step, torch.Tensor) else float(step)


def _bias_corrections(step: float, beta1: float, beta2: float, bias_correction: bool) -> tuple[float, float]:
    if not bias_correction:
        return 1.0, 1.0
    return 1.0 - beta1**step, 1.0 - beta2**step


def adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int | float | torch.Tensor,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    out: torch.Tensor | None = None,
    grad_scale: float | None = None,
    num_threads: int | None = None,
) -> None:
    """Apply one Adam (L2) or AdamW (decoupled) step in place, optionally writing the new parameter to `out`.

    The low-level entry for optimizers that keep their own flat fp32 master shards (ZeRO, Gemini chunks).

    Args:
        param: the fp32 master values (any shape); updated in place.
        grad: the gradient, same number of elements, fp32, bf16 or fp16 (never modified).
        exp_avg, exp_avg_sq: fp32 first and second moments, same number of elements; updated in place.
        step: the 1-based number of this update (the state's step after incrementing it). A 0-d tensor is
            accepted (read on the host, except on the CUDA fused path which reads it on the device).
        lr, beta1, beta2, eps, weight_decay: as in torch.optim.Adam(W).
        adamw_mode: True decays the parameter (AdamW); False adds weight_decay * param to the gradient (Adam).
        bias_correction: divide the moments by (1 - beta^step) as torch does; False skips it.
        out: optional buffer (fp32, bf16 or fp16, same number of elements, e.g. pinned host memory) that receives
            the updated parameter cast with round-to-nearest-even, written in the same pass on CPU.
        grad_scale: the gradient is divided by it first (a loss scale); None means 1.
        num_threads: CPU threads for the native kernel; default torch.get_num_threads().

    CPU tensors (fp32, contiguous) use the native kernel from kernels/cpu_adam when it can be built, and
    torch's fused CPU Adam plus a copy otherwise. CUDA tensors (fp32 contiguous param and moments, contiguous
    grad, `out` on the same device or None) use one Triton kernel that also writes `out` ([Note: device Adam]);
    otherwise torch's fused Adam kernels, and a host `out` is then filled by an asynchronous copy on the current
    stream (synchronize before reading it on the host).
    The native kernel releases the GIL, so it can run on a worker thread while the main thread works.

    Example:
        >>> p, g = torch.randn(1031), torch.randn(1031, dtype=torch.bfloat16)
        >>> m, v, out = torch.zeros(1031), torch.zeros(1031), torch.empty(1031, dtype=torch.bfloat16)
        >>> adam_update(p, g, m, v, step=1, lr=1e-3, weight_decay=0.01, out=out)
    """
    n = param.numel()
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("out", out)):
        if t is not None and t.numel() != n:
            raise ValueError(
                f"adam_update: {name} has {t.numel()} elements but param has {n}; they must match"
            )
    if grad.dtype not in _NATIVE_DTYPES or (out is not None and out.dtype not in _NATIVE_DTYPES):
        raise TypeError(
            f"adam_update: grad dtype {grad.dtype} / out dtype {None if out is None else out.dtype} not supported; "
            "use float32, bfloat16 or float16"
        )
    if _triton_eligible(param, grad, exp_avg, exp_avg_sq, out):
        _triton_update(param, grad, exp_avg, exp_avg_sq, out, step, lr, beta1, beta2, eps, weight_decay,
                       adamw_mode, bias_correction, grad_scale)  # fmt: skip
        return
    if param.device.type == "cpu" and param.is_contiguous() and not grad.is_contiguous():
        grad = grad.contiguous()  # one copy, then the native kernel, rather than the slower torch path
    if _native_eligible(param, grad, exp_avg, exp_avg_sq, out):
        native = native_adam()
        if native is not None:
            _native_update(native, param, grad, exp_avg, exp_avg_sq, out, step, lr, beta1, beta2, eps,
                           weight_decay, adamw_mode, bias_correction, grad_scale, num_threads)  # fmt: skip
            return
    with torch.no_grad():
        torch_adam_update(
            [param], [grad.reshape(param.shape)], [exp_avg.view(param.shape)], [exp_avg_sq.view(param.shape)], [step],
            lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
            bias_correction=bias_correction, grad_scale=grad_scale,
        )  # fmt: skip
        if out is not None:
            out.view(param.shape).copy_(param, non_blocking=out.device != param.device)


def _flat_fp32(param, grad, exp_avg, exp_avg_sq, out) -> bool:
    """fp32 param and moments; every tensor contiguous and on param's device: what both kernels read."""
    tensors = [param, grad, exp_avg, exp_avg_sq] + ([out] if out is not None else [])
    return param.dtype == exp_avg.dtype == exp_avg_sq.dtype == torch.float32 and all(
        t.device == param.device and t.is_contiguous() for t in tensors
    )


def _triton_eligible(param, grad, exp_avg, exp_avg_sq, out) -> bool:
    return (
        _flat_fp32(param, grad, exp_avg, exp_avg_sq, out)
        and param.numel() > 0
        and use_triton(param)  # CUDA; CPU only where the Triton interpreter is forced (tests)
    )


def _triton_update(param, grad, exp_avg, exp_avg_sq, out, step, lr, beta1, beta2, eps, weight_decay, adamw_mode,
                   bias_correction, grad_scale) -> None:  # fmt: skip
    import triton

    from cai.kernels.optim._adam_triton import adam_kernel

    on_device = isinstance(step, torch.Tensor) and step.device == param.device
    step_value = 0.0 if on_device else _scalar_step(step)
    n, block = param.numel(), 4096
    adam_kernel[(triton.cdiv(n, block),)](
        param, grad, exp_avg, exp_avg_sq, param if out is None else out, step if on_device else param, n,
        step_value, lr, beta1, beta2, 1.0 - beta1, 1.0 - beta2, _log(beta1), _log(beta2), eps, weight_decay,
        1.0 if grad_scale is None else 1.0 / grad_scale,
        ADAMW=adamw_mode, BIAS_CORRECTION=bias_correction, STEP_ON_DEVICE=on_device, HAS_OUT=out is not None,
        BLOCK=block, num_warps=8,
    )  # fmt: skip
    _count_writes(param, out)


def _count_writes(param: torch.Tensor, out: torch.Tensor | None) -> None:
    """Bump the version counters of what a kernel wrote through raw pointers, as torch's in-place ops do (what is
    keyed on a version, such as cai-kernels' kept FP8 weights, must see the new values)."""
    torch.autograd.graph.increment_version([param] if out is None else [param, out])


def _log(beta: float) -> float:
    return math.log(beta) if beta > 0 else -math.inf


def _native_eligible(param, grad, exp_avg, exp_avg_sq, out) -> bool:
    return param.device.type == "cpu" and _flat_fp32(param, grad, exp_avg, exp_avg_sq, out)


def _native_update(native, param, grad, exp_avg, exp_avg_sq, out, step, lr, beta1, beta2, eps, weight_decay,
                   adamw_mode, bias_correction, grad_scale, num_threads) -> None:  # fmt: skip
    s = _scalar_step(step)
    bc1, bc2 = _bias_corrections(s, beta1, beta2, bias_correction)
    rc = native.step(
        param.data_ptr(), grad.data_ptr(), _NATIVE_DTYPES[grad.dtype], exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
        0 if out is None else out.data_ptr(), -1 if out is None else _NATIVE_DTYPES[out.dtype], param.numel(),
        beta1, beta2, 1.0 - beta1, 1.0 - beta2, eps, weight_decay, 1.0 - lr * weight_decay, int(adamw_mode),
        lr / bc1, math.sqrt(bc2), 1.0 if grad_scale is None else grad_scale, num_threads or torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native cpu_adam_step returned {rc} (grad {grad.dtype}, out {out and out.dtype})")
    _count_writes(param, out)


def torch_adam_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[int | float | torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
    bias_correction: bool,
    grad_scale: float | None = None,
) -> None:
    """The same update with torch kernels, for tensors on one device: `torch._fused_adam(w)_` (one launch for
    the whole list) when it applies, else foreach arithmetic. Steps are 1-based, already incremented."""
    if not params:
        return
    grads = [g if g.dtype == p.dtype else g.to(p.dtype) for p, g in zip(params, grads)]
    if grad_scale is not None:
        # Out of place: torch's fused kernel would write the unscaled values back into the caller's grads.
        grads = list(torch._foreach_div(grads, grad_scale))
    fused = torch._fused_adamw_ if adamw_mode else torch._fused_adam_
    same_dtype = all(t.dtype == params[0].dtype for t in params + exp_avgs + exp_avg_sqs)
    # torch's fused CPU kernel walks param and grad memory linearly (it makes only the grad contiguous), so a
    # non-contiguous parameter would be updated with the wrong gradient elements: those take the foreach path.
    contiguous = all(t.is_contiguous() for t in params + grads + exp_avgs + exp_avg_sqs)
    on_fused_device = all(p.device.type in ("cpu", "cuda") for p in params)
    if bias_correction and same_dtype and contiguous and on_fused_device:
        device = params[0].device
        step_tensors = [
            s.to(device=device, dtype=torch.float32)
            if isinstance(s, torch.Tensor)
            else torch.full((), float(s), dtype=torch.float32, device=device)  # a fill kernel: no host sync
            for s in steps
        ]
        fused(
            params, grads, exp_avgs, exp_avg_sqs, [], step_tensors, lr=lr, beta1=beta1, beta2=beta2,
            weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False, grad_scale=None, found_inf=None,
        )  # fmt: skip
        return
    if weight_decay != 0:
        if adamw_mode:
            torch._foreach_mul_(params, 1.0 - lr * weight_decay)
        else:
            grads = list(torch._foreach_add(grads, params, alpha=weight_decay))
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
    for p, m, v, s in zip(params, exp_avgs, exp_avg_sqs, steps):
        bc1, bc2 = _bias_corrections(_scalar_step(s), beta1, beta2, bias_correction)
        denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
        p.addcdiv_(m, denom, value=-lr / bc1)
