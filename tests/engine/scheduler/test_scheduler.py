"""Scheduler policy without a model: a fake runner appends one token per completed chunk.

Every step driven through `run_step` is also checked against the invariants in
`tests.engine.factories.check_output` / `check_blocks` / `check_waiting` (budget, max_num_seqs,
slots for every scheduled token, no block owned twice, owned + free == total, the waiting queue's
counters equal to the sums over the sequences in it).
"""

from __future__ import annotations

import random
from concurrent.futures import Future
from typing import Any

import pytest

from engine.scheduler.core import SchedulerCore
from engine.sequence import Sequence, SequenceStatus
from engine.step import SchedulerOutput
from engine.types import FinishReason, GrammarError, Priority
from tests.engine.factories import (
    FAKE_TOKEN,
    FakeClock,
    assert_all_done,
    assert_waiting_counters_zero,
    check_blocks,
    check_waiting,
    make_scheduler,
    make_seq,
    make_seqs,
    run_step,
    run_until_done,
    scheduled,
)

FREE, PAID, BATCH = Priority.FREE, Priority.PAID, Priority.BATCH


# ---- budget, max_num_seqs, ordering ------------------------------------------------------------


def test_token_budget_and_max_num_seqs_bound_the_first_step() -> None:
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=10)
    seqs = make_seqs(6, prompt_len=3, max_tokens=2)
    for s in seqs:
        sched.add(s)
    out = run_step(sched)
    # Three whole prompts (9 tokens), then one token of the fourth; the fifth is over max_num_seqs.
    assert [c.num_tokens for c in out.prefills] == [3, 3, 3, 1]
    assert [c.seq for c in out.prefills] == seqs[:4]
    assert out.num_batched_tokens == 10
    assert len(sched.running) == 4 and len(sched.waiting) == 2


@pytest.mark.parametrize(("max_num_seqs", "budget"), [(1, 8), (2, 3), (3, 16), (8, 5), (16, 64)])
def test_budget_and_max_num_seqs_respected_every_step(max_num_seqs: int, budget: int) -> None:
    rng = random.Random(max_num_seqs * 100 + budget)
    sched = make_scheduler(
        num_blocks=24, block_size=4, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget
    )
    seqs = [make_seq(rng.randint(1, 40), rng.randint(1, 12)) for _ in range(20)]
    for s in seqs:
        sched.add(s)
    outputs = run_until_done(sched)  # run_step checks both bounds on every step
    assert max(o.num_batched_tokens for o in outputs) <= budget
    assert max(len(o.chunks) for o in outputs) <= max_num_seqs
    # The bounds bind: some steps are full.
    assert any(o.num_batched_tokens == budget or len(o.chunks) == max_num_seqs for o in outputs)
    assert_all_done(sched, seqs)


def test_decodes_are_scheduled_before_prefills_and_take_the_budget_first() -> None:
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=8)
    a, b = make_seq(3, max_tokens=10), make_seq(4, max_tokens=10)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prompts prefilled, each sampled its first token
    c = make_seq(20, max_tokens=2)
    sched.add(c)
    out = run_step(sched)
    assert [ch.seq for ch in out.decodes] == [a, b]
    assert [ch.seq for ch in out.prefills] == [c]
    assert out.chunks == out.decodes + out.prefills  # decodes first in the packed batch
    assert out.prefills[0].num_tokens == 6  # what the two decodes left of the budget of 8


def test_decodes_crowd_out_admission_when_the_budget_is_spent() -> None:
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=2)
    a, b = make_seq(1, max_tokens=10), make_seq(1, max_tokens=10)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    c = make_seq(5)
    sched.add(c)
    for _ in range(3):
        out = run_step(sched)
        assert [ch.seq for ch in out.chunks] == [a, b]
        assert c.status == SequenceStatus.WAITING


def test_decodes_get_blocks_before_a_new_sequence_is_admitted() -> None:
    sched = make_scheduler(
        num_blocks=6, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, watermark_blocks=0
    )
    a, b = make_seq(7, max_tokens=6), make_seq(7, max_tokens=6)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    run_step(sched)  # both hold 9 tokens in 2 full blocks: the next decode of each needs a third
    assert sched.blocks.num_free_blocks == 2
    c = make_seq(2)
    sched.add(c)  # would fit in one of the two free blocks
    out = run_step(sched)
    assert [ch.seq for ch in out.chunks] == [a, b]
    assert out.preempted == ()
    assert c.status == SequenceStatus.WAITING and sched.blocks.num_free_blocks == 0


def test_a_long_prompt_is_prefilled_in_chunks_and_samples_only_at_the_end() -> None:
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    seq = make_seq(50, max_tokens=3)
    sched.add(seq)
    chunks, completes, outputs = [], [], []
    while seq.is_prefilling or seq.num_computed_tokens == 0:
        out = sched.schedule()
        (chunk,) = out.chunks
        chunks.append(chunk.num_tokens)
        completes.append(chunk.completes)
        sched.update(out)
        if completes[-1]:
            seq.append_token(FAKE_TOKEN)
        outputs.append(seq.num_output_tokens)
    assert chunks == [16, 16, 16, 2]
    assert sum(chunks) == seq.num_prompt_tokens
    assert completes == [False, False, False, True]
    assert outputs == [0, 0, 0, 1]
    run_until_done(sched)
    assert_all_done(sched, [seq])


def test_chunked_prefill_shares_the_budget_with_decodes() -> None:
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=10)
    d = make_seq(2, max_tokens=20)
    sched.add(d)
    run_step(sched)
    long = make_seq(33, max_tokens=2)
    sched.add(long)
    sizes = []
    while long.num_output_tokens == 0:
        out = run_step(sched)
        assert [c.seq for c in out.decodes] == [d]
        (p,) = out.prefills
        assert p.seq is long
        sizes.append(p.num_tokens)
        assert long.num_output_tokens == (1 if sum(sizes) == 33 else 0)  # samples after its last chunk
    assert sizes == [9, 9, 9, 6]
    assert sum(sizes) == 33


