"""The paged KV cache tensors and the ``cai_paged`` attention function that Hugging Face models call.

[Note: packed batches]
A step runs the model once on every scheduled sequence's new tokens packed into one row, ``input_ids`` of shape
(1, T) with no padding, ``position_ids`` per token. The model computes q/k/v and rotary as usual and hands them to
the attention function registered under ``ATTENTION_NAME`` (transformers' ``AttentionInterface``), together with
this step's ``PagedBatch`` (passed as the ``cai_paged`` keyword, which the decoder models forward to attention).
The function writes the new K/V into the cache slots of their positions, then lets each query attend over its own
sequence's slots up to its position (cai-kernels' ``paged_attention``: Triton on CUDA, pure torch elsewhere): no
Hugging Face forward is copied, and no mask is built by the model (the mask functions have no entry for this
name, so transformers skips them).

[Note: rotary in the cache write]
Where cai-kernels' rotary stands in a model's modeling module (``patch_hf_model``), the engine wraps it
(``defer_rotary``): inside the engine's forwards (``rope_deferred``) the wrapper returns q and k unrotated and
leaves cos/sin for the attention function of the same layer, which rotates q and k and writes k and v into the
cache in one kernel (cai-kernels' ``paged_rope_kv_write``) instead of two. Outside those forwards (a reference
``generate``, a draft model with its own attention) the wrapper is the plain rotary. An attention call that finds
no cos/sin left (a model whose rotary was not wrapped) writes the cache as before.
"""

from __future__ import annotations

import functools
import itertools
import sys
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from cai.kernels import apply_rotary_pos_emb, paged_attention, paged_kv_write, paged_rope_kv_write

ATTENTION_NAME = "cai_paged"


class PagedKVCache:
    """Preallocated K and V per layer, ``num_blocks * block_size`` slots of (kv_heads, head_dim) each, plus one
    scratch block after them (``scratch_block``) that the block manager never hands out: the padding rows of a
    captured decode batch write and read there.

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
        self.scratch_block = num_blocks
        shape = ((num_blocks + 1) * block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def device(self) -> torch.device:
        return self.k[0].device

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
    block_tables: torch.Tensor  # (S, max blocks) int32, padded with the scratch block
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
        """The batch of sequences whose first ``num_computed[s]`` tokens are cached and ``num_new[s]`` follow.

        The host side is plain int arrays packed into one buffer, sent in one copy (pinned, asynchronous on
        CUDA)."""
        device = torch.device(device)
        S, T = len(num_new), sum(num_new)
        width = max(map(len, block_tables))
        host = host_int_arrays(cache, block_tables, num_computed, num_new, width)
        flat = to_device(host, device)
        tables, rest = flat[: S * width].view(S, width), flat[S * width :]
        return cls(
            cache=cache,
            slot_mapping=rest[2 * S + 1 : 2 * S + 1 + T].long(),
            positions=rest[2 * S + 1 + T :].long(),
            block_tables=tables,
            query_start=rest[: S + 1],
            num_computed=rest[S + 1 : 2 * S + 1],
            max_query_len=max(num_new),
            max_context_len=max(c + n for c, n in zip(num_computed, num_new, strict=True)),
        )


def host_int_arrays(
    cache: PagedKVCache,
    block_tables: list[list[int]],
    num_computed: list[int],
    num_new: list[int],
    width: int,
) -> array:
    """One int32 array: the block tables (S x width, padded with the scratch block), query starts (S + 1), tokens
    computed (S), then each new token's slot (T) and position (T)."""
    bs, pad = cache.block_size, cache.scratch_block
    out = array("i")
    for table in block_tables:
        out.extend(table)
        out.extend(itertools.repeat(pad, width - len(table)))
    out.append(0)
    out.extend(itertools.accumulate(num_new))
    out.extend(num_computed)
    positions = array("i")
    for table, c, n in zip(block_tables, num_computed, num_new, strict=True):
        for p in range(c, c + n):
            out.append(table[p // bs] * bs + p % bs)
        positions.extend(range(c, c + n))
    out.extend(positions)
    return out


def to_device(host: array, device: torch.device) -> torch.Tensor:
    """``host`` (an int32 array) as a tensor on ``device``: one asynchronous copy through pinned memory on
    CUDA."""
    cpu = torch.frombuffer(host, dtype=torch.int32) if len(host) else torch.empty(0, dtype=torch.int32)
    if device.type != "cuda":
        return cpu.clone()  # the array's buffer is reused by Python; own the data
    return cpu.pin_memory().to(device, non_blocking=True)


class _DeferredRope:
    """Whether the engine is inside a forward whose rotary is deferred, and the cos/sin of the current layer."""

    active = False
    pending: tuple[torch.Tensor, torch.Tensor] | None = None


_ROPE = _DeferredRope()


@contextmanager
def rope_deferred() -> Iterator[None]:
    """Within it, the wrapped rotary leaves cos/sin for the attention function (see [Note: rotary in the cache
    write])."""
    _ROPE.active, _ROPE.pending = True, None
    try:
        yield
    finally:
        _ROPE.active, _ROPE.pending = False, None


def _deferring(rotary):
    @functools.wraps(rotary)
    def apply(q, k, cos, sin, *args, **kwargs):
        if _ROPE.active and not args and not kwargs:
            _ROPE.pending = (cos, sin)
            return q, k
        return rotary(q, k, cos, sin, *args, **kwargs)

    apply.cai_deferring = True
    return apply


def defer_rotary(model: torch.nn.Module) -> list[str]:
    """Wrap cai-kernels' rotary in the modeling modules of ``model``'s layers (see [Note: rotary in the cache
    write]); returns the names of the modules whose rotary is deferred."""
    names = set()
    for mod in model.modules():
        modeling = sys.modules.get(type(mod).__module__)
        rotary = getattr(modeling, "apply_rotary_pos_emb", None)
        if rotary is apply_rotary_pos_emb:
            modeling.apply_rotary_pos_emb = _deferring(rotary)
        if getattr(getattr(modeling, "apply_rotary_pos_emb", None), "cai_deferring", False):
            names.add(modeling.__name__)
    return sorted(names)


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
    # (T, heads, hd) views
    query, key, value = (x[0].transpose(0, 1) for x in (query, key, value))
    rope, _ROPE.pending = _ROPE.pending, None
    if rope is None:
        paged_kv_write(key, value, k_cache, v_cache, cai_paged.slot_mapping)
    else:  # [Note: rotary in the cache write]
        cos, sin = (x.reshape(-1, x.shape[-1]) for x in rope)  # (T, R)
        query = paged_rope_kv_write(query, key, value, cos, sin, k_cache, v_cache, cai_paged.slot_mapping)
    out = paged_attention(
        query,
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
