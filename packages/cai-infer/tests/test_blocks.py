"""Block accounting: the block manager's prefix cache and copy on write, and a long random workload through the
scheduler (no model) that checks every step that each sequence reads the right K/V and that no block leaks."""

from __future__ import annotations

import random

import pytest

from cai.infer._blocks import BlockManager, BlockPoolExhausted
from cai.infer._sampling import SamplingParams
from cai.infer._scheduler import Scheduler, Sequence


def test_lookup_shares_full_blocks_then_the_partial_last_one():
    bm = BlockManager(8, 4)
    a = [bm.allocate() for _ in range(3)]
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    h0 = bm.register(a[0], None, tuple(tokens[0:4]))
    h1 = bm.register(a[1], h0, tuple(tokens[4:8]))
    bm.register(a[2], h1, tuple(tokens[8:10]))  # partial
    assert bm.lookup(tokens) == (a, 10)
    assert bm.ref[a[0]] == 2
    assert bm.lookup([1, 2, 3, 4, 5, 6, 7, 0]) == (a[:1], 4)  # diverges in the second block
    assert bm.lookup([9, 9]) == ([], 0)
    bm.release(a)
    bm.release(a)
    bm.release(a[:1])
    bm.check([])
    assert bm.num_free == 8 and bm.num_hit_tokens == 14


def test_cached_blocks_are_evicted_oldest_first_and_last_block_first():
    bm = BlockManager(3, 2)
    a, b = bm.allocate(), bm.allocate()
    h = bm.register(a, None, (1, 2))
    bm.register(b, h, (3, 4))
    bm.release([a, b])  # b is released first, so it is evicted before a
    c = bm.allocate()  # the never-used block 2 comes first
    d = bm.allocate()
    assert (c, d) == (2, b)
    assert bm.lookup([1, 2, 3, 4]) == ([a], 2)  # b's entry went with its eviction; a still serves
    with pytest.raises(BlockPoolExhausted, match="all 3 KV-cache blocks"):
        bm.allocate()
    bm.release([a, c, d])
    bm.check([])


def test_copy_on_write_moves_the_writer_to_a_fresh_block():
    bm = BlockManager(4, 4)
    a = bm.allocate()
    bm.register(a, None, (1, 2))  # a prompt's partial last block
    assert bm.lookup([1, 2]) == ([a], 2)  # a second holder
    new = bm.copy_on_write(a)
    assert new != a and bm.ref[a] == 1 and bm.ref[new] == 1 and bm.num_copies == 1
    bm.drop_partial(a)  # its last holder appends in place
    assert bm.lookup([1, 2]) == ([], 0)
    bm.release([a, new])
    bm.check([])


def _slot(seq: Sequence, pos: int, bs: int) -> int:
    return seq.block_table[pos // bs] * bs + pos % bs


@pytest.mark.parametrize("seed", range(4))
def test_random_workload_reads_right_kv_and_never_leaks(seed):
    rng = random.Random(seed)
    for _trial in range(6):
        bs = rng.choice([1, 2, 4])
        bm = BlockManager(rng.randint(4, 12), bs, enable_prefix_caching=rng.random() < 0.8)
        sched = Scheduler(bm, max_batch_size=rng.randint(1, 5), token_budget=rng.randint(1, 10))
        pool = bm.num_blocks * bs
        kv: dict[int, tuple[int, ...]] = {}  # slot -> the token prefix whose last K/V it holds
        live: list[Sequence] = []
        arrivals = 0
        for step in range(400):
            if step < 250 and rng.random() < 0.35:
                n = rng.randint(1, min(12, pool - 1))
                prompt = [rng.randrange(3) for _ in range(n)]  # 3 tokens: many shared prefixes
                new = rng.randint(1, min(8, pool - n))
                seq = Sequence(f"r{arrivals}", arrivals, prompt, SamplingParams(), new, frozenset({2}))
                arrivals += 1
                sched.add(seq)
                live.append(seq)
            if live and rng.random() < 0.04:
                victim = live.pop(rng.randrange(len(live)))
                assert sched.abort(victim.request_id) is victim
            if step >= 250 and not sched.has_unfinished():
                break
            batch = sched.schedule()
            assert len(batch) or not sched.has_unfinished(), "the scheduler made no progress"
            for src, dst in batch.copies:  # applied before the forward, in order
                snapshot = {o: kv.get(src * bs + o) for o in range(bs)}
                for o, v in snapshot.items():
                    kv[dst * bs + o] = v
            for seq, c, n in zip(batch.seqs, batch.num_computed, batch.num_new, strict=True):
                toks = seq.tokens
                for pos in range(c):  # what attention reads: every earlier position holds this sequence's K/V
                    assert kv.get(_slot(seq, pos, bs)) == tuple(toks[: pos + 1]), (
                        seed,
                        step,
                        seq.request_id,
                        pos,
                    )
                for pos in range(c, c + n):
                    kv[_slot(seq, pos, bs)] = tuple(toks[: pos + 1])
            sampled = [rng.randrange(3) for take in batch.samples if take]
            for seq in sched.update(batch, sampled):
                if seq.status.finished:
                    live.remove(seq)
            sched.check()
        assert not sched.has_unfinished(), "requests were left unfinished"
        assert bm.num_free == bm.num_blocks, f"{bm.num_blocks - bm.num_free} blocks leaked"
