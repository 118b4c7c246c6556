"""Where drafts pay: the step's drafts chosen from measured step times and each sequence's
measured acceptance, their KV slots, their grammar masks, and what they bought.

A decode step's time is measured by its row count (`StepTimes`: a step's rows share one pass
over the weights, but the kernels' tiles and threads make the cost a staircase, not a line). A
sequence's j-th draft token is accepted with probability about alpha ** j (alpha: its acceptance
so far, `Acceptance`) and costs one row. The step takes the draft rows best first and stops at the
count that gives the most expected tokens per second: a lone stream with a good draft verifies
many tokens, a full batch (every row costs) none, and a sequence whose drafts keep failing stops
drafting until its estimate recovers. Row counts not yet measured are estimated optimistically
(PRIOR_ROW_SHARE), so they are tried once and then known.

Only decode-only steps get drafts: a step with a prompt chunk is priced by the scheduler's own
budget (engine/scheduler/budget.py), and its decodes then ride on the chunk's pass anyway.
"""

from __future__ import annotations

import bisect
import heapq
import math
import weakref
from dataclasses import dataclass, field, replace

import torch

from engine.block_manager import BlockManager
from engine.config import SpeculativeConfig
from engine.grammar.interface import allocate_bitmask
from engine.grammar.mask import closing_due
from engine.sequence import Sequence
from engine.speculative.proposers import PredictionLookup, PromptLookup
from engine.step import ScheduledChunk, SchedulerOutput, StepResult

# A row count not measured yet: each row beyond the nearest measured count below costs this share
# of the smallest step's time (optimistic: a count that costs more is measured once and avoided).
PRIOR_ROW_SHARE = 0.1
# Acceptance before a sequence has verified anything (accepted, compared): a prediction is
# usually right; prompt lookup finds repeats less surely.
PRIOR_PREDICTION = (4.0, 5.0)
PRIOR_LOOKUP = (1.0, 2.0)
# Weight the past keeps at each verification: acceptance follows what the output does now.
ACCEPTANCE_DECAY = 0.8
# Weight a row count's time keeps at each new step of that count (contexts grow, load changes),
# and the decode steps after which a count not run since is measured afresh.
TIME_DECAY = 0.8
STALE_STEPS = 256


class StepTimes:
    """Decode-only step seconds by row count (exponentially weighted); unmeasured counts estimated.
    A count not run for STALE_STEPS steps counts as unmeasured again: a time taken while the machine
    was busy elsewhere would otherwise keep its count, and the drafts it needs, off for good."""

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}
        self._last: dict[int, int] = {}  # the step each count last ran at
        self._steps = 0

    def observe(self, seconds: float, rows: int) -> None:
        if not math.isfinite(seconds) or seconds <= 0:
            return  # a clock that does not move (tests) measures nothing
        self._steps += 1
        old = self._seconds.get(rows)
        self._seconds[rows] = seconds if old is None else TIME_DECAY * old + (1.0 - TIME_DECAY) * seconds
        self._last[rows] = self._steps

    def estimate(self, rows: int) -> float | None:
        """A `rows`-row step's seconds: measured, or between the measured counts around it, or
        beyond the largest at PRIOR_ROW_SHARE a row; None before any step was measured."""
        fresh = sorted(r for r, at in self._last.items() if self._steps - at < STALE_STEPS)
        if not fresh:
            return None
        if rows in self._seconds and rows in fresh:
            return self._seconds[rows]
        i = bisect.bisect_left(fresh, rows)
        per_row = PRIOR_ROW_SHARE * self._seconds[fresh[0]]
        if i == 0:
            return max(self._seconds[fresh[0]] - per_row * (fresh[0] - rows), per_row)
        below = fresh[i - 1]
        optimistic = self._seconds[below] + per_row * (rows - below)
        if i < len(fresh):
            return min(optimistic, self._seconds[fresh[i]])
        return optimistic


@dataclass
class Acceptance:
    """A sequence's draft tokens accepted of those compared (decayed): alpha, the chance the next
    draft token is accepted given the ones before it were."""

    accepted: float
    compared: float

    @property
    def alpha(self) -> float:
        return self.accepted / self.compared

    def update(self, accepted: int, proposed: int) -> None:
        compared = accepted + (1 if accepted < proposed else 0)
        self.accepted = ACCEPTANCE_DECAY * self.accepted + accepted
        self.compared = ACCEPTANCE_DECAY * self.compared + compared