def test_max_num_seqs_caps_admission_not_progress() -> None:
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    seqs = make_seqs(5, prompt_len=4, max_tokens=3)
    for s in seqs:
        sched.add(s)
    out = run_step(sched)
    assert [c.seq for c in out.chunks] == seqs[:2]
    run_until_done(sched)
    assert_all_done(sched, seqs)


# ---- preemption --------------------------------------------------------------------------------


def full_cache_of_three() -> tuple[SchedulerCore, Sequence, Sequence, Sequence]:
    """Three 8-token prompts fill a 6-block cache; each has sampled one token and needs a new block."""
    sched = make_scheduler(
        num_blocks=6, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, watermark_blocks=0
    )
    a, b, c = make_seqs(3, prompt_len=8, max_tokens=4)
    for s in (a, b, c):
        sched.add(s)
    run_step(sched)
    assert sched.blocks.num_free_blocks == 0
    assert [s.num_tokens for s in (a, b, c)] == [9, 9, 9]
    return sched, a, b, c


def test_preempts_the_most_recently_admitted_and_requeues_it_at_the_head() -> None:
    sched, a, b, c = full_cache_of_three()
    d = make_seq(8, max_tokens=4)
    sched.add(d)  # waits: no free block
    out = run_step(sched)
    assert out.preempted == (c,)
    assert [ch.seq for ch in out.decodes] == [a, b]
    assert c.status == SequenceStatus.PREEMPTED
    assert c.block_table == [] and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    assert c.token_ids == list(range(100, 108)) + [FAKE_TOKEN]  # its sampled token is kept
    assert c not in sched.running
    assert list(sched.waiting) == [c, d]  # ahead of the sequence that arrived earlier than its preemption
    check_blocks(sched)

    # Recomputed later: prompt and sampled token in one chunk that samples only at its end.
    recompute = []
    while c not in sched.running:
        out = run_step(sched)
        recompute = [ch for ch in out.prefills if ch.seq is c]
    assert recompute[0].num_tokens == 9 and c.num_output_tokens == 2
    run_until_done(sched)
    assert_all_done(sched, [a, b, c, d])
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions) == (0, 0, 1)


def test_lower_priority_is_preempted_before_more_recent_higher_priority() -> None:
    sched = make_scheduler(
        num_blocks=6, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, watermark_blocks=0
    )
    free_seq = make_seq(7, max_tokens=4, priority=FREE)
    sched.add(free_seq)
    run_step(sched)  # admitted first: 8 tokens in 2 blocks
    a, c = make_seq(8, max_tokens=4), make_seq(8, max_tokens=4)
    later_free = make_seq(4, max_tokens=4, priority=FREE)
    for s in (a, c, later_free):
        sched.add(s)
    run_step(sched)
    assert sched.blocks.num_free_blocks == 0
    assert later_free.status == SequenceStatus.WAITING
    assert c.admission_order > a.admission_order > free_seq.admission_order

    out = run_step(sched)
    # `a` needs a third block. The victim is the FREE sequence, although `c` was admitted later.
    assert out.preempted == (free_seq,)
    assert {ch.seq.request_id for ch in out.decodes} == {a.request_id, c.request_id}
    assert list(sched.waiting) == [free_seq, later_free]  # back at the head of its class
    run_until_done(sched)
    assert_all_done(sched, [free_seq, a, c, later_free])
    assert a.num_preemptions == c.num_preemptions == 0


def test_a_lowest_ranked_sequence_preempts_itself() -> None:
    sched = make_scheduler(
        num_blocks=4, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, watermark_blocks=0
    )
    low = make_seq(7, max_tokens=3, priority=FREE)
    sched.add(low)
    run_step(sched)
    high = make_seq(7, max_tokens=3)
    sched.add(high)
    run_step(sched)
    assert sched.blocks.num_free_blocks == 0
    out = run_step(sched)
    # `low` needs a block; `high` is already scheduled and outranks it, so `low` preempts itself.
    assert out.preempted == (low,)
    assert [ch.seq for ch in out.decodes] == [high]
    run_until_done(sched)
    assert_all_done(sched, [low, high])


def test_decodes_of_the_oldest_sequence_always_progress() -> None:
    # Every decode of the oldest sequence is scheduled: preemption only ever takes from the others.
    sched = make_scheduler(num_blocks=8, block_size=2, max_num_seqs=8, max_num_batched_tokens=64)
    oldest = make_seq(3, max_tokens=12)
    sched.add(oldest)
    run_step(sched)
    others = make_seqs(5, prompt_len=3, max_tokens=6)
    for s in others:
        sched.add(s)
    while not oldest.finished:
        before = oldest.num_output_tokens
        run_step(sched)
        assert oldest.num_output_tokens == before + 1
    run_until_done(sched)
    assert_all_done(sched, [oldest, *others])
    assert sched.num_preemptions > 0


@pytest.mark.parametrize("seed", range(8))
def test_overloaded_workload_finishes_without_deadlock(seed: int) -> None:
    """Total KV demand far above the cache: preemption, recomputation, and everything still finishes."""
    rng = random.Random(seed)
    num_blocks, block_size = 12, 4
    capacity = num_blocks * block_size
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=rng.choice([4, 8, 16]),
        max_num_batched_tokens=rng.choice([8, 16, 32]),
    )
    arrivals: dict[int, list[Sequence]] = {}
    seqs = []
    for _ in range(24):
        prompt = rng.randint(1, 30)
        # As the engine's validation guarantees: each request alone fits in the cache.
        seq = make_seq(prompt, rng.randint(1, min(20, capacity - prompt)), rng.choice([PAID, FREE]))
        seqs.append(seq)
        arrivals.setdefault(rng.randint(0, 30), []).append(seq)
    assert sum(s.num_prompt_tokens + s.sampling.max_tokens for s in seqs) > 4 * capacity
    for step in range(3000):
        for s in arrivals.pop(step, []):
            sched.add(s)
        if not arrivals and not sched.has_unfinished():
            break
        run_step(sched)
    else:
        pytest.fail(f"deadlock: {list(sched.sequences())}")
    assert_all_done(sched, seqs)
    assert sched.num_preemptions > 0


