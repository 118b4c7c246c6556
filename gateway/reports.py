"""Usage kept by a replica for the gateway in front of it (pool mode), read once per request.

A gateway settles a request with the tokens the replica reports in its response. A stream its
client left ends before the replica's final usage chunk; the replica still knows what it sent,
so it keeps the usage of each request a gateway tagged (`x-batchgate-request-id`) here when the
request ends, and the gateway reads it at `GET /v1/internal/usage/{request_id}` before it
settles. The reader may arrive first (the replica notices the cut a moment after the gateway):
it waits for the report, up to a deadline. Bounded: the oldest reports go first.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass

MAX_REPORTS = 10_000
WAIT_S = 2.0


@dataclass(frozen=True)
class Report:
    """What one request used, as its replica counted it."""

    num_prompt_tokens: int
    num_cached_tokens: int
    num_completion_tokens: int

    def body(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "cached_tokens": self.num_cached_tokens,
            "completion_tokens": self.num_completion_tokens,
        }


class Reports:
    """Reports by the gateway's request id; one event loop."""

    def __init__(self, max_reports: int = MAX_REPORTS) -> None:
        self._reports: OrderedDict[str, Report] = OrderedDict()
        self._waiters: dict[str, asyncio.Event] = {}
        self._max = max_reports

    def put(self, request_id: str, report: Report) -> None:
        self._reports[request_id] = report
        self._reports.move_to_end(request_id)
        while len(self._reports) > self._max:
            self._reports.popitem(last=False)
        waiter = self._waiters.pop(request_id, None)
        if waiter is not None:
            waiter.set()

    async def take(self, request_id: str, wait_s: float = WAIT_S) -> Report | None:
        """The report for `request_id` (removed), waiting up to `wait_s` for it; None if none came."""
        if request_id not in self._reports:
            waiter = self._waiters.setdefault(request_id, asyncio.Event())
            try:
                await asyncio.wait_for(waiter.wait(), wait_s)
            except TimeoutError:
                return None
            finally:
                if self._waiters.get(request_id) is waiter and not waiter.is_set():
                    self._waiters.pop(request_id, None)
        return self._reports.pop(request_id, None)
