"""The step-time budget (`target_itl_ms`; 0 turns it off): steps no slower than the target while
others are interactive, and lower classes yielding to higher ones under it.

Every running stream gets one token per step, so a step's duration is its streams' inter-token
latency. A long prompt (beyond the first length bucket) must therefore not make a step slower than
the target while others are interactive: while this step decodes anything or prefills a short
prompt, or shorter prompts wait, a long prompt's chunk is cut to what the step-cost model
(step_cost.py, fitted online to the step times the engine reports) predicts still fits the target
beside them (`time_limit`). Within a class, running short prompts' chunks and admissions come
before running long prompts' chunks, so short prompts take the step's room first; a long newcomer
waits while a long prompt of its class (or a higher one) still prefills. Against starvation: the
first long chunk of a step gets at least `min_long_prefill_chunk` tokens even when nothing fits,
and a long prompt that has not progressed for `max_long_prefill_stall_steps` steps is scheduled
ahead of the admissions with that many (`long_prefill_stalled`). Within a class, a long prompt
also leaves the step to the tenants served fewer tokens lately than its own (`LATELY_DECAY`): a
step that carries a prompt of theirs (its first token) carries no chunk of it, and while their
streams decode, or while they were served lately at all, it fits FAIR_STEP_SHARE of the budget
(with a floor of CROWDED_MIN_CHUNK tokens), so their next first token waits for a shorter step in
flight (`Crowding`); a step that completes a short prompt of theirs carries no decodes of the more
served tenants either (continuous.py, within the yield stall bound), and one more of their short
prompts joins a step that already completes prompts of the class only while that delays those
first tokens less in all than it saves its own (`sharing_delays_more`): where a prompt's prefill
is compute-bound (on a CPU) a burst of them goes in turns, a first token a step, and the
closed-loop clients that sent it no longer stay in lockstep. When nothing else is
interactive and no other tenant of the class was served lately, long prefill takes the whole token
budget. Until the cost model has seen enough steps
with prefill, only the token caps apply.

Lower classes yield under the same budget, so a paid request does not wait for free work on a CPU
where every row lengthens the step: while a higher class has work in the step (running or
waiting), a lower class's decodes are scheduled after the higher classes' prefills and admissions,
and join only while the step is predicted within the target (`fits_decode`); a row left out waits
(keeps its blocks) and joins first, regardless, once it has waited `max_yield_stall_steps` steps
(`yield_stalled`). While a higher class has arrived in the last `RECENT_CLASS_S` seconds, a lower
class's prefill chunks (short prompts too) are cut to what the target leaves beside the step's
decodes (`yield_limit`), so the step a paid arrival waits for is short as well (a step's first such
chunk gets `min_long_prefill_chunk` tokens even when nothing fits). With one class only, nothing
yields. The batch class has a tighter budget of its own while paid or free work is in the step:
that work's predicted time plus `BATCH_SLACK` of it (at least one batch row decodes; its prefill
chunks get no floor), and no stall-bound turns, so a batch cannot slow interactive streams to its
pace.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from engine.config import SchedulerConfig
from engine.scheduler.buckets import is_long
from engine.scheduler.step_builder import StepBuilder
from engine.scheduler.step_cost import StepCostModel, context_pairs
from engine.sequence import Sequence
from engine.step import SchedulerOutput
from engine.types import Priority

# How long an arrival of a class makes lower classes keep their prefill chunks within the step-time
# budget: a paid request that comes back within this time finds short steps.
RECENT_CLASS_S = 30.0

# While paid or free work is in a step, Batch API rows may lengthen it by at most this fraction
# (and at least one batch row decodes), so interactive streams keep ~1/(1 + BATCH_SLACK) of their
# pace; batch rows do not take the stall bound's turns. Alone, the batch takes the whole budget.
BATCH_SLACK = 0.15

# While tenants of its class served fewer tokens lately than its own have streams in the step, or
# were served lately at all, a long prompt's chunk fits this share of the budget: the first token
# of their next prompt, which comes at random and waits for the step in flight, waits less. 0.3
# and not 0.5: a light tenant's random arrivals' TTFT beside a heavy one went from 3.1-3.5x its
# TTFT alone to 1.5-2.3x, the heavy tenant keeping over half the tokens; 0.2 did no better
# (docs/BENCHMARKS.md, fair shares).
FAIR_STEP_SHARE = 0.3

# The floor of a crowded long prompt's chunk (when nothing fits FAIR_STEP_SHARE, or it stalled),
# below `min_long_prefill_chunk`: deep in a long context each of a chunk's tokens attends to all
# before it, and 32 tokens at 2,000 took 75-85 ms on 2 cores, over the whole share. It still
# progresses every step it runs.
CROWDED_MIN_CHUNK = 8

# Who is served less "lately" (the crowding above): tokens each tenant's sequences computed, the
# past's weight decaying by this much a step (a time constant of ~100 steps). Not the turns' virtual
# counters (fair_share.py): those lift a tenant that starts waiting to the others' level, so right
# after a light tenant's prompt its counter leads the heavy tenant's and could not tell them apart.
LATELY_DECAY = 0.99


class Crowding(enum.Enum):
    """Tenants of a long prompt's class served fewer tokens lately than its own, in the step being built."""

    NONE = "none"
    LATELY = "lately"  # none in it, but one was served lately: its next prompt may come any time
    DECODES = "decodes"  # their streams decode in it
    PROMPT = "prompt"  # a prompt of theirs prefills in it: its first token waits on the step


