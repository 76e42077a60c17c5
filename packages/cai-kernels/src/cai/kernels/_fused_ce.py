"""Cross-entropy fused with the lm_head matmul, computed in token chunks so the full logits never exist.

[Note: fused linear cross-entropy]
For each chunk of C tokens: `logits = h_c @ W.T` (C, V) in the compute dtype; a kernel computes per-row
max / sum-exp / target logit / sum of logits; the loss rows follow; a second kernel overwrites the logits
buffer with d loss / d logits; then `grad_h[c] = g @ W` and `grad_W += g.T @ h_c`. All the backward work is
done in the forward pass, so the backward only multiplies by the incoming scalar gradient. Extra memory is
one (C, V) chunk plus the gradients of h and W themselves.

Vocab parallel hook: with `process_group`, each rank holds a vocabulary shard `W[vocab_start_index :
vocab_start_index + V_local]`. The per-row statistics are combined across the group (max by
`all_reduce(MAX)`, then sum-exp, target logit, sum of logits and vocabulary size by one `all_reduce(SUM)`)
before the loss and the gradient are formed, and `grad_h` is summed across the group once at the end. Every
rank returns the same loss; each rank's weight gradient is the gradient of its shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cai.kernels._dispatch import use_triton

# Logits chunk budget. Time falls with the chunk size because every chunk re-reads and re-writes the whole
# bf16 grad_W (2 GiB of traffic for a 128k x 4096 head, ~0.45 ms, poorly hidden behind a K=512 matmul); memory
# grows with it. 160 MiB gives 640 rows for a 128k vocabulary in bf16: grad_W (1002 MiB) + grad_h (64 MiB at
# T=8192, H=4096) + the chunk (157 MiB) stay under 1.2 GiB, and the 13 chunks cost ~1.6 ms less than 16.
DEFAULT_CHUNK_BYTES = 160 * 2**20


def _stats_torch(logits, labels, vocab_start, ignore_index):
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    m = x.max(dim=-1).values
    se = torch.exp(x - m[:, None]).sum(-1)
    local = labels - vocab_start
    is_local = (labels != ignore_index) & (local >= 0) & (local < x.shape[1])
    tgt = x.gather(1, torch.where(is_local, local, 0)[:, None]).squeeze(1) * is_local
    return m, se, tgt, x.sum(-1)


def _grad_torch_(
    logits, labels, lse, scale, vocab_start, ignore_index, smooth_over_v, one_minus_smooth, two_z
):
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    g = torch.exp(x - lse[:, None]) * (1.0 + two_z * lse[:, None]) - smooth_over_v
    local = torch.where(labels != ignore_index, labels - vocab_start, -1)
    rows = torch.nonzero((local >= 0) & (local < x.shape[1])).squeeze(1)
    g[rows, local[rows]] -= one_minus_smooth
    logits.copy_(g * scale[:, None])


def _stats_triton(logits, labels, vocab_start, ignore_index):
    from cai.kernels._fused_ce_triton import ce_stats_kernel

    c, v = logits.shape
    out = torch.empty((4, c), dtype=torch.float32, device=logits.device)
    ce_stats_kernel[(c,)](
        logits, labels, out[0], out[1], out[2], out[3], v, logits.stride(0), vocab_start, ignore_index,
        BLOCK_V=_block_v(v), num_warps=8,
    )  # fmt: skip
    return out[0], out[1], out[2], out[3]


def _grad_triton_(
    logits, labels, lse, scale, vocab_start, ignore_index, smooth_over_v, one_minus_smooth, two_z
):
    from cai.kernels._fused_ce_triton import ce_grad_kernel

    c, v = logits.shape
    ce_grad_kernel[(c,)](
        logits, labels, lse, scale, v, logits.stride(0), vocab_start, ignore_index,
        float(smooth_over_v), float(one_minus_smooth), float(two_z), BLOCK_V=_block_v(v), num_warps=8,
    )  # fmt: skip


def _block_v(v: int) -> int:
    return min(4096, 1 << max(4, (v - 1).bit_length()))


def _combine_stats(m, se, tgt, sx, group):
    """Combine per-shard row statistics across the vocab-parallel group (see the module note)."""
    if group is None:
        return m, se, tgt, sx
    m_global = m.clone()
    dist.all_reduce(m_global, op=dist.ReduceOp.MAX, group=group)
    packed = torch.stack([se * torch.exp(m - m_global), tgt, sx])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    return m_global, packed[0], packed[1], packed[2]


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, opts):
        with torch.autocast(hidden.device.type, enabled=False):  # dtypes are chosen explicitly below
            return _FusedLinearCE._forward(ctx, hidden, weight, bias, labels, opts)

    @staticmethod
    def _forward(ctx, hidden, weight, bias, labels, opts):
        ignore_index, smoothing, z_loss, reduction, chunk, group, vocab_start, dtype, grad_mode = opts
        lead_shape = hidden.shape[:-1]
        h2d = hidden.reshape(-1, hidden.shape[-1]).to(dtype)
        y = labels.reshape(-1).to(device=h2d.device, dtype=torch.long)
        t, v_local = h2d.shape[0], weight.shape[0]
        w = weight.to(dtype)  # a copy only when the weight is kept in another dtype (fp32 master weights)
        b = bias.to(dtype) if bias is not None else None
        # forward() always runs with grad disabled: the caller's grad mode travels in opts.
        need_h = grad_mode and ctx.needs_input_grad[0]
        need_w = grad_mode and ctx.needs_input_grad[1]
        need_b = grad_mode and bias is not None and ctx.needs_input_grad[2]
        need_grad = need_h or need_w or need_b
        triton_path = use_triton(h2d)
        stats_fn = _stats_triton if triton_path else _stats_torch
        grad_fn = _grad_triton_ if triton_path else _grad_torch_

        valid = y != ignore_index
        n_valid = valid.sum()
        # Rows' gradient scale; a tensor so no host sync is needed to form the mean.
        denom = (
            n_valid.clamp(min=1).to(torch.float32) if reduction == "mean" else torch.ones((), device=y.device)
        )
        row_scale = valid.to(torch.float32) / denom
        grad_h = torch.empty_like(h2d) if need_h else None
        grad_w = torch.empty_like(w) if need_w else None
        grad_b = torch.zeros(v_local, dtype=torch.float32, device=h2d.device) if need_b else None
        loss_rows = torch.empty(t, dtype=torch.float32, device=h2d.device)
        v_total = float(v_local)
        if group is not None:  # shards may differ in size; label smoothing needs the global vocabulary size
            v_t = torch.tensor([v_local], dtype=torch.float64, device=h2d.device)
            dist.all_reduce(v_t, op=dist.ReduceOp.SUM, group=group)
            v_total = float(v_t.item())
        for i, c0 in enumerate(range(0, t, chunk)):
            c1 = min(c0 + chunk, t)
            h_c, y_c = h2d[c0:c1], y[c0:c1]
            logits = h_c @ w.T if b is None else torch.addmm(b, h_c, w.T)  # (C, V_local)
            m, se, tgt, sx = stats_fn(logits, y_c, vocab_start, ignore_index)
            m, se, tgt, sx = _combine_stats(m, se, tgt, sx, group)
            lse = m + torch.log(se)
            rows = (1.0 - smoothing) * (lse - tgt) + smoothing * (lse - sx / v_total) + z_loss * lse * lse
            loss_rows[c0:c1] = torch.where(valid[c0:c1], rows, 0.0)
            if not need_grad:
                continue
            grad_fn(
                logits, y_c, lse.contiguous(), row_scale[c0:c1].contiguous(), vocab_start, ignore_index,
                smoothing / v_total, 1.0 - smoothing, 2.0 * z_loss,
            )  # fmt: skip
            side = _side_stream(h2d.device) if need_h and need_w else None
            if side is not None:
                # Stream order keeps this safe: the side stream starts after the logit gradient is written,
                # and the current stream waits for it before anything (the next chunk's logits, which may
                # reuse this buffer's memory, or the caller) touches the buffer or grad_h again.
                current = torch.cuda.current_stream(h2d.device)
                side.wait_stream(current)
                with torch.cuda.stream(side):
                    torch.mm(logits, w, out=grad_h[c0:c1])
            elif need_h:
                torch.mm(logits, w, out=grad_h[c0:c1])
            if need_w:
                if i == 0:  # the first chunk writes, so grad_w needs no zero fill
                    torch.mm(logits.T, h_c, out=grad_w)
                else:
                    grad_w.addmm_(logits.T, h_c)
            if need_b:
                grad_b += logits.sum(0, dtype=torch.float32)
            if side is not None:
                current.wait_stream(side)
            del logits
        if t == 0 and need_w:
            grad_w.zero_()
        if need_h and group is not None:
            dist.all_reduce(grad_h, op=dist.ReduceOp.SUM, group=group)
        loss = loss_rows.sum() / denom
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.meta = (lead_shape, hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.applied = None  # the upstream gradient the saved gradients are scaled by (backward)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        lead_shape, h_dtype, w_dtype, b_dtype = ctx.meta
        # [Note: fused CE backward scaling] The gradients were formed for an upstream gradient of 1. The first
        # backward scales them in place, on the device: testing for the common case of exactly 1 would read the
        # value on the host and stall the queue between forward and backward. A graph kept for another backward
        # (retain_graph) leaves what it returned before untouched and scales out of place by the ratio to the
        # first upstream gradient, so a first upstream gradient of exactly 0 makes the later ones NaN.
        scale = grad_loss.reshape(()).float()
        first = ctx.applied is None
        factor = scale if first else scale / ctx.applied
        if first:
            ctx.applied = scale

        def scaled(g: torch.Tensor) -> torch.Tensor:
            f = factor.to(g.dtype)
            # in place through .data: the saved tensor's version stays, so a retained graph can unpack it again
            return g.data.mul_(f) if first else g * f

        out_h = out_w = out_b = None
        if grad_h is not None:
            out_h = scaled(grad_h).reshape(*lead_shape, -1).to(h_dtype)
        if grad_w is not None:
            out_w = scaled(grad_w).to(w_dtype)
        if grad_b is not None:
            out_b = scaled(grad_b).to(b_dtype)
        return out_h, out_w, out_b, None, None


# Whether grad_h's matmul runs on a side stream beside grad_W's (see _side_stream).
_OVERLAP = True
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device):
    """A second stream for grad_h = g @ W, run beside grad_W += g.T @ h on the current stream. grad_h's output
    is small (C x H): at C=640, H=4096 it is 80 tiles of 128x256 for 132 SMs, so alone it leaves SMs idle;
    grad_W's 16k tiles fill them. None off CUDA, or when disabled."""
    if not _OVERLAP or device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def _default_chunk(t: int, v_local: int, elem_bytes: int) -> int:
    rows = max(1, DEFAULT_CHUNK_BYTES // max(1, v_local * elem_bytes))
    # A multiple of 128 (the matmul tile height) when that large, else a power of two: friendly matmul shapes.
    rows = rows // 128 * 128 if rows >= 128 else 1 << (rows.bit_length() - 1)
    return max(16, min(rows, 4096, max(t, 1)))


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    reduction: str = "mean",
    chunk_size: int | None = None,
    process_group: dist.ProcessGroup | None = None,
    vocab_start_index: int = 0,
) -> torch.Tensor:
    """Cross-entropy of `hidden @ weight.T (+ bias)` against `labels`, never materialising the full logits.

    Equal (up to rounding) to `F.cross_entropy(hidden @ weight.T, labels, ignore_index=..., label_smoothing=...)`
    plus `z_loss * logsumexp(logits)**2` per token. Gradients of `hidden`, `weight` and `bias` are computed in
    the forward pass, chunk by chunk (see [Note: fused linear cross-entropy]); the backward is a scaling.

    Args:
        hidden: `(..., H)` activations (bf16, fp16 or fp32). The matmuls run in hidden's dtype, or in the
            autocast dtype when autocast is enabled.
        weight: `(V, H)` lm_head weight (cast to the matmul dtype if it differs).
        labels: `(...)` integer targets, `ignore_index` for tokens that do not count. No shifting is done.
        bias: optional `(V,)`.
        ignore_index: default -100.
        label_smoothing: eps in [0, 1): the target is `(1 - eps) * onehot + eps / V` (torch's definition).
        z_loss: coefficient of the `logsumexp**2` regulariser (PaLM); 0 disables it.
        reduction: `"mean"` over non-ignored tokens (0 when every token is ignored) or `"sum"`.
        chunk_size: tokens per chunk; default: the largest multiple of 128 whose (chunk, V) logits fit
            160 MiB (640 for a 128k vocabulary in bf16).
        process_group: vocab-parallel group; `weight` is then this rank's vocabulary shard (module note).
        vocab_start_index: first global vocabulary id of this rank's shard (0 without a group).

    Returns:
        A 0-d fp32 loss.

    Example:
        >>> loss = fused_linear_cross_entropy(h, model.lm_head.weight, labels, z_loss=1e-4)
        >>> loss.backward()
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r}; use 'mean' or 'sum'")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing}; it must be in [0, 1)")
    if z_loss < 0:
        raise ValueError(f"z_loss={z_loss}; it must be >= 0")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight {tuple(weight.shape)} must be (V, H) with H = hidden's last dim {hidden.shape[-1]}"
        )
    if labels.numel() * hidden.shape[-1] != hidden.numel():
        raise ValueError(
            f"labels {tuple(labels.shape)} must hold one target per row of hidden {tuple(hidden.shape)}"
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} must be ({weight.shape[0]},)")
    if process_group is None and vocab_start_index != 0:
        raise ValueError(
            f"vocab_start_index={vocab_start_index} needs a process_group (vocab-parallel shards)"
        )
    # Matmul dtype: the autocast dtype when autocast is on (as nn.Linear would use), else hidden's dtype.
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    t = labels.numel()
    chunk = chunk_size or _default_chunk(t, weight.shape[0], dtype.itemsize)
    if chunk <= 0:
        raise ValueError(f"chunk_size={chunk_size}; it must be positive")
    opts = (
        ignore_index,
        float(label_smoothing),
        float(z_loss),
        reduction,
        chunk,
        process_group,
        vocab_start_index,
    )
    opts += (dtype, torch.is_grad_enabled())
    return _FusedLinearCE.apply(hidden, weight, bias, labels, opts)