# ---- starvation ---------------------------------------------------------------------------------


def test_a_long_prompt_is_not_starved_by_a_stream_of_short_ones() -> None:
    sched = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=3, max_num_batched_tokens=8)
    for s in make_seqs(8, prompt_len=4, max_tokens=6):
        sched.add(s)
    long = make_seq(24, max_tokens=8)
    sched.add(long)
    num_steps = 0
    while not long.finished and num_steps < 300:
        sched.add(make_seq(4, max_tokens=6))  # arrivals faster than the service rate
        run_step(sched)
        num_steps += 1
    assert long.finished, long
    assert num_steps < 100
    assert len(sched.waiting) > num_steps // 2  # the others kept piling up behind it


def test_free_class_is_admitted_while_paid_traffic_leaves_room() -> None:
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    free_seq = make_seq(6, max_tokens=4, priority=FREE)
    for s in make_seqs(4, prompt_len=4, max_tokens=6):
        sched.add(s)
    sched.add(free_seq)
    for step in range(200):
        if step % 3 == 0:
            sched.add(make_seq(4, max_tokens=6))
        run_step(sched)
        if free_seq.finished:
            break
    assert free_seq.status == SequenceStatus.FINISHED_LENGTH
    assert step < 50


# ---- abort and error paths ------------------------------------------------------------------------


def test_abort_a_waiting_sequence() -> None:
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_seqs(2, prompt_len=4)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    sched.finish(b, SequenceStatus.FINISHED_ABORTED)
    assert b not in list(sched.waiting) and b not in sched.running
    assert b.finished and b.finish_reason == FinishReason.ABORT
    run_until_done(sched)
    assert_all_done(sched, [a])
    assert b.num_output_tokens == 0


def test_abort_a_running_sequence_frees_its_blocks() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4)
    a, b = make_seq(10, max_tokens=8), make_seq(6, max_tokens=8)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    run_step(sched)
    held = len(a.block_table)
    assert held == 3
    free_before = sched.blocks.num_free_blocks
    sched.finish(a, SequenceStatus.FINISHED_ABORTED)
    assert a.block_table == [] and a not in sched.running
    assert sched.blocks.num_free_blocks == free_before + held
    check_blocks(sched)
    out = run_step(sched)
    assert [c.seq for c in out.chunks] == [b]
    run_until_done(sched)
    assert_all_done(sched, [b])


def test_abort_a_preempted_sequence() -> None:
    sched, a, b, c = full_cache_of_three()
    out = run_step(sched)
    assert out.preempted == (c,)
    sched.finish(c, SequenceStatus.FINISHED_ABORTED)
    assert c not in list(sched.waiting) and c not in sched.running
    assert c.status == SequenceStatus.FINISHED_ABORTED
    run_until_done(sched)
    assert_all_done(sched, [a, b])
    assert c.num_output_tokens == 1


def test_abort_between_schedule_and_update() -> None:
    """The engine's race: a caller aborts while the forward pass of its chunk is running."""
    sched = make_scheduler(num_blocks=16, block_size=4)
    a, b = make_seq(6, max_tokens=5), make_seq(6, max_tokens=5)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert {c.seq.request_id for c in out.chunks} == {a.request_id, b.request_id}
    sched.finish(a, SequenceStatus.FINISHED_ABORTED)
    sched.update(out)
    b.append_token(FAKE_TOKEN)  # the runner's result for `a` is dropped
    check_blocks(sched)
    assert all(c.seq is not a for o in run_until_done(sched) for c in o.chunks)
    assert_all_done(sched, [b])


def test_a_failed_batch_frees_everything_and_the_rest_is_served() -> None:
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_seqs=3, max_num_batched_tokens=16)
    seqs = [make_seq(n, max_tokens=4) for n in (3, 5, 9, 2, 7)]
    for s in seqs:
        sched.add(s)
    run_step(sched)
    out = sched.schedule()
    failed = [c.seq for c in out.chunks]
    assert failed
    for seq in failed:  # what OutputProcessor.contain does when the forward pass raises
        sched.finish(seq, SequenceStatus.FINISHED_ERROR)
    check_blocks(sched)
    assert not sched.running
    rest = [s for s in seqs if s not in failed]
    run_until_done(sched)
    assert_all_done(sched, rest)
    assert all(s.finish_reason == FinishReason.ERROR for s in failed)


