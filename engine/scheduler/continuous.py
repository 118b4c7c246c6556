"""Continuous batching: iteration-level scheduling with priority classes, preemption for priority
and fair share, length buckets and the step-time budget.

A step, in order (core.py has the mechanics, budget.py the time budget, preemption.py the victims):

    decodes of the classes with work ahead of nobody (and of yielding rows stalled too long)
    for each class, highest first:
        (below the lead class) its decodes, while the step is predicted within the target
        its short prompts' chunks (and long prompts stalled too long) and its admissions, the
        least served tenants' first, then its other long prompts' chunks

Without the step-time budget (off, or before the cost model can predict) a class's running
prefills come before its admissions, and every decode goes first. A prefill chunk is capped by the
long-prompt share (buckets.py) and by the budget; a sequence that lacks a slot or blocks may
preempt a lower class's sequence, and a tenant far below its fair share of the slots another's.
Within a class, tenants share the step by work (fair_share.py): the prefill chunks of the tenants
served the fewest tokens go first, and a running prefill of a tenant served more tokens than the
next waiting sequence's waits until that one is admitted. A step that completes a short prompt of
a tenant served fewer tokens lately carries no decodes of its class's more served tenants, and
takes more short prompts of its class only while sharing the step saves their first tokens more
than it delays them (budget.py).
"""

from __future__ import annotations

from engine.scheduler.budget import Crowding
from engine.scheduler.core import SchedulerCore
from engine.scheduler.preemption import fair_share_swap, priority_victims, rank
from engine.scheduler.step_builder import StepBuilder
from engine.sequence import Sequence
from engine.types import Priority


