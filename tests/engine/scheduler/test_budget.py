"""The step-time budget (engine/scheduler/budget.py) without a model: long prompts' chunks cut to
the target beside interactive work, lower classes yielding to higher ones, the batch class's own
slack; driven through `run_step` with fake step times reported as the engine reports them.
"""

from __future__ import annotations

import random

import pytest

from engine.config import SchedulerConfig
from engine.scheduler.budget import BATCH_SLACK, CROWDED_MIN_CHUNK, FAIR_STEP_SHARE, RECENT_CLASS_S
from engine.scheduler.core import SchedulerCore
from engine.scheduler.step_cost import StepCost, context_pairs
from engine.sequence import Sequence, SequenceStatus
from engine.step import SchedulerOutput
from engine.types import Priority
from tests.engine.factories import (
    FakeClock,
    assert_all_done,
    make_scheduler,
    make_seq,
    make_seqs,
    run_step,
    run_until_done,
    scheduled,
)

FREE, PAID, BATCH = Priority.FREE, Priority.PAID, Priority.BATCH


# ---- the step-time budget (target_itl_ms) -----------------------------------------------------------

# Fake step times: 20 ms fixed, 1 ms per prefill token, 2 ms per decode row; target 100 ms.
TRUE_COST = StepCost(fixed_s=0.020, per_prefill_token_s=0.001, per_decode_row_s=0.002)
FLOOR = SchedulerConfig.min_long_prefill_chunk


def slo_scheduler(truth: StepCost = TRUE_COST, **policy: object) -> SchedulerCore:
    """Budget 256 tokens, one bucket boundary at 64 tokens, the share cap off (so only the time
    budget cuts chunks), target 100 ms, and a cost model trained on `truth`'s step times."""
    config: dict = {
        "num_blocks": 4096,
        "block_size": 4,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 256,
        "length_buckets": (64,),
        "long_prefill_share": 1.0,
        "target_itl_ms": 100.0,
    }
    sched = make_scheduler(**(config | policy))
    rng = random.Random(0)
    for _ in range(64):
        p, d, c = rng.randint(1, 256), rng.randint(0, 16), rng.randint(0, 1000)
        sched.step_cost.observe(truth.predict(p, d, context_pairs(c, p)), p, d, context_pairs(c, p))
    return sched


def timed_step(sched: SchedulerCore, truth: StepCost = TRUE_COST) -> SchedulerOutput:
    """One step, then its fake duration reported to the scheduler as the engine does."""
    out = run_step(sched)
    sched.record_step(out, step_seconds(out, truth))
    return out


def step_seconds(out: SchedulerOutput, truth: StepCost = TRUE_COST) -> float:
    return truth.predict(out.num_prefill_tokens, len(out.decodes), out.num_context_pairs)


def test_interactive_work_shrinks_a_long_prompts_chunks_and_idle_steps_restore_them() -> None:
    sched = slo_scheduler()
    long = make_seq(3000, max_tokens=2)
    sched.add(long)
    assert scheduled(timed_step(sched)) == {long.request_id: 256}  # nothing else: the whole budget
    shorts = make_seqs(4, prompt_len=20, max_tokens=10)
    for s in shorts:
        sched.add(s)
    out = timed_step(sched)
    # The short prompts go first and take the step's room (80 ms of prefill beside 20 ms fixed);
    # the long prompt gets only the minimum chunk.
    assert [c.seq for c in out.prefills] == [*shorts, long]
    assert scheduled(out)[long.request_id] == FLOOR
    # Four streams decode: 100 ms - 20 - 4 x 2 leaves 72 prompt tokens.
    while any(not s.finished for s in shorts):
        out = timed_step(sched)
        assert abs(scheduled(out)[long.request_id] - 72) <= 2
        assert step_seconds(out) <= 0.1 + 2 * TRUE_COST.per_prefill_token_s
    # Nothing else to do: the whole token budget again.
    assert scheduled(timed_step(sched)) == {long.request_id: 256}
    run_until_done(sched)
    assert_all_done(sched, [long, *shorts])


