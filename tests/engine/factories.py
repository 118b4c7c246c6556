"""Factories and a fake runner for model-free engine tests (vLLM's create_scheduler / create_requests).

The scheduler is pure policy, so it is driven with `Sequence` objects and a simulated forward pass:
`run_step` schedules, advances progress, appends one fake token for every chunk that completed its
sequence, and finishes a sequence with LENGTH once it has `max_tokens` outputs, as the engine does.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.scheduler import build_scheduler
from engine.scheduler.core import SchedulerCore
from engine.sequence import Sequence, SequenceStatus
from engine.step import SchedulerOutput
from engine.types import Priority, SamplingParams

FAKE_TOKEN = 7
_request_ids = itertools.count()


class FakeClock:
    """A clock the test moves by hand: no sleeping."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_scheduler(
    num_blocks: int = 16,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    clock: Callable[[], float] | None = None,
    watermark_blocks: int = 1,
    prefix_caching: bool = False,
    **policy: Any,
) -> SchedulerCore:
    """`policy`: other SchedulerConfig fields (length_buckets, long_prefill_share, batching, ...)."""
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        watermark_blocks=watermark_blocks,
        **policy,
    )
    return build_scheduler(config, BlockManager(num_blocks, block_size, prefix_caching), clock or FakeClock())


def make_seq(
    prompt_len: int,
    max_tokens: int = 4,
    priority: Priority = Priority.PAID,
    *,
    deadline: float | None = None,
    request_id: str | None = None,
    fairness_key: str = "",
    prompt: list[int] | None = None,
    cache_salt: str = "",
) -> Sequence:
    """A sequence whose prompt tokens are 100, 101, ... (distinct, so chunk contents are checkable)
    unless `prompt` is given (then `prompt_len` is ignored)."""
    return Sequence(
        request_id if request_id is not None else f"req-{next(_request_ids)}",
        0,
        list(prompt) if prompt is not None else list(range(100, 100 + prompt_len)),
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        priority=priority,
        deadline=deadline,
        fairness_key=fairness_key,
        cache_salt=cache_salt,
    )


def make_seqs(
    num: int, prompt_len: int, max_tokens: int = 4, priority: Priority = Priority.PAID
) -> list[Sequence]:
    return [make_seq(prompt_len, max_tokens, priority) for _ in range(num)]


def run_step(sched: SchedulerCore, check: bool = True) -> SchedulerOutput:
    """One engine iteration without a model; returns what was scheduled (as it was before update)."""
    out = sched.schedule()
    if check:
        check_output(sched, out)
    completing = [c.seq for c in out.chunks if c.completes]
    sched.update(out)
    for seq in completing:
        if seq.finished:  # finished (e.g. aborted) between scheduling and now
            continue
        seq.append_token(FAKE_TOKEN)
        if seq.num_output_tokens >= seq.sampling.max_tokens:
            sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
    if check:
        check_blocks(sched)
        check_waiting(sched)
    return out


def run_until_done(sched: SchedulerCore, max_steps: int = 10_000) -> list[SchedulerOutput]:
    """Step until nothing is left; fail (instead of hanging) if that takes more than `max_steps`."""
    outputs: list[SchedulerOutput] = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return outputs
        outputs.append(run_step(sched))
    raise AssertionError(f"not done after {max_steps} steps (deadlock?): {list(sched.sequences())}")


def check_output(sched: SchedulerCore, out: SchedulerOutput) -> None:
    """Invariants every scheduler output must satisfy, checked before `update`."""
    config = sched.config
    assert out.num_batched_tokens <= config.max_num_batched_tokens, out
    assert len(out.chunks) <= config.max_num_seqs, out
    assert len(sched.running) <= config.max_num_seqs
    ids = [c.seq.seq_id for c in out.chunks]
    assert len(ids) == len(set(ids)), f"a sequence scheduled twice: {ids}"
    for chunk in out.decodes:
        assert chunk.num_tokens == 1 and chunk.completes
    for chunk in out.chunks:
        seq = chunk.seq
        assert seq.status == SequenceStatus.RUNNING and seq in sched.running
        assert 1 <= chunk.num_tokens <= seq.num_uncomputed_tokens
        # Every position computed this step has a slot.
        end = seq.num_computed_tokens + chunk.num_tokens
        assert len(seq.block_table) * sched.blocks.block_size >= end, (seq, chunk)
    for seq in out.preempted:
        assert seq.num_computed_tokens == 0
        assert seq in sched.running or seq in list(sched.waiting)  # may be re-admitted in the same step