class ContinuousScheduler(SchedulerCore):
    def _fill(self, step: StepBuilder) -> None:
        ranked = sorted(self.running, key=rank)
        budget = self.budget
        timed = budget.budget_s is not None
        if timed:
            step.lead, step.recent = budget.lead_classes(self.running, self.waiting.top_class(), self.clock())
        # Stalled rows of yielding classes go first too, so the budget's other users see them.
        first = [s for s in ranked if s.priority <= step.lead or budget.yield_stalled(s)]
        self._schedule_decodes(step, first)
        for priority in sorted(Priority):
            mine = [s for s in ranked if s.priority == priority]
            if not timed:
                self._prefills_and_admissions(step, priority, mine)
                continue
            if priority is Priority.BATCH and step.lead < priority:
                step.batch_budget_s = budget.batch_budget(step)
            if priority > step.lead:
                self._schedule_decodes(step, mine, yielding=True)
            # Short prompts (and long ones stalled too long) first, then admissions, then the
            # other long prompts' chunks, in what is left of the step.
            later = [s for s in mine if self._is_long(s) and not budget.long_prefill_stalled(s)]
            self._prefills_and_admissions(step, priority, [s for s in mine if s not in later])
            self._schedule_prefills(step, later)
        if timed and not step.preempted:
            self._leave_first_tokens(step)

    def _leave_first_tokens(self, step: StepBuilder) -> None:
        """A step that completes a short prompt (its first token) carries no decodes of tenants of
        its class served more than that prompt's: their streams wait one short step, its first token
        waits for none of their rows. A row left out `max_yield_stall_steps` times stays. Not in the
        batch class: no first token of it is awaited, and its rows have no stall bound."""
        firsts = self._first_tokens(step)
        if not firsts:
            return
        less = self.budget.less_served_lately
        for chunk in list(step.decodes):
            if any(less(f, chunk.seq) for f in firsts) and not self.budget.yield_stalled(chunk.seq):
                step.drop(chunk.seq, long=False)

    def _first_tokens(self, step: StepBuilder) -> list[Sequence]:
        """The short prompts `step` completes (their first tokens are awaited), the batch class's
        aside."""
        return [
            c.seq
            for c in step.prefills
            if c.completes and not self._is_long(c.seq) and c.seq.priority is not Priority.BATCH
        ]

    def _first_token_waits(self, step: StepBuilder, seq: Sequence, want: int) -> bool:
        """A short prompt of a tenant served less lately than another of its class with work running
        (whose work keeps the steps coming) joins a step that already completes prompts of its
        class only while that costs their first tokens less than it saves its own (budget.py,
        `sharing_delays_more`): on a CPU a prompt's prefill is compute-bound, so a burst of the
        light tenant's prompts goes in turns, each first token after one short step."""
        if seq.priority is Priority.BATCH or self._is_long(seq) or want < seq.num_uncomputed_tokens:
            return False
        firsts = sum(1 for f in self._first_tokens(step) if f.priority == seq.priority)
        if firsts == 0 or not any(self.budget.less_served_lately(seq, s) for s in self.running):
            return False
        return self.budget.sharing_delays_more(step, firsts, seq, want)

    def _prefills_and_admissions(self, step: StepBuilder, priority: Priority, mine: list[Sequence]) -> None:
        """The class's running prefills (of `mine`) and its admissions, by fair share: prefills of
        the least served tenants first, and those of tenants served more than the next waiting
        sequence's tenant after the admissions that are served less than them."""
        served = self.waiting.served
        prefilling = sorted((s for s in mine if s.is_prefilling), key=lambda s: (served(s), rank(s)))
        head = self.waiting.peek(priority)
        bound = None if head is None else served(head)
        ahead = [s for s in prefilling if bound is None or served(s) <= bound]
        behind = prefilling[len(ahead) :]
        self._schedule_prefills(step, ahead)
        if behind:
            self._admit(step, priority, max_served=served(behind[0]))
            self._schedule_prefills(step, behind)
        self._admit(step, priority)

    def _chunk_limit(self, step: StepBuilder, seq: Sequence, joining: bool) -> tuple[int, bool]:
        want = min(seq.num_uncomputed_tokens, step.budget)
        if not self.config.length_buckets:
            return want, False
        shorter_waiting = self.waiting.has_waiting_below(self.waiting.bucket(seq), seq.priority)
        shared = (
            self.config.long_prefill_share < 1.0
            and shorter_waiting
            # A shorter prompt is waiting; the cap only helps if it could be admitted this step.
            and len(self.running) + (1 if joining else 0) < self.config.max_num_seqs
        )
        if shared:
            want = max(0, min(want, step.long_budget))
        long = want > 0 and self._is_long(seq)
        crowded = self._crowding(step, seq) if long else Crowding.NONE
        if long and (step.interactive or shorter_waiting or crowded is not Crowding.NONE):
            want = self.budget.time_limit(step, seq, want, joining, self.running, crowded)
        elif want > 0 and seq.priority > step.recent and step.interactive:
            want = self.budget.yield_limit(step, seq, want)
        return want, shared

    def _crowding(self, step: StepBuilder, seq: Sequence) -> Crowding:
        """What tenants of `seq`'s class served fewer tokens lately than its tenant have in `step`,
        or whether one was served lately (its next prompt may come during the step)."""
        others = [c for c in step.chunks.values() if self.budget.less_served_lately(c.seq, seq)]
        if any(c.seq.is_prefilling for c in others):
            return Crowding.PROMPT
        if others:
            return Crowding.DECODES
        return Crowding.LATELY if self.budget.others_served_less_lately(seq) else Crowding.NONE

    # ---- preemption for priority and fair share --------------------------------------------------

    def _fit_or_evict(self, step: StepBuilder, seq: Sequence, want: int, reserve: int) -> int:
        """Preempt lower-class sequences until `seq` fits `want` tokens (or none is left to take);
        returns the chunk that fits then. Nobody is preempted if even all of them would not help."""
        victims = priority_victims(self.running, seq, self.config.max_preemptions_per_seq)
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

    def _claim_slot(
        self, step: StepBuilder, seq: Sequence, priority: Priority
    ) -> tuple[Sequence, bool] | None:
        """A lower class's slot for `seq`, else a slot by fair share for another waiting sequence of
        its class (admitted out of turn), else None."""
        if self._evict_for(step, seq):
            return seq, False
        self.blocks.release_cached_prefix(seq)
        swap = fair_share_swap(self.running, self.waiting, priority, self.config.max_preemptions_per_seq)
        if swap is None:
            return None
        victim, newcomer = swap
        self._evict(step, victim)
        self.num_fairness_preemptions += 1
        return newcomer, True

    def _evict_for(self, step: StepBuilder, seq: Sequence) -> bool:
        """Preempt the lowest-ranked lower-class sequence for `seq`; False if there is none."""
        victims = priority_victims(self.running, seq, self.config.max_preemptions_per_seq)
        if not victims:
            return False
        victim = max(victims, key=rank)
        self._evict(step, victim)
        self.num_priority_preemptions += 1
        step.admit_below = min(step.admit_below, int(victim.priority))
        return True

    def _evict(self, step: StepBuilder, victim: Sequence) -> None:
        """Preempt `victim`, even if already scheduled this step (its tokens go back to the step)."""
        step.drop(victim, self._is_long(victim))
        self._preempt(victim)
        step.preempted.append(victim)