def test_finishing_everything_returns_every_block() -> None:
    sched, a, b, c = full_cache_of_three()
    d = make_seq(5)
    sched.add(d)
    run_step(sched)  # c preempted; d waiting
    for seq, status in (
        (a, SequenceStatus.FINISHED_STOPPED),
        (b, SequenceStatus.FINISHED_ERROR),
        (c, SequenceStatus.FINISHED_ABORTED),
        (d, SequenceStatus.FINISHED_ABORTED),
    ):
        sched.finish(seq, status)
    assert not sched.has_unfinished()
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks
    assert sched.schedule().is_empty


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_random_arrivals_aborts_and_priorities_keep_every_invariant(seed: int, prefix_caching: bool) -> None:
    rng = random.Random(1000 + seed)
    block_size = rng.choice([1, 2, 4, 16])
    num_blocks = rng.randint(2, 24)
    capacity = num_blocks * block_size
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=rng.randint(1, 8),
        max_num_batched_tokens=rng.randint(1, 40),
        watermark_blocks=rng.choice([0, 1]),
        prefix_caching=prefix_caching,
    )
    seqs: list[Sequence] = []
    for step in range(5000):
        if step < 60 and rng.random() < 0.5:
            prompt = rng.randint(1, max(1, capacity - 1))
            seq = make_seq(prompt, rng.randint(1, min(12, capacity - prompt)), rng.choice([PAID, FREE]))
            seqs.append(seq)
            sched.add(seq)
        live = [s for s in seqs if not s.finished]
        if live and rng.random() < 0.05:
            sched.finish(rng.choice(live), SequenceStatus.FINISHED_ABORTED)
            check_blocks(sched)
            check_waiting(sched)
        if step >= 60 and not sched.has_unfinished():
            break
        run_step(sched)
    else:
        pytest.fail(f"deadlock: {list(sched.sequences())}")
    for seq in seqs:
        assert seq.finished and seq.block_table == []
        if seq.status == SequenceStatus.FINISHED_LENGTH:
            assert seq.num_output_tokens == seq.sampling.max_tokens
        else:
            assert seq.status == SequenceStatus.FINISHED_ABORTED
    assert sched.blocks.num_free_blocks == num_blocks
    assert_waiting_counters_zero(sched)


# ---- queue deadlines -------------------------------------------------------------------------------


def test_a_waiting_sequence_past_its_deadline_expires() -> None:
    clock = FakeClock(100.0)
    sched = make_scheduler(max_num_seqs=1, clock=clock)
    running = make_seq(4, max_tokens=50, deadline=101.0)
    late = make_seq(4, deadline=105.0)
    patient = make_seq(4)  # no deadline
    for s in (running, late, patient):
        sched.add(s)
    out = run_step(sched)
    assert out.expired == () and running.started

    clock.advance(5.0)  # now == deadline: not yet past it
    assert run_step(sched).expired == ()
    clock.advance(0.5)
    out = run_step(sched)
    assert out.expired == (late,)
    assert late.status == SequenceStatus.FINISHED_ERROR and late.block_table == []
    assert list(sched.waiting) == [patient]
    # The running sequence is past its own deadline too, but it has started: it is never expired.
    assert running.status == SequenceStatus.RUNNING
    clock.advance(1000.0)
    outputs = run_until_done(sched)
    assert all(o.expired == () for o in outputs)
    assert_all_done(sched, [running, patient])


def test_a_preempted_sequence_does_not_expire() -> None:
    clock = FakeClock(0.0)
    sched = make_scheduler(
        num_blocks=6, block_size=4, max_num_batched_tokens=64, watermark_blocks=0, clock=clock
    )
    seqs = [make_seq(8, max_tokens=4, deadline=1.0) for _ in range(3)]
    for s in seqs:
        sched.add(s)
    run_step(sched)
    clock.advance(10.0)
    out = run_step(sched)
    assert out.preempted == (seqs[2],) and out.expired == ()
    outputs = run_until_done(sched)
    assert all(o.expired == () for o in outputs)
    assert_all_done(sched, seqs)


def test_an_aborted_or_admitted_sequence_never_expires_later() -> None:
    clock = FakeClock(0.0)
    sched = make_scheduler(max_num_seqs=1, clock=clock)
    admitted, aborted = make_seq(4, max_tokens=3, deadline=1.0), make_seq(4, deadline=1.0)
    sched.add(admitted)
    sched.add(aborted)
    run_step(sched)
    sched.finish(aborted, SequenceStatus.FINISHED_ABORTED)
    clock.advance(5.0)
    outputs = run_until_done(sched)
    assert all(o.expired == () for o in outputs)
    assert aborted.status == SequenceStatus.FINISHED_ABORTED
    assert_all_done(sched, [admitted])


def test_expiry_comes_before_admission() -> None:
    clock = FakeClock(0.0)
    sched = make_scheduler(clock=clock)
    seq = make_seq(4, deadline=2.0)
    sched.add(seq)
    clock.advance(3.0)
    out = sched.schedule()
    assert out.expired == (seq,) and out.is_empty
    assert not sched.has_unfinished()


# ---- watermark ---------------------------------------------------------------------------------------


def test_watermark_is_not_held_back_when_nothing_runs() -> None:
    # With nothing running no one needs the watermark, so a lone prompt may use the whole cache.
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=64, watermark_blocks=2)
    seq = make_seq(30, max_tokens=2)
    sched.add(seq)
    out = run_step(sched)
    assert scheduled(out) == {seq.request_id: 30}
    assert sched.blocks.num_free_blocks == 0
    run_until_done(sched)
    assert_all_done(sched, [seq])


def test_no_admission_into_the_watermark_while_decodes_may_use_it() -> None:
    sched = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64, watermark_blocks=1)
    a = make_seq(13, max_tokens=6)
    sched.add(a)
    run_step(sched)
    assert len(a.block_table) == 4 and sched.blocks.num_free_blocks == 1
    b = make_seq(1)
    sched.add(b)
    while len(a.block_table) < 5:
        out = run_step(sched)
        assert scheduled(out) == {a.request_id: 1}  # `b` would fit, but only into the watermark
        assert b.status == SequenceStatus.WAITING
    assert sched.blocks.num_free_blocks == 0  # the running decode took the reserved block
    run_until_done(sched)
    assert_all_done(sched, [a, b])


def test_without_a_watermark_admission_fills_the_cache() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64, watermark_blocks=0)
    a, b = make_seq(12, max_tokens=1), make_seq(4, max_tokens=1)
    sched.add(a)
    sched.add(b)
    out = run_step(sched)
    assert scheduled(out) == {a.request_id: 12, b.request_id: 4}
    assert_all_done(sched, [a, b])