def check_blocks(sched: SchedulerCore) -> None:
    """Every block is either held (by as many sequences as its reference count says, and by more
    than one only if it is a registered, full block) or free, never both; free blocks are exactly
    the rest of the cache."""
    bm = sched.blocks
    holders: dict[int, int] = {}
    for seq in sched.sequences():
        assert len(seq.block_table) == len(set(seq.block_table)), seq
        for b in seq.block_table:
            holders[b] = holders.get(b, 0) + 1
    for b, n in holders.items():
        assert bm._refs[b] == n, (b, bm._refs[b], n)
        assert n == 1 or b in bm._hash_of, f"unregistered block {b} shared"
    free = list(bm._free) + list(bm._evictable)
    assert len(free) == len(set(free)) and not set(free) & set(holders)
    assert all(bm._refs[b] == 0 for b in free)
    assert sorted(list(holders) + free) == list(range(bm.num_blocks))
    assert all(b in bm._hash_of for b in bm._evictable)
    assert {bm._block_of[h] for h in bm._hash_of.values()} == set(bm._hash_of)
    # A registered block a sequence holds is one of its full, computed blocks, with its own content.
    for seq in sched.sequences():
        for i, b in enumerate(seq.block_table):
            if b in bm._hash_of:
                assert (i + 1) * bm.block_size <= seq.num_computed_tokens, (seq, i)
                assert bm._hashes(seq, i + 1)[i] == bm._hash_of[b], (seq, i)
    for seq in sched.waiting:
        assert not seq.block_table and seq.num_computed_tokens == 0, seq


def check_waiting(sched: SchedulerCore) -> None:
    """The waiting queue's counters equal the sums over the sequences in it (they are kept as
    sequences come and go, so whatever happens to a sequence while queued must not skew them)."""
    waiting = sched.waiting
    members = list(waiting)
    assert len(waiting) == len(members)
    for p in Priority:
        of_class = [s for s in members if s.priority == p]
        assert waiting.tokens_by_priority()[p] == sum(s.num_uncomputed_tokens for s in of_class), p
        assert waiting.decode_tokens_by_priority()[p] == sum(
            max(0, s.sampling.max_tokens - s.num_output_tokens) for s in of_class
        ), p
        by_bucket = dict.fromkeys(waiting.labels, 0)
        for s in of_class:
            by_bucket[waiting.labels[waiting.bucket(s)]] += 1
        assert waiting.count_by_priority_and_bucket()[p.name.lower()] == by_bucket, p


def scheduled(out: SchedulerOutput) -> dict[str, int]:
    return {c.seq.request_id: c.num_tokens for c in out.chunks}


def assert_all_done(sched: SchedulerCore, seqs: list[Sequence]) -> None:
    for seq in seqs:
        assert seq.status == SequenceStatus.FINISHED_LENGTH, seq
        assert seq.num_output_tokens == seq.sampling.max_tokens, seq
        assert seq.output_token_ids == [FAKE_TOKEN] * seq.sampling.max_tokens
        assert seq.block_table == []
    assert not sched.has_unfinished()
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks


def assert_waiting_counters_zero(sched: SchedulerCore) -> None:
    """An empty queue counts nothing: no sequences, tokens or decode tokens in any class or bucket."""
    waiting = sched.waiting
    assert len(waiting) == 0
    assert waiting.count_by_bucket() == dict.fromkeys(waiting.labels, 0)
    assert set(waiting.tokens_by_priority().values()) == {0}
    assert set(waiting.decode_tokens_by_priority().values()) == {0}
