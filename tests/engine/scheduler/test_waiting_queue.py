"""The waiting queue's order: classes, resume-first, length buckets in turn, fairness keys in turn."""

from __future__ import annotations

import pytest

from engine.scheduler.waiting_queue import FairQueue, WaitingQueue, bucket_labels, bucket_of
from engine.sequence import Sequence
from engine.types import Priority
from tests.engine.factories import make_seq

FREE, PAID, BATCH = Priority.FREE, Priority.PAID, Priority.BATCH


def drain(q: WaitingQueue) -> list[Sequence]:
    out = []
    while len(q):
        out.append(q.pop())
    return out


def test_bucket_of_and_labels() -> None:
    bounds = (256, 1024, 4096)
    assert [bucket_of(n, bounds) for n in (1, 256, 257, 1024, 4096, 4097)] == [0, 0, 1, 1, 2, 3]
    assert bucket_labels(bounds) == ("<=256", "<=1024", "<=4096", ">4096")
    assert bucket_labels(()) == ("all",) and bucket_of(10**6, ()) == 0


@pytest.mark.parametrize("bounds", [(0, 4), (8, 8), (16, 4)])
def test_bad_boundaries_are_refused(bounds: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="length_buckets"):
        WaitingQueue(bounds)


def test_without_buckets_and_keys_each_class_is_fifo_and_paid_goes_first() -> None:
    q = WaitingQueue(())
    seqs = [make_seq(n, priority=p) for n, p in [(500, FREE), (3, PAID), (90, FREE), (7000, PAID)]]
    for s in seqs:
        q.push(s)
    assert list(q) == [seqs[1], seqs[3], seqs[0], seqs[2]]
    assert drain(q) == [seqs[1], seqs[3], seqs[0], seqs[2]]


def test_buckets_take_turns_starting_where_the_last_turn_ended() -> None:
    q = WaitingQueue((16, 64))
    longs = [make_seq(100) for _ in range(3)]
    mids = [make_seq(40)]
    shorts = [make_seq(8) for _ in range(2)]
    for s in (*longs, *mids, *shorts):
        q.push(s)
    assert drain(q) == [shorts[0], mids[0], longs[0], shorts[1], longs[1], longs[2]]


def test_fairness_keys_take_turns() -> None:
    fq = FairQueue()
    a = [make_seq(4, fairness_key="a") for _ in range(4)]
    b = [make_seq(4, fairness_key="b") for _ in range(2)]
    for s in (*a, b[0]):
        fq.push(s)
    assert fq.pop() is a[0]
    fq.push(b[1])
    assert list(fq) == [b[0], a[1], b[1], a[2], a[3]]
    assert [fq.pop() for _ in range(5)] == [b[0], a[1], b[1], a[2], a[3]]
    assert len(fq) == 0 and fq.peek() is None


def test_preempted_sequences_come_back_first_in_their_class() -> None:
    q = WaitingQueue((16,))
    waiting = [make_seq(4, priority=FREE), make_seq(40, priority=FREE)]
    for s in waiting:
        q.push(s)
    victim = make_seq(100, priority=FREE)
    q.push_front(victim)
    paid = make_seq(4, priority=PAID)
    q.push(paid)
    assert q.peek() is paid and q.peek(FREE) is victim
    assert drain(q) == [paid, victim, *waiting]


def test_peek_skips_buckets_and_remove_keeps_the_turn() -> None:
    q = WaitingQueue((16,))
    long, short = make_seq(100), make_seq(8)
    q.push(long)
    q.push(short)
    assert q.peek(PAID) is short
    assert q.peek(PAID, skip_buckets={0}) is long
    assert q.peek(PAID, skip_buckets={0, 1}) is None and q.peek(FREE) is None
    q.remove(short)
    assert q.peek() is long and len(q) == 1


def test_counters_follow_every_way_in_and_out() -> None:
    q = WaitingQueue((16,))
    a = make_seq(10, max_tokens=5, priority=PAID, fairness_key="t1")
    b = make_seq(30, max_tokens=7, priority=FREE, fairness_key="t2")
    c = make_seq(12, max_tokens=3, priority=FREE, fairness_key="t2")
    for s in (a, b, c):
        q.push(s)
    assert q.count_by_priority() == {"paid": 1, "free": 2, "batch": 0}
    assert q.count_by_bucket() == {"<=16": 2, ">16": 1}
    assert q.count_by_priority_and_bucket() == {
        "paid": {"<=16": 1, ">16": 0},
        "free": {"<=16": 1, ">16": 1},
        "batch": {"<=16": 0, ">16": 0},
    }
    assert q.tokens_by_priority() == {PAID: 10, FREE: 42, BATCH: 0}
    assert q.decode_tokens_by_priority() == {PAID: 5, FREE: 10, BATCH: 0}
    assert q.count_by_key() == {PAID: {"t1": 1}, FREE: {"t2": 2}, BATCH: {}}
    assert q.has_waiting_below(1, FREE) and q.has_waiting_below(1, PAID)
    assert not q.has_waiting_below(0, FREE)
    q.pop(a)
    assert not q.has_waiting_below(1, PAID)
    q.remove(b)
    assert q.count_by_bucket() == {"<=16": 1, ">16": 0}
    assert q.tokens_by_priority() == {PAID: 0, FREE: 12, BATCH: 0}
    q.pop()
    assert len(q) == 0 and q.count_by_priority() == {"paid": 0, "free": 0, "batch": 0}
    assert q.tokens_by_priority() == {PAID: 0, FREE: 0, BATCH: 0}


def test_counters_take_off_what_a_sequence_added_even_if_it_changed_while_queued() -> None:
    """Admission takes a cached prefix (raising `num_computed_tokens`) before it pops the sequence;
    neither that nor a failed admission that gives the prefix back may skew the counters."""
    q = WaitingQueue((16,))
    a, b = make_seq(10, max_tokens=5), make_seq(12, max_tokens=3)
    q.push(a)
    q.push(b)
    assert a in q and b in q and q.tokens_by_priority()[PAID] == 22
    a.num_computed_tokens = 8  # its cached prefix
    q.pop(a)
    b.num_computed_tokens = 4
    q.remove(b)
    assert a not in q and b not in q and len(q) == 0
    assert q.tokens_by_priority() == q.decode_tokens_by_priority() == {PAID: 0, FREE: 0, BATCH: 0}
    assert q.count_by_bucket() == {"<=16": 0, ">16": 0}


def test_a_sequence_queued_twice_is_a_bug() -> None:
    q = WaitingQueue(())
    seq = make_seq(4)
    q.push(seq)
    with pytest.raises(RuntimeError, match="already in the waiting queue"):
        q.push_front(seq)
    assert len(q) == 1


def test_pop_of_something_that_is_not_next_is_a_bug() -> None:
    q = WaitingQueue(())
    first, second = make_seq(4), make_seq(4)
    q.push(first)
    q.push(second)
    with pytest.raises(AssertionError):
        q.pop(second)
