"""The arrival estimate: pure arithmetic on a load snapshot, checked against hand-computed waits."""

from __future__ import annotations

import time

import pytest

from engine.deadlines import LoadSnapshot, PendingWork, RunningLoad, ServiceMeter, estimate_wait_s, kth_start
from engine.types import GenerationRequest, Priority, SamplingParams

FREE, PAID = Priority.FREE, Priority.PAID


def snapshot(**kw: object) -> LoadSnapshot:
    settings: dict = dict(
        max_num_seqs=4, max_num_batched_tokens=64, seconds_per_token=0.001, seconds_per_step=0.1
    )
    settings.update(kw)
    return LoadSnapshot(**settings)


def test_nothing_measured_means_admit() -> None:
    load = snapshot(seconds_per_token=None, seconds_per_step=None, waiting_by_key={FREE: {"": 10**6}})
    assert not load.measured
    assert estimate_wait_s(load, FREE) is None


def test_an_idle_engine_starts_at_once() -> None:
    assert estimate_wait_s(snapshot(), FREE) == 0.0


def test_prefill_bound_wait_counts_waiting_and_running_prompt_tokens() -> None:
    load = snapshot(
        waiting_by_key={FREE: {"": 2}},
        waiting_tokens={FREE: 1500},
        running=(RunningLoad(FREE, prefill_left=500, decode_left=10),),
    )
    assert estimate_wait_s(load, FREE) == pytest.approx(2.0)  # 2000 tokens at 1 ms


def test_slot_bound_wait_follows_the_earliest_free_slots() -> None:
    running = tuple(RunningLoad(FREE, 0, n) for n in (10, 20, 30, 40))
    load = snapshot(running=running, seconds_per_token=0.0)
    assert estimate_wait_s(load, FREE) == pytest.approx(1.0, rel=0.01)  # the first slot frees at step 10
    # One request ahead (5 tokens) takes that slot until step 15; the next slot frees at step 20.
    ahead = snapshot(
        running=running,
        seconds_per_token=0.0,
        waiting_by_key={FREE: {"": 1}},
        waiting_decode_tokens={FREE: 5},
    )
    assert estimate_wait_s(ahead, FREE) == pytest.approx(1.5, rel=0.01)
    # Sequences really generate half of max_tokens on average: everything is twice as fast.
    half = snapshot(running=running, seconds_per_token=0.0, completion_ratio=0.5)
    assert estimate_wait_s(half, FREE) == pytest.approx(0.5, rel=0.01)


def test_paid_ignores_free_work_it_would_preempt() -> None:
    load = snapshot(
        waiting_by_key={FREE: {"": 100}},
        waiting_tokens={FREE: 10_000},
        waiting_decode_tokens={FREE: 10_000},
        running=tuple(RunningLoad(FREE, 0, 100) for _ in range(4)),
    )
    assert estimate_wait_s(load, PAID) == 0.0
    assert estimate_wait_s(load, FREE) > 10.0


def test_fair_share_puts_one_turn_of_a_flooding_key_ahead() -> None:
    load = snapshot(
        waiting_by_key={FREE: {"flood": 99, "light": 0}},
        waiting_tokens={FREE: 9900},
        waiting_decode_tokens={FREE: 99 * 16},
    )
    light = estimate_wait_s(load, FREE, "light")
    flood = estimate_wait_s(load, FREE, "flood")
    assert light == pytest.approx(0.1)  # one flood request's 100 tokens ahead
    # The flooding key waits for all its own: 99 ahead of 16 steps each on 4 slots -> 24 rounds.
    assert flood == pytest.approx(24 * 16 * 0.1, rel=0.01)


def test_pending_requests_count_as_ahead() -> None:
    pending = PendingWork()
    request = GenerationRequest("r", [1] * 300, SamplingParams(max_tokens=8, n=2), priority=FREE)
    pending.add(request)
    assert pending.by_key[FREE] == {"": 2} and pending.tokens[FREE] == 600
    assert estimate_wait_s(snapshot(), FREE, pending=pending) == pytest.approx(0.6)
    assert estimate_wait_s(snapshot(), PAID, pending=pending) == 0.0
    pending.remove(request)
    assert pending.by_key[FREE] == {} and pending.tokens[FREE] == 0


def test_the_estimate_is_fast_on_a_long_queue() -> None:
    load = snapshot(
        max_num_seqs=64,
        waiting_by_key={FREE: {f"t{i}": 50 for i in range(100)}},
        waiting_tokens={FREE: 5000 * 200},
        waiting_decode_tokens={FREE: 5000 * 128},
        running=tuple(RunningLoad(FREE, 0, 10 + i) for i in range(64)),
    )
    start = time.perf_counter()
    for _ in range(100):
        estimate_wait_s(load, FREE, "t3")
    assert (time.perf_counter() - start) / 100 < 0.005


def test_kth_start() -> None:
    assert kth_start([0.0, 0.0], 10.0, 1) == pytest.approx(0.0, abs=0.02)
    assert kth_start([0.0, 0.0], 10.0, 3) == pytest.approx(10.0, rel=1e-3)
    assert kth_start([4.0, 7.0], 5.0, 3) == pytest.approx(9.0, rel=1e-3)
    assert kth_start([], 1.0, 1) == float("inf")


def test_service_meter() -> None:
    meter = ServiceMeter(max_steps=4)
    assert meter.seconds_per_token is None and meter.seconds_per_step is None
    meter.record_step(0.0, 10, 0)  # a fake clock: no busy time measured
    assert meter.seconds_per_token is None
    for _ in range(4):
        meter.record_step(0.2, 60, 4)
    assert meter.seconds_per_step == pytest.approx(0.2)
    assert meter.seconds_per_token == pytest.approx(0.2 / 64)
    assert meter.prefill_tokens_per_s == pytest.approx(300.0)
    assert meter.decode_steps_per_s == pytest.approx(5.0)
    for _ in range(200):
        meter.record_finish(8, 16)
    assert meter.completion_ratio == pytest.approx(0.5, abs=0.01)
