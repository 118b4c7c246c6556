"""Iteration-level scheduling: pure policy, no tensors.

Each step decides only how many tokens each sequence advances (as vLLM v1): one for a running
sequence that decodes, a chunk for one that prefills, so chunked prefill is the normal case. Within
`max_num_batched_tokens` and `max_num_seqs`, and only with free KV blocks, a step schedules:

    1. the decodes of all running sequences (highest rank first);
    2. for each priority class, highest first: its running prefills, then its admissions from the
       waiting queue (`engine.policy.WaitingQueue`: buckets and fairness keys take turns).

So a paid arrival never waits behind a free sequence's chunked prefill. Preemption (blocks freed,
recomputed later) happens for two reasons:

- memory: a running sequence cannot get a block; the lowest-ranked running sequence (lowest class,
  most recently admitted) that is not yet scheduled goes. Unbounded, so nothing deadlocks; a step
  that preempted for memory admits nobody, or the victim would come straight back and thrash.
- priority: a waiting (or prefilling) sequence lacks a slot or blocks while a lower class runs; the
  lowest-ranked lower-class sequence goes, even if already scheduled this step, unless it has been
  preempted `max_preemptions_per_seq` times. The sequence it made room for is admitted in the same
  step; nobody of the victim's class is. The `batch` class (Batch API lines) has no such bound: it
  runs only in the slots and blocks paid and free traffic leave, and gives them up whenever a
  waiting interactive sequence needs them, however often that happens.
- fair share: every slot is taken and a waiting sequence's tenant (fairness key) runs at least two
  fewer sequences of its class than another tenant; that tenant's newest sequence goes (same bound).

Length buckets: while shorter prompts (of the same or a higher class) wait and a slot is free, the
prefill chunks of longer prompts share at most `long_prefill_share` of the step's budget, so a burst
of long prompts cannot hold back short ones.

Step-time budget (`target_itl_ms`; 0 turns it off): every running stream gets one token per step, so
a step's duration is its streams' inter-token latency. A long prompt (beyond the first length
bucket) must therefore not make a step slower than the target while others are interactive: while
this step decodes anything or prefills a short prompt, or shorter prompts wait, a long prompt's
chunk is cut to what `engine.step_cost` predicts still fits the target beside them (the cost model
is fitted online to the step times the engine reports through `record_step`). Within a class,
running short prompts' chunks and admissions come before running long prompts' chunks, so short
prompts take the step's room first; a long newcomer waits while a long prompt of its class (or a
higher one) still prefills. Against starvation: the first long chunk of a step gets at least
`min_long_prefill_chunk` tokens even when nothing fits, and a long prompt that has not progressed
for `max_long_prefill_stall_steps` steps is scheduled ahead of the admissions with that many. When
nothing else is interactive, long prefill takes the whole token budget. Until the cost model has
seen enough steps with prefill, only the token caps apply.

Lower classes yield under the same budget, so a paid request does not wait for free work on a CPU
where every row lengthens the step: while a higher class has work in the step (running or
waiting), a lower class's decodes are scheduled after the higher classes' prefills and admissions,
and join only while the step is predicted within the target; a row left out waits (keeps its
blocks) and joins first, regardless, once it has waited `max_yield_stall_steps` steps. While a higher class
has arrived in the last `RECENT_CLASS_S` seconds, a lower class's prefill chunks (short prompts
too) are cut to what the target leaves beside the step's decodes, so the step a paid arrival waits
for is short as well (a step's first such chunk gets `min_long_prefill_chunk` tokens even when
nothing fits). With one class only, nothing yields. The batch class has a tighter budget of its own while
paid or free work is in the step: that work's predicted time plus `BATCH_SLACK` of it (at least one
batch row decodes; its prefill chunks get no floor), and no stall-bound turns, so a batch cannot
slow interactive streams to its pace.

Static batching (the baseline): a batch of up to `max_num_seqs` forms from the waiting queue while
nothing runs (over several steps if the budget is short), and nobody else is admitted until all of
it has finished. It keeps the class order but neither preempts for priority nor caps long prompts.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.block_manager import BlockManager
from engine.config import EngineConfig, SchedulerConfig
from engine.policy import WaitingQueue
from engine.sequence import Sequence, SequenceStatus
from engine.step import ScheduledChunk, SchedulerOutput
from engine.step_cost import StepCostModel
from engine.types import GrammarError, Priority

if TYPE_CHECKING:
    from engine.lora import LoraSlots


@dataclass
class _Step:
    """The step being built: what is scheduled so far and what is left of the budgets."""

    budget: int
    long_budget: int
    decodes: list[ScheduledChunk] = field(default_factory=list)
    prefills: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    chunks: dict[tuple[str, int], ScheduledChunk] = field(default_factory=dict)
    long_chunks: dict[tuple[str, int], int] = field(default_factory=dict)  # against long_budget
    num_prefill_tokens: int = 0
    num_short_prefills: int = 0  # prefill chunks of prompts within the first length bucket
    num_long_prefills: int = 0  # and of longer ones
    memory_preempted: bool = False
    admit_below: int = len(Priority)  # only classes below this may be admitted (priority preemption)
    admitting: bool = True
    # Classes below these yield to the step-time budget (module docstring): decodes below `lead`,
    # the highest class with work now; prefill chunks below `recent`, the highest seen lately.
    lead: int = len(Priority)
    recent: int = len(Priority)
    # The batch class's own step-time budget while interactive work is in the step (see BATCH_SLACK).
    batch_budget_s: float | None = None

    def add(self, chunk: ScheduledChunk, decode: bool, shared: bool = False, long: bool = False) -> None:
        """`shared`: the chunk counts against `long_budget`; `long`: it is a long prompt's."""
        (self.decodes if decode else self.prefills).append(chunk)
        self.chunks[chunk.seq.seq_id] = chunk
        self.budget -= chunk.num_tokens
        if shared:
            self.long_chunks[chunk.seq.seq_id] = chunk.num_tokens
            self.long_budget -= chunk.num_tokens
        if not decode:
            self.num_prefill_tokens += chunk.num_tokens
            if long:
                self.num_long_prefills += 1
            else:
                self.num_short_prefills += 1

    def drop(self, seq: Sequence, long: bool) -> None:
        """Unschedule `seq` (a priority victim) and give its tokens back."""
        chunk = self.chunks.pop(seq.seq_id, None)
        if chunk is None:
            return
        decode = chunk in self.decodes
        (self.decodes if decode else self.prefills).remove(chunk)
        self.budget += chunk.num_tokens
        self.long_budget += self.long_chunks.pop(seq.seq_id, 0)
        if not decode:
            self.num_prefill_tokens -= chunk.num_tokens
            if long:
                self.num_long_prefills -= 1
            else:
                self.num_short_prefills -= 1

    @property
    def interactive(self) -> bool:
        """Something in this step is latency-bound: a stream decoding or a short prompt prefilling."""
        return bool(self.decodes) or self.num_short_prefills > 0


