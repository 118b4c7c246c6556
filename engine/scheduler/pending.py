"""Sequences on their way into the waiting queue, and out of it by deadline.

A constrained sequence first waits for its grammar's compile (WAITING_FOR_GRAMMAR), a LoRA
sequence for a slot of its adapter (WAITING_FOR_ADAPTER), each list in arrival order; a queued or
running sequence holds its adapter's slot (engine/lora.py) until it finishes. A waiting sequence
that has not started by its deadline is taken out, for the engine to fail with a fast refusal.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING

from engine.scheduler.waiting_queue import WaitingQueue
from engine.sequence import Sequence, SequenceStatus
from engine.types import GrammarError

if TYPE_CHECKING:
    from engine.lora import LoraSlots


class Pending:
    """The grammar compiles and adapter slots sequences wait for, and the waiting ones' deadlines."""

    def __init__(self, loras: LoraSlots | None) -> None:
        self.loras = loras
        # Constrained sequences whose grammar still compiles: they join the waiting queue at the
        # first step after their compile is done.
        self.compiling: list[Sequence] = []
        # Sequences whose LoRA adapter has no slot yet.
        self.parked: list[Sequence] = []
        # Waiting sequences with a deadline, earliest first; entries of sequences that have started
        # or finished since are dropped when they reach the top.
        self._deadlines: list[tuple[float, int, Sequence]] = []
        self._deadline_order = itertools.count()

    def hold(self, seq: Sequence) -> bool:
        """Hold `seq` back (True) while its grammar compiles or its adapter has no slot; else it
        has its adapter's slot and may be queued (False)."""
        if seq.grammar_compile is not None:
            seq.status = SequenceStatus.WAITING_FOR_GRAMMAR
            self.compiling.append(seq)
            return True
        if not self._take_slot(seq):
            seq.status = SequenceStatus.WAITING_FOR_ADAPTER
            self.parked.append(seq)
            return True
        return False

    def track_deadline(self, seq: Sequence) -> None:
        """`seq` was queued: watch its deadline, if it has one and has not started."""
        if seq.deadline is not None and not seq.started:
            heapq.heappush(self._deadlines, (seq.deadline, next(self._deadline_order), seq))

    def start_compiled(self, queue: Callable[[Sequence], None]) -> tuple[tuple[Sequence, GrammarError], ...]:
        """`queue` each sequence whose grammar is compiled, with its own parser state; take out
        those whose compile failed (FINISHED_ERROR), returned with the failure."""
        failed = []
        for seq in [s for s in self.compiling if s.grammar_compile is None or s.grammar_compile.done()]:
            self.compiling.remove(seq)
            error = seq.start_grammar()
            if error is not None:
                seq.status = SequenceStatus.FINISHED_ERROR
                failed.append((seq, error))
            else:
                queue(seq)
        return tuple(failed)

    def unpark(self, queue: Callable[[Sequence], None]) -> None:
        """`queue` the parked sequences whose adapter now gets a slot, in arrival order."""
        if self.loras is None:
            return
        self.loras.drop_released()
        for seq in list(self.parked):
            if self._take_slot(seq):
                self.parked.remove(seq)
                queue(seq)

    def expire(self, waiting: WaitingQueue, now: float) -> list[Sequence]:
        """Take out of `waiting` the sequences past their deadline that never started (a preempted
        one has started: it is never expired). Costs O(expired log n), not O(waiting)."""
        expired = []
        while self._deadlines and self._deadlines[0][0] < now:
            _, _, seq = heapq.heappop(self._deadlines)
            if seq.started or seq.status != SequenceStatus.WAITING:
                continue  # admitted, aborted or already expired since it was queued
            waiting.remove(seq)
            seq.status = SequenceStatus.FINISHED_ERROR
            expired.append(seq)
        return expired

    def wait_for_grammar(self, timeout_s: float) -> None:
        futures = [s.grammar_compile for s in self.compiling if s.grammar_compile is not None]
        if futures:
            wait_futures(futures, timeout_s, FIRST_COMPLETED)

    def discard(self, seq: Sequence) -> None:
        """`seq` finished: out of the lists, its adapter's slot given back."""
        if seq in self.compiling:
            self.compiling.remove(seq)
        if seq in self.parked:
            self.parked.remove(seq)
        if seq.lora_slot >= 0 and self.loras is not None:
            self.loras.release(seq.lora_slot)
            seq.lora_slot = -1

    def _take_slot(self, seq: Sequence) -> bool:
        """Give `seq` its adapter's slot (True), or False: every slot is held by other adapters."""
        if seq.lora is None or seq.lora_slot >= 0:
            return True
        if self.loras is None:
            raise RuntimeError("a LoRA sequence reached a scheduler without adapter slots")
        slot = self.loras.acquire(seq.lora)
        if slot is None:
            return False
        seq.lora_slot = slot
        return True
