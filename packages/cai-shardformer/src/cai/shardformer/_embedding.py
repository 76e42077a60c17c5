"""Vocabulary-parallel embedding and lm_head with vocabulary padding, the embedding-dim split `Embedding1D`,
and the vocab-parallel cross-entropy that never gathers the logits.

[Note: vocabulary padding]
A vocabulary of V rows is stored as Vp = V rounded up to a multiple of `make_vocab_size_divisible_by * tp`,
Vp / tp rows per rank, rank r holding global rows [r * Vp / tp, (r + 1) * Vp / tp). Rows >= V are padding:
zero, never looked up (ids < V), and left out of the loss (the cross-entropy sees only each rank's real
rows). The state dict holds the real rows only, and loading accepts them, so checkpoints never show Vp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cai.kernels import fused_linear_cross_entropy
from cai.shardformer._layout import Piece, gather_rows, padded_vocab, take_rows, vocab_pieces
from cai.shardformer._linear import ParallelModule, _group
from cai.shardformer._ops import copy_to_tp_region, gather_from_tp_region, reduce_from_tp_region


class _VocabParallel(ParallelModule):
    """Shared by the vocab-parallel embedding and head: rows of `weight` (and `bias`) split by vocabulary."""

    split_dims = {"weight": 0, "bias": 0}

    def _init_vocab(self, vocab: int, process_group, multiple: int | None) -> None:
        self.process_group = _group(process_group)
        self._tp = dist.get_world_size(self.process_group)
        self.num_embeddings = vocab
        self.make_vocab_size_divisible_by = multiple
        self.padded_vocab = padded_vocab(vocab, self._tp, multiple)
        self.vocab_per_rank = self.padded_vocab // self._tp
        (piece,) = self.pieces("weight", dist.get_rank(self.process_group))
        self.vocab_start_index, self.vocab_real_rows = piece.global_, piece.length

    def pieces(self, name: str, rank: int) -> list[Piece]:
        return vocab_pieces(self.num_embeddings, self.padded_vocab, self._tp, rank)

    def full_size(self, name: str) -> int:
        return self.num_embeddings

    def _copy_from(self, native: nn.Module) -> None:
        mine = self.pieces("weight", dist.get_rank(self.process_group))
        with torch.no_grad():
            self.weight.copy_(take_rows(native.weight, mine, self.vocab_per_rank, 0))
            if getattr(self, "bias", None) is not None:
                self.bias.copy_(take_rows(native.bias, mine, self.vocab_per_rank, 0))

    # See [Note: vocabulary padding]: the state dict holds the real rows of this rank only.
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name in ("weight", "bias"):
            if destination.get(prefix + name) is not None:
                destination[prefix + name] = destination[prefix + name][: self.vocab_real_rows]

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in ("weight", "bias"):
            t = state_dict.get(prefix + name)
            if t is not None and t.shape[0] == self.vocab_real_rows != self.vocab_per_rank:
                padded = t.new_zeros((self.vocab_per_rank, *t.shape[1:]))
                padded[: self.vocab_real_rows] = t
                state_dict[prefix + name] = padded
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def full_tensor(self, name: str, local: torch.Tensor | None = None) -> torch.Tensor:
        local = getattr(self, name) if local is None else local
        return gather_rows(local, lambda r: self.pieces(name, r), self.num_embeddings, 0, self.process_group)


class VocabParallelEmbedding1D(_VocabParallel):
    """An embedding whose vocabulary rows are split over the tp ranks (padded, see [Note: vocabulary
    padding]): each rank looks up the ids it holds, zeros the rest, and the results are all-reduced."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        process_group: dist.ProcessGroup | None = None,
        make_vocab_size_divisible_by: int | None = 64,
    ):
        super().__init__()
        self._init_vocab(num_embeddings, process_group, make_vocab_size_divisible_by)
        self.embedding_dim, self.padding_idx = embedding_dim, padding_idx
        self.weight = nn.Parameter(
            torch.zeros(self.vocab_per_rank, embedding_dim, dtype=dtype, device=device)
        )

    @classmethod
    def from_native_module(cls, module: nn.Embedding, process_group=None, **kw):
        new = cls(
            module.num_embeddings, module.embedding_dim, padding_idx=module.padding_idx,
            dtype=module.weight.dtype, device=module.weight.device, process_group=process_group, **kw,
        )  # fmt: skip
        new._copy_from(module)
        return new

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start_index
        outside = (local < 0) | (local >= self.vocab_per_rank)
        pad = self.padding_idx
        pad = pad - self.vocab_start_index if pad is not None and 0 <= pad - self.vocab_start_index < self.vocab_per_rank else None  # fmt: skip
        out = F.embedding(local.masked_fill(outside, 0), self.weight, padding_idx=pad)  # (..., H)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp_region(out, self.process_group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings} (padded {self.padded_vocab}), {self.embedding_dim}, tp={self._tp}"