# How long an arrival of a class makes lower classes keep their prefill chunks within the step-time
# budget: a paid request that comes back within this time finds short steps.
RECENT_CLASS_S = 30.0

# While paid or free work is in a step, Batch API rows may lengthen it by at most this fraction
# (and at least one batch row decodes), so interactive streams keep ~1/(1 + BATCH_SLACK) of their
# pace; batch rows do not take the stall bound's turns. Alone, the batch takes the whole budget.
BATCH_SLACK = 0.15


def _rank(seq: Sequence) -> tuple[int, int]:
    """Higher rank is preempted first: lower priority, then the most recently admitted."""
    return (int(seq.priority), seq.admission_order)


class Scheduler:
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
        self.running: list[Sequence] = []
        # Constrained sequences whose grammar still compiles (WAITING_FOR_GRAMMAR), in arrival
        # order: they join `waiting` at the first step after their compile is done.
        self.compiling: list[Sequence] = []
        # Sequences whose LoRA adapter has no slot yet (WAITING_FOR_ADAPTER), in arrival order; a
        # queued or running sequence holds its adapter's slot (engine/lora.py) until it finishes.
        self.loras = loras
        self.parked: list[Sequence] = []
        self.num_preemptions = 0
        self.num_priority_preemptions = 0
        self.num_fairness_preemptions = 0
        self.static = config.batching == "static"
        # Static batching: whether the current batch still takes members, how many it took, and who
        # they are (a member preempted for memory may come back while the batch runs).
        self._batch_open = True
        self._batch_size = 0
        self._batch_members: set[tuple[str, int]] = set()
        # Waiting sequences with a deadline, earliest first; entries of sequences that have started
        # or finished since are dropped when they reach the top.
        self._deadlines: list[tuple[float, int, Sequence]] = []
        self._deadline_order = itertools.count()
        # The step-time budget: the cost model the engine's step times train, the number of steps
        # scheduled so far, and the step in which each long prompt still prefilling last progressed.
        self.step_cost = StepCostModel()
        self._num_steps = 0
        self._long_progress: dict[tuple[str, int], int] = {}
        # The step in which each running sequence last decoded, and when each class last arrived.
        self._decode_progress: dict[tuple[str, int], int] = {}
        self._arrived: dict[Priority, float] = {}

    @classmethod
    def for_engine(
        cls, config: EngineConfig, num_blocks: int, clock: Callable[[], float], loras: LoraSlots | None = None
    ) -> Scheduler:
        """The engine's scheduler, over a block manager of `num_blocks` of its own."""
        blocks = BlockManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        return cls(config.scheduler, blocks, clock, loras)

    # ---- queue operations -------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue `seq`; one whose grammar is compiling (`grammar_compile`) waits for it first."""
        if seq.grammar_compile is not None:
            seq.status = SequenceStatus.WAITING_FOR_GRAMMAR
            self.compiling.append(seq)
            return
        if not self._take_slot(seq):
            seq.status = SequenceStatus.WAITING_FOR_ADAPTER
            self.parked.append(seq)
            return
        seq.status = SequenceStatus.WAITING
        self.waiting.push(seq)
        self._arrived[seq.priority] = self.clock()
        if seq.deadline is not None and not seq.started:
            heapq.heappush(self._deadlines, (seq.deadline, next(self._deadline_order), seq))

    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0 or bool(self.compiling) or bool(self.parked)

    def sequences(self) -> Iterable[Sequence]:
        yield from self.running
        yield from self.waiting
        yield from self.compiling
        yield from self.parked

    def _take_slot(self, seq: Sequence) -> bool:
        """Give `seq` its adapter's slot (True), or False: every slot is held by other adapters."""
        if seq.lora is None or seq.lora_slot >= 0:
            return True
        if self.loras is None:
            raise RuntimeError("a LoRA sequence reached a scheduler without adapter slots")
        slot = self.loras.acquire(seq.lora)
        if slot is None:
            return False
        seq.lora_slot = slot
        return True

    def _unpark(self) -> None:
        """Queue the parked sequences whose adapter now gets a slot, in arrival order."""
        if self.loras is None:
            return
        self.loras.drop_released()
        for seq in list(self.parked):
            if self._take_slot(seq):
                self.parked.remove(seq)
                self.add(seq)

    def wait_for_grammar(self, timeout_s: float) -> None:
        """Block until a compile that a sequence waits for is done, or `timeout_s` passed (for a
        step with nothing else to do: not a busy loop)."""
        futures = [s.grammar_compile for s in self.compiling if s.grammar_compile is not None]
        if futures:
            wait_futures(futures, timeout_s, FIRST_COMPLETED)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End `seq` with a terminal status: out of every queue, all its blocks freed (one place).

        Goes by where the sequence is, not by what its status says, so it also ends one that a
        failed step left between queues (e.g. taken from the waiting queue, not yet running);
        finishing a finished sequence again only sets its status."""
        assert status.finished, status
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.compiling:
            self.compiling.remove(seq)
        if seq in self.parked:
            self.parked.remove(seq)
        if seq.lora_slot >= 0 and self.loras is not None:
            self.loras.release(seq.lora_slot)
            seq.lora_slot = -1
        self.blocks.free(seq)
        self._long_progress.pop(seq.seq_id, None)
        self._decode_progress.pop(seq.seq_id, None)
        seq.status = status

    def record_step(self, output: SchedulerOutput, seconds: float) -> None:
        """The measured duration of the step that ran `output` (the engine calls this after each
        step): trains the step-cost model behind the step-time budget."""
        self.step_cost.observe(seconds, output.num_prefill_tokens, len(output.decodes))

    # ---- the step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        grammar_failed = self._start_compiled()
        self._unpark()
        expired = self._expire_waiting()
        self._num_steps += 1
        step = _Step(self.config.max_num_batched_tokens, self.config.long_prefill_budget)
        if self.static and not self.running:  # the previous batch has drained: form the next
            self._batch_open, self._batch_size = True, 0
            self._batch_members.clear()

        ranked = sorted(self.running, key=_rank)
        if self._time_budget_s is not None:
            step.lead, step.recent = self._lead_classes()
        # Stalled rows of yielding classes go first too, so the budget's other users see them.
        first = [s for s in ranked if s.priority <= step.lead or self._stalled_decode(s)]
        self._schedule_decodes(step, first)
        for priority in sorted(Priority):
            mine = [s for s in ranked if s.priority == priority]
            if self._time_budget_s is None:
                self._schedule_prefills(step, mine)
                self._admit(step, priority)
                continue
            if priority is Priority.BATCH and step.lead < priority:
                step.batch_budget_s = self._batch_budget(step)
            if priority > step.lead:
                self._schedule_decodes(step, mine, yielding=True)
            # Short prompts (and long ones stalled too long) first, then admissions, then the
            # other long prompts' chunks, in what is left of the step.
            later = [s for s in mine if self._is_long(s) and not self._stalled(s)]
            self._schedule_prefills(step, [s for s in mine if s not in later])
            self._admit(step, priority)
            self._schedule_prefills(step, later)

        if self.static and step.budget > 0:
            self._batch_open = False  # it stopped taking members for want of room or of requests
        return SchedulerOutput(
            tuple(step.decodes), tuple(step.prefills), tuple(step.preempted), tuple(expired), grammar_failed
        )

    def _schedule_decodes(self, step: _Step, ranked: list[Sequence], yielding: bool = False) -> None:
        """One token for each running sequence that decodes; `yielding`: only while the step is
        predicted within the time budget."""
        for seq in ranked:
            if seq.is_prefilling or step.budget < 1 or seq.status != SequenceStatus.RUNNING:
                continue
            if seq.seq_id in step.chunks or (yielding and not self._fits_decode(step)):
                continue
            if self._make_room(step, seq, seq.num_tokens):
                step.add(ScheduledChunk(seq, 1), decode=True)

    def _make_room(self, step: _Step, seq: Sequence, num_tokens: int) -> bool:
        """Preempt lower-ranked unscheduled running sequences until `seq` fits, or preempt `seq`."""
        while not self.blocks.allocate(seq, num_tokens):
            candidates = [s for s in self.running if s.seq_id not in step.chunks]
            victim = max(candidates, key=_rank)
            self._preempt(victim)
            step.preempted.append(victim)
            step.memory_preempted = True
            if victim is seq:
                return False
        return True

    def _schedule_prefills(self, step: _Step, ranked: list[Sequence]) -> None:
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
                chunk = self._preempt_for_priority(step, seq, want, reserve=0)
            if chunk == 0 and not step.chunks:
                # Nothing at all runs this step, so nothing will free room: without this, sequences
                # that all hold part of a prompt could wait for each other forever.
                chunk = self._preempt_for_memory(step, seq)
            if chunk == 0:
                continue  # keeps its blocks; decodes finishing will free room
            self.blocks.allocate(seq, seq.num_computed_tokens + chunk)
            step.add(ScheduledChunk(seq, chunk), decode=False, shared=shared, long=self._is_long(seq))

    def _admit(self, step: _Step, priority: Priority) -> None:
        """Admit waiting sequences of one class while the budget, slots and blocks allow."""
        if not step.admitting or step.memory_preempted or priority >= step.admit_below:
            return
        skip: set[int] = set()  # buckets whose long prompts have used their share this step
        while step.budget > 0:
            seq = self.waiting.peek(priority, skip)
            if seq is None:
                return  # this class is done; the next one may go on
            if self.static and not self._may_join_batch(seq):
                step.admitting = False
                return
            self.blocks.take_cached_prefix(seq)
            want, shared = self._chunk_limit(step, seq, joining=True)
            if want == 0:
                self.blocks.release_cached_prefix(seq)
                skip.add(self.waiting.bucket(seq))
                continue
            out_of_turn = False
            if len(self.running) >= self.config.max_num_seqs and not self._evict_for(step, seq):
                self.blocks.release_cached_prefix(seq)
                fair = self._evict_for_fairness(step, priority)
                if fair is None:
                    step.admitting = False
                    return
                seq, out_of_turn = fair, True
                self.blocks.take_cached_prefix(seq)
                want, shared = self._chunk_limit(step, seq, joining=True)
            # The watermark keeps blocks back for running sequences to grow into, when there are any.
            reserve = self.config.watermark_blocks if self.running else 0
            chunk = self._fit_chunk(seq, want, reserve)
            if chunk < want:
                chunk = self._preempt_for_priority(step, seq, want, reserve)
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
            if self.static:
                self._join_batch(seq)

    def _count_cache_lookup(self, seq: Sequence) -> None:
        """Prefix-cache accounting at admission; a choice's first admission sets what its usage
        reports as cached prompt tokens (a recompute after preemption is the engine's business)."""
        if not self.blocks.enable_prefix_caching:
            return
        self.blocks.count_lookup(seq.num_tokens, seq.num_computed_tokens)
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)

    def _chunk_limit(self, step: _Step, seq: Sequence, joining: bool) -> tuple[int, bool]:
        """The most tokens `seq` may prefill now, and whether the long-prompt share bounds it."""
        want = min(seq.num_uncomputed_tokens, step.budget)
        if self.static or not self.config.length_buckets:
            return want, False  # (static batching admits nobody mid-batch: a cap would only waste)
        shorter_waiting = self.waiting.has_waiting_below(self.waiting.bucket(seq), seq.priority)
        shared = (
            self.config.long_prefill_share < 1.0
            and shorter_waiting
            # A shorter prompt is waiting; the cap only helps if it could be admitted this step.
            and len(self.running) + (1 if joining else 0) < self.config.max_num_seqs
        )
        if shared:
            want = max(0, min(want, step.long_budget))
        if want > 0 and self._is_long(seq) and (step.interactive or shorter_waiting):
            want = self._time_limit(step, seq, want, joining)
        elif want > 0 and seq.priority > step.recent and step.interactive:
            want = self._yield_limit(step, want)
        return want, shared

    # ---- the step-time budget --------------------------------------------------------------------

    @property
    def _time_budget_s(self) -> float | None:
        """The step-time budget, once the cost model can predict; None: token caps only."""
        if self.static or self.config.target_itl_ms <= 0 or not self.config.length_buckets:
            return None
        return self.config.target_itl_ms / 1000.0 if self.step_cost.cost is not None else None

    def _is_long(self, seq: Sequence) -> bool:
        """A prompt beyond the first length bucket: its chunks yield to interactive work."""
        buckets = self.config.length_buckets
        return bool(buckets) and seq.num_prompt_tokens > buckets[0]

    def _stalled(self, seq: Sequence) -> bool:
        """A long prompt still prefilling that has not progressed for the allowed number of steps."""
        last = self._long_progress.get(seq.seq_id)
        return last is not None and self._num_steps - last >= self.config.max_long_prefill_stall_steps

    def _time_limit(self, step: _Step, seq: Sequence, want: int, joining: bool) -> int:
        """`want` cut to what the step-time budget leaves beside what `step` already holds.

        A newcomer waits (0) while long prompts of its class or a higher one still prefill: they
        take the room first, and fewer prompts hold blocks half-computed. A stalled long prompt
        gets the floor (`min_long_prefill_chunk`) and no more: it is scheduled ahead of the
        admissions, before the step's room is known. Otherwise a chunk is what fits, and below the
        floor 0, except that the step's first long chunk gets the floor."""
        budget_s = self._time_budget_s
        cost = self.step_cost.cost
        if budget_s is None or cost is None:
            return want
        if joining and self._long_prefilling(seq.priority):
            return 0
        floor = self.config.min_long_prefill_chunk
        if self._stalled(seq):
            return min(want, floor)
        fits = cost.max_prefill_tokens(budget_s, len(step.decodes))
        if fits is None:
            return want
        fits -= step.num_prefill_tokens
        if fits >= floor:
            return min(want, fits)
        return min(want, floor) if step.num_long_prefills == 0 else 0

    def _lead_classes(self) -> tuple[int, int]:
        """The highest class with work now (running or waiting), and the highest that arrived within
        `RECENT_CLASS_S` (or is here now): the classes below them yield (module docstring)."""
        lead = min((int(s.priority) for s in self.running), default=len(Priority))
        waiting = self.waiting.top_class()
        lead = lead if waiting is None else min(lead, int(waiting))
        now = self.clock()
        recent = min((int(p) for p, t in self._arrived.items() if now - t <= RECENT_CLASS_S), default=lead)
        return lead, min(lead, recent)

    def _fits_decode(self, step: _Step) -> bool:
        """Whether one more decode row keeps `step` within the time budget (the batch class's own
        while it is set, with one batch row always let in)."""
        budget_s, cost = step.batch_budget_s or self._time_budget_s, self.step_cost.cost
        if budget_s is None or cost is None:
            return True
        batch_rows = (c for c in step.decodes if c.seq.priority is Priority.BATCH)
        if step.batch_budget_s is not None and next(batch_rows, None) is None:
            return True
        return cost.predict(step.num_prefill_tokens, len(step.decodes) + 1) <= budget_s

    def _batch_budget(self, step: _Step) -> float | None:
        """The step's predicted time with the interactive classes' work, plus BATCH_SLACK of it."""
        budget_s, cost = self._time_budget_s, self.step_cost.cost
        if budget_s is None or cost is None:
            return None
        return min(budget_s, cost.predict(step.num_prefill_tokens, len(step.decodes)) * (1 + BATCH_SLACK))

    def _stalled_decode(self, seq: Sequence) -> bool:
        """A yielding row that joins first (the stall bound); not for the batch class."""
        return seq.priority is not Priority.BATCH and self._decode_stalled(seq)

    def _decode_stalled(self, seq: Sequence) -> bool:
        last = self._decode_progress.get(seq.seq_id)
        return last is not None and self._num_steps - last >= self.config.max_yield_stall_steps

    def _yield_limit(self, step: _Step, want: int) -> int:
        """A lower class's chunk: cut to what the time budget leaves beside `step`; the step's first
        prefill gets the floor (`min_long_prefill_chunk`) even when nothing fits."""
        budget_s, cost = step.batch_budget_s or self._time_budget_s, self.step_cost.cost
        if budget_s is None or cost is None:
            return want
        fits = cost.max_prefill_tokens(budget_s, len(step.decodes))
        if fits is None:
            return want
        fits -= step.num_prefill_tokens
        if step.batch_budget_s is not None:
            return max(0, min(want, fits))  # the batch class gets no floor beside interactive work
        floor = self.config.min_long_prefill_chunk
        if fits >= floor:
            return min(want, fits)
        return min(want, floor) if step.num_prefill_tokens == 0 else 0

    def _long_prefilling(self, max_priority: Priority) -> bool:
        """Whether a long prompt of class <= `max_priority` is admitted and still prefilling."""
        return any(s.priority <= max_priority and s.is_prefilling and self._is_long(s) for s in self.running)

    def _fit_chunk(self, seq: Sequence, want: int, reserve: int) -> int:
        """The largest chunk <= `want` whose slots fit in `seq`'s blocks plus the free ones."""
        bs = self.blocks.block_size
        capacity = (len(seq.block_table) + max(0, self.blocks.num_free_blocks - reserve)) * bs
        return max(0, min(want, capacity - seq.num_computed_tokens))

    # ---- preemption ------------------------------------------------------------------------------

    def _priority_victims(self, seq: Sequence) -> list[Sequence]:
        if self.static:
            return []
        bound = self.config.max_preemptions_per_seq
        return [
            s
            for s in self.running
            if s.priority > seq.priority
            and (s.num_preemptions < bound or s.priority is Priority.BATCH)
            and s is not seq
        ]

    def _evict_for(self, step: _Step, seq: Sequence) -> bool:
        """Preempt the lowest-ranked lower-class sequence for `seq`; False if there is none."""
        victims = self._priority_victims(seq)
        if not victims:
            return False
        victim = max(victims, key=_rank)
        step.drop(victim, self._is_long(victim))
        self._preempt(victim)
        step.preempted.append(victim)
        self.num_priority_preemptions += 1
        step.admit_below = min(step.admit_below, int(victim.priority))
        return True

    def _evict_for_fairness(self, step: _Step, priority: Priority) -> Sequence | None:
        """All slots are taken: if a waiting sequence of `priority` belongs to a fairness key (tenant)
        that runs at least two fewer sequences of the class than the heaviest key, preempt that
        key's newest sequence and return the waiting one, to be admitted out of turn; else None.

        So a tenant's first request does not wait for another tenant's to finish. Bounded like
        priority preemption (`max_preemptions_per_seq`); each swap moves the two keys toward an
        equal share, so it cannot ping-pong. Costs one pass over the waiting queue."""
        if self.static:
            return None
        counts: dict[str, int] = {}
        for s in self.running:
            if s.priority == priority:
                counts[s.fairness_key] = counts.get(s.fairness_key, 0) + 1
        bound = self.config.max_preemptions_per_seq
        movable = [s for s in self.running if s.priority == priority and s.num_preemptions < bound]
        if not movable:
            return None
        heaviest = max(counts[s.fairness_key] for s in movable)
        waiting = next(
            (
                s
                for s in self.waiting
                if s.priority == priority and counts.get(s.fairness_key, 0) <= heaviest - 2
            ),
            None,
        )
        if waiting is None:
            return None
        victim = max((s for s in movable if counts[s.fairness_key] == heaviest), key=_rank)
        step.drop(victim, self._is_long(victim))
        self._preempt(victim)
        step.preempted.append(victim)
        self.num_fairness_preemptions += 1
        return waiting

    def _preempt_for_priority(self, step: _Step, seq: Sequence, want: int, reserve: int) -> int:
        """Preempt lower-class sequences until `seq` fits `want` tokens (or none is left to take);
        returns the chunk that fits then. Nobody is preempted if even all of them would not help."""
        victims = self._priority_victims(seq)
        if not victims:
            return self._fit_chunk(seq, want, reserve)
        bs = self.blocks.block_size
        reclaimable = sum(self.blocks.reclaimable(v) for v in victims)
        best = (len(seq.block_table) + max(0, self.blocks.num_free_blocks + reclaimable - reserve)) * bs
        if min(want, best - seq.num_computed_tokens) <= self._fit_chunk(seq, want, reserve):
            return self._fit_chunk(seq, want, reserve)
        chunk = self._fit_chunk(seq, want, reserve)
        while chunk < want and self._evict_for(step, seq):
            chunk = self._fit_chunk(seq, want, reserve)
        return chunk

    def _preempt_for_memory(self, step: _Step, seq: Sequence) -> int:
        """Preempt lower-ranked unscheduled sequences until `seq` can compute at least one token."""
        chunk = 0
        while chunk == 0:
            candidates = [s for s in self.running if s.seq_id not in step.chunks and _rank(s) > _rank(seq)]
            if not candidates:
                return 0
            victim = max(candidates, key=_rank)
            self._preempt(victim)
            step.preempted.append(victim)
            step.memory_preempted = True
            chunk = self._fit_chunk(seq, min(seq.num_uncomputed_tokens, step.budget), reserve=0)
        return chunk

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        self._long_progress.pop(seq.seq_id, None)
        self._decode_progress.pop(seq.seq_id, None)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(seq)

    # ---- static batching ----------------------------------------------------------------------------

    def _may_join_batch(self, seq: Sequence) -> bool:
        if seq.seq_id in self._batch_members:
            return True  # a member preempted for memory comes back
        return self._batch_open and self._batch_size < self.config.max_num_seqs

    def _join_batch(self, seq: Sequence) -> None:
        if seq.seq_id not in self._batch_members:
            self._batch_members.add(seq.seq_id)
            self._batch_size += 1
            if self._batch_size >= self.config.max_num_seqs:
                self._batch_open = False

    # ---- grammars, deadlines and progress ------------------------------------------------------------

    def _start_compiled(self) -> tuple[tuple[Sequence, GrammarError], ...]:
        """Queue the sequences whose grammar is compiled, each with its own parser state; take out
        those whose compile failed (FINISHED_ERROR), returned with the failure."""
        failed = []
        for seq in [s for s in self.compiling if s.grammar_compile is None or s.grammar_compile.done()]:
            self.compiling.remove(seq)
            error = seq.start_grammar()
            if error is not None:
                seq.status = SequenceStatus.FINISHED_ERROR
                failed.append((seq, error))
            else:
                self.add(seq)
        return tuple(failed)

    def _expire_waiting(self) -> list[Sequence]:
        """Take out the waiting sequences past their deadline that never started (a preempted one
        has started: it is never expired). Costs O(expired log n), not O(waiting)."""
        now = self.clock()
        expired = []
        while self._deadlines and self._deadlines[0][0] < now:
            _, _, seq = heapq.heappop(self._deadlines)
            if seq.started or seq.status != SequenceStatus.WAITING:
                continue  # admitted, aborted or already expired since it was queued
            self.waiting.remove(seq)
            seq.status = SequenceStatus.FINISHED_ERROR
            expired.append(seq)
        return expired

    def update(self, output: SchedulerOutput) -> None:
        """Advance progress after the forward pass ran `output`."""
        for chunk in output.chunks:
            chunk.seq.num_computed_tokens += chunk.num_tokens
            self.blocks.register_full_blocks(chunk.seq)
            if not chunk.seq.finished:
                self._decode_progress[chunk.seq.seq_id] = self._num_steps
        for chunk in output.prefills:
            seq = chunk.seq
            if self._is_long(seq) and seq.is_prefilling and not seq.finished:
                self._long_progress[seq.seq_id] = self._num_steps
            else:
                self._long_progress.pop(seq.seq_id, None)
