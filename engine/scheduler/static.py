"""Static batching (the baseline the continuous scheduler is compared with).

A batch of up to `max_num_seqs` forms from the waiting queue while nothing runs (over several
steps if the token budget is short), and nobody else is admitted until all of it has finished. It
keeps the class order but neither preempts for priority or fair share nor caps long prompts; a
member preempted for memory comes back while its batch runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.scheduler.core import SchedulerCore
from engine.scheduler.preemption import rank
from engine.scheduler.step_builder import StepBuilder
from engine.sequence import Sequence
from engine.types import Priority

if TYPE_CHECKING:
    from engine.lora import LoraSlots


class StaticBatchScheduler(SchedulerCore):
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        clock: Callable[[], float] = time.monotonic,
        loras: LoraSlots | None = None,
    ) -> None:
        super().__init__(config, block_manager, clock, loras)
        # Whether the current batch still takes members, how many it took, and who they are.
        self._batch_open = True
        self._batch_size = 0
        self._batch_members: set[tuple[str, int]] = set()

    def _fill(self, step: StepBuilder) -> None:
        if not self.running:  # the previous batch has drained: form the next
            self._batch_open, self._batch_size = True, 0
            self._batch_members.clear()
        ranked = sorted(self.running, key=rank)
        self._schedule_decodes(step, ranked)
        for priority in sorted(Priority):
            self._schedule_prefills(step, [s for s in ranked if s.priority == priority])
            self._admit(step, priority)
        if step.budget > 0:
            self._batch_open = False  # it stopped taking members for want of room or of requests

    def _may_admit(self, seq: Sequence) -> bool:
        if seq.seq_id in self._batch_members:
            return True  # a member preempted for memory comes back
        return self._batch_open and self._batch_size < self.config.max_num_seqs

    def _admitted(self, seq: Sequence) -> None:
        if seq.seq_id not in self._batch_members:
            self._batch_members.add(seq.seq_id)
            self._batch_size += 1
            if self._batch_size >= self.config.max_num_seqs:
                self._batch_open = False
