"""Expert compute for mixture-of-experts layers: token permutation by expert and a grouped GEMM.

[Note: expert-sorted rows]
A router picks `k` experts per token, giving `T * k` (token, expert) pairs. `permute_tokens` orders the pairs by
expert with one stable sort (ties keep token order, so the layout is deterministic), gathers the token rows in
that order and counts the rows per expert. `grouped_linear` then multiplies each expert's contiguous block of
rows by that expert's weight, and `unpermute_tokens` puts the rows back in (token, slot) order and sums each
token's `k` rows weighted by the router. No step loops in Python over tokens; the loop fallback of
`grouped_linear` loops over experts only.

[Note: grouped GEMM paths]
`grouped_linear` runs forward, input gradient and weight gradient on one of three paths (torch._grouped_mm, the
Triton kernels, a loop over experts), chosen per call by the first rule that applies:
1. `backend=` other than "auto" forces a path ("grouped_mm", "triton", "loop"); a forced path that cannot run
   raises and says why (the benchmark uses this to time each path).
2. `CAI_KERNELS_IMPL=torch` (or `CAI_KERNELS_FALLBACK`) picks the loop and `CAI_KERNELS_IMPL=triton` the Triton
   kernels, as for every kernel in this package ([Note: implementation choice] in _dispatch.py).
3. Otherwise CUDA bf16 on compute capability 9.x (Hopper) takes `torch._grouped_mm`: torch's CUTLASS grouped
   GEMM (TMA loads, warp-specialised, one launch per GEMM, offsets read on the device). It needs 16-byte
   strides (in and out features multiples of 8) and fewer than 1024 experts. Elsewhere torch runs that op as a
   per-group loop of matmuls after copying the offsets to the host (fp16, fp32, other architectures), which
   gains nothing over path 5; torch also sends compute capability 10.x to CUTLASS, but that is not measured
   here, so it stays on path 4. The calls are the ones torch's own autograd formulas for `_grouped_mm` make.
4. Other CUDA tensors take the Triton kernels of _moe_triton.py, autotuned per (N, K) on first use.
5. CPU tensors (and CUDA without Triton) take a loop over experts of torch matmuls.
Rows need no padding on any path: `torch._grouped_mm` walks row groups by pointer offsets along the row (not
contiguous) dimension of row-major operands, so group sizes need no alignment; the weight gradient passes `dy`
transposed (column-major) and `x` row-major, the layout whose group offsets also need none.

[Note: idle experts]
An expert with no rows must get a zero weight gradient. The loop keeps every weight in the graph and the Triton
weight-gradient kernel stores zeros for an empty row range; `torch._grouped_mm` leaves a group with no rows
undefined on some GPUs (pytorch/pytorch#172439, Blackwell), so those experts are zeroed explicitly.
"""

from __future__ import annotations

from typing import Literal

import torch

from cai.kernels._dispatch import FALLBACK_ENV, IMPL_ENV, _interpret, _requested_impl, _triton_import

Backend = Literal["auto", "grouped_mm", "triton", "loop"]
_BACKENDS = ("auto", "grouped_mm", "triton", "loop")
# The compute capability (major) where "auto" picks torch._grouped_mm, see [Note: grouped GEMM paths].
_GROUPED_MM_MAJOR = 9
_GROUPED_MM_MAX_EXPERTS = 1023  # CUTLASS path: "Can't process more than 1024 groups"


