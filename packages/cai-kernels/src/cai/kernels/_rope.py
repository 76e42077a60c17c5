"""Rotary position embedding for q and k together, in the Hugging Face Llama/Qwen/Mistral layout."""

from __future__ import annotations

import torch

from cai.kernels._dispatch import use_triton


def _candidates(hq: int, hk: int, head_major: bool) -> list[tuple[int, int, int]]:
    """(tokens per program, heads per program, num_warps); the first is the static choice: one token with
    every head when a token's heads are contiguous, a run of tokens per head otherwise."""
    import triton

    hmax = triton.next_power_of_2(max(hq, hk))
    first = (16, 1, 4) if head_major else (1, hmax, 4)
    out = [first]
    for bt, bh, w in ((1, hmax, 8), (2, hmax, 8), (4, 8, 4), (8, 4, 4), (16, 2, 4), (16, 1, 4), (32, 1, 4),
                      (8, 8, 8), (16, 4, 8), (4, 16, 8)):  # fmt: skip
        cfg = (bt, min(bh, hmax), w)
        if cfg not in out:
            out.append(cfg)
    return out


def _launch(q, k, cos, sin, backward, out_strides=None):
    """q: (B, Hq, T, D), k: (B, Hk, T, D) (any strides), cos/sin: (B, T, R) (any strides, R <= D, R even).
    Outputs take q's and k's layout, or `out_strides` = (q strides, k strides) when given."""
    import triton

    from cai.kernels._rope_triton import rope
    from cai.kernels._tune import pick

    bsz, hq, t, d = q.shape
    hk = k.shape[1]
    r = cos.shape[-1]
    if out_strides is None:
        qo, ko = torch.empty_like(q), torch.empty_like(k)
    else:
        qo = torch.empty_strided(q.shape, out_strides[0], dtype=q.dtype, device=q.device)
        ko = torch.empty_strided(k.shape, out_strides[1], dtype=k.dtype, device=k.device)
    half, pas = r // 2, d - r

    def run(cfg):
        block_t, block_h, num_warps = cfg
        grid = (bsz * triton.cdiv(t, block_t), triton.cdiv(hq, block_h) + triton.cdiv(hk, block_h))
        rope[grid](
            q, k, qo, ko, cos, sin, t, hq, hk, half, pas,
            *q.stride(), *k.stride(), *qo.stride(), *ko.stride(), *cos.stride(),
            BACKWARD=backward, BLOCK_T=block_t, BLOCK_H=block_h,
            BLOCK_HALF=triton.next_power_of_2(half), BLOCK_PASS=triton.next_power_of_2(pas) if pas else 0,
            num_warps=num_warps,
        )  # fmt: skip

    # Layout: whether consecutive tokens of a head lie closer in memory than a token's heads.
    head_major = q.stride(2) < q.stride(1)
    key = ("rope", backward, hq, hk, d, r, q.dtype, head_major, k.stride(2) < k.stride(1),
           qo.stride(2) < qo.stride(1), bsz * t >= 4096)  # fmt: skip
    run(pick(key, lambda: _candidates(hq, hk, head_major), run, q.device))
    return qo, ko


class _RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        qo, ko = _launch(q, k, cos, sin, backward=False)
        ctx.in_strides = (qo.stride(), ko.stride())  # q's and k's layout (empty_like keeps a dense layout)
        return qo, ko

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        # Gradients are written in q's and k's own layout, whatever the incoming gradients' layout: HF attention
        # hands back (B, H, T, D)-contiguous gradients for q viewed from a (B, T, H, D) projection, and a
        # gradient in that other layout would cost a full copy downstream (the view's backward, or the
        # accumulation into a leaf's .grad).
        dq, dk = _launch(dq, dk, cos, sin, backward=True, out_strides=ctx.in_strides)
        return dq, dk, None, None


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _torch_rope(q, k, cos, sin):
    # q: (B, Hq, T, D); cos: (B, T, R) -> broadcast over heads.
    r = cos.shape[-1]
    acc = torch.promote_types(q.dtype, torch.float32)
    c, s = cos.unsqueeze(1).to(acc), sin.unsqueeze(1).to(acc)
    out = []
    for x in (q, k):
        xr, xp = x[..., :r].to(acc), x[..., r:]
        y = (xr * c + _rotate_half(xr) * s).to(x.dtype)
        out.append(torch.cat((y, xp), dim=-1) if xp.shape[-1] else y)
    return tuple(out)


def apply_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
    *,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by the rotary embedding (`x * cos + rotate_half(x) * sin`), the Hugging Face convention.

    Same signature and semantics as `transformers.models.llama.modeling_llama.apply_rotary_pos_emb` (5.x:
    `(q, k, cos, sin, unsqueeze_dim=1)`), so it can stand in for it; `position_ids` is an extra keyword.

    Args:
        q: `(B, Hq, T, D)` when `unsqueeze_dim=1` (HF attention layout) or `(B, T, Hq, D)` when `unsqueeze_dim=2`.
        k: same layout with `Hk` heads (grouped-query attention is fine).
        cos, sin: `(B, T, R)` or `(T, R)` per-position values (what HF's rotary embedding module returns), or,
            when `position_ids` is given, tables `(max_positions, R)` indexed by it. `R <= D` and even: with
            `R < D` (partial rotary) the first `R` dims are rotated and the rest pass through unchanged.
        position_ids: optional `(B, T)` integer positions used to index `cos`/`sin` tables.
        unsqueeze_dim: 1 or 2, which dim of q/k holds the heads (HF's meaning).

    Returns:
        `(q_rotated, k_rotated)` in q's and k's layout and dtype; math in fp32. No gradient flows to cos/sin.
    """
    if unsqueeze_dim not in (1, 2):
        raise ValueError(f"unsqueeze_dim={unsqueeze_dim}; it must be 1 (B, H, T, D) or 2 (B, T, H, D)")
    if position_ids is not None:
        if cos.dim() != 2:
            raise ValueError(
                f"with position_ids, cos/sin must be (max_positions, R) tables, got {tuple(cos.shape)}"
            )
        cos, sin = cos[position_ids], sin[position_ids]  # (B, T, R)
    if unsqueeze_dim == 2:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    bsz, _, t, d = q.shape
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    r = cos.shape[-1]
    if r % 2 or r > d or cos.shape[-2] != t or sin.shape != cos.shape:
        raise ValueError(
            f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} do not fit q {tuple(q.shape)}: need (B or 1, T={t}, R) "
            f"with R even and R <= head dim {d}"
        )
    cos, sin = cos.expand(bsz, t, r), sin.expand(bsz, t, r)
    if q.numel() > 0 and use_triton(q):
        qo, ko = _RopeFunction.apply(q, k, cos, sin)
    else:
        qo, ko = _torch_rope(q, k, cos, sin)
    if unsqueeze_dim == 2:
        qo, ko = qo.transpose(1, 2), ko.transpose(1, 2)
    return qo, ko