def test_a_cache_no_larger_than_the_watermark_still_serves_a_request_that_fits() -> None:
    # The engine caps max_model_len at num_blocks * block_size, so a one-block cache accepts this
    # request (e.g. EngineConfig.of(max_num_seqs=1, max_model_len=16) plans exactly one 16-token block);
    # admission must not wait forever for a free block beyond the watermark.
    sched = make_scheduler(num_blocks=1, block_size=16, max_num_batched_tokens=64, watermark_blocks=1)
    seq = make_seq(8, max_tokens=8)
    sched.add(seq)
    run_until_done(sched, max_steps=100)
    assert_all_done(sched, [seq])


# ---- priority classes and priority preemption ------------------------------------------------------


def test_paid_is_admitted_before_free_that_arrived_earlier() -> None:
    sched = make_scheduler(num_blocks=64, max_num_seqs=2, max_num_batched_tokens=64)
    f1, f2 = make_seq(4, priority=FREE), make_seq(4, priority=FREE)
    p = make_seq(4, priority=PAID)
    for s in (f1, f2, p):
        sched.add(s)
    out = run_step(sched)
    assert [c.seq for c in out.prefills] == [p, f1]
    assert f2.status == SequenceStatus.WAITING and out.preempted == ()


def test_paid_preempts_the_newest_free_sequence_for_a_slot_and_starts_in_that_step() -> None:
    sched = make_scheduler(num_blocks=64, max_num_seqs=2, max_num_batched_tokens=64)
    f1, f2 = make_seq(4, max_tokens=10, priority=FREE), make_seq(4, max_tokens=10, priority=FREE)
    sched.add(f1)
    sched.add(f2)
    run_step(sched)
    run_step(sched)
    p = make_seq(4, max_tokens=3, priority=PAID)
    sched.add(p)
    out = run_step(sched)
    assert out.preempted == (f2,)
    assert [c.seq for c in out.decodes] == [f1]  # the victim's decode was taken back out
    assert [c.seq for c in out.prefills] == [p]
    assert f2.status == SequenceStatus.PREEMPTED and f2.num_computed_tokens == 0
    assert sched.num_preemptions == sched.num_priority_preemptions == 1
    run_until_done(sched)
    assert_all_done(sched, [f1, f2, p])  # the victim recomputes and still gets all its tokens


def test_paid_preempts_free_sequences_for_blocks() -> None:
    sched = make_scheduler(
        num_blocks=6, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, watermark_blocks=0
    )
    f1, f2 = make_seq(7, max_tokens=6, priority=FREE), make_seq(7, max_tokens=6, priority=FREE)
    sched.add(f1)
    sched.add(f2)
    run_step(sched)  # 2 blocks each, 2 free
    p = make_seq(12, max_tokens=2, priority=PAID)  # needs 3 blocks for its prompt
    later = make_seq(2, max_tokens=2, priority=FREE)
    sched.add(p)
    sched.add(later)
    out = run_step(sched)
    assert out.preempted == (f2,)
    assert scheduled(out) == {f1.request_id: 1, p.request_id: 12}  # the whole prompt, at once
    # Nobody of the victim's class is admitted in that step: neither the victim nor `later`.
    assert f2.status == SequenceStatus.PREEMPTED and later.status == SequenceStatus.WAITING
    run_until_done(sched)
    assert_all_done(sched, [f1, f2, p, later])


def test_a_paid_prefill_that_lacks_blocks_preempts_free() -> None:
    # A free decode grows while a paid prompt is prefilled in chunks of 4; the cache runs out.
    sched = make_scheduler(
        num_blocks=8, block_size=4, max_num_seqs=8, max_num_batched_tokens=5, watermark_blocks=0
    )
    free_seq = make_seq(4, max_tokens=20, priority=FREE)
    sched.add(free_seq)
    run_step(sched)
    paid = make_seq(24, max_tokens=2, priority=PAID)
    sched.add(paid)
    for _ in range(5):
        out = run_step(sched)
        assert scheduled(out) == {free_seq.request_id: 1, paid.request_id: 4}
    assert sched.blocks.num_free_blocks == 0 and len(paid.block_table) == 5
    out = run_step(sched)
    # The free decode, already scheduled, is taken back out and preempted for the paid chunk.
    assert out.preempted == (free_seq,) and out.decodes == ()
    assert scheduled(out) == {paid.request_id: 4}
    assert sched.num_priority_preemptions == 1
    run_until_done(sched)
    assert_all_done(sched, [paid, free_seq])


def test_a_sequence_is_preempted_for_priority_at_most_max_preemptions_per_seq_times() -> None:
    sched = make_scheduler(
        num_blocks=64, max_num_seqs=1, max_num_batched_tokens=64, max_preemptions_per_seq=2
    )
    free_seq = make_seq(4, max_tokens=30, priority=FREE)
    sched.add(free_seq)
    run_step(sched)
    for round_ in range(3):
        paid = make_seq(4, max_tokens=2, priority=PAID)
        sched.add(paid)
        out = run_step(sched)
        if round_ < 2:
            assert out.preempted == (free_seq,) and paid.status == SequenceStatus.RUNNING
            run_step(sched)  # paid finishes; free comes back
            run_step(sched)
            assert paid.finished and free_seq.status == SequenceStatus.RUNNING
        else:
            # Bound reached: the paid request waits for the free one to finish.
            assert out.preempted == () and paid.status == SequenceStatus.WAITING
            while not free_seq.finished:
                run_step(sched)
                assert paid.status == SequenceStatus.WAITING or free_seq.finished
    assert free_seq.num_preemptions == 2 and sched.num_priority_preemptions == 2
    run_until_done(sched)
    assert_all_done(sched, [free_seq])
    assert paid.finished


