"""The scheduler: pure policy, no tensors. Each step it decides how many tokens each sequence
advances, within the step's token budget, the sequence slots and the free KV blocks.

    interface.py      SchedulerInterface: what the engine calls (add, schedule, update, finish)
    core.py           SchedulerCore: the queues and a step's mechanics; the policy's hooks
    continuous.py     ContinuousScheduler: classes, priority and fair-share preemption, caps
    static.py         StaticBatchScheduler: the baseline, a batch runs until its last member ends
    step_builder.py   StepBuilder: the batch under construction, what is left of its budgets
    preemption.py     who is preempted, for memory, priority or fair share
    pending.py        Pending: grammar compiles and adapter slots waited for, queue deadlines
    budget.py         StepTimeBudget: steps within a target time; lower classes yield
    step_cost.py      StepCostModel: what a step costs, fitted online to the engine's step times
    waiting_queue.py  WaitingQueue: priority classes, length buckets, fair turns between tenants
    buckets.py        prompt-length buckets, and which prompts are long
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.scheduler.continuous import ContinuousScheduler
from engine.scheduler.core import SchedulerCore
from engine.scheduler.static import StaticBatchScheduler

if TYPE_CHECKING:
    from engine.lora import LoraSlots


def build_scheduler(
    config: SchedulerConfig,
    block_manager: BlockManager,
    clock: Callable[[], float] = time.monotonic,
    loras: LoraSlots | None = None,
) -> SchedulerCore:
    """The scheduler for `config.batching` ("continuous" or "static"), over `block_manager`."""
    policy = StaticBatchScheduler if config.batching == "static" else ContinuousScheduler
    return policy(config, block_manager, clock, loras)
