"""The KV-cache block pool: reference counts, a free list, and the prefix cache keyed by content hash.

[Note: block lifetime]
A block is in exactly one of three states:
  - used: ``ref[b] > 0``; that many sequences list it in their block tables.
  - cached: ``ref[b] == 0`` and it holds the KV of a known token prefix (``hash_of[b]`` is set); it stays in the
    free list, so allocation may take it back, but a sequence whose prompt starts with that prefix can claim it
    first (``lookup``), which takes it out of the free list.
  - free: ``ref[b] == 0``, no hash.
The free list is ordered by release (least recently released first), so cached blocks are evicted oldest first.
``check()`` verifies these invariants; the tests call it after every step.

[Note: prefix hashes]
A block's hash covers its tokens and the hash of the block before it, so equal hashes mean equal token prefixes
from position 0 (the KV of a token depends on every token before it). Full blocks are keyed by
``(parent, tokens)``; the partially filled last block of a prompt is keyed the same way with its shorter token
tuple, so a later identical prompt can share it too.

[Note: copy on write]
A sequence writes only into slots at or after its ``num_computed`` position. Before it writes into a block that
another sequence also holds (``ref > 1``), it takes a private copy (``copy_on_write``). A block it holds alone
that is cached as a prompt's partial last block is copied too when a free block is left, so the entry keeps
serving later identical prompts (one block copy per request); with no free block left the entry is dropped
instead (``drop_partial``) and the block is written in place, so a lone sequence never waits on a copy. A cached
full block is only ever rewritten with the same token at the same position (the last prompt token, recomputed
for its logits), which leaves it valid.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockPoolExhausted(RuntimeError):
    """No free block is left; the scheduler answers by preempting a sequence."""


class BlockManager:
    """Reference-counted blocks ``0 .. num_blocks-1`` with a prefix cache.

    The manager only does accounting; the KV tensors live in ``PagedKVCache`` and block copies are returned
    to the caller as ``(src, dst)`` pairs to apply before the next forward."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.hash_of: dict[int, int] = {}  # block -> content hash
        self.block_of: dict[int, int] = {}  # content hash -> block
        self.partial: set[int] = set()  # blocks cached under a partial (shorter than block_size) token tuple
        self.num_hit_tokens = 0  # prompt tokens found in the prefix cache, since construction
        self.num_copies = 0  # copies on write, since construction

    # -- allocation ---------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free or cached)."""
        return len(self.free)

    def allocate(self) -> int:
        if not self.free:
            raise BlockPoolExhausted(f"all {self.num_blocks} KV-cache blocks are in use")
        block, _ = self.free.popitem(last=False)
        self._forget(block)  # evicts a cached prefix
        self.ref[block] = 1
        return block

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block nobody uses goes to the end of the free list."""
        # Released in reverse so that a sequence's last blocks are evicted before its first ones (a later prompt
        # can only reuse a block if it reuses every block before it).
        for block in reversed(blocks):
            assert self.ref[block] > 0, f"block {block} released more often than it was taken"
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self.free[block] = None

    def _forget(self, block: int) -> None:
        self.partial.discard(block)
        h = self.hash_of.pop(block, None)
        if h is not None and self.block_of.get(h) == block:
            del self.block_of[h]

    # -- prefix cache -------------------------------------------------------------------------------------------
    @staticmethod
    def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
        return hash((parent, tokens))

    def lookup(self, tokens: list[int]) -> tuple[list[int], int]:
        """The cached blocks that hold the longest prefix of ``tokens`` (full blocks, then possibly a partial
        last one), each with a reference taken, and the number of tokens they cover."""
        if not self.enable_prefix_caching:
            return [], 0
        blocks: list[int] = []
        parent = None
        bs = self.block_size
        start = 0
        while start < len(tokens):
            chunk = tuple(tokens[start : start + bs])
            h = self.chain_hash(parent, chunk)
            block = self.block_of.get(h)
            if block is None:
                break
            self._take(block)
            blocks.append(block)
            start += len(chunk)
            parent = h
            if len(chunk) < bs:
                break
        self.num_hit_tokens += start
        return blocks, start

    def _take(self, block: int) -> None:
        if self.ref[block] == 0:
            del self.free[block]
        self.ref[block] += 1

    def register(self, block: int, parent: int | None, tokens: tuple[int, ...]) -> int:
        """Record that ``block`` holds the KV of ``tokens`` after the prefix hashed ``parent``; returns its hash.

        When another block already holds that content, the first one stays the cached one."""
        h = self.chain_hash(parent, tokens)
        if self.enable_prefix_caching and block not in self.hash_of and h not in self.block_of:
            self.hash_of[block] = h
            self.block_of[h] = block
            if len(tokens) < self.block_size:
                self.partial.add(block)
        return h

    def drop_partial(self, block: int) -> None:
        """Forget ``block``'s partial-prefix cache entry, if it has one (its holder is about to append to it)."""
        if block in self.partial:
            self._forget(block)

    def copy_on_write(self, block: int) -> int:
        """A private copy of ``block`` for its writer: a new block (the caller copies the KV) with the writer's
        reference moved to it."""
        new = self.allocate()
        self.release([block])
        self.num_copies += 1
        return new

    # -- checks -------------------------------------------------------------------------------------------------
    def check(self, tables: list[list[int]] | None = None) -> None:
        """Assert the invariants of [Note: block lifetime]; with ``tables`` (every live block table), also that
        the reference counts are exactly the number of tables listing each block."""
        for b in range(self.num_blocks):
            assert self.ref[b] >= 0, f"block {b} has reference count {self.ref[b]}"
            assert (self.ref[b] == 0) == (b in self.free), (
                f"block {b}: ref {self.ref[b]}, in free list {b in self.free}"
            )
        assert self.partial <= set(self.hash_of), (
            f"partial blocks {self.partial - set(self.hash_of)} have no hash"
        )
        for h, b in self.block_of.items():
            assert self.hash_of.get(b) == h, (
                f"prefix hash {h} points to block {b}, which holds {self.hash_of.get(b)}"
            )
        if tables is not None:
            counts = [0] * self.num_blocks
            for table in tables:
                for b in table:
                    counts[b] += 1
            assert counts == self.ref, f"reference counts {self.ref} differ from block-table counts {counts}"
