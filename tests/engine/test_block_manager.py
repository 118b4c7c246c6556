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


def test_freeing_a_block_owned_by_another_sequence_is_an_invariant_error() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    a, b = make_seq(1), make_seq(1)
    assert bm.allocate(a, 1)
    b.block_table = list(a.block_table)  # corrupted bookkeeping
    with pytest.raises(AssertionError, match="owned by"):
        bm.free(b)
