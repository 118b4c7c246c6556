"""Iteration-level scheduling: pure policy, no tensors.

Each step decides only how many tokens each sequence advances (as vLLM v1): one for a running
sequence that decodes, a chunk for one that prefills, so chunked prefill is the normal case. Order:
decodes of running sequences first, then running prefills, then new admissions from the waiting
queue, all within `max_num_batched_tokens` and `max_num_seqs`, and only with free KV blocks.
When a running sequence cannot get a block, the lowest-ranked running sequence (lowest priority,
most recently admitted) is preempted: its blocks are freed and it waits to be recomputed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus
from engine.types import Priority


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # Free blocks kept back when admitting new sequences, so running ones can still grow.
    watermark_blocks: int = 1


@dataclass(frozen=True)
class ScheduledChunk:
    """`seq` computes tokens [num_computed_tokens, num_computed_tokens + num_tokens) this step."""

    seq: Sequence
    num_tokens: int

    @property
    def completes(self) -> bool:
        """After this chunk every known token is computed, so the step samples a new one."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    decodes: tuple[ScheduledChunk, ...]  # one token each
    prefills: tuple[ScheduledChunk, ...]
    preempted: tuple[Sequence, ...]
    expired: tuple[Sequence, ...]  # waited past their queue deadline; the engine fails them

    @property
    def chunks(self) -> tuple[ScheduledChunk, ...]:
        return self.decodes + self.prefills

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class WaitingQueue:
    """Waiting sequences, one FIFO per priority class; the higher class is always served first.

    The seam for policies (length buckets, fair share): `peek`/`pop` decide who is next.
    """

    def __init__(self) -> None:
        self._queues: dict[Priority, deque[Sequence]] = {p: deque() for p in Priority}

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __iter__(self):  # type: ignore[no-untyped-def]
        for p in sorted(self._queues):
            yield from self._queues[p]

    def push(self, seq: Sequence) -> None:
        self._queues[seq.priority].append(seq)

    def push_front(self, seq: Sequence) -> None:
        """A preempted sequence goes back to the head of its class: it was admitted before others."""
        self._queues[seq.priority].appendleft(seq)

    def peek(self) -> Sequence | None:
        for p in sorted(self._queues):
            if self._queues[p]:
                return self._queues[p][0]
        return None

    def pop(self) -> Sequence:
        for p in sorted(self._queues):
            if self._queues[p]:
                return self._queues[p].popleft()
        raise IndexError("pop from an empty waiting queue")

    def remove(self, seq: Sequence) -> None:
        self._queues[seq.priority].remove(seq)

    def count_by_priority(self) -> dict[str, int]:
        return {p.name.lower(): len(q) for p, q in self._queues.items()}


def _rank(seq: Sequence) -> tuple[int, int]:
    """Higher rank is preempted first: lower priority, then the most recently admitted."""
    return (int(seq.priority), seq.admission_order)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.blocks = block_manager
        self.clock = clock
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ---- queue operations -------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.push(seq)

    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def sequences(self) -> Iterable[Sequence]:
        yield from self.running
        yield from self.waiting

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End `seq` with a terminal status: out of every queue, all its blocks freed (one place)."""
        assert status.finished, status
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif not seq.status.finished:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = status

    # ---- the step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        expired = self._expire_waiting()
        preempted: list[Sequence] = []
        scheduled: set[tuple[str, int]] = set()

        def make_room(seq: Sequence, num_tokens: int) -> bool:
            """Preempt lower-ranked unscheduled running sequences until `seq` fits, or preempt `seq`."""
            while not self.blocks.allocate(seq, num_tokens):
                candidates = [s for s in self.running if s.seq_id not in scheduled]
                victim = max(candidates, key=_rank)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    return False
            return True

        ranked = sorted(self.running, key=_rank)
        decodes: list[ScheduledChunk] = []
        for seq in ranked:
            if seq.is_prefilling or budget < 1 or seq.status != SequenceStatus.RUNNING:
                continue
            if make_room(seq, seq.num_tokens):
                decodes.append(ScheduledChunk(seq, 1))
                scheduled.add(seq.seq_id)
                budget -= 1

        prefills: list[ScheduledChunk] = []
        for seq in ranked:
            if not seq.is_prefilling or budget < 1 or seq.status != SequenceStatus.RUNNING:
                continue
            chunk = self._fit_chunk(seq, min(seq.num_uncomputed_tokens, budget), reserve=0)
            if chunk == 0:
                continue  # keeps its blocks; decodes finishing will free room
            self.blocks.allocate(seq, seq.num_computed_tokens + chunk)
            prefills.append(ScheduledChunk(seq, chunk))
            scheduled.add(seq.seq_id)
            budget -= chunk

        # No admissions in a step that preempted: the victim would come straight back and thrash.
        # The watermark keeps blocks back for running sequences to grow into, when there are any.
        reserve = self.config.watermark_blocks if self.running else 0
        while not preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.peek()
            if seq is None:
                break
            chunk = self._fit_chunk(seq, min(seq.num_uncomputed_tokens, budget), reserve=reserve)
            if chunk == 0:
                break  # no room: wait for running sequences to finish (FIFO within the class)
            self.waiting.pop()
            self.blocks.allocate(seq, seq.num_computed_tokens + chunk)
            seq.mark_admitted()
            self.running.append(seq)
            prefills.append(ScheduledChunk(seq, chunk))
            scheduled.add(seq.seq_id)
            budget -= chunk

        return SchedulerOutput(tuple(decodes), tuple(prefills), tuple(preempted), tuple(expired))

    def _fit_chunk(self, seq: Sequence, want: int, reserve: int) -> int:
        """The largest chunk <= `want` whose slots fit in `seq`'s blocks plus the free ones."""
        bs = self.blocks.block_size
        capacity = (len(seq.block_table) + max(0, self.blocks.num_free_blocks - reserve)) * bs
        return max(0, min(want, capacity - seq.num_computed_tokens))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(seq)

    def _expire_waiting(self) -> list[Sequence]:
        now = self.clock()
        expired = [s for s in self.waiting if not s.started and s.deadline is not None and now > s.deadline]
        for seq in expired:
            self.waiting.remove(seq)
            seq.status = SequenceStatus.FINISHED_ERROR
        return expired

    def update(self, output: SchedulerOutput) -> None:
        """Advance progress after the forward pass ran `output`."""
        for chunk in output.chunks:
            chunk.seq.num_computed_tokens += chunk.num_tokens