def test_without_a_target_or_before_measuring_long_chunks_are_cut_by_tokens_only() -> None:
    """Today's behaviour (here with the share cap off): the running long prompt goes first and
    takes the whole token budget while the short ones wait."""
    for sched in (slo_scheduler(target_itl_ms=0.0), make_scheduler(**slo_policy())):
        long = make_seq(3000, max_tokens=2)
        sched.add(long)
        run_step(sched)
        shorts = make_seqs(4, prompt_len=20, max_tokens=10)
        for s in shorts:
            sched.add(s)
        assert scheduled(run_step(sched)) == {long.request_id: 256}


def slo_policy() -> dict:
    return {
        "num_blocks": 4096,
        "block_size": 4,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 256,
        "length_buckets": (64,),
        "long_prefill_share": 1.0,
    }


def test_a_waiting_short_prompt_alone_also_shrinks_a_long_chunk() -> None:
    """No stream decodes, but a short prompt waits for a slot: the long chunk leaves the step short."""
    sched = slo_scheduler(max_num_seqs=2)
    long, other = make_seq(3000, max_tokens=2), make_seq(3000, max_tokens=2)
    sched.add(long)
    sched.add(other)
    timed_step(sched)  # both admitted: every slot is taken
    short = make_seq(20, max_tokens=2)
    sched.add(short)
    out = timed_step(sched)
    assert sum(scheduled(out).values()) <= 80  # (100 ms - 20 fixed) / 1 ms per token


def test_every_long_prompt_progresses_within_the_stall_bound_when_nothing_fits() -> None:
    """Twelve paid streams cost 140 ms per step alone (10 ms per row): nothing fits the budget.
    Yet a paid long prompt progresses every step by the minimum chunk (the step's first long
    chunk), a second paid one waits for it to finish its prefill, and a free long prompt that was
    already prefilling progresses at least every `max_long_prefill_stall_steps` steps; all finish."""
    truth = StepCost(fixed_s=0.020, per_prefill_token_s=0.001, per_decode_row_s=0.010)
    sched = slo_scheduler(truth)
    free_long = make_seq(2000, max_tokens=2, priority=FREE)
    sched.add(free_long)
    timed_step(sched, truth)
    paid_longs = make_seqs(2, prompt_len=300, max_tokens=2)
    shorts = make_seqs(12, prompt_len=20, max_tokens=200)
    for s in (*shorts, *paid_longs):
        sched.add(s)
    progress: dict[str, list[int]] = {s.request_id: [] for s in (free_long, *paid_longs)}
    step = 0
    while free_long.is_prefilling or any(not s.started or s.is_prefilling for s in paid_longs):
        step += 1
        assert step < 1000, "long prompts starved"
        out = timed_step(sched, truth)
        longs = [c for c in out.prefills if c.seq.request_id in progress]
        if step > 1:  # (the first step admits the short prompts: still room for long chunks)
            assert all(c.num_tokens <= FLOOR for c in longs)
        for c in longs:
            progress[c.seq.request_id].append(step)
    first, second = (progress[s.request_id] for s in paid_longs)
    assert first == list(range(first[0], first[-1] + 1))  # every step
    assert second[0] > first[-1]  # only once the first one's prefill is done
    stall = SchedulerConfig.max_long_prefill_stall_steps
    steps = progress[free_long.request_id]
    assert steps[0] <= stall
    assert max(b - a for a, b in zip(steps, steps[1:], strict=False)) == stall
    run_until_done(sched)
    assert_all_done(sched, [free_long, *paid_longs, *shorts])


def decoding(sched: SchedulerCore, seqs: list[Sequence]) -> None:
    """Add `seqs` and step until every one of them has prefilled and decodes."""
    for s in seqs:
        sched.add(s)
    while any(s.is_prefilling or s.status != SequenceStatus.RUNNING for s in seqs):
        timed_step(sched)