class VocabParallelLMHead1D(_VocabParallel):
    """The output projection split by vocabulary rows (padded). `gather_output=True` returns the full logits
    over the real vocabulary; otherwise each rank's slice of Vp / tp columns (padding columns are zero).
    Training code should not need the logits: `vocab_parallel_cross_entropy(hidden, head, labels)` computes
    the loss from the hidden states without building them across the vocabulary.

    `defer` (set by the model-level loss hook of a policy) makes forward return its input unchanged, so a
    Hugging Face `loss_function` receives the hidden states in place of the logits."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        process_group: dist.ProcessGroup | None = None,
        gather_output: bool = False,
        make_vocab_size_divisible_by: int | None = 64,
    ):
        super().__init__()
        self._init_vocab(out_features, process_group, make_vocab_size_divisible_by)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        self.defer = False
        self.weight = nn.Parameter(torch.zeros(self.vocab_per_rank, in_features, dtype=dtype, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.vocab_per_rank, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_native_module(cls, module: nn.Linear, process_group=None, **kw):
        new = cls(
            module.in_features, module.out_features, bias=module.bias is not None, dtype=module.weight.dtype,
            device=module.weight.device, process_group=process_group, **kw,
        )  # fmt: skip
        new._copy_from(module)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.defer:
            return x
        logits = F.linear(copy_to_tp_region(x, self.process_group), self.weight, self.bias)  # (..., Vp / tp)
        if not self.gather_output:
            return logits
        return gather_from_tp_region(logits, self.process_group)[..., : self.num_embeddings]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, vocab={self.num_embeddings} (padded {self.padded_vocab}), tp={self._tp}"


def vocab_parallel_cross_entropy(
    hidden: torch.Tensor,
    lm_head: VocabParallelLMHead1D,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Cross-entropy of `lm_head(hidden)` against `labels` (no shifting) without gathering the logits.

    Each rank multiplies `hidden` by its real vocabulary rows in chunks (cai-kernels'
    `fused_linear_cross_entropy` with the tp group); only per-token statistics and `hidden`'s gradient are
    all-reduced. `hidden` is replicated on the tp ranks; every rank returns the same loss.

    Example:
        >>> loss = vocab_parallel_cross_entropy(h[:, :-1], model.lm_head, ids[:, 1:])
    """
    rows = lm_head.vocab_real_rows
    return fused_linear_cross_entropy(
        hidden, lm_head.weight[:rows], labels,
        bias=None if lm_head.bias is None else lm_head.bias[:rows],
        ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
        process_group=lm_head.process_group if lm_head._tp > 1 else None,
        vocab_start_index=lm_head.vocab_start_index,
    )  # fmt: skip


class Embedding1D(ParallelModule):
    """An embedding split along the embedding dim: each rank looks up its columns and the outputs are
    all-gathered along the last dim (`gather_output=True`), or kept split."""

    split_dims = {"weight": 1}

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        process_group: dist.ProcessGroup | None = None,
        gather_output: bool = True,
    ):
        super().__init__()
        self.process_group = _group(process_group)
        self._tp = dist.get_world_size(self.process_group)
        if embedding_dim % self._tp:
            raise ValueError(
                f"Embedding1D: embedding_dim={embedding_dim} does not divide over tp={self._tp}; use a tp size "
                f"that divides it, or VocabParallelEmbedding1D"
            )
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.gather_output = gather_output
        cols = embedding_dim // self._tp
        self.weight = nn.Parameter(torch.zeros(num_embeddings, cols, dtype=dtype, device=device))

    def pieces(self, name: str, rank: int) -> list[Piece]:
        per = self.embedding_dim // self._tp
        return [Piece(0, rank * per, per)]

    def full_size(self, name: str) -> int:
        return self.embedding_dim

    @classmethod
    def from_native_module(cls, module: nn.Embedding, process_group=None, **kw):
        new = cls(
            module.num_embeddings, module.embedding_dim, padding_idx=module.padding_idx,
            dtype=module.weight.dtype, device=module.weight.device, process_group=process_group, **kw,
        )  # fmt: skip
        mine = new.pieces("weight", dist.get_rank(new.process_group))
        with torch.no_grad():
            new.weight.copy_(take_rows(module.weight, mine, new.weight.shape[1], 1))
        return new

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(ids, self.weight, padding_idx=self.padding_idx)  # (..., H / tp)
        return gather_from_tp_region(out, self.process_group) if self.gather_output else out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self._tp}"
