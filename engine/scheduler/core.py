"""The scheduler's core: its queues and the mechanics of one step, shared by every policy.

Each step decides only how many tokens each sequence advances (as vLLM v1): one for a running
sequence that decodes, a chunk for one that prefills, so chunked prefill is the normal case. Within
`max_num_batched_tokens` and `max_num_seqs`, and only with free KV blocks, a step schedules:

    1. the decodes of the running sequences (highest rank first);
    2. for each priority class, highest first: its running prefills, then its admissions from the
       waiting queue (`WaitingQueue`: buckets and fairness keys take turns).

So a paid arrival never waits behind a free sequence's chunked prefill. The policy (continuous.py,
static.py) orders these (`_fill`) and decides at a few hooks: how big a prefill chunk may be
(`_chunk_limit`), whom to preempt for a chunk or a slot (`_fit_or_evict`, `_claim_slot`), and who
may join (`_may_admit`, `_admitted`). The core preempts for memory itself (preemption.py), so
nothing deadlocks whatever the policy.

Before a sequence is queued it may wait for its grammar's compile or for a slot of its LoRA
adapter, and a queued one past its deadline is taken out (pending.py).
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.scheduler.buckets import is_long
from engine.scheduler.budget import StepTimeBudget
from engine.scheduler.interface import SchedulerInterface
from engine.scheduler.pending import Pending
from engine.scheduler.preemption import memory_victim
from engine.scheduler.step_builder import StepBuilder
from engine.scheduler.step_cost import StepCostModel
from engine.scheduler.waiting_queue import WaitingQueue
from engine.sequence import Sequence, SequenceStatus
from engine.step import ScheduledChunk, SchedulerOutput
from engine.types import Priority

if TYPE_CHECKING:
    from engine.lora import LoraSlots


class SchedulerCore(SchedulerInterface):
    """The queues, and a step's decodes, prefill chunks and admissions; a policy subclass fills
    the step (`_fill`) and may refine the hooks, whose plain forms here cap nothing and preempt
    only for memory."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        clock: Callable[[], float] = time.monotonic,
        loras: LoraSlots | None = None,
    ) -> None:
        self.config = config
        self.blocks = block_manager
        self.clock = clock
        self.waiting = WaitingQueue(config.length_buckets)
        self.running = []
        # Grammar compiles and adapter slots that sequences wait for, and the queue deadlines.
        self.pending = Pending(loras)
        self.compiling = self.pending.compiling
        self.parked = self.pending.parked
        self.num_preemptions = 0
        self.num_priority_preemptions = 0
        self.num_fairness_preemptions = 0
        # The step-time budget's state, trained by every step (static batching never asks it).
        self.budget = StepTimeBudget(config)

    @property
    def step_cost(self) -> StepCostModel:
        """The step-cost model the engine's step times train (budget.py)."""
        return self.budget.step_cost

    # ---- queue operations -------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if self.pending.hold(seq):
            return
        seq.status = SequenceStatus.WAITING
        self.waiting.push(seq)
        self.budget.note_arrival(seq.priority, self.clock())
        self.pending.track_deadline(seq)

    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0 or bool(self.compiling) or bool(self.parked)

    def sequences(self) -> Iterable[Sequence]:
        yield from self.running
        yield from self.waiting
        yield from self.compiling
        yield from self.parked

    def wait_for_grammar(self, timeout_s: float) -> None:
        self.pending.wait_for_grammar(timeout_s)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        # Goes by where the sequence is, not by what its status says.
        assert status.finished, status
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self.pending.discard(seq)
        self.blocks.free(seq)
        self.budget.forget(seq)
        seq.status = status

    def update(self, output: SchedulerOutput) -> None:
        for chunk in output.chunks:
            chunk.seq.num_computed_tokens += chunk.num_tokens
            self.blocks.register_full_blocks(chunk.seq)
            self.waiting.charge(chunk.seq, chunk.num_tokens)  # its tenant's share of the work
        self.budget.note_progress(output)

    def record_step(self, output: SchedulerOutput, seconds: float) -> None:
        self.budget.observe(output, seconds)

    # ---- the step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        grammar_failed = self.pending.start_compiled(self.add)
        self.pending.unpark(self.add)
        expired = self.pending.expire(self.waiting, self.clock())
        self.budget.begin_step()
        step = StepBuilder(self.config.max_num_batched_tokens, self.config.long_prefill_budget)
        self._fill(step)
        return SchedulerOutput(
            tuple(step.decodes),
            tuple(step.prefills),
            tuple(step.preempted),
            tuple(expired),
            grammar_failed,
            step.num_context_pairs,
        )

    @abstractmethod
    def _fill(self, step: StepBuilder) -> None:
        """The policy: schedule this step's decodes, prefill chunks and admissions into `step`."""

    def _is_long(self, seq: Sequence) -> bool:
        return is_long(seq.num_prompt_tokens, self.config.length_buckets)

    def _schedule_decodes(self, step: StepBuilder, ranked: list[Sequence], yielding: bool = False) -> None:
        """One token for each running sequence that decodes; `yielding`: only while the step is
        predicted within the time budget."""
        for seq in ranked:
            if seq.is_prefilling or step.budget < 1 or seq.status != SequenceStatus.RUNNING:
                continue
            if seq.seq_id in step.chunks or (yielding and not self.budget.fits_decode(step)):
                continue
            if self._make_room(step, seq, seq.num_tokens):
                step.add(ScheduledChunk(seq, 1), decode=True)

    def _schedule_prefills(self, step: StepBuilder, ranked: list[Sequence]) -> None:
        """Next chunks of running sequences that are still prefilling (one class, by rank)."""
        for seq in ranked:
            if not seq.is_prefilling or seq.status != SequenceStatus.RUNNING or seq.seq_id in step.chunks:
                continue
            if step.budget < 1:
                return
            want, shared = self._chunk_limit(step, seq, joining=False)
            if want == 0:
                continue
            chunk = self._fit_chunk(seq, want, reserve=0)
            if chunk < want:
                chunk = self._fit_or_evict(step, seq, want, reserve=0)
            if chunk == 0 and not step.chunks:
                # Nothing at all runs this step, so nothing will free room: without this, sequences
                # that all hold part of a prompt could wait for each other forever.
                chunk = self._preempt_for_memory(step, seq)
            if chunk == 0:
                continue  # keeps its blocks; decodes finishing will free room
            self.blocks.allocate(seq, seq.num_computed_tokens + chunk)
            step.add(ScheduledChunk(seq, chunk), decode=False, shared=shared, long=self._is_long(seq))

    def _admit(self, step: StepBuilder, priority: Priority, max_served: float | None = None) -> None:
        """Admit waiting sequences of one class while the budget, slots and blocks allow;
        `max_served`: only while the next one's key has been served at most that many tokens (the
        rest wait for the prefills of less served keys first; the class is not done)."""
        if not step.admitting or step.memory_preempted or priority >= step.admit_below:
            return
        skip: set[int] = set()  # buckets whose long prompts have used their share this step
        while step.budget > 0:
            seq = self.waiting.peek(priority, skip)
            if seq is None:
                return  # this class is done; the next one may go on
            resumed = seq.status == SequenceStatus.PREEMPTED  # mid-stream: it goes first regardless
            if max_served is not None and not resumed and self.waiting.served(seq) > max_served:
                return
            if not self._may_admit(seq):
                step.admitting = False
                return
            self.blocks.take_cached_prefix(seq)
            want, shared = self._chunk_limit(step, seq, joining=True)
            if want == 0 or (not resumed and self._first_token_waits(step, seq, want)):
                self.blocks.release_cached_prefix(seq)
                skip.add(self.waiting.bucket(seq))
                continue
            out_of_turn = False
            if len(self.running) >= self.config.max_num_seqs:
                claimed = self._claim_slot(step, seq, priority)
                if claimed is None:
                    step.admitting = False
                    return
                seq, out_of_turn = claimed
                if out_of_turn:
                    self.blocks.take_cached_prefix(seq)
                    want, shared = self._chunk_limit(step, seq, joining=True)
            # The watermark keeps blocks back for running sequences to grow into, when there are any.
            reserve = self.config.watermark_blocks if self.running else 0
            chunk = self._fit_chunk(seq, want, reserve)
            if chunk < want:
                chunk = self._fit_or_evict(step, seq, want, reserve)
            if chunk == 0:
                # No room: wait for running sequences to finish. Nobody behind it (in this class or
                # a lower one) may take the blocks it is waiting for.
                self.blocks.release_cached_prefix(seq)
                step.admitting = False
                return
            if out_of_turn:
                self.waiting.remove(seq)
            else:
                self.waiting.pop(seq)
            self._count_cache_lookup(seq)
            self.blocks.allocate(seq, seq.num_computed_tokens + chunk)
            seq.mark_admitted()
            self.running.append(seq)
            step.add(ScheduledChunk(seq, chunk), decode=False, shared=shared, long=self._is_long(seq))
            self._admitted(seq)

    def _count_cache_lookup(self, seq: Sequence) -> None:
        """Prefix-cache accounting at admission; a choice's first admission sets what its usage
        reports as cached prompt tokens (a recompute after preemption is the engine's business)."""
        if not self.blocks.enable_prefix_caching:
            return
        self.blocks.count_lookup(seq.num_tokens, seq.num_computed_tokens)
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)

    def _fit_chunk(self, seq: Sequence, want: int, reserve: int) -> int:
        """The largest chunk <= `want` whose slots fit in `seq`'s blocks plus the free ones."""
        bs = self.blocks.block_size
        capacity = (len(seq.block_table) + max(0, self.blocks.num_free_blocks - reserve)) * bs
        return max(0, min(want, capacity - seq.num_computed_tokens))

    # ---- the policy's hooks, in their plain forms ----------------------------------------------

    def _chunk_limit(self, step: StepBuilder, seq: Sequence, joining: bool) -> tuple[int, bool]:
        """The most tokens `seq` may prefill now, and whether the long-prompt share bounds it."""
        return min(seq.num_uncomputed_tokens, step.budget), False

    def _fit_or_evict(self, step: StepBuilder, seq: Sequence, want: int, reserve: int) -> int:
        """The chunk <= `want` that fits once the policy has preempted whom it may for `seq`."""
        return self._fit_chunk(seq, want, reserve)

    def _claim_slot(
        self, step: StepBuilder, seq: Sequence, priority: Priority
    ) -> tuple[Sequence, bool] | None:
        """Every slot is taken: (the sequence to admit now, whether out of its turn, its cached
        prefix not yet taken), or None. Any other answer than (`seq`, False) has given `seq`'s
        cached prefix back."""
        self.blocks.release_cached_prefix(seq)
        return None

    def _may_admit(self, seq: Sequence) -> bool:
        return True

    def _first_token_waits(self, step: StepBuilder, seq: Sequence, want: int) -> bool:
        """Whether `seq`, admissible with a chunk of `want` tokens, waits for a later step (its
        bucket's turn is kept)."""
        return False

    def _admitted(self, seq: Sequence) -> None:
        """`seq` joined `running` this step."""

    # ---- preemption ------------------------------------------------------------------------------

    def _make_room(self, step: StepBuilder, seq: Sequence, num_tokens: int) -> bool:
        """Preempt lower-ranked unscheduled running sequences until `seq` fits, or preempt `seq`."""
        while not self.blocks.allocate(seq, num_tokens):
            victim = memory_victim(self.running, step.chunks)
            assert victim is not None  # `seq` itself is running and unscheduled
            self._preempt(victim)
            step.preempted.append(victim)
            step.memory_preempted = True
            if victim is seq:
                return False
        return True

    def _preempt_for_memory(self, step: StepBuilder, seq: Sequence) -> int:
        """Preempt lower-ranked unscheduled sequences until `seq` can compute at least one token."""
        chunk = 0
        while chunk == 0:
            victim = memory_victim(self.running, step.chunks, above=seq)
            if victim is None:
                return 0
            self._preempt(victim)
            step.preempted.append(victim)
            step.memory_preempted = True
            chunk = self._fit_chunk(seq, min(seq.num_uncomputed_tokens, step.budget), reserve=0)
        return chunk

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        self.budget.forget(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(seq)