def test_free_decodes_yield_to_a_paid_prefill_and_join_within_the_stall_bound() -> None:
    """A paid prompt of 64 tokens costs 84 ms of the 100 ms target: 8 of the 12 free streams fit
    beside it (2 ms each), the other 4 wait; with paid arriving every step, no free stream waits
    more than `max_yield_stall_steps` steps. Free work alone does not yield."""
    sched = slo_scheduler()
    frees = make_seqs(12, prompt_len=20, max_tokens=200, priority=FREE)
    decoding(sched, frees)
    assert {c.seq for c in timed_step(sched).decodes} == set(frees)  # one class: nothing yields
    paid = make_seq(64, max_tokens=1)
    sched.add(paid)
    out = timed_step(sched)
    assert scheduled(out)[paid.request_id] == 64
    assert len(out.decodes) == 8 and step_seconds(out) <= 0.1
    assert [c.seq for c in out.decodes] == frees[:8]  # the oldest first
    last = {s.seq_id: 0 for s in frees}
    bound = SchedulerConfig.max_yield_stall_steps
    for step in range(1, 40):
        sched.add(make_seq(64, max_tokens=1))
        out = timed_step(sched)
        for c in out.decodes:
            last[c.seq.seq_id] = step
        assert all(step - at <= bound for at in last.values()), (step, last)
    run_until_done(sched)
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks


def test_batch_rows_lengthen_an_interactive_step_by_at_most_the_batch_slack() -> None:
    """8 free streams decode in 36 ms; 12 batch rows beside them get the 15% slack (41.4 ms): the
    2 oldest decode each step, the others wait (no stall-bound turns for the batch class). Once
    the free streams finish, every running batch row decodes."""
    sched = slo_scheduler()
    frees = make_seqs(8, prompt_len=20, max_tokens=30, priority=FREE)
    batch = make_seqs(12, prompt_len=20, max_tokens=200, priority=BATCH)
    decoding(sched, batch)
    decoding(sched, frees)
    alone = TRUE_COST.predict(0, len(frees))
    for _ in range(20):
        out = timed_step(sched)
        rows = [c.seq for c in out.decodes]
        assert set(frees) <= set(rows)
        assert [s for s in rows if s.priority is BATCH] == batch[:2]
        assert step_seconds(out) <= alone * (1 + BATCH_SLACK)
    while not all(s.finished for s in frees):
        timed_step(sched)
    decodable = [s for s in batch if s.status == SequenceStatus.RUNNING and not s.is_prefilling]
    assert len(decodable) > 2
    assert set(decodable) <= {c.seq for c in timed_step(sched).decodes}
    run_until_done(sched)
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks


def test_free_prefill_is_cut_to_the_budget_while_paid_traffic_arrived_lately() -> None:
    """14 free streams decode (48 ms predicted); a free prompt of 64 tokens joins them in one chunk
    when no paid request came lately, and is cut to the 52 tokens the 100 ms target leaves for
    `RECENT_CLASS_S` seconds after a paid arrival."""
    clock = FakeClock()
    sched = slo_scheduler(clock=clock)
    decoding(sched, make_seqs(14, prompt_len=20, max_tokens=500, priority=FREE))
    newcomer = make_seq(64, max_tokens=1, priority=FREE)
    sched.add(newcomer)
    assert scheduled(timed_step(sched))[newcomer.request_id] == 64
    paid = make_seq(8, max_tokens=1)
    sched.add(paid)
    while not paid.finished:
        timed_step(sched)
    clock.advance(RECENT_CLASS_S - 1)
    newcomer = make_seq(64, max_tokens=1, priority=FREE)
    sched.add(newcomer)
    out = timed_step(sched)
    assert scheduled(out)[newcomer.request_id] == 52 and step_seconds(out) <= 0.1
    clock.advance(2)
    newcomer = make_seq(64, max_tokens=1, priority=FREE)
    sched.add(newcomer)
    assert scheduled(timed_step(sched))[newcomer.request_id] == 64


