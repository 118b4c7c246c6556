"""A gateway's batch run slots, shared among tenants in turns.

At most `total` batches run at once on a gateway (`--batch-max-running`), and at most a tenant's
own cap of its batches (`batch_max_running_per_tenant`). A freed slot goes to the tenant served
least recently among those with a batch waiting and under their cap (round robin; a tenant never
served goes first, then by how long it has waited), each tenant's batches in the order they came.
So one tenant's many long batches hold at most its cap of the slots, and another tenant's batch
starts at the next free slot, never behind all of them.

    async with slots.slot(tenant, cap):   # waits for a slot; released on exit
        ... run the batch ...
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass


@dataclass
class _Waiter:
    future: asyncio.Future[None]
    cap: int


class RunSlots:
    """See the module docstring."""

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError(f"the run slots must be at least 1, got {total}")
        self.total = total
        self._running: dict[str, int] = {}  # per tenant, its batches holding a slot
        self._waiting: OrderedDict[str, deque[_Waiter]] = OrderedDict()  # in the order they came
        self._served: dict[str, int] = {}  # per tenant, the number of its last grant
        self._num_grants = 0

    @property
    def num_running(self) -> int:
        return sum(self._running.values())

    def running(self, tenant: str) -> int:
        return self._running.get(tenant, 0)

    def num_waiting(self, tenant: str | None = None) -> int:
        if tenant is not None:
            return len(self._waiting.get(tenant, ()))
        return sum(len(q) for q in self._waiting.values())

    @contextlib.asynccontextmanager
    async def slot(self, tenant: str, cap: int) -> AsyncIterator[None]:
        """Hold one of the slots (waiting for the tenant's turn) while inside."""
        waiter = _Waiter(asyncio.get_running_loop().create_future(), max(1, cap))
        self._waiting.setdefault(tenant, deque()).append(waiter)
        self._dispatch()
        try:
            await waiter.future
        except BaseException:
            if waiter.future.done() and not waiter.future.cancelled():
                self._release(tenant)  # granted just as it was cancelled
            else:
                self._forget(tenant, waiter)
            raise
        try:
            yield
        finally:
            self._release(tenant)

    def _forget(self, tenant: str, waiter: _Waiter) -> None:
        queue = self._waiting.get(tenant)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self._waiting[tenant]

    def _release(self, tenant: str) -> None:
        left = self._running[tenant] - 1
        if left:
            self._running[tenant] = left
        else:
            del self._running[tenant]
        self._dispatch()

    def _dispatch(self) -> None:
        """Grant free slots, one tenant's turn at a time: the least recently served first."""
        while self.num_running < self.total:
            eligible = [t for t, q in self._waiting.items() if self._running.get(t, 0) < q[0].cap]
            if not eligible:
                return
            tenant = min(eligible, key=lambda t: self._served.get(t, -1))  # stable: then by arrival
            queue = self._waiting[tenant]
            waiter = queue.popleft()
            if not queue:
                del self._waiting[tenant]
            if waiter.future.done():  # cancelled, not yet forgotten: it takes no turn
                continue
            self._num_grants += 1
            self._served[tenant] = self._num_grants
            self._running[tenant] = self._running.get(tenant, 0) + 1
            waiter.future.set_result(None)
