"""Sequences and the continuous-batching scheduler: admission, chunked prefill, preemption by recompute.

[Note: one step]
``schedule()`` picks this step's work under a token budget: first every running sequence in arrival order (one
token for a decoding sequence, the next chunk of a prompt still being prefilled), then waiting sequences in arrival
order while the batch has room (``max_batch_size``) and budget. A sequence's KV blocks are reserved before it is
scheduled; when the pool is empty the latest-arrived running sequence is preempted: its blocks are released and
it goes back to the waiting queue with its output so far, to be recomputed as one longer prompt when it is
admitted again (no swap space). The earliest arrival is never preempted by a later one, so every request
finishes. A decoding sequence whose next token will start a block gets that block a step early when nothing waits
and blocks are plentiful (``_reserve_next``), so the next step can be launched ahead. ``update()`` then advances
each scheduled sequence by its tokens, registers its filled blocks in the prefix cache, appends the sampled token
where the chunk reached the end of the sequence, and frees the blocks of sequences that finished.
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass, field

import torch

from ._blocks import BlockManager
from ._sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued; holds no blocks (or only prefix-cache hits taken while being admitted)
    RUNNING = "running"  # admitted; holds blocks for every computed token
    FINISHED_STOPPED = "stop"  # sampled EOS or a stop token
    FINISHED_LENGTH = "length"  # reached max_new_tokens
    FINISHED_ABORTED = "abort"  # aborted by the caller

    @property
    def finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)


@dataclass(eq=False)
class Sequence:
    """One request: its tokens, its place in the cache and how it samples."""

    request_id: str
    arrival: int
    prompt_token_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    stop_ids: frozenset[int]
    generator: torch.Generator | None = None
    tokens: list[int] = field(init=False)  # prompt then output; appended in place, never copied per step
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose K/V are in the cache
    block_hashes: list[int] = field(default_factory=list)  # chain hash of each computed full block
    status: SequenceStatus = SequenceStatus.WAITING
    num_preemptions: int = 0
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per output token, when asked for
    text_end: int | None = None  # where a stop string cut the output text

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_token_ids) :]

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.tokens) - len(self.prompt_token_ids)


@dataclass(frozen=True)
class ScheduledBatch:
    """This step's work: each sequence with its number of new tokens, block copies to apply first, and which
    sequences sample a token at the end of their chunk."""

    seqs: list[Sequence]
    num_new: list[int]
    num_computed: list[int]
    samples: list[bool]
    copies: list[tuple[int, int]]

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, blocks: BlockManager, *, max_batch_size: int, token_budget: int) -> None:
        self.blocks = blocks
        self.max_batch_size = max_batch_size
        self.token_budget = token_budget
        self.waiting: list[Sequence] = []  # by arrival
        self.running: list[Sequence] = []  # by arrival
        self.num_preemptions = 0

    # -- queue --------------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        keys = [s.arrival for s in self.waiting]
        self.waiting.insert(bisect.bisect(keys, seq.arrival), seq)

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._free(seq)
                    seq.status = SequenceStatus.FINISHED_ABORTED
                    return seq
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- scheduling ---------------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """This step's batch; see [Note: one step]."""
        budget = self.token_budget
        seqs: list[Sequence] = []
        num_new: list[int] = []
        copies: list[tuple[int, int]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._fit(seq, min(seq.num_tokens - seq.num_computed, budget), copies)
            if n:
                seqs.append(seq)
                num_new.append(n)
                budget -= n
                i += 1
                if n == 1 and seq.num_tokens - seq.num_computed == 1:
                    self._reserve_next(seq)
            else:
                self._preempt(self.running[-1])  # the latest arrival; may be `seq` itself
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            if not seq.block_table:
                hit, covered = self.blocks.lookup(seq.tokens)
                seq.block_table = hit
                # The last token is always recomputed: its logits pick the next token.
                seq.num_computed = min(covered, seq.num_tokens - 1)
            n = self._fit(seq, min(seq.num_tokens - seq.num_computed, budget), copies)
            if not n:
                self._free(seq)
                break
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            num_new.append(n)
            budget -= n
        computed = [s.num_computed for s in seqs]
        samples = [c + n == s.num_tokens for s, c, n in zip(seqs, computed, num_new, strict=True)]
        return ScheduledBatch(seqs, num_new, computed, samples, copies)

    def can_run_ahead(self, batch: ScheduledBatch) -> bool:
        """Whether the decode step after ``batch`` may be launched before ``batch``'s tokens are known (see
        _runner.py [Note: launching ahead]): unless one of its sequences samples a stop token, the next ``schedule``
        returns the same sequences, one token each, writing into blocks they already hold alone (no new block, no
        copy, no cached partial block) and none of them ends by length."""
        if self.waiting or len(batch.seqs) != len(self.running) or len(batch.seqs) > self.token_budget:
            return False
        bs = self.blocks.block_size
        for seq, c in zip(batch.seqs, batch.num_computed, strict=True):
            j = (c + 1) // bs  # the block of the next step's token
            if seq.num_output_tokens + 1 >= seq.max_new_tokens or j >= len(seq.block_table):
                return False
            block = seq.block_table[j]
            if self.blocks.ref[block] != 1 or block in self.blocks.partial:
                return False
        return True

    def _reserve(self, seq: Sequence, n: int, copies: list[tuple[int, int]]) -> bool:
        """Blocks for ``seq``'s next ``n`` tokens: new blocks past its table, private copies of blocks it shares
        and writes into (see _blocks.py [Note: copy on write]). All or nothing."""
        bs = self.blocks.block_size
        first, end = seq.num_computed // bs, -(-(seq.num_computed + n) // bs)
        touched = range(first, min(end, len(seq.block_table)))
        shared = [j for j in touched if self.blocks.ref[seq.block_table[j]] > 1]
        cached = [j for j in touched if j not in shared and seq.block_table[j] in self.blocks.partial]
        fresh = max(0, end - len(seq.block_table))
        if len(shared) + fresh > self.blocks.num_free:
            return False
        if len(shared) + len(cached) + fresh <= self.blocks.num_free:
            shared += cached  # keep the cached partial block intact for later identical prompts
        for j in touched:
            if j in shared:
                old = seq.block_table[j]
                seq.block_table[j] = self.blocks.copy_on_write(old)
                copies.append((old, seq.block_table[j]))
            else:
                self.blocks.drop_partial(seq.block_table[j])
        for _ in range(fresh):
            seq.block_table.append(self.blocks.allocate())
        return True

    def _reserve_next(self, seq: Sequence) -> None:
        """The block of a decoding sequence's token after this one, one step early, when that token starts a new
        block, nothing is waiting and every running sequence could still get a block: so the next step needs no
        new block and can be launched ahead (see _runner.py [Note: launching ahead]); without it a single stream
        could not launch ahead at one step in ``block_size``."""
        # where the next step's token goes
        block, offset = divmod(seq.num_computed + 1, self.blocks.block_size)
        starts_block = offset == 0 and block == len(seq.block_table)
        goes_on = seq.num_output_tokens + 1 < seq.max_new_tokens
        if starts_block and goes_on and not self.waiting and self.blocks.num_free > len(self.running):
            seq.block_table.append(self.blocks.allocate())

    def _fit(self, seq: Sequence, n: int, copies: list[tuple[int, int]]) -> int:
        """The largest chunk of at most ``n`` tokens whose blocks ``_reserve`` gets (0: not even one token)."""
        if self._reserve(seq, n, copies):
            return n
        bs = self.blocks.block_size
        # Whole free blocks past the table, less one for a copy on write the first block may need.
        room = (len(seq.block_table) + self.blocks.num_free - 1) * bs - seq.num_computed
        if 1 <= room < n and self._reserve(seq, room, copies):
            return room
        return 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq)

    def _free(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed = 0

    # -- after the forward --------------------------------------------------------------------------------------
    def update(self, batch: ScheduledBatch, sampled: list[int] | list[list[int]]) -> list[Sequence]:
        """Advance the batch by its computed tokens and the ``sampled`` ones (per sampling sequence, in order: a
        token, or a list of tokens from a speculative step); returns the sequences that got new tokens.

        [Note: speculative advance]
        A list ``[d_1 .. d_m, b]`` is m accepted draft tokens and the token sampled after them. The step computed
        the K/V of the drafts (their slots follow the sequence's last token), so ``num_computed`` grows by
        ``n + m``; the K/V of rejected drafts sit past ``num_computed``, are never read, and the blocks that held
        only them go back to the pool here. A stop token or the length limit cuts the list short."""
        out = []
        it = iter(sampled)
        bs = self.blocks.block_size
        for seq, n, sample in zip(batch.seqs, batch.num_new, batch.samples, strict=True):
            new: list[int] = []
            status = None
            if sample:
                got = next(it)
                for token in [got] if isinstance(got, int) else got:
                    new.append(token)
                    if token in seq.stop_ids:
                        status = SequenceStatus.FINISHED_STOPPED
                    elif seq.num_output_tokens + len(new) >= seq.max_new_tokens:
                        status = SequenceStatus.FINISHED_LENGTH
                    if status is not None:
                        break
            seq.tokens.extend(new)
            seq.num_computed += n + max(0, len(new) - 1)
            while len(seq.block_hashes) < seq.num_computed // bs:
                j = len(seq.block_hashes)
                parent = seq.block_hashes[-1] if seq.block_hashes else None
                tokens = tuple(seq.tokens[j * bs : (j + 1) * bs])
                seq.block_hashes.append(self.blocks.register(seq.block_table[j], parent, tokens))
            if seq.num_computed == len(seq.prompt_token_ids) and seq.num_computed % bs:
                # The prompt's partial last block: cached for identical prompts; this sequence copies it before
                # writing its first generated token there (see _blocks.py [Note: prefix hashes]).
                j = len(seq.block_hashes)
                parent = seq.block_hashes[-1] if seq.block_hashes else None
                self.blocks.register(seq.block_table[j], parent, tuple(seq.tokens[j * bs : seq.num_computed]))
            if not sample:
                continue
            out.append(seq)
            if status is not None:
                self.finish(seq, status)
                continue
            # blocks past the next token's held only rejected drafts (the next token's own block may have been
            # reserved a step early: _reserve_next)
            keep = seq.num_computed // bs + 1
            self.blocks.release(seq.block_table[keep:])
            del seq.block_table[keep:]
        return out

    def reserve_more(self, seq: Sequence, n: int, copies: list[tuple[int, int]]) -> bool:
        """Blocks for ``n`` tokens from ``seq``'s ``num_computed`` on, after ``schedule`` reserved fewer (the
        draft tokens of a speculative step); all or nothing."""
        return self._reserve(seq, n, copies)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.status = status

    def check(self) -> None:
        """Block accounting invariants (tests call this after every step)."""
        self.blocks.check([s.block_table for s in self.running + self.waiting])