@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_keep_long_chunks_within_the_step_time_budget(seed: int) -> None:
    """Random costs, budgets and arrivals; the cost model learns only from the reported step times.
    Once it has, a long prompt's chunk that joins interactive work (decodes or short prompts
    already in the step) above the minimum chunk always leaves the step within the target, and
    every sequence finishes."""
    rng = random.Random(9000 + seed)
    truth = StepCost(
        fixed_s=rng.uniform(0.005, 0.04),
        per_prefill_token_s=rng.uniform(0.0002, 0.002),
        per_decode_row_s=rng.uniform(0.0005, 0.005),
        per_context_pair_s=rng.choice([0.0, rng.uniform(1e-7, 2e-6)]),  # attention over the context
    )
    target_s = rng.uniform(0.06, 0.2)
    clock = FakeClock()
    sched = make_scheduler(
        num_blocks=rng.randint(200, 1200),
        block_size=4,
        max_num_seqs=rng.randint(4, 24),
        max_num_batched_tokens=rng.choice([128, 256, 512]),
        length_buckets=rng.choice([(64,), (32, 128)]),
        long_prefill_share=rng.choice([0.5, 1.0]),
        target_itl_ms=1000 * target_s,
        clock=clock,
    )
    capacity = sched.blocks.num_blocks * sched.blocks.block_size
    seqs: list[Sequence] = []
    measured_at = None
    for step in range(20_000):
        if step < 300 and rng.random() < 0.3:
            long = rng.random() < 0.15
            prompt = rng.randint(150, min(900, capacity // 3)) if long else rng.randint(4, 40)
            seq = make_seq(
                prompt, rng.randint(1, 40), rng.choice([PAID, FREE]), fairness_key=rng.choice("ab")
            )
            seqs.append(seq)
            sched.add(seq)
        if step >= 300 and not sched.has_unfinished():
            break
        out = timed_step(sched, truth)
        clock.advance(0.05)
        if sched.step_cost.cost is not None and measured_at is None:
            measured_at = step
        if measured_at is None or step < measured_at + 20:
            continue
        # Replay the step in the order it was built: decodes, then the prefills as added.
        prefill_tokens, pairs, interactive = 0, 0, bool(out.decodes)
        for c in out.prefills:
            prefill_tokens += c.num_tokens
            pairs += context_pairs(c.seq.num_computed_tokens - c.num_tokens, c.num_tokens)  # ran: advanced
            if not sched._is_long(c.seq):
                interactive = True
                continue
            if interactive and c.num_tokens > FLOOR:
                seconds = truth.predict(prefill_tokens, len(out.decodes), pairs)
                one_token = truth.per_prefill_token_s + 1000 * truth.per_context_pair_s
                assert seconds <= target_s * 1.02 + one_token, (step, out)
    else:
        pytest.fail(f"not done: {list(sched.sequences())}")
    assert measured_at is not None
    for seq in seqs:
        assert seq.status == SequenceStatus.FINISHED_LENGTH and seq.block_table == []
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks


def test_a_long_prompt_leaves_a_less_served_tenants_prompt_the_step_and_shares_it_with_its_streams() -> None:
    """Tenant a's long prompt against tenant b's short ones (one class): the step that carries b's
    prompts (their first tokens) carries no chunk of a's; while b's streams decode, a's chunks fit
    FAIR_STEP_SHARE of the budget. The same short prompts of a's own tenant get neither."""
    truth = StepCost(fixed_s=0.020, per_prefill_token_s=0.0005, per_decode_row_s=0.002)
    chunks = {}
    for tenant in ("b", "a"):
        sched = slo_scheduler(truth)
        long = make_seq(3000, max_tokens=2, fairness_key="a")
        sched.add(long)
        assert scheduled(timed_step(sched, truth)) == {long.request_id: 256}
        shorts = [make_seq(20, max_tokens=10, fairness_key=tenant) for _ in range(2)]
        for s in shorts:
            sched.add(s)
        first = scheduled(timed_step(sched, truth))
        later = [scheduled(timed_step(sched, truth))[long.request_id] for _ in range(5)]
        chunks[tenant] = (first.get(long.request_id, 0), later)
        run_until_done(sched)
        assert_all_done(sched, [long, *shorts])
    # b: no chunk beside b's prompts, then (100 ms x FAIR_STEP_SHARE - 20 - 2 x 2) / 0.5 ms a step.
    assert chunks["b"][0] == 0
    shared = (100 * FAIR_STEP_SHARE - 20 - 4) / 0.5
    assert shared >= CROWDED_MIN_CHUNK and all(abs(c - shared) <= 2 for c in chunks["b"][1])
    # a's own short prompts: (100 - 20 - 40) / 0.5 = 80 beside them, then (100 - 20 - 4) / 0.5 = 152.
    assert chunks["a"][0] > 0
    assert all(abs(c - 152) <= 2 for c in chunks["a"][1])


def test_a_long_prompt_keeps_to_the_share_while_a_lighter_tenant_was_served_lately() -> None:
    """b's one request ends; a's long prompt then has the step to itself, nothing else interactive,
    yet its chunks still fit FAIR_STEP_SHARE of the target (b's next prompt may come at any time and
    would wait for the step in flight), until b's tokens served lately have decayed below one:
    then it takes the whole token budget again. A tenant never served keeps nothing back."""
    truth = StepCost(fixed_s=0.020, per_prefill_token_s=0.0005, per_decode_row_s=0.002)
    shared = int((100 * FAIR_STEP_SHARE - 20) / 0.5)
    sched = slo_scheduler(truth)
    long = make_seq(16000, max_tokens=1, fairness_key="a")
    b = make_seq(20, max_tokens=10, fairness_key="b")
    sched.add(b)
    while not b.finished:
        timed_step(sched, truth)
    sched.add(long)
    sizes = []
    while long.is_prefilling:
        sizes.append(scheduled(timed_step(sched, truth))[long.request_id])
    # a's first chunk: a has been served less than b so far. Then a leads, and keeps to the share.
    assert sizes[0] == 256 and 256 in sizes[1:]
    released = sizes.index(256, 1)
    assert all(abs(n - shared) <= 1 for n in sizes[1:released])
    assert 200 < released < 400  # b's 30 tokens decay below one (0.99 a step) after ~340 steps
    sched = slo_scheduler(truth)  # b never served: a's first chunk is the whole budget
    alone = make_seq(3000, max_tokens=1, fairness_key="a")
    sched.add(alone)
    assert scheduled(timed_step(sched, truth)) == {alone.request_id: 256}
    run_until_done(sched)
    assert_all_done(sched, [alone])


def test_a_crowded_chunk_deep_in_a_long_prompt_gets_the_lower_floor() -> None:
    """b's streams decode beside a's prompt, deep where nothing fits the share: a's chunk gets
    CROWDED_MIN_CHUNK tokens, not `min_long_prefill_chunk` (deep in a long context those took
    longer than the whole share). Beside streams of a's own tenant it gets the usual floor."""
    truth = StepCost(0.020, per_prefill_token_s=0.0005, per_decode_row_s=0.002, per_context_pair_s=2e-5)
    for streams in ("b", "a"):
        sched = slo_scheduler(truth)
        decoding(sched, [make_seq(20, max_tokens=4000, fairness_key=streams) for _ in range(2)])
        long = make_seq(3000, max_tokens=1, fairness_key="a")
        sched.add(long)
        sizes = {}
        while long.is_prefilling:
            depth = long.num_computed_tokens
            sizes[depth] = scheduled(timed_step(sched, truth)).get(long.request_id, 0)
        deep = [n for d, n in sizes.items() if d > 1000 and d + n < 3000]  # not the last chunk
        assert deep and set(deep) == ({CROWDED_MIN_CHUNK} if streams == "b" else {FLOOR}), set(deep)


def test_a_chunk_deep_in_a_long_prompt_is_cut_to_the_budget_at_its_depth() -> None:
    """Attention costs 0.5 us per query-key pair: four streams decode beside a 3,000-token prompt, and
    every chunk keeps the step within the 100 ms target at every depth, so chunks shrink as the
    prompt gets deeper: ~144 tokens first, ~41 at 2,500 deep (a model without the pairs gave them
    one size at every depth)."""
    truth = StepCost(0.020, per_prefill_token_s=0.0005, per_decode_row_s=0.002, per_context_pair_s=5e-7)
    sched = slo_scheduler(truth)
    long = make_seq(3000, max_tokens=2)
    decoding(sched, make_seqs(4, prompt_len=20, max_tokens=2000))
    sched.add(long)
    sizes = {}
    while long.is_prefilling:
        depth = long.num_computed_tokens
        out = timed_step(sched, truth)
        assert step_seconds(out, truth) <= 0.1 + 0.0005 + 1500e-6  # one token's cost of slack
        sizes[depth] = scheduled(out).get(long.request_id, 0)
    shallow = [n for d, n in sizes.items() if 0 < d < 500]
    deep = [n for d, n in sizes.items() if d > 2500]
    assert min(shallow) > 2 * max(deep) > 0


def test_a_light_tenants_prompts_in_a_row_each_get_a_step_without_the_long_chunk() -> None:
    """b's prompts arrive one a step while a's long prompt prefills and a's next one waits. Each b
    prompt's step carries no chunk of a's, the second too: b has been served fewer tokens lately.
    (The turns' counters lift b to a's waiting prompt's level when b starts waiting, so right after
    its first prompt b's counter led a's, and the second prompt shared its step with a chunk.)"""
    sched = slo_scheduler()
    long, waiting = (make_seq(3000, max_tokens=2, fairness_key="a") for _ in range(2))
    sched.add(long)
    sched.add(waiting)
    assert scheduled(timed_step(sched)) == {long.request_id: 256}
    shorts = []
    for _ in range(3):
        short = make_seq(20, max_tokens=10, fairness_key="b")
        sched.add(short)
        shorts.append(short)
        out = scheduled(timed_step(sched))
        assert out.get(short.request_id) == 20 and long.request_id not in out
    run_until_done(sched)
    assert_all_done(sched, [long, waiting, *shorts])


def test_a_light_tenants_first_token_waits_for_no_decode_of_the_heavier_tenant() -> None:
    """a's eight streams decode (and a was served more); b's prompt's step carries none of them, and
    they decode in the next. With a prompt of b in every step, each of a's streams still decodes
    at least once in every `max_yield_stall_steps` steps. A prompt of a's own leaves them in."""
    sched = slo_scheduler()
    streams = [make_seq(40, max_tokens=400, fairness_key="a") for _ in range(8)]
    decoding(sched, streams)
    b = make_seq(20, max_tokens=1, fairness_key="b")
    sched.add(b)
    out = timed_step(sched)
    assert scheduled(out) == {b.request_id: 20}
    assert {c.seq for c in timed_step(sched).decodes} == set(streams)
    last = {s.request_id: 0 for s in streams}
    bound = sched.config.max_yield_stall_steps
    for step in range(1, 25):
        sched.add(make_seq(20, max_tokens=1, fairness_key="b"))
        for c in timed_step(sched).decodes:
            last[c.seq.request_id] = step
        assert all(step - t <= bound for t in last.values()), (step, last)
    own = make_seq(20, max_tokens=1, fairness_key="a")
    sched.add(own)
    out = timed_step(sched)
    assert scheduled(out).get(own.request_id) == 20 and len(out.decodes) == len(streams)


def _first_token_steps(truth: StepCost, heavy: bool) -> list[int]:
    """The step (from 1) in which each of b's four 30-token prompts, sent at once, completes; with
    `heavy`, while two streams of a (served more) decode."""
    sched = slo_scheduler(truth)
    if heavy:
        decoding(sched, [make_seq(40, max_tokens=400, fairness_key="a") for _ in range(2)])
    burst = [make_seq(30, max_tokens=8, fairness_key="b") for _ in range(4)]
    for seq in burst:
        sched.add(seq)
    done: dict[str, int] = {}
    for step in range(1, 9):
        timed_step(sched, truth)
        done |= {s.request_id: step for s in burst if not s.is_prefilling and s.request_id not in done}
    return sorted(done.values())


def test_a_light_tenants_burst_beside_a_heavier_tenant_goes_in_turns_where_prefill_is_compute_bound() -> None:
    """b's prompt adds 30 ms to a step, more than sharing saves it (20 ms fixed, 4 ms of a's decode
    rows): beside a's streams, b's burst completes one prompt a step. Where a step's fixed cost
    dominates (as on a GPU) it shares one step, and so it does with no heavier tenant running."""
    assert _first_token_steps(TRUE_COST, heavy=True) == [1, 2, 3, 4]
    assert _first_token_steps(TRUE_COST, heavy=False) == [1, 1, 1, 1]
    weights_bound = StepCost(fixed_s=0.050, per_prefill_token_s=0.0001, per_decode_row_s=0.0005)
    assert _first_token_steps(weights_bound, heavy=True) == [1, 1, 1, 1]


def test_batch_rows_are_not_left_out_for_a_batch_prompts_first_token() -> None:
    """In the batch class no first token is awaited and rows have no stall bound: a light batch
    tenant's prompt leaves the heavier batch tenant's decodes in its step."""
    sched = slo_scheduler()
    streams = [make_seq(40, max_tokens=400, priority=BATCH, fairness_key="a") for _ in range(4)]
    decoding(sched, streams)
    b = make_seq(20, max_tokens=1, priority=BATCH, fairness_key="b")
    sched.add(b)
    out = timed_step(sched)
    assert scheduled(out).get(b.request_id) == 20 and {c.seq for c in out.decodes} == set(streams)
