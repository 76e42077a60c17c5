"""Where a rank's local rows sit in the global tensor: head-group aware column splits, vocabulary padding,
replicated kv heads, and the gathering of a full tensor from the shards.

[Note: pieces]
A parallel layer's local weight is a concatenation of pieces; piece i says "local rows [local, local+length)
hold global rows [global_, global_+length)" along the split dim. Every rank can compute every other rank's
pieces from its rank alone, so gathering a full tensor (tests, checkpoints) needs one all-gather of equal-size
local tensors and no metadata exchange. Rows that a rank holds but that are not in any piece are vocabulary
padding: zero, never trained in a way anyone sees, and never written to a state dict.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger("cai.shardformer")


@dataclass(frozen=True)
class Piece:
    local: int
    global_: int
    length: int
    replicated: bool = False  # the same global rows live on several ranks (kv heads when kv heads < tp)


def column_pieces(
    splits: list[tuple[int, int | None]], tp: int, rank: int, *, what: str = "weight"
) -> list[Piece]:
    """Pieces of one rank for an output dim made of `splits` = [(rows, heads or None), ...] (fused QKV is
    three splits). A split with `heads` keeps whole heads on a rank: heads divisible by tp are dealt out;
    fewer heads than tp, with tp a multiple of heads, are replicated (rank r holds head r // (tp // heads))."""
    pieces, local, offset = [], 0, 0
    for rows, heads in splits:
        if heads is None:
            if rows % tp:
                raise ValueError(
                    f"{what}: {rows} output features do not divide over tp={tp}; use a tp size that divides "
                    f"{rows}"
                )
            per = rows // tp
            pieces.append(Piece(local, offset + rank * per, per))
        else:
            if rows % heads:
                raise ValueError(f"{what}: {rows} rows are not {heads} heads of equal size")
            head_dim = rows // heads
            if heads % tp == 0:
                per = heads // tp * head_dim
                pieces.append(Piece(local, offset + rank * per, per))
            elif tp % heads == 0:
                per = head_dim
                pieces.append(Piece(local, offset + rank // (tp // heads) * head_dim, per, replicated=True))
            else:
                raise ValueError(
                    f"{what}: {heads} heads cannot be split over tp={tp} (neither divides the other); use a tp "
                    f"size that divides {heads} or a multiple of it"
                )
        local += pieces[-1].length
        offset += rows
    return pieces


def vocab_pieces(vocab: int, padded: int, tp: int, rank: int) -> list[Piece]:
    """Rank `rank`'s real vocabulary rows when `vocab` is padded to `padded` and split evenly over tp."""
    per = padded // tp
    start = rank * per
    length = max(0, min(vocab, start + per) - start)
    return [Piece(0, start, length)]


def padded_vocab(vocab: int, tp: int, multiple: int | None) -> int:
    """The vocabulary size a tp group stores: a multiple of `multiple * tp`, or `vocab` when padding is off."""
    if multiple is None:
        if vocab % tp:
            raise ValueError(
                f"vocabulary size {vocab} does not divide over tp={tp} and padding is off "
                f"(make_vocab_size_divisible_by=None); set make_vocab_size_divisible_by (64 pads it to "
                f"{-(-vocab // (64 * tp)) * 64 * tp})"
            )
        return vocab
    if multiple < 1:
        raise ValueError(
            f"make_vocab_size_divisible_by={multiple}; use a positive int, or None for no padding"
        )
    step = multiple * tp
    padded = -(-vocab // step) * step
    if vocab <= padded - padded // tp:
        # The last rank would hold nothing but padding: its loss statistics would be over an empty vocabulary.
        raise ValueError(
            f"vocabulary size {vocab} padded to {padded} leaves the last of {tp} tp ranks without a real row; "
            f"lower make_vocab_size_divisible_by={multiple} (for example to 1)"
        )
    return padded


def local_rows(pieces: list[Piece]) -> int:
    return max((p.local + p.length for p in pieces), default=0)


def take_rows(full: torch.Tensor, pieces: list[Piece], rows: int, dim: int) -> torch.Tensor:
    """This rank's local tensor of `rows` along `dim` from the full tensor (padding rows zero)."""
    shape = list(full.shape)
    shape[dim] = rows
    out = full.new_zeros(shape)
    for p in pieces:
        out.narrow(dim, p.local, p.length).copy_(full.narrow(dim, p.global_, p.length))
    return out


def gather_rows(local: torch.Tensor, pieces_of, full_rows: int, dim: int, group) -> torch.Tensor:
    """The full tensor from every rank's local one; `pieces_of(rank)` gives a rank's pieces (see [Note:
    pieces]). Replicas write the same rows; padding rows are dropped."""
    world = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.detach().contiguous(), group=group)
    shape = list(local.shape)
    shape[dim] = full_rows
    full = local.new_empty(shape)
    for r, part in enumerate(parts):
        for p in pieces_of(r):
            full.narrow(dim, p.global_, p.length).copy_(part.narrow(dim, p.local, p.length))
    return full


# Replica groups per tp group: created once (creating a group is collective, and each layer asking for its
# own would create one per layer), dropped with the tp group.
_REPLICA_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def replica_group(group, replicas: int):
    """The sub-group of `group` whose ranks hold the same replicated head: consecutive runs of `replicas`
    ranks. Every rank of `group` must call this in the same order (group creation is collective)."""
    cache = _REPLICA_GROUPS.setdefault(group, {})
    if replicas not in cache:
        ranks = dist.get_process_group_ranks(group)
        mine = None
        for start in range(0, len(ranks), replicas):
            members = ranks[start : start + replicas]
            g = dist.new_group(members)
            if dist.get_rank() in members:
                mine = g
        cache[replicas] = mine
        logger.warning(
            "cai-shardformer: %d kv heads per group of %d tp ranks are replicated (fewer kv heads than tp ranks)",
            len(ranks) // replicas,
            len(ranks),
        )
    return cache[replicas]