def permute_tokens(
    x: torch.Tensor, expert_index: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather token rows grouped by expert (see [Note: expert-sorted rows]).

    Args:
        x: `(T, H)` token rows.
        expert_index: `(T, k)` expert ids chosen for each token.
        num_experts: `E`; ids must lie in `[0, E)`.

    Returns:
        `(rows, order, counts)`: `rows` `(T * k, H)` sorted by expert, `order` `(T * k,)` the flat (token, slot)
        position of each sorted row (pass it to :func:`unpermute_tokens`), `counts` `(E,)` int64 rows per expert.
    """
    if x.dim() != 2 or expert_index.dim() != 2 or expert_index.shape[0] != x.shape[0]:
        raise ValueError(
            f"permute_tokens: x {tuple(x.shape)} must be (T, H) and expert_index {tuple(expert_index.shape)} "
            f"(T, k) with the same T; flatten batch and sequence first"
        )
    flat = expert_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    if counts.numel() != num_experts:
        raise ValueError(
            f"permute_tokens: expert ids reach {counts.numel() - 1} but num_experts={num_experts}"
        )
    rows = x[order // expert_index.shape[1]]  # backward is an index_add over tokens
    return rows, order, counts


def unpermute_tokens(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Undo :func:`permute_tokens` and combine: `out[t] = sum_j weights[t, j] * rows[position of (t, j)]`.

    Args:
        rows: `(T * k, H)` expert outputs in the sorted order.
        order: the `order` returned by :func:`permute_tokens`.
        weights: `(T, k)` router weights; the product is taken in the promoted dtype and the sum returned in
            `rows.dtype`.

    Returns:
        `(T, H)`. Gradients flow to `rows` and `weights`.
    """
    t, k = weights.shape
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    by_token = rows[inverse].view(t, k, rows.shape[-1])  # (T, k, H)
    return (by_token * weights.unsqueeze(-1)).sum(dim=1).to(rows.dtype)


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _grouped_mm_misfit(dtype: torch.dtype, n_experts: int, out_f: int, in_f: int) -> str | None:
    # Why torch._grouped_mm cannot take these operands (None when it can).
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"torch._grouped_mm takes bf16, fp16 or fp32, not {dtype}"
    align = 16 // dtype.itemsize
    if in_f % align or out_f % align:
        return (
            f"in={in_f} and out={out_f} features must be multiples of {align} ({dtype} rows of 16-byte multiples "
            "for torch._grouped_mm)"
        )
    if n_experts > _GROUPED_MM_MAX_EXPERTS:
        return f"{n_experts} experts; torch._grouped_mm takes at most {_GROUPED_MM_MAX_EXPERTS} groups"
    return None


def _check_triton(device: torch.device, who: str) -> None:
    ok, why = _triton_import()
    if not ok:
        raise RuntimeError(f"{who} but {why}")
    if device.type != "cuda" and not _interpret():
        raise RuntimeError(
            f"{who} with a {device.type} tensor needs TRITON_INTERPRET=1 (set before the first kernel call); use a "
            "CUDA tensor or another backend"
        )


def _choose(
    device: torch.device, dtype: torch.dtype, n_experts: int, out_f: int, in_f: int, backend: str = "auto"
) -> tuple[str, str]:
    """`(path, reason)` with path "grouped_mm" | "triton" | "loop" (see [Note: grouped GEMM paths])."""
    if backend not in _BACKENDS:
        raise ValueError(f"grouped_linear: backend={backend!r} is not one of {_BACKENDS}")
    if backend == "loop":
        return "loop", "backend='loop'"
    if backend == "grouped_mm":
        why = _grouped_mm_misfit(dtype, n_experts, out_f, in_f)
        if why:
            raise ValueError(f"grouped_linear(backend='grouped_mm'): {why}")
        return "grouped_mm", "backend='grouped_mm'"
    if backend == "triton":
        _check_triton(device, "grouped_linear(backend='triton')")
        return "triton", "backend='triton'"
    impl = _requested_impl()
    if impl == "torch":
        return "loop", f"{IMPL_ENV}=torch or {FALLBACK_ENV} is set"
    if impl == "triton":
        _check_triton(device, f"{IMPL_ENV}=triton")
        return "triton", f"{IMPL_ENV}=triton"
    if device.type != "cuda":
        return "loop", f"{device.type} tensors take the per-expert loop of torch matmuls"
    why = _grouped_mm_misfit(dtype, n_experts, out_f, in_f)
    if why is None and dtype != torch.bfloat16:
        why = f"{dtype}: torch._grouped_mm has a CUTLASS kernel for bf16 only"
    if why is None:
        major, minor = _capability(device)
        if major != _GROUPED_MM_MAJOR:
            why = f"sm_{major}{minor}: torch._grouped_mm is picked on compute capability {_GROUPED_MM_MAJOR}.x only"
        else:
            return "grouped_mm", f"torch._grouped_mm (CUTLASS) for bf16 on sm_{major}{minor}"
    ok, triton_why = _triton_import()
    if ok:
        return "triton", f"Triton kernels ({why})"
    return "loop", f"per-expert loop ({why}; {triton_why})"


def _packed(t: torch.Tensor) -> torch.Tensor:
    # Row-major strides and 16-byte aligned data: what both kernels index with and torch._grouped_mm's TMA loads
    # need. `.contiguous()` is not enough: it keeps odd strides on size-1 dims, which torch._grouped_mm rejects.
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.append(step)
        step *= size
    if t.stride() == tuple(reversed(strides)) and t.data_ptr() % 16 == 0:
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _prec(t: torch.Tensor) -> str:
    # fp32 stays fp32 (tf32 would miss the fp32 tolerance of the parity tests); half types have one precision.
    return "ieee" if t.dtype == torch.float32 else "tf32"


def _upcast(t: torch.Tensor) -> bool:
    # UPCAST: the Triton interpreter keeps bf16 as raw 16-bit integers and its tl.dot multiplies those, so on CPU the
    # operands go to fp32 first. The result is the same (a product of two half-precision values is exact in fp32,
    # and the accumulator is fp32 either way); compiled kernels multiply in the inputs' dtype on the tensor cores.
    # The interpreter also truncates fp32 to bf16 where compiled kernels round to nearest, so there the kernels
    # store fp32 and torch rounds (`_out_dtype`).
    return t.dtype != torch.float32 and _interpret()


def _out_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if _upcast(t) else t.dtype


def _triton_mm(x, w, offs, n, k, w_strides):
    # y (rows, n) = x @ W[e] per expert, W[e] read through its (reduction, column) strides.
    import triton

    from cai.kernels._moe_triton import grouped_mm_kernel

    rows, n_e = x.shape[0], w.shape[0]
    y = torch.empty(rows, n, device=x.device, dtype=_out_dtype(x))

    def grid(meta):  # see [Note: grouped tiles] in _moe_triton.py
        return ((triton.cdiv(rows, meta["BM"]) + n_e) * triton.cdiv(n, meta["BN"]),)

    grouped_mm_kernel[grid](
        x, w, y, offs, n_e, rows, n, k, x.stride(0), x.stride(1), w.stride(0), *w_strides, y.stride(0), y.stride(1),
        E_POW2=max(2, triton.next_power_of_2(n_e)), PREC=_prec(x), UPCAST=_upcast(x), INTERPRET=_interpret(),
    )  # fmt: skip
    return y.to(x.dtype)


def _triton_wgrad(dy, x, offs, n_e):
    import triton

    from cai.kernels._moe_triton import grouped_mm_wgrad_kernel

    out_f, in_f = dy.shape[1], x.shape[1]
    dw = torch.empty(n_e, out_f, in_f, device=x.device, dtype=_out_dtype(x))

    def grid(meta):
        return (triton.cdiv(out_f, meta["BN"]) * triton.cdiv(in_f, meta["BK"]), n_e)

    grouped_mm_wgrad_kernel[grid](
        dy, x, dw, offs, out_f, in_f, dy.stride(0), dy.stride(1), x.stride(0), x.stride(1),
        dw.stride(0), dw.stride(1), dw.stride(2), PREC=_prec(x), UPCAST=_upcast(x), INTERPRET=_interpret(),
    )  # fmt: skip
    return dw.to(x.dtype)


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, counts, counts_list, path):
        x, weight = _packed(x), _packed(weight)
        n_e, out_f, in_f = weight.shape
        if path == "grouped_mm":
            offs = torch.cumsum(counts.to(x.device), 0, dtype=torch.int32)  # (E,) one past each expert's rows
            y = torch._grouped_mm(x, weight.transpose(1, 2), offs=offs)  # (N, in) @ (E, in, out)
        else:
            offs = torch.zeros(
                n_e + 1, dtype=torch.int64, device=x.device
            )  # (E + 1,) first row of each expert
            offs[1:] = torch.cumsum(counts.to(x.device, torch.int64), 0)
            # y = x @ W[e]^T: the kernel's (reduction, column) strides of W are (stride 2, stride 1).
            y = _triton_mm(x, weight, offs, out_f, in_f, (weight.stride(2), weight.stride(1)))
        ctx.save_for_backward(x, weight, offs)
        ctx.path, ctx.idle = path, [e for e, c in enumerate(counts_list) if c == 0]
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, offs = ctx.saved_tensors
        dy = _packed(dy)
        n_e, out_f, in_f = weight.shape
        dx = dw = None
        if ctx.path == "grouped_mm":
            if ctx.needs_input_grad[0]:
                dx = torch._grouped_mm(dy, weight, offs=offs)  # (N, out) @ (E, out, in)
            if ctx.needs_input_grad[1]:
                dw = torch._grouped_mm(dy.t(), x, offs=offs)  # (out, N) @ (N, in) per row group: (E, out, in)
                if ctx.idle:  # see [Note: idle experts]
                    dw[ctx.idle] = 0
        else:
            if ctx.needs_input_grad[0]:
                # dx = dy @ W[e]: reduction over W's dim 1, columns along dim 2.
                dx = _triton_mm(dy, weight, offs, in_f, out_f, (weight.stride(1), weight.stride(2)))
            if ctx.needs_input_grad[1]:
                dw = _triton_wgrad(dy, x, offs, n_e)
        return dx, dw, None, None, None


