"""The embedding batcher's thread: it runs a `BatchPolicy` (engine/embeddings/policy.py) over a
model and hands the results to asyncio callers.

One model call runs at a time, on the batcher's own thread, beside (not inside) the generation
engine's loop. A model call that raises fails exactly the requests with inputs in that batch
(GenerationFailedError); the batcher goes on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from engine.embeddings.policy import BatchLimits, BatchPolicy, BatchRecord, Completion, EmbeddingRequest
from engine.loop_thread import LoopThread
from engine.types import EngineDeadError, EngineOverloadedError

logger = logging.getLogger(__name__)


class EmbeddingModelLike(Protocol):
    """What the batcher calls: one vector per input, in order (engine/embeddings/model.py)."""

    def embed(self, batch: list[list[int]]) -> list[list[float]]: ...


@dataclass
class BatcherStats:
    num_queued_inputs: int = 0
    busy: bool = False
    num_batches: int = 0
    num_failed_batches: int = 0
    refusals_by_reason: dict[str, int] = field(default_factory=dict)


class EmbeddingBatcher(LoopThread):
    """Runs a `BatchPolicy` over a model on its own thread; asyncio callers `await embed(...)`.

    `on_batch(record)` is called on the batcher thread after every model call, before its
    callers are answered (metrics; it must be quick: it runs under the batcher's lock).
    Cancelling `embed` (the client disconnected) drops the request's inputs that have not run.

    Give the `model`, or `build` to have it built on the batcher's own thread (`start()` waits
    for it and re-raises what building raised). Built on another thread that lives on (a
    loader's), its forwards are slower: that thread keeps an OpenMP team, and with more libgomp
    threads than CPUs every team stops spinning between parallel regions (docs/BENCHMARKS.md).
    The chat engine builds on its thread too.
    """

    def __init__(
        self,
        model: EmbeddingModelLike | None,
        limits: BatchLimits | None = None,
        *,
        on_batch: Callable[[BatchRecord], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        build: Callable[[], EmbeddingModelLike] | None = None,
    ) -> None:
        if (model is None) == (build is None):
            raise TypeError("EmbeddingBatcher needs a model or a build function, not both")
        super().__init__("batchgate-embeddings")
        self._model = model
        self._build = build
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self.policy = BatchPolicy(limits)
        self._on_batch = on_batch
        self._clock = clock
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[Completion]]] = {}
        self._stats = BatcherStats()

    def start(self) -> EmbeddingBatcher:
        """Start the batcher thread; with `build`, block until the model is built there."""
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error
        return self

    @property
    def model(self) -> EmbeddingModelLike:
        if self._model is None:
            raise RuntimeError("the embedding model is not built yet (call start())")
        return self._model

    @property
    def ready(self) -> bool:
        return self._thread.is_alive() and self._dead is None and not self._stopping

    def stats(self) -> BatcherStats:
        with self._lock:
            self._stats.num_queued_inputs = self.policy.num_queued_inputs
            self._stats.busy = self.policy.busy
            return BatcherStats(**vars(self._stats))

    async def embed(self, request: EmbeddingRequest) -> tuple[list[float], ...]:
        """The request's vectors in input order. Raises EngineOverloadedError at once when it
        could not start in time, EngineDeadError when the batcher is not running,
        GenerationFailedError when its batch failed."""
        if not self.ready:
            raise EngineDeadError(f"the embedding batcher is not running: {self._dead or 'shut down'}")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Completion] = loop.create_future()
        with self._lock:
            try:
                self.policy.add(request, self._clock())
            except EngineOverloadedError:
                reasons = self._stats.refusals_by_reason
                reasons["deadline_at_arrival"] = reasons.get("deadline_at_arrival", 0) + 1
                raise
            self._waiters[request.request_id] = (loop, future)
            self._wakeup.notify()
        try:
            completion = await future
        except asyncio.CancelledError:
            with self._lock:
                self._waiters.pop(request.request_id, None)
                self.policy.abort(request.request_id)
            raise
        if completion.error is not None:
            raise completion.error
        return completion.vectors

    def shutdown(self) -> None:
        self._stop_loop()

    def _run(self) -> None:
        if self._build is not None:
            try:
                self._model = self._build()
            except BaseException as exc:  # noqa: BLE001 - re-raised by start() on the caller's thread
                self._build_error = exc
                self._dead = exc
                self._built.set()
                return
        self._built.set()
        try:
            while True:
                with self._lock:
                    while True:
                        if self._stopping:
                            return
                        now = self._clock()
                        batch = self.policy.next_batch(now)
                        self._deliver(self.policy.take_completions())
                        if batch is not None:
                            break
                        wake = self.policy.wake_at()
                        self._wakeup.wait(None if wake is None else max(0.0, wake - now))
                    inputs = batch.inputs
                vectors: list[list[float]] | None = None
                error: BaseException | None = None
                try:
                    vectors = self.model.embed(inputs)
                except Exception as exc:  # noqa: BLE001 - fails this batch's requests; the loop goes on
                    logger.exception("embedding model call failed (%d inputs)", len(inputs))
                    error = exc
                with self._lock:
                    record = self.policy.finish(batch, vectors, self._clock(), error)
                    self._stats.num_batches += 1
                    self._stats.num_failed_batches += int(record.failed)
                    if self._on_batch is not None:  # before the callers hear: metrics lead results
                        try:
                            self._on_batch(record)
                        except Exception:  # noqa: BLE001 - metrics never stop the batcher
                            logger.exception("on_batch callback failed")
                    self._deliver(self.policy.take_completions())
        except BaseException as exc:  # noqa: BLE001 - the loop must not die silently
            logger.exception("embedding batcher died")
            self._dead = exc
        finally:
            with self._lock:
                self.policy.fail_all(EngineDeadError("the embedding batcher stopped"))
                self._deliver(self.policy.take_completions())

    def _deliver(self, completions: list[Completion]) -> None:
        """Hand completions to their callers' loops (holding the lock)."""
        for completion in completions:
            waiter = self._waiters.pop(completion.request_id, None)
            if waiter is None:
                continue
            loop, future = waiter
            try:
                loop.call_soon_threadsafe(_resolve, future, completion)
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                pass


def _resolve(future: asyncio.Future[Completion], completion: Completion) -> None:
    if not future.done():
        future.set_result(completion)