def test_no_priority_preemption_when_the_bound_is_zero() -> None:
    sched = make_scheduler(
        num_blocks=64, max_num_seqs=1, max_num_batched_tokens=64, max_preemptions_per_seq=0
    )
    free_seq = make_seq(4, max_tokens=5, priority=FREE)
    sched.add(free_seq)
    run_step(sched)
    paid = make_seq(4, max_tokens=2, priority=PAID)
    sched.add(paid)
    outputs = run_until_done(sched)
    assert all(o.preempted == () for o in outputs)
    assert_all_done(sched, [free_seq, paid])


def test_a_batch_sequence_gives_up_its_slot_to_free_and_paid_however_often() -> None:
    # The bound on priority preemptions does not protect the batch class, even at 0.
    for bound in (0, 2):
        sched = make_scheduler(
            num_blocks=64, max_num_seqs=1, max_num_batched_tokens=64, max_preemptions_per_seq=bound
        )
        batch_seq = make_seq(4, max_tokens=40, priority=BATCH)
        sched.add(batch_seq)
        run_step(sched)
        for round_ in range(5):
            interactive = make_seq(4, max_tokens=2, priority=FREE if round_ % 2 else PAID)
            sched.add(interactive)
            out = run_step(sched)
            assert out.preempted == (batch_seq,) and interactive.status == SequenceStatus.RUNNING
            while not interactive.finished:
                run_step(sched)
            run_step(sched)
            assert batch_seq.status == SequenceStatus.RUNNING  # back in the slot left free
        assert batch_seq.num_preemptions == 5
        run_until_done(sched)
        assert_all_done(sched, [batch_seq])


def test_a_batch_sequence_gives_up_blocks_and_waits_behind_free() -> None:
    sched = make_scheduler(
        num_blocks=6, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, watermark_blocks=0
    )
    b1, b2 = make_seq(7, max_tokens=6, priority=BATCH), make_seq(7, max_tokens=6, priority=BATCH)
    sched.add(b1)
    sched.add(b2)
    run_step(sched)
    free_seq = make_seq(12, max_tokens=2, priority=FREE)
    sched.add(free_seq)
    out = run_step(sched)
    assert out.preempted == (b2,) and free_seq.status == SequenceStatus.RUNNING
    # Nobody of the batch class is admitted while the free one runs in the room it took.
    assert b2.status == SequenceStatus.PREEMPTED
    run_until_done(sched)
    assert_all_done(sched, [b1, b2, free_seq])


def test_a_sequence_past_the_bound_is_still_preempted_for_memory() -> None:
    sched = make_scheduler(
        num_blocks=4, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, watermark_blocks=0
    )
    paid = make_seq(7, max_tokens=4, priority=PAID)
    free_seq = make_seq(7, max_tokens=4, priority=FREE)
    sched.add(paid)
    sched.add(free_seq)
    run_step(sched)
    free_seq.num_preemptions = sched.config.max_preemptions_per_seq  # immune to priority preemption
    run_step(sched)  # both hold 9 tokens in 2 full... the cache is full
    outputs = run_until_done(sched)
    assert any(free_seq in o.preempted for o in outputs)  # else the paid decode could never grow
    assert sched.num_priority_preemptions == 0
    assert_all_done(sched, [paid, free_seq])


def test_paid_waiting_behind_a_free_chunked_prefill_goes_first() -> None:
    sched = make_scheduler(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=16, length_buckets=())
    long_free = make_seq(64, max_tokens=2, priority=FREE)
    sched.add(long_free)
    run_step(sched)
    paid = make_seq(10, max_tokens=2, priority=PAID)
    sched.add(paid)
    out = run_step(sched)
    assert scheduled(out) == {paid.request_id: 10, long_free.request_id: 6}
    assert [c.seq for c in out.prefills] == [paid, long_free]


# ---- length buckets ------------------------------------------------------------------------------------


def burst_of_long_prompts(
    **policy: object,
) -> tuple[SchedulerCore, list[Sequence], Sequence, list[SchedulerOutput]]:
    """Five 100-token prompts arrive, then (a step later) one 8-token prompt; budget 32."""
    sched = make_scheduler(num_blocks=256, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, **policy)
    longs = make_seqs(5, prompt_len=100, max_tokens=2)
    for s in longs:
        sched.add(s)
    outputs = [run_step(sched)]
    short = make_seq(8, max_tokens=2)
    sched.add(short)
    while short.status == SequenceStatus.WAITING:
        outputs.append(run_step(sched))
    return sched, longs, short, outputs


def test_a_short_prompt_is_not_held_back_by_a_burst_of_long_ones() -> None:
    sched, longs, short, outputs = burst_of_long_prompts(length_buckets=(16,), long_prefill_share=0.5)
    assert len(outputs) == 2  # admitted in the very next step
    first, second = outputs
    assert scheduled(first) == {longs[0].request_id: 32}  # nothing shorter waited: no cap
    # Longer prompts' chunks share half the budget while the short prompt waits.
    assert scheduled(second)[longs[0].request_id] == 16
    assert scheduled(second)[short.request_id] == 8
    run_until_done(sched)
    assert_all_done(sched, [*longs, short])

    sched, longs, short, outputs = burst_of_long_prompts(length_buckets=())
    assert len(outputs) > 10  # plain FIFO: it waits for all five long prompts to be prefilled
    run_until_done(sched)
    assert_all_done(sched, [*longs, short])


def test_long_prompts_share_the_capped_budget_between_them() -> None:
    sched = make_scheduler(
        num_blocks=256,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        length_buckets=(16,),
        long_prefill_share=0.25,
    )
    longs = make_seqs(3, prompt_len=100, max_tokens=2)
    shorts = make_seqs(20, prompt_len=12, max_tokens=30)
    for s in (*longs, *shorts):
        sched.add(s)
    for _ in range(6):
        out = run_step(sched)
        long_tokens = sum(c.num_tokens for c in out.prefills if c.seq in longs)
        if any(s.status == SequenceStatus.WAITING for s in shorts) and len(sched.running) < 8:
            assert long_tokens <= 8
    run_until_done(sched)
    assert_all_done(sched, [*longs, *shorts])


