"""The engine's counters and rates, and the two snapshots it publishes from them: `EngineStats`
(metrics, health) and `LoadSnapshot` (what an arrival's queue-deadline estimate reads)."""

from __future__ import annotations

import threading
from collections import deque

from engine.deadlines import LoadSnapshot, RunningLoad, ServiceMeter
from engine.lora import LoraRegistry, LoraSlots
from engine.scheduler.interface import SchedulerInterface
from engine.speculative.speculator import SpeculationStats
from engine.step import SchedulerOutput
from engine.types import EngineStats, Priority, StepStage

# The output-token rate is measured over the steps of this many last seconds.
_THROUGHPUT_WINDOW_S = 10.0


class EngineCounters:
    """What the engine counts as it runs: steps, step failures by stage, refusals by reason, the
    service rates (`meter`) and the recent output-token rate. Engine thread only, except the
    refusals: counted on the engine thread (expiry) and on callers' threads (at arrival)."""

    def __init__(
        self,
        scheduler: SchedulerInterface,
        loras: LoraRegistry,
        lora_slots: LoraSlots,
        speculation: SpeculationStats | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.loras = loras
        self.lora_slots = lora_slots
        self.speculation = speculation if speculation is not None else SpeculationStats()
        self.meter = ServiceMeter()
        self.num_steps = 0  # steps that ran a batch
        self.last_batch_size = 0
        self.step_failures = dict.fromkeys(StepStage, 0)
        self._recent: deque[tuple[float, int]] = deque()
        self._recent_tokens = 0  # the sum of `_recent`'s token counts (stats() runs every step)
        self._refusals: dict[str, int] = {}
        self._refusals_lock = threading.Lock()

    def count_batch(self, out: SchedulerOutput) -> None:
        """A step is about to run `out`'s batch."""
        self.num_steps += 1
        self.last_batch_size = len(out.chunks)

    def count_refusal(self, reason: str) -> None:
        with self._refusals_lock:
            self._refusals[reason] = self._refusals.get(reason, 0) + 1

    def refusal_counts(self) -> dict[str, int]:
        """Refusals by reason so far; safe from any thread."""
        with self._refusals_lock:
            return dict(self._refusals)

    def record_step(self, elapsed_s: float, now: float, out: SchedulerOutput, num_sampled: int) -> None:
        """A step that ran `out` took `elapsed_s` and sampled `num_sampled` tokens, ending at `now`."""
        self.meter.record_step(
            elapsed_s, sum(c.num_tokens for c in out.prefills), sum(c.num_tokens for c in out.decodes)
        )
        self._recent.append((now, num_sampled))
        self._recent_tokens += num_sampled
        while self._recent and self._recent[0][0] < now - _THROUGHPUT_WINDOW_S:
            self._recent_tokens -= self._recent.popleft()[1]

    def stats(self) -> EngineStats:
        """A snapshot of queues, rates and counters; engine thread only.

        Cost is independent of the number of waiting requests (the queue keeps counters).
        """
        scheduler = self.scheduler
        blocks = scheduler.blocks
        running = scheduler.running
        waiting = scheduler.waiting
        span = (self._recent[-1][0] - self._recent[0][0]) if len(self._recent) > 1 else 0.0
        return EngineStats(
            num_running=len(running),
            num_waiting=len(waiting),
            num_free_blocks=blocks.num_free_blocks,
            num_total_blocks=blocks.num_blocks,
            block_size=blocks.block_size,
            output_tokens_per_s=(self._recent_tokens / span) if span > 0 else 0.0,
            num_preemptions=scheduler.num_preemptions,
            num_waiting_tokens=sum(waiting.tokens_by_priority().values())
            + sum(s.num_uncomputed_tokens for s in running if s.is_prefilling),
            num_running_tokens=sum(s.sampling.max_tokens - s.num_output_tokens for s in running),
            waiting_by_priority=waiting.count_by_priority(),
            running_by_priority={
                p.name.lower(): sum(1 for s in running if s.priority == p) for p in Priority
            },
            refusals_by_reason=self.refusal_counts(),
            last_batch_size=self.last_batch_size,
            total_steps=self.num_steps,
            waiting_by_bucket=waiting.count_by_bucket(),
            waiting_by_priority_and_bucket=waiting.count_by_priority_and_bucket(),
            num_priority_preemptions=scheduler.num_priority_preemptions,
            num_fairness_preemptions=scheduler.num_fairness_preemptions,
            prefill_tokens_per_s=self.meter.prefill_tokens_per_s,
            decode_steps_per_s=self.meter.decode_steps_per_s,
            batching=scheduler.config.batching,
            prefix_cache_queried_tokens=blocks.num_queried_tokens,
            prefix_cache_hit_tokens=blocks.num_hit_tokens,
            step_failures_by_stage={stage.value: n for stage, n in self.step_failures.items()},
            lora_bytes=self.loras.nbytes,
            loras_resident=tuple(a.name for a in self.lora_slots.resident()),
            num_waiting_for_adapter=len(scheduler.parked),
            spec_drafts=self.speculation.num_verified_drafts,
            spec_draft_tokens=self.speculation.num_draft_tokens,
            spec_accepted_tokens=self.speculation.num_accepted_tokens,
            spec_accepted_per_draft=tuple(self.speculation.accepted_histogram),
        )

    def load_snapshot(self) -> LoadSnapshot:
        """What the arrival estimate needs, frozen; engine thread only."""
        waiting, config = self.scheduler.waiting, self.scheduler.config
        return LoadSnapshot(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            seconds_per_token=self.meter.seconds_per_token,
            seconds_per_step=self.meter.seconds_per_step,
            completion_ratio=self.meter.completion_ratio,
            waiting_by_key=waiting.count_by_key(),
            waiting_tokens=waiting.tokens_by_priority(),
            waiting_decode_tokens=waiting.decode_tokens_by_priority(),
            running=tuple(
                RunningLoad(
                    s.priority,
                    s.num_uncomputed_tokens if s.is_prefilling else 0,
                    max(0, s.sampling.max_tokens - s.num_output_tokens),
                )
                for s in self.scheduler.running
            ),
        )
