"""Queue deadlines at arrival: estimate when a new request would start, from a published snapshot.

The estimate must be fast and safe off the engine thread, so it reads only a frozen `LoadSnapshot`
(published after every step) plus `PendingWork` (requests accepted since that snapshot), never the
live scheduler. It is deliberately simple and errs towards admitting: a request it lets in that then
cannot start in time is still refused, by expiry in the queue.

A new request of class c and fairness key k starts once

- the prompt tokens ahead of it are prefilled: waiting tokens of classes <= c (of class c only the
  share that round-robin between keys puts ahead of k), plus what running sequences of classes <= c
  still have to prefill, at the measured seconds per batched token; and
- a slot is free: with S = max_num_seqs slots, each busy slot frees after its running sequence's
  remaining tokens (scaled by the measured fraction of max_tokens that sequences really generate),
  and the n sequences ahead take the earliest free slots in turn; at the measured seconds per step.

Running sequences of lower classes are ignored: the scheduler preempts them for a higher class.
KV-block pressure is not modelled. Before anything has been measured, every request is admitted.
A request is refused when the estimate exceeds `DEADLINE_MARGIN` of its deadline: the estimate is
rough, and one admitted that then expires in the queue costs its caller the whole deadline instead
of a fast refusal.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.types import GenerationRequest, Priority

_RATIO_WEIGHT = 0.05  # weight of one finished sequence in the completion-ratio average
DEADLINE_MARGIN = 0.8  # refuse at arrival when the estimated wait exceeds this share of the deadline


@dataclass(frozen=True)
class RunningLoad:
    priority: Priority
    prefill_left: int  # tokens still to (re)compute before it decodes
    decode_left: int  # max_tokens minus tokens generated so far


@dataclass(frozen=True)
class LoadSnapshot:
    """What the arrival estimate needs from the engine, frozen after a step."""

    max_num_seqs: int
    max_num_batched_tokens: int
    seconds_per_token: float | None = None  # busy seconds per batched token, over recent steps
    seconds_per_step: float | None = None  # busy seconds per step, over recent steps
    completion_ratio: float = 1.0  # generated / max_tokens, averaged over finished sequences
    waiting_by_key: Mapping[Priority, Mapping[str, int]] = field(default_factory=dict)
    waiting_tokens: Mapping[Priority, int] = field(default_factory=dict)
    waiting_decode_tokens: Mapping[Priority, int] = field(default_factory=dict)
    running: tuple[RunningLoad, ...] = ()

    @property
    def measured(self) -> bool:
        return self.seconds_per_token is not None and self.seconds_per_step is not None


class PendingWork:
    """Requests accepted at arrival that the latest snapshot does not show yet (not thread-safe:
    the caller holds its own lock)."""

    def __init__(self) -> None:
        self.by_key: dict[Priority, dict[str, int]] = {p: {} for p in Priority}
        self.tokens = dict.fromkeys(Priority, 0)
        self.decode_tokens = dict.fromkeys(Priority, 0)

    def add(self, request: GenerationRequest, sign: int = 1) -> None:
        n = request.sampling.n
        by_key = self.by_key[request.priority]
        count = by_key.get(request.fairness_key, 0) + sign * n
        if count > 0:
            by_key[request.fairness_key] = count
        else:
            by_key.pop(request.fairness_key, None)
        self.tokens[request.priority] += sign * n * len(request.prompt_token_ids)
        self.decode_tokens[request.priority] += sign * n * request.sampling.max_tokens

    def remove(self, request: GenerationRequest) -> None:
        self.add(request, sign=-1)


class ServiceMeter:
    """Measured service rate over the last `max_steps` engine steps (busy time only, so an idle
    engine keeps its last measurement), and how much of max_tokens sequences really generate."""

    def __init__(self, max_steps: int = 128) -> None:
        self._steps: deque[tuple[float, int, int]] = deque(maxlen=max_steps)
        self.completion_ratio = 1.0

    def record_step(self, seconds: float, num_prefill_tokens: int, num_decode_tokens: int) -> None:
        self._steps.append((max(0.0, seconds), num_prefill_tokens, num_decode_tokens))

    def record_finish(self, num_output_tokens: int, max_tokens: int) -> None:
        ratio = min(1.0, num_output_tokens / max(1, max_tokens))
        self.completion_ratio += _RATIO_WEIGHT * (ratio - self.completion_ratio)

    def _sums(self) -> tuple[float, int, int, int]:
        busy = sum(s for s, _, _ in self._steps)
        prefill = sum(p for _, p, _ in self._steps)
        decode = sum(d for _, _, d in self._steps)
        return busy, prefill, decode, len(self._steps)

    @property
    def seconds_per_token(self) -> float | None:
        busy, prefill, decode, _ = self._sums()
        return busy / (prefill + decode) if busy > 0 and prefill + decode > 0 else None

    @property
    def seconds_per_step(self) -> float | None:
        busy, _, _, steps = self._sums()
        return busy / steps if busy > 0 and steps else None

    @property
    def prefill_tokens_per_s(self) -> float:
        busy, prefill, _, _ = self._sums()
        return prefill / busy if busy > 0 else 0.0

    @property
    def decode_steps_per_s(self) -> float:
        busy, _, _, steps = self._sums()
        return steps / busy if busy > 0 else 0.0


def estimate_wait_s(
    load: LoadSnapshot,
    priority: Priority,
    fairness_key: str = "",
    pending: PendingWork | None = None,
) -> float | None:
    """Seconds until a request of `priority` and `fairness_key` arriving now would start; None when
    nothing has been measured yet (admit)."""
    if load.seconds_per_token is None or load.seconds_per_step is None:
        return None
    num_ahead = 0.0
    tokens_ahead = 0.0
    decode_ahead = 0.0
    for p in Priority:
        if p > priority:
            continue
        counts = dict(load.waiting_by_key.get(p, {}))
        tokens = load.waiting_tokens.get(p, 0)
        decode = load.waiting_decode_tokens.get(p, 0)
        if pending is not None:
            for key, n in pending.by_key[p].items():
                counts[key] = counts.get(key, 0) + n
            tokens += pending.tokens[p]
            decode += pending.decode_tokens[p]
        total = sum(counts.values())
        if total <= 0:
            continue
        if p == priority:
            # Keys take turns: before this request's turn each other key gets at most as many
            # turns as this key has requests waiting, plus one.
            mine = counts.get(fairness_key, 0)
            n = sum(c if key == fairness_key else min(c, mine + 1) for key, c in counts.items())
        else:
            n = total
        num_ahead += n
        tokens_ahead += tokens * n / total
        decode_ahead += decode * n / total

    running = [r for r in load.running if r.priority <= priority]
    prefill_s = (tokens_ahead + sum(r.prefill_left for r in running)) * load.seconds_per_token

    ratio = max(0.0, min(1.0, load.completion_ratio))
    num_free = max(0, load.max_num_seqs - len(running))
    if num_ahead < num_free:
        slot_steps = 0.0
    else:
        mean_len = max(1.0, ratio * decode_ahead / num_ahead) if num_ahead else 1.0
        busy_until = [0.0] * num_free + [max(1.0, ratio * r.decode_left) for r in running]
        slot_steps = kth_start(busy_until, mean_len, int(num_ahead) + 1)
    return max(prefill_s, slot_steps * load.seconds_per_step)


def kth_start(busy_until: list[float], period: float, k: int) -> float:
    """When the k-th (1-based) of a line of equal jobs starts, each taking the earliest free slot.

    Slot j is free from `busy_until[j]`; a job occupies its slot for `period`. The k-th start is the
    smallest T at which sum_j (floor((T - busy_until[j]) / period) + 1) >= k, found by bisection.
    """
    if not busy_until:
        return math.inf
    lo, hi = min(busy_until), max(busy_until) + k * period

    def started_by(t: float) -> int:
        return sum(int((t - b) // period) + 1 for b in busy_until if b <= t)

    for _ in range(48):
        mid = (lo + hi) / 2
        if started_by(mid) >= k:
            hi = mid
        else:
            lo = mid
        if hi - lo < 1e-3 * period:
            break
    return hi
