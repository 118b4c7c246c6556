"""What the engine asks of a scheduler: the seam between engine/llm_engine.py and the policies.

    add(seq) --> schedule() --> SchedulerOutput --> (forward pass, sampling) --> update(output)
                                                                             --> record_step(...)
    finish(seq, status): every terminal path, in one place

A scheduler is pure policy: it touches no tensors, only sequences, its queues and the KV block
manager's bookkeeping. The engine reads the queues (statistics, fault handling) and never changes
them itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.scheduler.waiting_queue import WaitingQueue
from engine.sequence import Sequence, SequenceStatus
from engine.step import SchedulerOutput


class SchedulerInterface(ABC):
    """One engine's scheduler (engine thread only)."""

    config: SchedulerConfig
    blocks: BlockManager
    running: list[Sequence]  # admitted: they hold blocks, prefilling or decoding
    waiting: WaitingQueue  # queued to start (or, preempted, to start again)
    compiling: list[Sequence]  # waiting for their grammar's compile (WAITING_FOR_GRAMMAR)
    parked: list[Sequence]  # waiting for a LoRA adapter slot (WAITING_FOR_ADAPTER)
    num_preemptions: int  # for any reason
    num_priority_preemptions: int
    num_fairness_preemptions: int

    @abstractmethod
    def add(self, seq: Sequence) -> None:
        """Queue `seq`; one whose grammar is compiling (`grammar_compile`) waits for it first."""

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """The next step: which chunks of which sequences run, who was preempted, and who the
        engine must fail (expired deadlines, failed grammar compiles)."""

    @abstractmethod
    def update(self, output: SchedulerOutput) -> None:
        """Advance progress after the forward pass ran `output`."""

    @abstractmethod
    def record_step(self, output: SchedulerOutput, seconds: float) -> None:
        """The measured duration of the step that ran `output` (the engine calls this after each
        step)."""

    @abstractmethod
    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End `seq` with a terminal status: out of every queue, all its blocks freed (one place).

        Goes by where the sequence is, not by what its status says, so it also ends one that a
        failed step left between queues (e.g. taken from the waiting queue, not yet running);
        finishing a finished sequence again only sets its status."""

    @abstractmethod
    def has_unfinished(self) -> bool:
        """Whether any sequence is queued, compiling, parked or running."""

    @abstractmethod
    def sequences(self) -> Iterable[Sequence]:
        """Every sequence the scheduler holds, in any queue."""

    @abstractmethod
    def wait_for_grammar(self, timeout_s: float) -> None:
        """Block until a compile that a sequence waits for is done, or `timeout_s` passed (for a
        step with nothing else to do: not a busy loop)."""
