"""The shape the engine's loop (engine/async_engine.py) and the embedding batcher
(engine/embeddings/batcher.py) share: a loop on its own daemon thread, woken through one condition."""

from __future__ import annotations

import threading


class LoopThread:
    """A lock, the condition on it that wakes the loop (`_wakeup`), the stop flag, the error that
    ended the loop (`_dead`, None while it runs) and the thread. A subclass implements `_run`, the
    loop, which returns once it sees `_stopping`; the thread is started by the subclass."""

    def __init__(self, thread_name: str) -> None:
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._stopping = False
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def _stop_loop(self, timeout_s: float = 30.0) -> None:
        """Set `_stopping`, wake the loop, and wait for its thread to end (at most `timeout_s`)."""
        with self._lock:
            self._stopping = True
            self._wakeup.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
