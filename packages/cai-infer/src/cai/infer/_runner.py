"""One forward of a Hugging Face causal LM over a scheduled batch, packed without padding."""

from __future__ import annotations

import torch
from torch import nn

from ._attention import ATTENTION_NAME, PagedBatch, PagedKVCache
from ._parallel import local_kv_heads
from ._scheduler import ScheduledBatch


def kv_cache_for(
    model: nn.Module, *, num_blocks: int, block_size: int, dtype: torch.dtype, tp_size: int = 1
) -> PagedKVCache:
    """A paged cache shaped for ``model``'s decoder layers (its text config's layers, kv heads and head dim); with
    ``tp_size > 1`` the model is sharded and the cache holds this rank's kv heads."""
    cfg = model.config.get_text_config()
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    return PagedKVCache(
        num_layers=cfg.num_hidden_layers,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=local_kv_heads(kv_heads, tp_size),
        head_dim=head_dim,
        dtype=dtype,
        device=next(model.parameters()).device,
    )


class ModelRunner:
    """Runs ``model`` (switched to the ``cai_paged`` attention) on the new tokens of a ``ScheduledBatch``."""

    def __init__(self, model: nn.Module, cache: PagedKVCache) -> None:
        model.set_attn_implementation(ATTENTION_NAME)
        self.model = model
        self.cache = cache
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, drafts: list[list[int]] | None = None) -> torch.Tensor:
        """Writes the batch's K/V into the cache; returns the logits (fp32) of the last token of each sequence
        that samples, in batch order (shape (samples, vocab)).

        With ``drafts`` (per sequence of the batch; a sampling sequence may carry draft tokens, whose blocks the
        caller reserved), the drafts run after the sequence's tokens and each sampling sequence gets
        ``1 + len(its drafts)`` rows: the logits after its last token and after each draft."""
        self.cache.copy_blocks(batch.copies)
        drafts = drafts or [[] for _ in batch.seqs]
        ids: list[int] = []
        keep: list[int] = []
        num_new: list[int] = []
        for seq, c, n, sample, extra in zip(
            batch.seqs, batch.num_computed, batch.num_new, batch.samples, drafts, strict=True
        ):
            ids.extend(seq.tokens[c : c + n])
            ids.extend(extra)
            num_new.append(n + len(extra))
            if sample:
                keep.extend(range(len(ids) - 1 - len(extra), len(ids)))
        paged = PagedBatch.build(
            self.cache,
            block_tables=[s.block_table for s in batch.seqs],
            num_computed=batch.num_computed,
            num_new=num_new,
            device=self.device,
        )
        out = self.model(
            input_ids=torch.tensor([ids], device=self.device),  # (1, T): packed, no padding
            position_ids=paged.positions[None],
            use_cache=False,
            logits_to_keep=torch.tensor(keep or [len(ids) - 1], device=self.device),
            cai_paged=paged,
        )
        logits = out.logits[0].float()  # (len(keep), vocab)
        return logits if keep else logits[:0]