class StepTimeBudget:
    """The budget's state (the cost model, the step count, each sequence's last progress, each
    class's last arrival) and the limits it sets on a step being built. The scheduler tells it what
    happens (`begin_step`, `note_arrival`, `note_progress`, `forget`, `observe`) and asks it."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.step_cost = StepCostModel()  # trained by the engine's step times (`observe`)
        self.num_steps = 0  # steps scheduled so far
        # The step in which each running sequence last ran a chunk, and each long prompt still
        # prefilling; when each class last arrived (the scheduler's clock).
        self._last_run: dict[tuple[str, int], int] = {}
        self._long_last_run: dict[tuple[str, int], int] = {}
        self._arrived: dict[Priority, float] = {}
        self._lately: dict[tuple[Priority, str], tuple[float, int]] = {}  # tokens, as of which step

    # ---- what happened ------------------------------------------------------------------------

    def begin_step(self) -> None:
        self.num_steps += 1

    def note_arrival(self, priority: Priority, now: float) -> None:
        self._arrived[priority] = now

    def observe(self, output: SchedulerOutput, seconds: float) -> None:
        """The measured duration of the step that ran `output`: trains the step-cost model."""
        self.step_cost.observe(
            seconds, output.num_prefill_tokens, output.num_decode_rows, output.num_context_pairs
        )

    def note_progress(self, output: SchedulerOutput) -> None:
        """After the forward pass ran `output` (its sequences' progress already advanced)."""
        for chunk in output.chunks:
            key = (chunk.seq.priority, chunk.seq.fairness_key)
            self._lately[key] = (self._served_lately(key) + chunk.num_tokens, self.num_steps)
        if len(self._lately) > 64 and self.num_steps % 64 == 0:  # not a pass over every key each step
            for key in [k for k in self._lately if self._served_lately(k) < 1.0]:
                del self._lately[key]  # bounded by the tenants served in the last few hundred steps
        for chunk in output.chunks:
            if not chunk.seq.finished:
                self._last_run[chunk.seq.seq_id] = self.num_steps
        for chunk in output.prefills:
            seq = chunk.seq
            if self._is_long(seq) and seq.is_prefilling and not seq.finished:
                self._long_last_run[seq.seq_id] = self.num_steps
            else:
                self._long_last_run.pop(seq.seq_id, None)

    def forget(self, seq: Sequence) -> None:
        """`seq` stopped running (finished or preempted)."""
        self._long_last_run.pop(seq.seq_id, None)
        self._last_run.pop(seq.seq_id, None)

    def _served_lately(self, key: tuple[Priority, str]) -> float:
        tokens, step = self._lately.get(key, (0.0, self.num_steps))
        return float(tokens * LATELY_DECAY ** (self.num_steps - step))

    def served_lately(self, seq: Sequence) -> float:
        """Tokens `seq`'s tenant was served in its class lately (LATELY_DECAY)."""
        return self._served_lately((seq.priority, seq.fairness_key))

    def less_served_lately(self, seq: Sequence, than: Sequence) -> bool:
        """Whether `seq`'s tenant is another of `than`'s class, served fewer tokens lately."""
        return (
            seq.priority == than.priority
            and seq.fairness_key != than.fairness_key
            and self.served_lately(seq) < self.served_lately(than)
        )

    def others_served_less_lately(self, seq: Sequence) -> bool:
        """Whether another tenant of `seq`'s class was served lately, fewer tokens than `seq`'s."""
        mine = self.served_lately(seq)
        return any(
            1.0 <= self._served_lately(other) < mine
            for other in self._lately
            if other[0] == seq.priority and other[1] != seq.fairness_key
        )

    # ---- what it allows -------------------------------------------------------------------------

    @property
    def budget_s(self) -> float | None:
        """The step-time budget, once the cost model can predict; None: token caps only."""
        if self.config.target_itl_ms <= 0 or not self.config.length_buckets:
            return None
        return self.config.target_itl_ms / 1000.0 if self.step_cost.cost is not None else None

    def _is_long(self, seq: Sequence) -> bool:
        return is_long(seq.num_prompt_tokens, self.config.length_buckets)

    def long_prefill_stalled(self, seq: Sequence) -> bool:
        """A long prompt still prefilling that has not progressed for the allowed number of steps."""
        last = self._long_last_run.get(seq.seq_id)
        return last is not None and self.num_steps - last >= self.config.max_long_prefill_stall_steps

    def yield_stalled(self, seq: Sequence) -> bool:
        """A yielding decode row left out for `max_yield_stall_steps` steps: it joins first, whatever
        the budget says. Never the batch class's."""
        if seq.priority is Priority.BATCH:
            return False
        last = self._last_run.get(seq.seq_id)
        return last is not None and self.num_steps - last >= self.config.max_yield_stall_steps

    def lead_classes(
        self, running: Iterable[Sequence], top_waiting: Priority | None, now: float
    ) -> tuple[int, int]:
        """The highest class with work now (running, or `top_waiting`), and the highest that arrived
        within `RECENT_CLASS_S` (or is here now): the classes below them yield."""
        lead = min((int(s.priority) for s in running), default=len(Priority))
        lead = lead if top_waiting is None else min(lead, int(top_waiting))
        recent = min((int(p) for p, t in self._arrived.items() if now - t <= RECENT_CLASS_S), default=lead)
        return lead, min(lead, recent)

    def time_limit(
        self,
        step: StepBuilder,
        seq: Sequence,
        want: int,
        joining: bool,
        running: Iterable[Sequence],
        crowded: Crowding = Crowding.NONE,
    ) -> int:
        """`want` cut to what the step-time budget leaves beside what `step` already holds (a long
        prompt's chunk).

        A newcomer waits (0) while long prompts of its class or a higher one still prefill (in
        `running`): they take the room first, and fewer prompts hold blocks half-computed. A stalled
        long prompt gets the floor (`min_long_prefill_chunk`) and no more: it is scheduled ahead of
        the admissions, before the step's room is known. `crowded`: tenants of its class served
        fewer tokens lately than `seq`'s have work in the step, or were served lately: their
        prompt's first token waits for no chunk of `seq` (0), else `seq` fits FAIR_STEP_SHARE of the
        budget, and the floor is CROWDED_MIN_CHUNK. Otherwise a chunk is what fits, and below the
        floor 0, except that the step's first long chunk gets the floor."""
        budget_s = self.budget_s
        cost = self.step_cost.cost
        if budget_s is None or cost is None:
            return want
        if joining and any(
            s.priority <= seq.priority and s.is_prefilling and self._is_long(s) for s in running
        ):
            return 0
        floor = self.config.min_long_prefill_chunk
        if crowded is not Crowding.NONE:
            floor = min(floor, CROWDED_MIN_CHUNK)
        if self.long_prefill_stalled(seq):
            return min(want, floor)
        if crowded is Crowding.PROMPT:
            return 0
        if crowded is not Crowding.NONE:
            budget_s *= FAIR_STEP_SHARE
        fits = self._fits(step, budget_s, seq)
        if fits is None:
            return want
        if fits >= floor:
            return min(want, fits)
        return min(want, floor) if step.num_long_prefills == 0 else 0

    def _fits(self, step: StepBuilder, budget_s: float, seq: Sequence) -> int | None:
        """The tokens of `seq`'s next chunk that keep `step` predicted within `budget_s`."""
        cost = self.step_cost.cost
        assert cost is not None
        held = (len(step.decodes), step.num_prefill_tokens, step.num_context_pairs)
        return cost.max_prefill_tokens(budget_s, *held, context=seq.num_computed_tokens)

    def yield_limit(self, step: StepBuilder, seq: Sequence, want: int) -> int:
        """A lower class's chunk: cut to what the time budget leaves beside `step`; the step's first
        prefill gets the floor (`min_long_prefill_chunk`) even when nothing fits."""
        budget_s, cost = step.batch_budget_s or self.budget_s, self.step_cost.cost
        if budget_s is None or cost is None:
            return want
        fits = self._fits(step, budget_s, seq)
        if fits is None:
            return want
        if step.batch_budget_s is not None:
            return max(0, min(want, fits))  # the batch class gets no floor beside interactive work
        floor = self.config.min_long_prefill_chunk
        if fits >= floor:
            return min(want, fits)
        return min(want, floor) if step.num_prefill_tokens == 0 else 0

    def sharing_delays_more(self, step: StepBuilder, firsts: int, seq: Sequence, tokens: int) -> bool:
        """Whether `tokens` of `seq`'s prompt, completing it in `step`, would delay the `firsts`
        first tokens the step already completes by more in all than sharing the step saves `seq`:
        the next step's cost besides its prompt (the fixed cost, and the decode rows, which run
        there too)."""
        cost = self.step_cost.cost
        if self.budget_s is None or cost is None:
            return False
        pairs = context_pairs(seq.num_computed_tokens, tokens)
        added = cost.per_prefill_token_s * tokens + cost.per_context_pair_s * pairs
        return firsts * added > cost.fixed_s + cost.per_decode_row_s * len(step.decodes)

    def fits_decode(self, step: StepBuilder) -> bool:
        """Whether one more decode row keeps `step` within the time budget (the batch class's own
        while it is set, with one batch row always let in)."""
        budget_s, cost = step.batch_budget_s or self.budget_s, self.step_cost.cost
        if budget_s is None or cost is None:
            return True
        batch_rows = (c for c in step.decodes if c.seq.priority is Priority.BATCH)
        if step.batch_budget_s is not None and next(batch_rows, None) is None:
            return True
        predicted = cost.predict(step.num_prefill_tokens, len(step.decodes) + 1, step.num_context_pairs)
        return predicted <= budget_s

    def batch_budget(self, step: StepBuilder) -> float | None:
        """The step's predicted time with the interactive classes' work, plus BATCH_SLACK of it."""
        budget_s, cost = self.budget_s, self.step_cost.cost
        if budget_s is None or cost is None:
            return None
        work = cost.predict(step.num_prefill_tokens, len(step.decodes), step.num_context_pairs)
        return min(budget_s, work * (1 + BATCH_SLACK))
