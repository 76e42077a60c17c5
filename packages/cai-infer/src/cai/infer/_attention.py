"""The paged KV cache tensors and the ``cai_paged`` attention function that Hugging Face models call.

[Note: packed batches]
A step runs the model once on every scheduled sequence's new tokens packed into one row, ``input_ids`` of shape
(1, T) with no padding, ``position_ids`` per token. The model computes q/k/v and rotary as usual and hands them to
the attention function registered under ``ATTENTION_NAME`` (transformers' ``AttentionInterface``), together with
this step's ``PagedBatch`` (passed as the ``cai_paged`` keyword, which the decoder models forward to attention).
The function writes the new K/V into the cache slots of their positions, then lets each query attend over its own
sequence's slots up to its position: no Hugging Face forward is copied, and no mask is built by the model (the
mask functions have no entry for this name, so transformers skips them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

ATTENTION_NAME = "cai_paged"


class PagedKVCache:
    """Preallocated K and V per layer, ``num_blocks * block_size`` slots of (kv_heads, head_dim) each.

    Slot ``block * block_size + offset`` holds the token at ``offset`` of ``block``."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block ``src`` to block ``dst`` in every layer, for each ``(src, dst)`` (copy on write)."""
        if not pairs:
            return
        bs = self.block_size
        offs = torch.arange(bs, device=self.k[0].device)
        src = torch.cat([s * bs + offs for s, _ in pairs])
        dst = torch.cat([d * bs + offs for _, d in pairs])
        for cache in (*self.k, *self.v):
            cache[dst] = cache[src]


@dataclass(frozen=True, kw_only=True)
class PagedBatch:
    """Where this step's tokens go in the cache and what each sequence's queries see.

    S sequences; T new tokens in all; Q and C the longest new-token count and the longest context."""

    cache: PagedKVCache
    slot_mapping: torch.Tensor  # (T,) cache slot of each new token
    query_index: torch.Tensor  # (S, Q) index into the T tokens of the sequence's i-th new token; padding -> 0
    query_valid: torch.Tensor  # (S, Q) bool
    query_pos: torch.Tensor  # (S, Q) position of each query in its sequence
    context_slots: torch.Tensor  # (S, C) cache slot of each position of the sequence's context; padding -> 0
    context_len: torch.Tensor  # (S,) positions of the context after this step's tokens are written

    @classmethod
    def build(
        cls,
        cache: PagedKVCache,
        *,
        block_tables: list[list[int]],
        num_computed: list[int],
        num_new: list[int],
        device: torch.device | str,
    ) -> PagedBatch:
        """The batch of sequences whose first ``num_computed[s]`` tokens are cached and ``num_new[s]`` follow."""
        bs = cache.block_size
        S = len(num_new)
        Q = max(num_new)
        C = max(c + n for c, n in zip(num_computed, num_new, strict=True))
        query_index = torch.zeros(S, Q, dtype=torch.long)
        query_valid = torch.zeros(S, Q, dtype=torch.bool)
        query_pos = torch.zeros(S, Q, dtype=torch.long)
        context_slots = torch.zeros(S, C, dtype=torch.long)
        slots = []
        start = 0
        for s, (table, c, n) in enumerate(zip(block_tables, num_computed, num_new, strict=True)):
            ctx = c + n
            pos = torch.arange(ctx)
            seq_slots = torch.tensor(table, dtype=torch.long)[pos // bs] * bs + pos % bs
            context_slots[s, :ctx] = seq_slots
            slots.append(seq_slots[c:])
            query_index[s, :n] = torch.arange(start, start + n)
            query_valid[s, :n] = True
            query_pos[s, :n] = torch.arange(c, ctx)
            start += n
        return cls(
            cache=cache,
            slot_mapping=torch.cat(slots).to(device),
            query_index=query_index.to(device),
            query_valid=query_valid.to(device),
            query_pos=query_pos.to(device),
            context_slots=context_slots.to(device),
            context_len=torch.tensor(
                [c + n for c, n in zip(num_computed, num_new, strict=True)], device=device
            ),
        )

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """(S, Q, C) True where a query may attend a context position: causal, inside the sliding window.

        Padding queries attend position 0 only, so their softmax stays finite (their output is dropped)."""
        kv_pos = torch.arange(self.context_slots.shape[1], device=self.query_pos.device)  # (C,)
        q = self.query_pos[:, :, None]  # (S, Q, 1)
        allowed = kv_pos[None, None, :] <= q
        if sliding_window is not None:
            allowed &= kv_pos[None, None, :] > q - sliding_window
        allowed &= self.query_valid[:, :, None]
        return allowed | (~self.query_valid[:, :, None] & (kv_pos == 0)[None, None, :])


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
    *,
    scaling: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of packed queries (T, heads, head_dim) over each sequence's cached context; returns (T, heads,
    head_dim). Pure torch: pads to (S, Q) queries and (S, C) keys, groups query heads per kv head (GQA)."""
    _, nh, hd = query.shape
    S, Q = batch.query_index.shape
    nkv = k_cache.shape[1]
    g = nh // nkv
    q = query[batch.query_index]  # (S, Q, nh, hd)
    q = q.view(S, Q, nkv, g, hd).permute(0, 2, 3, 1, 4)  # (S, nkv, g, Q, hd)
    k = k_cache[batch.context_slots].permute(0, 2, 1, 3).unsqueeze(2)  # (S, nkv, 1, C, hd)
    v = v_cache[batch.context_slots].permute(0, 2, 1, 3).unsqueeze(2)  # (S, nkv, 1, C, hd)
    scores = (q @ k.transpose(-1, -2)).float() * scaling  # (S, nkv, g, Q, C)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~batch.mask(sliding_window)[:, None, None], float("-inf"))
    out = scores.softmax(-1).to(v.dtype) @ v  # (S, nkv, g, Q, hd)
    out = out.permute(0, 3, 1, 2, 4).reshape(S, Q, nh, hd)
    return out[batch.query_valid]  # (T, nh, hd): valid queries are in token order


def _hf_paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    cai_paged: PagedBatch | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    # transformers' attention-function contract: q (1, heads, T, hd), k/v (1, kv_heads, T, hd) after rotary;
    # returns (1, T, heads, hd) and no weights.
    if cai_paged is None:
        raise RuntimeError(
            f"{type(module).__name__} runs with attn_implementation={ATTENTION_NAME!r} but got no `cai_paged` batch; "
            "this attention function serves models run by cai.infer.InferenceEngine only"
        )
    layer = module.layer_idx
    k_cache, v_cache = cai_paged.cache.k[layer], cai_paged.cache.v[layer]
    k_cache[cai_paged.slot_mapping] = key[0].transpose(0, 1).to(k_cache.dtype)  # (T, nkv, hd)
    v_cache[cai_paged.slot_mapping] = value[0].transpose(0, 1).to(v_cache.dtype)
    out = paged_attention(
        query[0].transpose(0, 1),
        k_cache,
        v_cache,
        cai_paged,
        scaling=scaling if scaling is not None else module.head_dim**-0.5,
        sliding_window=sliding_window,
        softcap=softcap,
    )
    return out.unsqueeze(0).to(query.dtype), None


AttentionInterface.register(ATTENTION_NAME, _hf_paged_attention)
