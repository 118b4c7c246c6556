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
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus
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
    **policy: Any,
) -> Scheduler:
    """`policy`: other SchedulerConfig fields (length_buckets, long_prefill_share, batching, ...)."""
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        watermark_blocks=watermark_blocks,
        **policy,
    )
    return Scheduler(config, BlockManager(num_blocks, block_size), clock or FakeClock())


def make_seq(
    prompt_len: int,
    max_tokens: int = 4,
    priority: Priority = Priority.PAID,
    *,
    deadline: float | None = None,
    request_id: str | None = None,
    fairness_key: str = "",
) -> Sequence:
    """A sequence whose prompt tokens are 100, 101, ... (distinct, so chunk contents are checkable)."""
    return Sequence(
        request_id if request_id is not None else f"req-{next(_request_ids)}",
        0,
        list(range(100, 100 + prompt_len)),
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        priority=priority,
        deadline=deadline,
        fairness_key=fairness_key,
    )


def make_seqs(
    num: int, prompt_len: int, max_tokens: int = 4, priority: Priority = Priority.PAID
) -> list[Sequence]:
    return [make_seq(prompt_len, max_tokens, priority) for _ in range(num)]


def run_step(sched: Scheduler, check: bool = True) -> SchedulerOutput:
    """One engine iteration without a model; returns what was scheduled (as it was before update)."""
    out = sched.schedule()
    if check:
        check_output(sched, out)
    completing = [c.seq for c in out.chunks if c.completes]
    sched.update(out)
    for seq in completing:
        if seq.finished:  # finished (e.g. aborted) between scheduling and now
            continue
        seq.append_token(FAKE_TOKEN, None)
        if seq.num_output_tokens >= seq.sampling.max_tokens:
            sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
    if check:
        check_blocks(sched)
    return out


def run_until_done(sched: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    """Step until nothing is left; fail (instead of hanging) if that takes more than `max_steps`."""
    outputs: list[SchedulerOutput] = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return outputs
        outputs.append(run_step(sched))
    raise AssertionError(f"not done after {max_steps} steps (deadlock?): {list(sched.sequences())}")


def check_output(sched: Scheduler, out: SchedulerOutput) -> None:
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


def check_blocks(sched: Scheduler) -> None:
    """No block is owned twice, and owned plus free blocks are exactly the whole cache."""
    owned = [b for s in sched.sequences() for b in s.block_table]
    assert len(owned) == len(set(owned)), "a block handed out twice"
    free = list(sched.blocks._free)
    assert len(free) == len(set(free)) and not set(free) & set(owned)
    assert sorted(owned + free) == list(range(sched.blocks.num_blocks))
    for seq in sched.waiting:
        assert not seq.block_table and seq.num_computed_tokens == 0, seq
