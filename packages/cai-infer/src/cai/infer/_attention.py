"""The paged KV cache tensors and the ``cai_paged`` attention function that Hugging Face models call.

[Note: packed batches]
A step runs the model once on every scheduled sequence's new tokens packed into one row, ``input_ids`` of shape
(1, T) with no padding, ``position_ids`` per token. The model computes q/k/v and rotary as usual and hands them to
the attention function registered under ``ATTENTION_NAME`` (transformers' ``AttentionInterface``), together with
this step's ``PagedBatch`` (passed as the ``cai_paged`` keyword, which the decoder models forward to attention).
The function writes the new K/V into the cache slots of their positions, then lets each query attend over its own
sequence's slots up to its position (cai-kernels' ``paged_attention``: Triton on CUDA, pure torch elsewhere): no Hugging Face forward is copied, and no mask is built by the model (the
mask functions have no entry for this name, so transformers skips them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from cai.kernels import paged_attention

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
    """Where this step's tokens go in the cache and which context each sequence's queries see.

    S sequences, T new tokens in all, packed sequence after sequence."""

    cache: PagedKVCache
    slot_mapping: torch.Tensor  # (T,) cache slot of each new token
    positions: torch.Tensor  # (T,) position of each new token in its sequence
    block_tables: torch.Tensor  # (S, max blocks) int32, padded with block 0
    query_start: torch.Tensor  # (S + 1,) int32 offsets of each sequence's new tokens
    num_computed: torch.Tensor  # (S,) int32 tokens cached before this step's
    max_query_len: int
    max_context_len: int

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
        width = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long)  # (S, W)
        new = torch.tensor(num_new)
        starts = torch.zeros(len(num_new) + 1, dtype=torch.long)
        torch.cumsum(new, 0, out=starts[1:])
        seq = torch.repeat_interleave(torch.arange(len(num_new)), new)  # (T,) sequence of each token
        positions = torch.tensor(num_computed)[seq] + torch.arange(int(starts[-1])) - starts[seq]  # (T,)
        slots = tables[seq, positions // bs] * bs + positions % bs  # (T,)
        return cls(
            cache=cache,
            slot_mapping=slots.to(device),
            positions=positions.to(device),
            block_tables=tables.to(device=device, dtype=torch.int32),
            query_start=starts.to(device=device, dtype=torch.int32),
            num_computed=torch.tensor(num_computed, dtype=torch.int32, device=device),
            max_query_len=max(num_new),
            max_context_len=max(c + n for c, n in zip(num_computed, num_new, strict=True)),
        )


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
    if key.shape[1] != k_cache.shape[1]:
        raise RuntimeError(
            f"layer {layer} computes {key.shape[1]} kv heads but the paged cache holds {k_cache.shape[1]} per "
            "token; the cache is sized from the model's config (divided by tp_size when sharded), so this model's "
            "attention splits its kv heads in a way the engine does not know"
        )
    k_cache[cai_paged.slot_mapping] = key[0].transpose(0, 1).to(k_cache.dtype)  # (T, nkv, hd)
    v_cache[cai_paged.slot_mapping] = value[0].transpose(0, 1).to(v_cache.dtype)
    out = paged_attention(
        query[0].transpose(0, 1),  # (T, heads, hd)
        k_cache,
        v_cache,
        block_tables=cai_paged.block_tables,
        query_start=cai_paged.query_start,
        num_computed=cai_paged.num_computed,
        block_size=cai_paged.cache.block_size,
        max_query_len=cai_paged.max_query_len,
        max_context_len=cai_paged.max_context_len,
        scaling=scaling if scaling is not None else module.head_dim**-0.5,
        sliding_window=sliding_window,
        softcap=softcap,
    )
    return out.unsqueeze(0).to(query.dtype), None


AttentionInterface.register(ATTENTION_NAME, _hf_paged_attention)
