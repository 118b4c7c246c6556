"""Dynamic batching for an embedding model: when a batch closes and what goes into it.

The classic policy for fixed-cost models (Triton's dynamic batcher, Clipper): callers wait while
their inputs queue; a batch closes when it is full (`max_batch_inputs` inputs, or no more queued
input fits in `max_batch_tokens` padded tokens), or when its oldest input has waited `max_wait_s`,
whichever comes first, and a request that finds the model idle and the queue empty runs at once:
it does not wait for company.

Choosing a batch (`BatchPolicy.next_batch`), within the queue window (the oldest
`window_inputs` inputs, paid before free):

    anchor = the oldest input of the best class (so nothing starves)
    grow around it in length order, taking the shorter or the longer neighbour, whichever adds
    fewer padding tokens, while the batch stays within both limits; then the next class, likewise

so a batch holds inputs of similar lengths (little padding). A request with more inputs than a
batch holds is split across batches and reassembled in order. Queue deadlines: a request that
could not start in time, by the measured seconds per padded token and the work queued ahead, is
refused at arrival with EngineOverloadedError (the chat path's fast 503); one whose deadline
passes in the queue before any of its inputs ran gets the same. A failed model call fails exactly
the requests with inputs in that batch (GenerationFailedError).

Pure policy: no torch, no threads, time passed in; tested with a fake model and an injected clock.
engine/embeddings/batcher.py runs it on a thread.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from engine.deadlines import DEADLINE_MARGIN
from engine.types import (
    DuplicateRequestError,
    EngineError,
    EngineOverloadedError,
    GenerationFailedError,
    InvalidRequestError,
    Priority,
)

logger = logging.getLogger(__name__)

_SPT_WEIGHT = 0.2  # weight of the latest batch in the seconds-per-padded-token average


@dataclass(frozen=True)
class BatchLimits:
    """When a batch closes. Defaults: 100 inputs, 8192 padded tokens, 5 ms."""

    max_batch_inputs: int = 100
    max_batch_tokens: int = 8192  # inputs x the longest of them
    max_wait_s: float = 0.005
    window_inputs: int = 400  # queued inputs (oldest first) a batch is chosen from, by length

    def __post_init__(self) -> None:
        if self.max_batch_inputs < 1:
            raise ValueError(f"max_batch_inputs must be >= 1, got {self.max_batch_inputs}")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        if not self.max_wait_s >= 0:
            raise ValueError(f"max_wait_s must be >= 0, got {self.max_wait_s}")
        if self.window_inputs < self.max_batch_inputs:
            raise ValueError("window_inputs must be >= max_batch_inputs")


@dataclass(frozen=True)
class EmbeddingRequest:
    """What a caller submits: token ids per input (non-empty, within the model's window)."""

    request_id: str
    inputs: tuple[tuple[int, ...], ...]
    priority: Priority = Priority.PAID
    # Seconds from arrival by which its first input must have started; None: no deadline.
    queue_deadline_s: float | None = None


@dataclass(frozen=True)
class Completion:
    """The end of one request: its vectors in input order, or the error that ended it."""

    request_id: str
    vectors: tuple[list[float], ...] = ()
    error: EngineError | None = None


@dataclass(frozen=True)
class BatchRecord:
    """What one model call did, for metrics: sizes, each input's queue wait and the call's time."""

    num_inputs: int
    num_tokens: int  # real tokens
    num_padded_tokens: int
    queue_wait_s: tuple[float, ...]
    model_s: float
    failed: bool


@dataclass(eq=False)
class _Request:
    request: EmbeddingRequest
    arrival: float
    results: list[list[float] | None]
    num_done: int = 0
    started: bool = False


@dataclass(frozen=True, eq=False)
class _Item:
    owner: _Request
    index: int
    seq: int  # arrival order of the input (FIFO within a class)
    arrival: float

    @property
    def length(self) -> int:
        return len(self.owner.request.inputs[self.index])

    @property
    def key(self) -> tuple[int, int]:
        return (self.owner.request.priority, self.seq)


@dataclass(frozen=True)
class Batch:
    """One model call: the inputs it embeds, in the order the model gets them."""

    items: tuple[_Item, ...]
    started: float

    @property
    def inputs(self) -> list[list[int]]:
        return [list(item.owner.request.inputs[item.index]) for item in self.items]

    @property
    def num_padded_tokens(self) -> int:
        return len(self.items) * max(item.length for item in self.items)

    def request_ids(self) -> list[str]:
        return list(dict.fromkeys(item.owner.request.request_id for item in self.items))


class BatchPolicy:
    """The batcher's state and decisions; not thread-safe (the runner holds its lock).

    Protocol: `add` (may refuse), then repeatedly `next_batch(now)` -> run the batch -> `finish`;
    `wake_at()` says when `next_batch` may close a batch with no other event; `abort` drops a
    request's queued inputs; completed and failed requests collect in `take_completions()`.
    """

    def __init__(self, limits: BatchLimits | None = None) -> None:
        self.limits = limits or BatchLimits()
        self._queue: list[_Item] = []  # kept sorted by (priority, seq)
        self._requests: dict[str, _Request] = {}
        self._seq = itertools.count()
        self._running: Batch | None = None
        self._run_now = False  # a request found the model idle and the queue empty
        self._completions: list[Completion] = []
        self.seconds_per_token: float | None = None  # per padded token, measured

    # -- arrivals ----------------------------------------------------------------------------

    def add(self, request: EmbeddingRequest, now: float) -> None:
        """Queue the request's inputs, or raise EngineOverloadedError when it could not start
        before its queue deadline (DuplicateRequestError for a request id already queued,
        InvalidRequestError for no inputs or an empty one)."""
        if request.request_id in self._requests:
            raise DuplicateRequestError(f"request_id {request.request_id!r} is already queued")
        if not request.inputs or any(not ids for ids in request.inputs):
            raise InvalidRequestError("every input must hold at least one token")
        deadline = request.queue_deadline_s
        if deadline is not None:
            wait = self.estimate_wait_s(request.priority, now)
            if wait is not None and wait > DEADLINE_MARGIN * deadline:
                raise EngineOverloadedError(
                    f"the embedding queue is too long to start within the {deadline:g} s queue deadline "
                    f"(estimated wait {wait:.2f} s); retry later",
                    retry_after_s=max(1.0, wait),
                )
        idle = self._running is None and not self._queue
        owner = _Request(request, now, [None] * len(request.inputs))
        self._requests[request.request_id] = owner
        for i in range(len(request.inputs)):
            self._queue.append(_Item(owner, i, next(self._seq), now))
        self._queue.sort(key=lambda item: item.key)
        if idle:
            self._run_now = True

    def abort(self, request_id: str) -> None:
        """Forget a request (its caller left): queued inputs are dropped, results of a running
        batch discarded. Unknown ids are ignored."""
        owner = self._requests.pop(request_id, None)
        if owner is not None:
            self._queue = [item for item in self._queue if item.owner is not owner]

    def estimate_wait_s(self, priority: Priority, now: float) -> float | None:
        """Seconds until a new request of `priority` would start: the running call's rest plus the
        tokens queued at its class or better, at the measured seconds per padded token; None
        before any call was measured (admit)."""
        spt = self.seconds_per_token
        if spt is None:
            return None
        # Batches are grouped by length, so the queue costs about its real tokens.
        ahead = sum(item.length for item in self._queue if item.owner.request.priority <= priority)
        wait = ahead * spt
        if self._running is not None:
            wait += max(0.0, self._running.num_padded_tokens * spt - (now - self._running.started))
        return wait

    # -- batches -----------------------------------------------------------------------------

    def next_batch(self, now: float) -> Batch | None:
        """The batch to run now, or None (the model is busy, the queue is empty, or the batch is
        neither full nor old enough). Requests whose deadline passed before they started end."""
        if self._running is not None:
            return None
        self._expire(now)
        if not self._queue:
            return None
        chosen = self._choose()
        full = len(chosen) < len(self._queue)
        oldest = min(item.arrival for item in self._queue)
        if not (self._run_now or full or now - oldest >= self.limits.max_wait_s):
            return None
        self._run_now = False
        taken = {id(item) for item in chosen}
        self._queue = [item for item in self._queue if id(item) not in taken]
        for item in chosen:
            item.owner.started = True
        self._running = Batch(tuple(chosen), now)
        return self._running

    def wake_at(self) -> float | None:
        """When the oldest queued input reaches the wait limit (None: nothing queued, or busy)."""
        if self._running is not None or not self._queue:
            return None
        if self._run_now:
            return float("-inf")
        return min(item.arrival for item in self._queue) + self.limits.max_wait_s

    def finish(
        self,
        batch: Batch,
        vectors: Sequence[list[float]] | None,
        now: float,
        error: BaseException | None = None,
    ) -> BatchRecord:
        """Record a finished model call: its vectors (in `batch.items` order), or the error that
        failed every request with an input in it."""
        assert batch is self._running, "finish() takes the batch next_batch() returned"
        self._running = None
        model_s = max(0.0, now - batch.started)
        failed = error is not None or vectors is None or len(vectors) != len(batch.items)
        if failed:
            if error is None:
                got = None if vectors is None else len(vectors)
                logger.error("embedding model returned %s vectors for %d inputs", got, len(batch.items))
            for request_id in batch.request_ids():
                if request_id in self._requests:
                    self.abort(request_id)
                    self._completions.append(
                        Completion(
                            request_id,
                            error=GenerationFailedError("the embedding model failed on this request's batch"),
                        )
                    )
        else:
            assert vectors is not None
            padded = batch.num_padded_tokens
            spt = model_s / padded
            prev = self.seconds_per_token
            self.seconds_per_token = spt if prev is None else prev + _SPT_WEIGHT * (spt - prev)
            for item, vector in zip(batch.items, vectors, strict=True):
                owner = item.owner
                if self._requests.get(owner.request.request_id) is not owner:
                    continue  # aborted while its batch ran
                owner.results[item.index] = vector
                owner.num_done += 1
                if owner.num_done == len(owner.results):
                    del self._requests[owner.request.request_id]
                    done = tuple(v for v in owner.results if v is not None)
                    self._completions.append(Completion(owner.request.request_id, vectors=done))
        return BatchRecord(
            num_inputs=len(batch.items),
            num_tokens=sum(item.length for item in batch.items),
            num_padded_tokens=batch.num_padded_tokens,
            queue_wait_s=tuple(batch.started - item.arrival for item in batch.items),
            model_s=model_s,
            failed=failed,
        )

    def take_completions(self) -> list[Completion]:
        out, self._completions = self._completions, []
        return out

    def fail_all(self, error: EngineError) -> None:
        """Every request still known ends with `error` (the batcher is stopping)."""
        for request_id in list(self._requests):
            self.abort(request_id)
            self._completions.append(Completion(request_id, error=error))

    @property
    def num_queued_inputs(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> bool:
        return self._running is not None

    # -- internals ---------------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        for owner in list(self._requests.values()):
            deadline = owner.request.queue_deadline_s
            if deadline is not None and not owner.started and now - owner.arrival > deadline:
                self.abort(owner.request.request_id)
                self._completions.append(
                    Completion(
                        owner.request.request_id,
                        error=EngineOverloadedError(
                            f"the request did not start within its {deadline:g} s queue deadline; "
                            "retry later",
                            retry_after_s=max(1.0, deadline),
                        ),
                    )
                )

    def _choose(self) -> list[_Item]:
        """Inputs of the next batch: grown around each class's oldest by least added padding."""
        limits = self.limits
        window = self._queue[: limits.window_inputs]
        chosen: list[_Item] = []
        longest = 0
        for priority in sorted({item.owner.request.priority for item in window}):
            members = [item for item in window if item.owner.request.priority == priority]
            anchor = members[0]  # the oldest of this class (the queue is sorted by class, then seq)
            by_length = sorted(members, key=lambda item: (item.length, item.seq))
            pos = by_length.index(anchor)
            if not self._fits(chosen, longest, anchor):
                break
            chosen.append(anchor)
            longest = max(longest, anchor.length)
            lo, hi = pos - 1, pos + 1
            while len(chosen) < limits.max_batch_inputs and (lo >= 0 or hi < len(by_length)):
                # Padding each side would add: a shorter input pads itself up to the longest; a
                # longer one pads every input already chosen up to it.
                cost_lo = longest - by_length[lo].length if lo >= 0 else None
                cost_hi = (by_length[hi].length - longest) * len(chosen) if hi < len(by_length) else None
                sides = sorted(
                    (cost, side) for cost, side in ((cost_lo, "lo"), (cost_hi, "hi")) if cost is not None
                )
                took = False
                for _, side in sides:
                    item = by_length[lo] if side == "lo" else by_length[hi]
                    if self._fits(chosen, longest, item):
                        chosen.append(item)
                        longest = max(longest, item.length)
                        if side == "lo":
                            lo -= 1
                        else:
                            hi += 1
                        took = True
                        break
                if not took:
                    break
            if len(chosen) >= limits.max_batch_inputs or len(chosen) < sum(
                1 for item in window if item.owner.request.priority <= priority
            ):
                break  # full, or this class did not all fit: lower classes wait
        return chosen

    def _fits(self, chosen: list[_Item], longest: int, item: _Item) -> bool:
        if not chosen:
            return True  # a batch always takes its first input, however long
        if len(chosen) + 1 > self.limits.max_batch_inputs:
            return False
        return (len(chosen) + 1) * max(longest, item.length) <= self.limits.max_batch_tokens
