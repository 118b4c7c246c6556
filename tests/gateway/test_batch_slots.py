"""The batch run slots (gateway/batches/slots.py): shared among tenants in turns, each tenant
within its own cap; a cancelled wait takes nobody's slot."""

from __future__ import annotations

import asyncio

import pytest

from gateway.batches.slots import RunSlots


async def _run(slots: RunSlots, tenant: str, cap: int, started: list[str], release: asyncio.Event) -> None:
    async with slots.slot(tenant, cap):
        started.append(tenant)
        await release.wait()


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_freed_slot_goes_to_the_tenant_served_least_recently() -> None:
    slots = RunSlots(1)
    started: list[str] = []
    gates = {name: asyncio.Event() for name in ("a1", "a2", "a3", "b1", "c1")}
    tasks = [asyncio.create_task(_run(slots, "a", 8, started, gates["a1"]))]
    await _settle()
    for name in ("a2", "a3", "b1", "c1"):  # a's two more come first, then b's, then c's
        tasks.append(asyncio.create_task(_run(slots, name[0], 8, started, gates[name])))
        await _settle()
    for name in ("a1", "b1", "a2", "c1"):
        gates[name].set()
        await _settle()
    gates["a3"].set()
    await asyncio.gather(*tasks)
    # Not a, a, a, b, c (first come, first served): each tenant in its turn.
    assert started == ["a", "b", "c", "a", "a"]


async def test_a_tenant_runs_at_most_its_cap_and_leaves_the_other_slots() -> None:
    slots = RunSlots(3)
    started: list[str] = []
    release = asyncio.Event()
    tasks = [asyncio.create_task(_run(slots, "heavy", 1, started, release)) for _ in range(4)]
    await _settle()
    assert slots.running("heavy") == 1 and slots.num_waiting("heavy") == 3 and slots.num_running == 1
    tasks.append(asyncio.create_task(_run(slots, "light", 1, started, release)))
    await _settle()
    assert started == ["heavy", "light"]  # at once, in a slot heavy could not take
    release.set()
    await asyncio.gather(*tasks)
    assert slots.num_running == 0 and slots.num_waiting() == 0


async def test_a_cancelled_wait_takes_no_slot() -> None:
    slots = RunSlots(1)
    started: list[str] = []
    hold, free = asyncio.Event(), asyncio.Event()
    first = asyncio.create_task(_run(slots, "a", 1, started, hold))
    await _settle()
    waiting = asyncio.create_task(_run(slots, "b", 1, started, free))
    later = asyncio.create_task(_run(slots, "c", 1, started, free))
    await _settle()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    hold.set()
    free.set()
    await asyncio.gather(first, later)
    assert started == ["a", "c"] and slots.num_running == 0 and slots.num_waiting() == 0