def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, *, backend: Backend = "auto"
) -> torch.Tensor:
    """Per-expert linear over expert-sorted rows: `y[rows of e] = x[rows of e] @ weight[e]^T`.

    Args:
        x: `(N, in)` rows grouped by expert (the first `counts[0]` rows belong to expert 0, and so on).
        weight: `(E, out, in)`, the Hugging Face layout of stacked expert weights (`gate_up_proj`, `down_proj`).
        counts: `(E,)` integer rows per expert, summing to `N` (read on the host once per call).
        backend: "auto" (default) picks per call: `torch._grouped_mm` for CUDA bf16 on Hopper, the autotuned
            Triton kernels on other CUDA tensors, a loop over experts of torch matmuls on CPU. "grouped_mm",
            "triton" or "loop" forces one and raises if it cannot run (see [Note: grouped GEMM paths] in
            `cai/kernels/_moe.py` for the order and the reasons).

    Returns:
        `(N, out)` in `x.dtype`, accumulated in fp32 on the grouped_mm and Triton paths. Gradients flow to `x` and
        `weight`; an expert with no rows gets a zero weight gradient.

    Example:
        >>> rows, order, counts = permute_tokens(x, top_k_index, num_experts)
        >>> out = unpermute_tokens(grouped_linear(rows, w, counts), order, top_k_weights)
    """
    if (
        x.dim() != 2
        or weight.dim() != 3
        or weight.shape[2] != x.shape[1]
        or counts.numel() != weight.shape[0]
    ):
        raise ValueError(
            f"grouped_linear: x {tuple(x.shape)} must be (N, in), weight {tuple(weight.shape)} (E, out, in) with "
            f"the same in, and counts {tuple(counts.shape)} one entry per expert"
        )
    if x.dtype != weight.dtype:
        raise ValueError(
            f"grouped_linear: x is {x.dtype} but weight is {weight.dtype}; cast one to the other"
        )
    counts_list = counts.tolist()
    if sum(counts_list) != x.shape[0] or min(counts_list, default=0) < 0:
        raise ValueError(
            f"grouped_linear: counts {counts_list} must be >= 0 and sum to x's {x.shape[0]} rows"
        )
    n_e, out_f, in_f = weight.shape
    path, _ = _choose(x.device, x.dtype, n_e, out_f, in_f, backend)
    if x.numel() > 0 and weight.numel() > 0 and path != "loop":
        return _GroupedLinear.apply(x, weight, counts, counts_list, path)
    parts = [xe @ weight[e].t() for e, xe in enumerate(torch.split(x, counts_list)) if counts_list[e]]
    if not parts:  # every expert idle: keep the weight in the graph so its gradient is zero, not None
        return x @ weight.sum(0).t() * 0
    return torch.cat(parts)
