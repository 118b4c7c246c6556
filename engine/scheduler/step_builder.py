"""The batch under construction: what a step has scheduled so far and what is left of its budgets.

The scheduler fills one `StepBuilder` per step (decodes, then prefill chunks and admissions), asks
it how much room is left, and gives a priority victim's tokens back with `drop`; the step's
`SchedulerOutput` is what it holds at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.scheduler.step_cost import context_pairs
from engine.sequence import Sequence
from engine.step import ScheduledChunk
from engine.types import Priority


@dataclass
class StepBuilder:
    """The step being built: what is scheduled so far and what is left of the budgets."""

    budget: int  # tokens left of max_num_batched_tokens
    long_budget: int  # tokens left to long prompts' chunks while shorter prompts wait
    decodes: list[ScheduledChunk] = field(default_factory=list)
    prefills: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    chunks: dict[tuple[str, int], ScheduledChunk] = field(default_factory=dict)
    long_chunks: dict[tuple[str, int], int] = field(default_factory=dict)  # against long_budget
    num_prefill_tokens: int = 0
    num_context_pairs: int = 0  # the prefill chunks' query-key pairs (what their attention costs)
    num_short_prefills: int = 0  # prefill chunks of prompts within the first length bucket
    num_long_prefills: int = 0  # and of longer ones
    memory_preempted: bool = False
    admit_below: int = len(Priority)  # only classes below this may be admitted (priority preemption)
    admitting: bool = True
    # Classes below these yield to the step-time budget (engine/scheduler/budget.py): decodes below
    # `lead`, the highest class with work now; prefill chunks below `recent`, the highest seen lately.
    lead: int = len(Priority)
    recent: int = len(Priority)
    # The batch class's own step-time budget while interactive work is in the step (BATCH_SLACK).
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
            self.num_context_pairs += context_pairs(chunk.seq.num_computed_tokens, chunk.num_tokens)
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
            self.num_context_pairs -= context_pairs(chunk.seq.num_computed_tokens, chunk.num_tokens)
            if long:
                self.num_long_prefills -= 1
            else:
                self.num_short_prefills -= 1

    @property
    def interactive(self) -> bool:
        """Something in this step is latency-bound: a stream decoding or a short prompt prefilling."""
        return bool(self.decodes) or self.num_short_prefills > 0