def test_buckets_take_turns_at_admission() -> None:
    sched = make_scheduler(
        num_blocks=256, max_num_seqs=1, max_num_batched_tokens=256, length_buckets=(16, 64)
    )
    order = [make_seq(n, max_tokens=1) for n in (100, 100, 40, 40, 8, 8)]
    for s in order:
        sched.add(s)
    admitted = []
    while sched.has_unfinished():
        out = run_step(sched)
        admitted += [c.seq for c in out.prefills]  # whole prompts: one chunk each
    # Round robin over the non-empty buckets (<=16, <=64, >64), starting with the shortest.
    assert [s.num_prompt_tokens for s in admitted] == [8, 40, 100, 8, 40, 100]


# ---- fair share ----------------------------------------------------------------------------------------


def test_a_flooding_tenant_does_not_delay_another_beyond_one_turn() -> None:
    sched = make_scheduler(num_blocks=256, max_num_seqs=1, max_num_batched_tokens=64)
    flood = [make_seq(4, max_tokens=2, fairness_key="a") for _ in range(10)]
    for s in flood:
        sched.add(s)
    light = make_seq(4, max_tokens=2, fairness_key="b")
    sched.add(light)
    admitted = []
    while sched.has_unfinished():
        out = run_step(sched)
        admitted += [c.seq for c in out.prefills]
    assert admitted.index(light) == 1  # after the one "a" request whose turn it was
    assert_all_done(sched, [*flood, light])


def test_tenants_alternate_within_a_class() -> None:
    sched = make_scheduler(num_blocks=256, max_num_seqs=4, max_num_batched_tokens=64)
    a = [make_seq(4, fairness_key="a") for _ in range(6)]
    b = [make_seq(4, fairness_key="b") for _ in range(2)]
    for s in (*a, *b):
        sched.add(s)
    out = run_step(sched)
    assert [c.seq for c in out.prefills] == [a[0], b[0], a[1], b[1]]


