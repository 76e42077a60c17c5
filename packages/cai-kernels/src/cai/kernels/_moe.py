"""Expert compute for mixture-of-experts layers: token permutation by expert and a grouped GEMM.

[Note: expert-sorted rows]
A router picks `k` experts per token, giving `T * k` (token, expert) pairs. `permute_tokens` orders the pairs by
expert with one stable sort (ties keep token order, so the layout is deterministic), gathers the token rows in
that order and counts the rows per expert. `grouped_linear` then multiplies each expert's contiguous block of
rows by that expert's weight, and `unpermute_tokens` puts the rows back in (token, slot) order and sums each
token's `k` rows weighted by the router. No step loops in Python over tokens; the torch fallback of
`grouped_linear` loops over experts only.
"""

from __future__ import annotations

import torch

from cai.kernels._dispatch import _interpret, use_triton

# (BM rows, BN columns, BK reduction) per program; 16 is tl.dot's smallest size.
_BLOCKS = {"cuda": (64, 64, 32), "cpu": (16, 16, 16)}


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


def _tiles(counts: list[int], bm: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    # Row tiles that never cross an expert boundary: (expert, first row) per tile.
    experts, starts, row = [], [], 0
    for e, c in enumerate(counts):
        for r in range(row, row + c, bm):
            experts.append(e)
            starts.append(r)
        row += c
    return (
        torch.tensor(experts, dtype=torch.int32, device=device),
        torch.tensor(starts, dtype=torch.int64, device=device),
    )


def _prec(t: torch.Tensor) -> str:
    # fp32 stays fp32 (tf32 would miss the fp32 tolerance of the parity tests); half types have one precision.
    return "ieee" if t.dtype == torch.float32 else "tf32"


def _upcast(t: torch.Tensor) -> bool:
    # UPCAST: the Triton interpreter keeps bf16 as raw 16-bit integers and its tl.dot multiplies those, so on CPU the
    # operands go to fp32 first. The result is the same (a product of two half-precision values is exact in fp32,
    # and the accumulator is fp32 either way); compiled kernels multiply in the inputs' dtype on the tensor cores.
    return t.dtype != torch.float32 and _interpret()


def _grouped_mm(x, w, offs, counts, n, k, w_strides):
    import triton

    from cai.kernels._moe_triton import grouped_mm_kernel

    bm, bn, bk = _BLOCKS["cuda" if x.is_cuda else "cpu"]
    y = torch.empty(x.shape[0], n, device=x.device, dtype=x.dtype)
    tile_e, tile_r = _tiles(counts, bm, x.device)
    if tile_e.numel():
        grid = (tile_e.numel(), triton.cdiv(n, bn))
        grouped_mm_kernel[grid](
            x, w, y, tile_e, tile_r, offs, n, k, x.stride(0), x.stride(1), w.stride(0), *w_strides,
            y.stride(0), y.stride(1), BM=bm, BN=bn, BK=bk, PREC=_prec(x), UPCAST=_upcast(x),
        )  # fmt: skip
    return y


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, counts):
        x, weight = x.contiguous(), weight.contiguous()
        counts_list = counts.tolist()
        offs = torch.zeros(len(counts_list) + 1, dtype=torch.int64, device=x.device)
        offs[1:] = torch.cumsum(counts.to(x.device, torch.int64), 0)
        out_f, in_f = weight.shape[1], weight.shape[2]
        # y = x @ W[e]^T: the kernel's (reduction, column) strides of W are (stride 2, stride 1).
        y = _grouped_mm(x, weight, offs, counts_list, out_f, in_f, (weight.stride(2), weight.stride(1)))
        ctx.save_for_backward(x, weight, offs)
        ctx.counts = counts_list
        return y

    @staticmethod
    def backward(ctx, dy):
        import triton

        from cai.kernels._moe_triton import grouped_mm_wgrad_kernel

        x, weight, offs = ctx.saved_tensors
        dy = dy.contiguous()
        n_e, out_f, in_f = weight.shape
        dx = dw = None
        if ctx.needs_input_grad[0]:
            # dx = dy @ W[e]: reduction over W's dim 1, columns along dim 2.
            dx = _grouped_mm(dy, weight, offs, ctx.counts, in_f, out_f, (weight.stride(1), weight.stride(2)))
        if ctx.needs_input_grad[1]:
            bm, bn, bk = _BLOCKS["cuda" if x.is_cuda else "cpu"]
            dw = torch.empty_like(weight)
            grid = (n_e, triton.cdiv(out_f, bn), triton.cdiv(in_f, bk))
            grouped_mm_wgrad_kernel[grid](
                dy, x, dw, offs, out_f, in_f, dy.stride(0), dy.stride(1), x.stride(0), x.stride(1),
                dw.stride(0), dw.stride(1), dw.stride(2), BM=bm, BN=bn, BK=bk, PREC=_prec(x), UPCAST=_upcast(x),
            )  # fmt: skip
        return dx, dw, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per-expert linear over expert-sorted rows: `y[rows of e] = x[rows of e] @ weight[e]^T`.

    Args:
        x: `(N, in)` rows grouped by expert (the first `counts[0]` rows belong to expert 0, and so on).
        weight: `(E, out, in)`, the Hugging Face layout of stacked expert weights (`gate_up_proj`, `down_proj`).
        counts: `(E,)` integer rows per expert, summing to `N` (read on the host once per call).

    Returns:
        `(N, out)` in `x.dtype`. Triton kernels forward and backward (fp32 accumulation) where
        `use_triton(x)`; otherwise a loop over experts of torch matmuls.

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
    if x.numel() > 0 and use_triton(x):
        return _GroupedLinear.apply(x, weight, counts)
    parts = [xe @ weight[e].t() for e, xe in enumerate(torch.split(x, counts_list)) if counts_list[e]]
    if not parts:  # every expert idle: keep the weight in the graph so its gradient is zero, not None
        return x @ weight.sum(0).t() * 0
    return torch.cat(parts)
