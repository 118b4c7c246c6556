"""Who is preempted, for each of the three reasons (the scheduler does the preempting: blocks freed,
the sequence back at the head of its class, recomputed later).

- memory: a running sequence cannot get a block; the lowest-ranked running sequence (lowest class,
  most recently admitted) that is not yet scheduled goes. Unbounded, so nothing deadlocks; a step
  that preempted for memory admits nobody, or the victim would come straight back and thrash.
- priority: a waiting (or prefilling) sequence lacks a slot or blocks while a lower class runs; the
  lowest-ranked lower-class sequence goes, even if already scheduled this step, unless it has been
  preempted `max_preemptions_per_seq` times. The sequence it made room for is admitted in the same
  step; nobody of the victim's class is. The `batch` class (Batch API lines) has no such bound: it
  runs only in the slots and blocks paid and free traffic leave, and gives them up whenever a
  waiting interactive sequence needs them, however often that happens.
- fair share: every slot is taken and a waiting sequence's tenant (fairness key) runs at least two
  fewer sequences of its class than another tenant; that tenant's newest sequence goes (same bound).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from engine.scheduler.waiting_queue import WaitingQueue
from engine.sequence import Sequence
from engine.types import Priority


def rank(seq: Sequence) -> tuple[int, int]:
    """Higher rank is preempted first: lower priority, then the most recently admitted."""
    return (int(seq.priority), seq.admission_order)


def memory_victim(
    running: Iterable[Sequence], scheduled: Collection[tuple[str, int]], above: Sequence | None = None
) -> Sequence | None:
    """The highest-ranked running sequence not `scheduled` this step (and ranked above `above`,
    when given), or None."""
    candidates = [
        s for s in running if s.seq_id not in scheduled and (above is None or rank(s) > rank(above))
    ]
    return max(candidates, key=rank, default=None)


def priority_victims(running: Iterable[Sequence], seq: Sequence, max_preemptions: int) -> list[Sequence]:
    """The running sequences of a lower class than `seq` that may still be preempted for it."""
    return [
        s
        for s in running
        if s.priority > seq.priority
        and (s.num_preemptions < max_preemptions or s.priority is Priority.BATCH)
        and s is not seq
    ]


def fair_share_swap(
    running: Iterable[Sequence], waiting: WaitingQueue, priority: Priority, max_preemptions: int
) -> tuple[Sequence, Sequence] | None:
    """(victim, newcomer): a waiting sequence of `priority` whose fairness key (tenant) runs at least
    two fewer sequences of the class than the heaviest key, and that key's newest sequence that may
    still be preempted; None when there is none.

    So a tenant's first request does not wait for another tenant's to finish. Bounded like priority
    preemption (`max_preemptions`); each swap moves the two keys toward an equal share, so it
    cannot ping-pong. Costs one pass over the waiting queue."""
    of_class = [s for s in running if s.priority == priority]
    counts: dict[str, int] = {}
    for s in of_class:
        counts[s.fairness_key] = counts.get(s.fairness_key, 0) + 1
    movable = [s for s in of_class if s.num_preemptions < max_preemptions]
    if not movable:
        return None
    heaviest = max(counts[s.fairness_key] for s in movable)
    newcomer = next(
        (s for s in waiting if s.priority == priority and counts.get(s.fairness_key, 0) <= heaviest - 2),
        None,
    )
    if newcomer is None:
        return None
    victim = max((s for s in movable if counts[s.fairness_key] == heaviest), key=rank)
    return victim, newcomer
