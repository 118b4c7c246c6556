"""BlockManager: allocation on demand, check-then-act admission, idempotent free, slot arithmetic."""

from __future__ import annotations

import random

import pytest

from engine.block_manager import BlockManager
from engine.sequence import Sequence
from tests.engine.factories import make_seq


def owned_blocks(*seqs: Sequence) -> list[int]:
    return [b for s in seqs for b in s.block_table]


def test_rejects_an_empty_cache() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(0, 4)


def test_allocates_blocks_only_as_the_sequence_grows() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(10)
    assert bm.allocate(seq, 1)
    assert len(seq.block_table) == 1
    assert bm.allocate(seq, 4)  # still inside the first block
    assert len(seq.block_table) == 1
    assert bm.allocate(seq, 5)
    assert len(seq.block_table) == 2
    assert bm.allocate(seq, 3)  # asking for fewer tokens never shrinks nor grows the table
    assert len(seq.block_table) == 2
    assert bm.allocate(seq, 12)
    assert len(seq.block_table) == 3
    assert bm.num_free_blocks == 5


@pytest.mark.parametrize(
    ("num_tokens", "held", "needed"),
    [(0, 0, 0), (1, 0, 1), (4, 0, 1), (5, 0, 2), (8, 1, 1), (9, 1, 2), (3, 2, 0)],
)
def test_blocks_needed_is_ceil_minus_held(num_tokens: int, held: int, needed: int) -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(1)
    assert bm.allocate(seq, held * 4)
    assert bm.blocks_needed(seq, num_tokens) == needed


def test_can_allocate_then_allocate_agree() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    a, b = make_seq(8), make_seq(8)
    assert bm.can_allocate(a, 8)
    assert bm.allocate(a, 8)
    assert bm.num_free_blocks == 1
    assert bm.can_allocate(b, 4)
    assert not bm.can_allocate(b, 4, reserve=1)  # the reserve is kept back
    assert not bm.can_allocate(b, 5)
    assert not bm.allocate(b, 5)
    # A refused allocation takes nothing.
    assert b.block_table == [] and bm.num_free_blocks == 1
    assert bm.allocate(b, 4)
    assert bm.num_free_blocks == 0
    assert not bm.can_allocate(a, 9)
    assert bm.can_allocate(a, 8)  # already held: needs no new block


def test_free_returns_every_block_and_is_idempotent() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = make_seq(5), make_seq(2)
    assert bm.allocate(a, 5) and bm.allocate(b, 2)
    assert bm.num_free_blocks == 0
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 3
    bm.free(a)
    assert bm.num_free_blocks == 3
    bm.free(b)
    bm.free(b)
    assert bm.num_free_blocks == bm.num_blocks == 4
    # Freed blocks are reusable.
    c = make_seq(8)
    assert bm.allocate(c, 8)
    assert sorted(c.block_table) == [0, 1, 2, 3]