# ---- every policy at once keeps every invariant ---------------------------------------------------


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_under_every_policy_keep_every_invariant(seed: int, prefix_caching: bool) -> None:
    rng = random.Random(5000 + seed)
    block_size = rng.choice([2, 4])
    num_blocks = rng.randint(6, 32)
    capacity = num_blocks * block_size
    clock = FakeClock()
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=rng.randint(1, 8),
        max_num_batched_tokens=rng.randint(4, 40),
        watermark_blocks=rng.choice([0, 1]),
        clock=clock,
        length_buckets=rng.choice([(), (4,), (4, 12), (8, 16, 32)]),
        long_prefill_share=rng.choice([0.25, 0.5, 1.0]),
        max_preemptions_per_seq=rng.choice([0, 1, 3]),
        batching=rng.choice(["continuous", "continuous", "static"]),
        prefix_caching=prefix_caching,
    )
    seqs: list[Sequence] = []
    for step in range(5000):
        if step < 80 and rng.random() < 0.6:
            prompt = rng.randint(1, max(1, capacity // 2))
            seq = make_seq(
                prompt,
                rng.randint(1, min(16, capacity - prompt)),
                rng.choice([PAID, FREE]),
                fairness_key=rng.choice("abc"),
                deadline=rng.choice([None, None, clock.now + rng.uniform(1, 30)]),
            )
            seqs.append(seq)
            sched.add(seq)
        live = [s for s in seqs if not s.finished]
        if live and rng.random() < 0.03:
            sched.finish(rng.choice(live), SequenceStatus.FINISHED_ABORTED)
            check_blocks(sched)
            check_waiting(sched)
        if step >= 80 and not sched.has_unfinished():
            break
        run_step(sched)
        clock.advance(0.5)
    else:
        pytest.fail(f"deadlock: {list(sched.sequences())}")
    for seq in seqs:
        assert seq.finished and seq.block_table == []
        if seq.status == SequenceStatus.FINISHED_LENGTH:
            assert seq.num_output_tokens == seq.sampling.max_tokens
        elif seq.status == SequenceStatus.FINISHED_ERROR:
            assert not seq.started  # only expiry fails a sequence here
        else:
            assert seq.status == SequenceStatus.FINISHED_ABORTED
    assert sched.blocks.num_free_blocks == num_blocks
    assert_waiting_counters_zero(sched)


# ---- fair share between tenants of one class ------------------------------------------------------------


def tenant_seq(key: str, max_tokens: int = 20) -> Sequence:
    seq = make_seq(4, max_tokens=max_tokens, priority=FREE)
    seq.fairness_key = key
    return seq


def test_a_tenant_with_nothing_running_takes_a_slot_from_the_heaviest_tenant() -> None:
    sched = make_scheduler(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
    heavy = [tenant_seq("heavy") for _ in range(5)]
    for s in heavy:
        sched.add(s)
    run_step(sched)
    assert [s.fairness_key for s in sched.running] == ["heavy"] * 4
    light = tenant_seq("light", max_tokens=2)
    sched.add(light)
    out = run_step(sched)
    assert out.preempted == (heavy[3],)  # the newest of the heaviest tenant
    assert light in [c.seq for c in out.prefills]  # admitted in the same step
    assert sched.num_fairness_preemptions == 1
    run_until_done(sched)
    assert_all_done(sched, [*heavy, light])


def test_no_fairness_preemption_between_balanced_tenants_or_across_classes_or_past_the_bound() -> None:
    # A key that runs one fewer than the heaviest is not behind enough: 2 (a) vs 1 (b).
    sched = make_scheduler(num_blocks=64, max_num_seqs=3, max_num_batched_tokens=64)
    for key in ("a", "a", "b"):
        sched.add(tenant_seq(key))
    run_step(sched)
    sched.add(tenant_seq("b"))
    out = run_step(sched)
    assert out.preempted == () and sched.num_fairness_preemptions == 0
    # Bound 0: never preempted for fairness.
    sched = make_scheduler(
        num_blocks=64, max_num_seqs=2, max_num_batched_tokens=64, max_preemptions_per_seq=0
    )
    for key in ("a", "a"):
        sched.add(tenant_seq(key))
    run_step(sched)
    sched.add(tenant_seq("b"))
    assert run_step(sched).preempted == ()
    # A paid sequence's tenant does not count against free tenants (priority handles classes).
    sched = make_scheduler(num_blocks=64, max_num_seqs=2, max_num_batched_tokens=64)
    paid = make_seq(4, max_tokens=20, priority=PAID)
    paid.fairness_key = "a"
    sched.add(paid)
    sched.add(tenant_seq("a"))
    run_step(sched)
    sched.add(tenant_seq("b"))
    assert run_step(sched).preempted == ()


# ---- prefix caching ------------------------------------------------------------------------------


def test_a_cached_prefix_is_not_prefilled_again() -> None:
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=64, prefix_caching=True)
    first = make_seq(0, max_tokens=2, prompt=list(range(10)))
    sched.add(first)
    run_until_done(sched)
    second = make_seq(0, max_tokens=2, prompt=list(range(8)) + [50, 51, 52])
    sched.add(second)
    out = run_step(sched)
    # Two full blocks (8 tokens) were computed by `first`: only the last 3 tokens are prefilled.
    assert scheduled(out) == {second.request_id: 3}
    assert second.num_cached_tokens == 8
    assert sched.blocks.num_hit_tokens == 8 and sched.blocks.num_queried_tokens == 10 + 11
    run_until_done(sched)
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks


def test_a_preempted_sequence_recomputes_only_what_the_cache_lost() -> None:
    sched = make_scheduler(
        num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=64, prefix_caching=True
    )
    free = make_seq(0, max_tokens=8, priority=FREE, prompt=list(range(13)))
    sched.add(free)
    run_step(sched)  # 13 prompt tokens in 4 blocks: 3 full ones registered
    paid = make_seq(0, max_tokens=2, priority=PAID, prompt=list(range(200, 213)))
    sched.add(paid)
    out = run_step(sched)  # 4 + 4 blocks > 8 - watermark: the free one is preempted for priority
    assert free in out.preempted
    run_until_done(sched)
    assert free.status == SequenceStatus.FINISHED_LENGTH
    # Re-admitted, it found its own registered blocks again (nothing else needed them).
    assert sched.blocks.num_hit_tokens >= 12
    assert free.num_cached_tokens == 0  # usage reports the first admission only


def test_a_failed_admission_gives_the_cached_prefix_back() -> None:
    sched = make_scheduler(
        num_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, prefix_caching=True
    )
    warm = make_seq(0, max_tokens=1, prompt=list(range(9)))
    sched.add(warm)
    run_until_done(sched)
    hog = make_seq(0, max_tokens=8, prompt=list(range(300, 316)))  # 4 blocks, then up to 6
    sched.add(hog)
    run_step(sched)
    late = make_seq(0, max_tokens=1, prompt=list(range(9)) + list(range(400, 410)))  # 5 blocks
    sched.add(late)
    run_step(sched)
    # It took the one cached block left, found no room beyond it (the watermark keeps the last
    # free block for the running hog) and waits holding nothing, with nothing counted as computed.
    assert late.status == SequenceStatus.WAITING
    assert late.block_table == [] and late.num_computed_tokens == 0
    assert sched.blocks.num_free_blocks == 1 and sched.blocks.num_hit_tokens == 0
    check_blocks(sched)
    run_until_done(sched)
    assert late.status == SequenceStatus.FINISHED_LENGTH


# ---- grammars ---------------------------------------------------------------------------------------


class _Compiled:
    def new_grammar(self) -> Any:
        return object()


def test_a_sequence_waits_in_the_scheduler_until_its_grammar_compiled() -> None:
    sched = make_scheduler()
    compile_done: Future[Any] = Future()
    constrained, free = make_seq(4), make_seq(4)
    constrained.grammar_compile = compile_done
    sched.add(constrained)
    sched.add(free)
    assert constrained.status == SequenceStatus.WAITING_FOR_GRAMMAR and sched.compiling == [constrained]
    assert list(sched.waiting) == [free] and sched.has_unfinished()
    out = run_step(sched)
    assert [c.seq for c in out.prefills] == [free] and out.grammar_failed == ()

    compile_done.set_result(_Compiled())
    out = run_step(sched)
    assert [c.seq for c in out.prefills] == [constrained] and constrained.grammar is not None
    assert sched.compiling == [] and constrained.grammar_compile is None


def test_a_failed_compile_takes_the_sequence_out_for_the_engine_to_fail() -> None:
    sched = make_scheduler()
    compile_done: Future[Any] = Future()
    seq = make_seq(4)
    seq.grammar_compile = compile_done
    sched.add(seq)
    compile_done.set_exception(RuntimeError("no such rule"))
    out = run_step(sched)
    ((failed, error),) = out.grammar_failed
    assert failed is seq and isinstance(error, GrammarError) and "no such rule" in str(error)
    assert seq.status == SequenceStatus.FINISHED_ERROR and not sched.has_unfinished() and out.is_empty


def test_finishing_a_sequence_that_waits_for_its_grammar_takes_it_out() -> None:
    sched = make_scheduler()
    seq = make_seq(4)
    seq.grammar_compile = Future()
    sched.add(seq)
    sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
    assert sched.compiling == [] and not sched.has_unfinished()
