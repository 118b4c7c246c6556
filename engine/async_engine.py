"""AsyncEngine: the engine loop in its own thread, so an asyncio server never waits on the model.

Callers `submit()` from the event loop and iterate the returned stream; the loop thread drains
submissions and aborts before each step (so an abort takes effect at the next iteration), runs the
step, and hands each step's outputs to the callers' event loops in one `call_soon_threadsafe`.
Stats are published as a snapshot after every step, so `stats()` never touches live state.

Queue deadlines at arrival: `submit()` estimates the request's wait from the latest published load
snapshot plus the requests accepted since (`PendingWork`), under the same lock that enqueues it, and
raises EngineOverloadedError at once when it could not start in time (see engine/deadlines.py).

Liveness: a fault in a step is contained by the engine (engine/output_processor.py); anything else that
escapes the loop ends it, fails every pending request, and `health()` then says the engine is
dead. The loop also keeps a heartbeat, the last time it made progress, so `health()` can tell a
stuck loop (a step that never returns, a loop that spins without scheduling anything) from an
idle one; what counts as stuck is the caller's setting (`EngineHealth.problem`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from engine.config import EngineConfig
from engine.deadlines import PendingWork
from engine.grammar.interface import CompiledGrammar
from engine.llm_engine import LLMEngine
from engine.loop_thread import LoopThread
from engine.lora import LoraAdapter
from engine.types import (
    DuplicateRequestError,
    EngineDeadError,
    EngineError,
    EngineHealth,
    EngineStats,
    FinishReason,
    GenerationFailedError,
    GenerationRequest,
    GrammarSpec,
    RequestOutput,
)

logger = logging.getLogger(__name__)

DELIVERY_WAIT_S = 0.02  # the longest the engine waits for the event loop between steps


class RequestStream(AsyncIterator[RequestOutput]):
    """The outputs of one request, all choices interleaved; ends after every choice finished.

    Closing it early (`aclose()`, e.g. on client disconnect) aborts the request in the engine.
    """

    def __init__(self, engine: AsyncEngine, request: GenerationRequest) -> None:
        self.request_id = request.request_id
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._num_choices = request.sampling.n
        self._num_finished = 0
        self.loop = asyncio.get_running_loop()

    @property
    def done(self) -> bool:
        return self._num_finished >= self._num_choices

    def _put(self, output: RequestOutput) -> None:
        self._queue.put_nowait(output)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        output = await self._queue.get()
        if output.finished:
            self._num_finished += 1
            if self.done:
                self._engine._forget(self.request_id)
        return output

    async def aclose(self) -> None:
        if not self.done:
            self._engine.abort(self.request_id)
            self._num_finished = self._num_choices
            self._engine._forget(self.request_id)


class AsyncEngine(LoopThread):
    def __init__(self, engine: LLMEngine, clock: Callable[[], float] | None = None) -> None:
        """`clock`: for the heartbeat (tests move it by hand); the engine's own by default."""
        super().__init__("batchgate-engine")
        self.engine = engine
        self.model_name = engine.model_name
        self.model_type = engine.spec.model_type
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self._incoming: list[GenerationRequest] = []
        self._aborts: list[str] = []
        self._streams: dict[str, RequestStream] = {}
        self._stats = engine.stats()
        self._load = engine.load_snapshot()
        self._pending = PendingWork()  # accepted, not yet in the published `_load`
        # The heartbeat (see `health`): when the loop last made progress, whether it is waiting
        # for work, and since when submitted requests have waited for it to take them.
        self._clock = clock or engine.clock
        self._beat = self._clock()
        self._idle = True
        self._incoming_since: float | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        """Load the model (blocking) and start the engine thread.

        The engine is built on the thread that then runs it: oneDNN/OpenMP set up per-thread state
        while the weights are packed, and steps run on another thread were measurably slower."""
        built: dict[str, Any] = {}
        ready, go = threading.Event(), threading.Event()

        def engine_thread() -> None:
            try:
                built["engine"] = LLMEngine(config)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                built["error"] = exc
                return
            finally:
                ready.set()
            go.wait()
            if built.get("self") is not None:
                built["self"]._run()

        thread = threading.Thread(target=engine_thread, name="batchgate-engine", daemon=True)
        thread.start()
        ready.wait()
        if "error" in built:
            raise built["error"]
        try:
            self = cls(built["engine"])
            self._thread = thread
            built["self"] = self
        finally:
            go.set()  # with no "self" (the constructor raised) the thread just ends
        return self

    def start(self) -> None:
        """Start the loop thread of an engine given to the constructor (from_config starts its own)."""
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self._down_reason() is None

    def _down_reason(self) -> str | None:
        """Why the loop is not running (no exception text: callers and probes see this), or None."""
        if self._dead is not None:
            return f"the engine loop died ({type(self._dead).__name__}); see the server log"
        if self._stopping:
            return "the engine was shut down"
        if self.engine.failure is not None:
            return "a tensor-parallel rank failed; see the server log"
        if not self._thread.is_alive():
            return "the engine loop is not running"
        return None

    def health(self) -> EngineHealth:
        """Liveness from the loop's heartbeat; from any thread, never waits for the engine.

        `stalled_s` counts from the later of the loop's last progress (a step that ran a batch or
        ended a request, or it ran out of work) and the oldest submission it has not taken yet; it
        is 0 while the loop waits for work with none submitted."""
        reason = self._down_reason()
        if reason is not None:
            return EngineHealth(alive=False, reason=reason)
        since = self._incoming_since
        if self._idle and since is None:
            return EngineHealth(alive=True)
        start = self._beat if since is None else max(self._beat, since)
        return EngineHealth(alive=True, stalled_s=max(0.0, self._clock() - start))

    @property
    def stopping(self) -> bool:
        """Whether shutdown() was called (an engine that stops without it has failed)."""
        return self._stopping

    @property
    def failure_reason(self) -> str | None:
        """Why the engine stopped on its own, for the server log: its loop's error, or a
        tensor-parallel rank's failure."""
        if self._dead is not None:
            return f"{type(self._dead).__name__}: {self._dead}"
        return self.engine.failure

    def stats(self) -> EngineStats:
        # Refusals at arrival happen on callers' threads, between snapshots: count them live.
        return dataclasses.replace(self._stats, refusals_by_reason=self.engine.refusal_counts())

    # ---- caller side (event loop thread) ------------------------------------------------------

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Validate and enqueue; raise at once (too long, overloaded, dead) instead of streaming.

        EngineOverloadedError (with `retry_after_s`) when the estimated wait, from the published
        snapshot, exceeds the request's queue deadline; it costs microseconds, not a step.
        """
        reason = self._down_reason()
        if reason is not None:
            raise EngineDeadError(f"the engine is not running: {reason}")
        self.engine.validate(request)
        stream = RequestStream(self, request)
        with self._lock:
            if request.request_id in self._streams:
                raise DuplicateRequestError(f"request_id {request.request_id!r} is already in the engine")
            self.engine.check_arrival(request, self._load, self._pending)
            self._pending.add(request)
            self._streams[request.request_id] = stream
            if not self._incoming:
                self._incoming_since = self._clock()
            self._incoming.append(request)
            self._wakeup.notify()
        return stream

    def grammar(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """`spec` compiled off the engine thread (cached); await it with asyncio.wrap_future. The
        gateway does, before admission, so a bad schema is a 400 that never reaches the engine."""
        return self.engine.grammar(spec)

    # LoRA adapters: the registry is thread-safe (engine/lora.py); slots change on the engine thread.

    def loras(self) -> dict[str, LoraAdapter]:
        return self.engine.loras.names()

    def lora_bytes(self) -> int:
        return self.engine.loras.nbytes

    def resolve_lora(self, name: str) -> LoraAdapter:
        return self.engine.loras.get(name)

    def load_lora(self, name: str, path: str) -> LoraAdapter:
        return self.engine.load_lora(name, path)

    def unload_lora(self, name: str, wait: bool = True) -> Future[None]:
        return self.engine.loras.unload(name, wait)

    def abort(self, request_id: str) -> None:
        """Abort at the next iteration; its blocks are freed then. Unknown ids are ignored."""
        with self._lock:
            self._aborts.append(request_id)
            self._wakeup.notify()

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def shutdown(self) -> None:
        self._stop_loop()
        self.engine.close()

    # ---- engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while (
                        not self._stopping
                        and not self._incoming
                        and not self._aborts
                        and not self.engine.has_unfinished()
                    ):
                        self._idle = True
                        self._wakeup.wait()
                    if self._idle:  # woken with work: the heartbeat counts from now
                        self._beat = self._clock()
                        self._idle = False
                    if self._stopping:
                        break
                    incoming, self._incoming = self._incoming, []
                    self._incoming_since = None
                    aborts, self._aborts = self._aborts, []
                num_steps = self.engine.num_steps
                outputs: list[RequestOutput] = []
                for request in incoming:
                    outputs.extend(self._add(request))
                for request_id in aborts:
                    outputs.extend(self.engine.abort_request(request_id))
                outputs.extend(self.engine.step())
                if outputs or self.engine.num_steps != num_steps or not self.engine.has_unfinished():
                    self._beat = self._clock()
                self._stats = self.engine.stats()
                load = self.engine.load_snapshot()
                with self._lock:  # the snapshot now shows what was drained before this step
                    self._load = load
                    for request in incoming:
                        self._pending.remove(request)
                delivered = self._deliver(outputs)
                # Let the event loop turn this step's outputs into SSE writes before the next step
                # starts: both at once put a third busy thread on a small machine, and the step's
                # OpenMP ops stall on a descheduled partner. Bounded: a busy loop never holds it long.
                delivered.wait(DELIVERY_WAIT_S)
        except BaseException as exc:  # noqa: BLE001 - the loop must not die silently
            logger.exception("engine loop died")
            self._dead = exc
        finally:
            self._fail_all()

    def _add(self, request: GenerationRequest) -> list[RequestOutput]:
        try:
            self.engine.add_request(request)
            return []
        except Exception as exc:  # noqa: BLE001 - validated at submit; a late failure ends the request
            if isinstance(exc, EngineError):
                error: EngineError = exc
            else:  # its text stays in the log
                logger.exception("adding request %s to the engine failed", request.request_id)
                error = GenerationFailedError.for_request(request.request_id)
            return [
                RequestOutput(
                    request.request_id,
                    i,
                    (),
                    "",
                    len(request.prompt_token_ids),
                    0,
                    FinishReason.ERROR,
                    error=error,
                )
                for i in range(request.sampling.n)
            ]

    def _deliver(self, outputs: list[RequestOutput]) -> threading.Event:
        """Hand `outputs` to their streams' event loops; the event is set once every loop has run
        the callbacks that the hand-off woke (the streams' consumers), or at once if none."""
        done = threading.Event()
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]]
        by_loop = defaultdict(list)
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    by_loop[stream.loop].append((stream, out))
        remaining = [len(by_loop)]
        ack_lock = threading.Lock()

        def ack() -> None:
            with ack_lock:
                remaining[0] -= 1
                if remaining[0] <= 0:
                    done.set()

        if not by_loop:
            done.set()
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items, loop, ack)
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                ack()
        return done

    def _fail_all(self) -> None:
        """On shutdown or death, every pending request ends with an error, never silence."""
        error = EngineDeadError("the engine stopped")
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            items = [
                (stream, RequestOutput(stream.request_id, i, (), "", 0, 0, FinishReason.ERROR, error=error))
                for i in range(stream._num_choices)
            ]
            try:
                stream.loop.call_soon_threadsafe(_put_all, items, stream.loop, lambda: None)
            except RuntimeError:
                pass


def _put_all(
    items: list[tuple[RequestStream, RequestOutput]], loop: asyncio.AbstractEventLoop, ack: Callable[[], None]
) -> None:
    for stream, out in items:
        stream._put(out)
    loop.call_soon(_ack_when_idle, loop, ack, 0)


def _ack_when_idle(loop: asyncio.AbstractEventLoop, ack: Callable[[], None], hops: int) -> None:
    """Call `ack` once the callbacks that the puts set off have run: an output passes through a
    few tasks (stream -> merged outputs -> SSE frame -> socket write), one loop pass each. Goes by
    the loop's ready queue where it is visible (asyncio's), else waits a fixed number of passes."""
    ready = getattr(loop, "_ready", None)
    busy = bool(ready) if ready is not None else hops < 4
    if busy and hops < 8:
        loop.call_soon(_ack_when_idle, loop, ack, hops + 1)
    else:
        ack()