class _State:
    """One sequence's draft sources and acceptance of each."""

    def __init__(self, seq: Sequence) -> None:
        p = seq.sampling
        self.prediction = PredictionLookup(p.prediction) if p.prediction else None
        self.lookup = PromptLookup()
        self.by_prediction = Acceptance(*PRIOR_PREDICTION)
        self.by_lookup = Acceptance(*PRIOR_LOOKUP)
        self.source: Acceptance | None = None  # the source of the draft in flight

    def best_alpha(self) -> float:
        return max(self.by_prediction.alpha if self.prediction else 0.0, self.by_lookup.alpha)

    def propose(self, seq: Sequence, k: int) -> tuple[list[int], Acceptance]:
        if self.prediction is not None:
            draft = self.prediction.propose(seq.token_ids, seq.num_prompt_tokens, k)
            if draft:
                return draft, self.by_prediction
        return self.lookup.propose(seq.token_ids, seq.num_prompt_tokens, k), self.by_lookup


@dataclass
class SpeculationStats:
    """Totals since start (engine thread writes, a snapshot reads)."""

    num_verified_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Verified drafts by how many of their tokens were accepted (index: 0..num_speculative_tokens).
    accepted_histogram: list[int] = field(default_factory=list)


class Speculator:
    def __init__(self, config: SpeculativeConfig, blocks: BlockManager, max_model_len: int) -> None:
        self.enabled = config.enable_speculative_decoding
        self.always = config.speculate_always
        self.max_draft = config.num_speculative_tokens
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.times = StepTimes()
        # The most draft rows one step adds (beyond them the step is far from memory-bound).
        self.max_rows = 4 * config.num_speculative_tokens
        self._states: weakref.WeakKeyDictionary[Sequence, _State] = weakref.WeakKeyDictionary()
        self.stats = SpeculationStats(accepted_histogram=[0] * (self.max_draft + 1))

    # ---- before the forward pass --------------------------------------------------------------

    def plan(self, out: SchedulerOutput) -> SchedulerOutput:
        """`out` with drafts on the decodes where they pay (`out` itself where none does)."""
        if not self.enabled or not out.decodes or out.prefills:
            return out
        base = len(out.decodes)
        seconds = self.times.estimate(base)
        if seconds is None:
            if not self.always:
                return out  # nothing measured yet
            seconds = 1.0
        # The least acceptance a first draft token needs: the cheapest extra row's share of the step.
        extra = self.times.estimate(base + 1) or seconds
        bar = -1.0 if self.always else max(extra - seconds, 0.0) * base / seconds
        states = [self._state(c.seq) if c.seq.sampling.speculative else None for c in out.decodes]
        if all(s is None or s.best_alpha() <= bar for s in states):
            return out
        drafts: dict[int, tuple[list[int], Acceptance]] = {}
        heap: list[tuple[float, int, int]] = []  # (-alpha ** j, decode index, j) of each draft token
        for i, (chunk, state) in enumerate(zip(out.decodes, states, strict=True)):
            if state is None or state.best_alpha() <= bar:
                continue
            draft, source = state.propose(chunk.seq, self._room(chunk.seq))
            draft = self._grammar_prefix(chunk.seq, draft)
            if draft:
                drafts[i] = (draft, source)
                heapq.heappush(heap, (-source.alpha, i, 1))
        # Draft rows best first; keep the count with the most expected tokens per second.
        taken: list[tuple[int, int]] = []
        tokens, best_rate, best = float(base), base / seconds, 0
        while heap and len(taken) < self.max_rows:
            gain, i, j = heapq.heappop(heap)
            taken.append((i, j))
            tokens -= gain
            step_s = self.times.estimate(base + len(taken)) or seconds
            if self.always or tokens / step_s > best_rate:
                best_rate, best = tokens / step_s, len(taken)
            draft, source = drafts[i]
            if j < len(draft):
                heapq.heappush(heap, (gain * source.alpha, i, j + 1))
        lengths: dict[int, int] = {}
        for i, j in taken[:best]:
            lengths[i] = max(lengths.get(i, 0), j)
        if not lengths:
            return out
        decodes = list(out.decodes)
        for i, k in lengths.items():
            draft, source = drafts[i]
            seq = decodes[i].seq
            k = min(k, self._room(seq))  # the drafts before it may have taken the free blocks
            if k == 0 or not self.blocks.allocate(seq, seq.num_tokens + k):
                continue
            state = states[i]
            assert state is not None
            state.source = source
            decodes[i] = ScheduledChunk(seq, 1, tuple(draft[:k]))
        return replace(out, decodes=tuple(decodes))

    def _state(self, seq: Sequence) -> _State:
        state = self._states.get(seq)
        if state is None:
            state = self._states[seq] = _State(seq)
        return state

    def _room(self, seq: Sequence) -> int:
        """How long `seq`'s draft may be: within max_tokens, the context, and the KV blocks it holds
        or can take without touching the last free one (drafts never preempt anything)."""
        room = min(
            self.max_draft,
            seq.sampling.max_tokens - seq.num_output_tokens - 1,
            self.max_model_len - seq.num_tokens - 1,
        )
        if room <= 0:
            return 0
        bs = self.blocks.block_size
        held = len(seq.block_table) * bs - seq.num_tokens
        spare = max(0, self.blocks.num_free_blocks - 1) * bs
        return max(0, min(room, held + spare))

    @staticmethod
    def _grammar_prefix(seq: Sequence, draft: list[int]) -> list[int]:
        """The longest prefix of `draft` that `seq`'s grammar accepts (all of it: no grammar)."""
        if seq.grammar is None or not draft:
            return draft
        return draft[: seq.grammar.valid_prefix(draft)]

    def bitmask(self, out: SchedulerOutput, vocab_size: int) -> torch.Tensor | None:
        """A drafted step's grammar mask, a row per logits row: row j of a constrained draft is its
        grammar's after the draft's first j tokens. None: no row is constrained."""
        sampled = [(c.seq, c.draft) for c in out.decodes] + [(c.seq, ()) for c in out.prefills if c.completes]
        if all(seq.grammar is None for seq, _ in sampled):
            return None
        bitmask = allocate_bitmask(sum(len(d) + 1 for _, d in sampled), vocab_size)
        row = 0
        for seq, draft in sampled:
            grammar = seq.grammar
            if grammar is None:
                row += len(draft) + 1
                continue
            for j in range(len(draft) + 1):
                grammar.fill_bitmask(
                    bitmask, row, closing_due(seq.sampling.max_tokens, seq.num_output_tokens + j)
                )
                row += 1
                if j < len(draft):
                    accepted = grammar.accept_token(draft[j])
                    assert accepted, "a draft is cut to its grammar's prefix when planned"
            grammar.rollback(len(draft))
        return bitmask

    # ---- after the step's outputs -------------------------------------------------------------

    def accepted(self, out: SchedulerOutput, result: StepResult) -> None:
        """Each drafted sequence's accepted draft tokens count as computed (their K/V was written by
        the pass); its acceptance and the totals learn from them."""
        for chunk, tokens in zip(out.decodes, result.tokens, strict=False):
            if not chunk.draft:
                continue
            seq, state = chunk.seq, self._states.get(chunk.seq)
            accepted = len(tokens) - 1
            stats = self.stats
            stats.num_verified_drafts += 1
            stats.num_draft_tokens += len(chunk.draft)
            stats.num_accepted_tokens += accepted
            stats.accepted_histogram[min(accepted, len(stats.accepted_histogram) - 1)] += 1
            seq.num_draft_tokens += len(chunk.draft)
            seq.num_accepted_tokens += accepted
            if state is not None and state.source is not None:
                state.source.update(accepted, len(chunk.draft))
                state.source = None
            if not seq.finished:
                seq.num_computed_tokens += accepted
                self.blocks.register_full_blocks(seq)
                self.blocks.trim(seq, seq.num_tokens)  # the rejected tokens' slots go back

    def prediction_matched(self, seq: Sequence) -> int:
        """Of `seq`'s predicted output, the tokens its output took so far (0: none drafted from it)."""
        state = self._states.get(seq)
        if state is None or state.prediction is None:
            return 0
        state.prediction.follow(seq.output_token_ids)
        return state.prediction.matched

    def observe(self, out: SchedulerOutput, seconds: float) -> None:
        """A step's measured time: decode-only steps train the step times."""
        if out.decodes and not out.prefills:
            self.times.observe(seconds, out.num_decode_rows)