def test_slot_arithmetic() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_seq(1), make_seq(1)
    # Interleave the two sequences' growth so their tables are not contiguous.
    for n in range(1, 11):
        assert bm.allocate(a, n) and bm.allocate(b, n)
    for seq in (a, b):
        for pos in range(10):
            block = seq.block_table[pos // 4]
            assert bm.slot(seq, pos) == block * 4 + pos % 4
    slots = [bm.slot(s, p) for s in (a, b) for p in range(10)]
    assert len(set(slots)) == len(slots)  # no two tokens share a slot
    assert all(0 <= s < bm.num_blocks * bm.block_size for s in slots)


def test_never_hands_out_a_block_twice() -> None:
    rng = random.Random(0)
    bm = BlockManager(num_blocks=20, block_size=3)
    seqs = [make_seq(1) for _ in range(6)]
    wanted = {s.seq_id: 0 for s in seqs}
    for _ in range(2000):
        seq = rng.choice(seqs)
        if rng.random() < 0.15:
            bm.free(seq)
            wanted[seq.seq_id] = 0
            continue
        n = wanted[seq.seq_id] + rng.randint(1, 5)
        before = list(seq.block_table)
        could = bm.can_allocate(seq, n)
        assert bm.allocate(seq, n) == could
        if could:
            wanted[seq.seq_id] = n
            assert seq.block_table[: len(before)] == before  # growth only appends
            assert len(seq.block_table) * 3 >= n
        else:
            assert seq.block_table == before
        owned = owned_blocks(*seqs)
        assert len(owned) == len(set(owned))
        assert len(owned) + bm.num_free_blocks == bm.num_blocks
    for seq in seqs:
        bm.free(seq)
    assert bm.num_free_blocks == bm.num_blocks


def test_freeing_a_block_more_often_than_it_was_taken_is_an_invariant_error() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    a, b = make_seq(1), make_seq(1)
    assert bm.allocate(a, 1)
    b.block_table = list(a.block_table)  # corrupted bookkeeping: b never took the block
    bm.free(b)
    with pytest.raises(AssertionError, match="held by nobody"):
        bm.free(a)


# ---- prefix caching -------------------------------------------------------------------------------


def computed(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> Sequence:
    """Give `seq` slots for its tokens (or the first `num_tokens`), mark them computed, register."""
    n = seq.num_tokens if num_tokens is None else num_tokens
    assert bm.allocate(seq, n)
    seq.num_computed_tokens = n
    bm.register_full_blocks(seq)
    return seq


def test_a_repeated_prefix_is_taken_from_the_cache_and_shared() -> None:
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = computed(bm, make_seq(0, prompt=list(range(14))))  # blocks 0-2 full, block 3 partial
    assert bm.num_cached_blocks == 3
    b = make_seq(0, prompt=list(range(12)) + [99, 98, 97])  # shares 3 full blocks, then differs
    assert bm.take_cached_prefix(b) == 12
    assert b.block_table == a.block_table[:3] and b.num_computed_tokens == 12
    assert bm.num_free_blocks == 16 - 4  # nothing new was taken
    assert bm.reclaimable(b) == 0 and bm.reclaimable(a) == 1
    bm.free(a)  # b still holds the shared three
    assert bm.num_free_blocks == 16 - 3
    computed(bm, b)
    bm.free(b)
    assert bm.num_free_blocks == 16
    # Freed, the blocks keep their content: a later request still hits.
    c = make_seq(0, prompt=list(range(13)))
    assert bm.take_cached_prefix(c) == 12
    bm.free(c)


def test_the_last_token_is_always_computed() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    computed(bm, make_seq(0, prompt=list(range(8))))
    again = make_seq(0, prompt=list(range(8)))  # the same two full blocks
    assert bm.take_cached_prefix(again) == 4  # the second block is recomputed for the logits
    assert again.num_uncomputed_tokens == 4


def test_hits_stop_at_the_first_different_block_and_chain_on_the_prefix() -> None:
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    computed(bm, make_seq(0, prompt=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]))
    # Same second and third blocks after a different first one: no hit (the whole prefix counts).
    other = make_seq(0, prompt=[0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])
    assert bm.take_cached_prefix(other) == 0
    mid = make_seq(0, prompt=[1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12, 13])
    assert bm.take_cached_prefix(mid) == 4


def test_salts_keep_caches_apart() -> None:
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    computed(bm, make_seq(0, prompt=list(range(9)), cache_salt="tenant-a"))
    assert bm.take_cached_prefix(make_seq(0, prompt=list(range(9)), cache_salt="tenant-b")) == 0
    assert bm.take_cached_prefix(make_seq(0, prompt=list(range(9)), cache_salt="tenant-a")) == 8


def test_without_prefix_caching_nothing_is_registered_or_found() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    computed(bm, make_seq(0, prompt=list(range(9))))
    assert bm.num_cached_blocks == 0
    assert bm.take_cached_prefix(make_seq(0, prompt=list(range(9)))) == 0


def test_cached_blocks_are_evicted_only_when_no_clean_block_is_left_oldest_first() -> None:
    bm = BlockManager(num_blocks=5, block_size=2, enable_prefix_caching=True)
    old = computed(bm, make_seq(0, prompt=[1, 2, 3, 4]))
    new = computed(bm, make_seq(0, prompt=[5, 6]))
    bm.free(old)
    bm.free(new)
    assert bm.num_free_blocks == 5 and bm.num_cached_blocks == 3
    # Two clean blocks are used before any cached one.
    filler = make_seq(0, prompt=[7, 8, 9])
    assert bm.allocate(filler, 3)
    assert bm.num_cached_blocks == 3
    # The next block evicts the least recently freed: `old`'s second block (a sequence's tail goes
    # first), then its first; `new`'s block survives.
    assert bm.allocate(filler, 5)
    assert bm.take_cached_prefix(make_seq(0, prompt=[1, 2, 3, 4, 0])) == 2
    assert bm.take_cached_prefix(make_seq(0, prompt=[5, 6, 0])) == 2


def test_the_same_prefix_computed_twice_at_once_registers_one_copy() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = computed(bm, make_seq(0, prompt=list(range(5))))
    b = computed(bm, make_seq(0, prompt=list(range(5))))  # admitted before a registered: own copy
    assert bm.num_cached_blocks == 1
    bm.free(b)
    bm.free(a)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 1


def test_release_of_an_unadmitted_prefix_returns_it() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    computed(bm, make_seq(0, prompt=list(range(9))))
    seq = make_seq(0, prompt=list(range(9)))
    bm.take_cached_prefix(seq)
    bm.release_cached_prefix(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert bm.take_cached_prefix(seq) == 8  # still cached, and takeable again
