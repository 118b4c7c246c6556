"""The budget webhook: a POST when a settlement crosses a budget's soft threshold.

    --budget-webhook-url https://billing.example.com/hooks/batchgate

Redis (or the in-process store) reports each crossing once per budget and window, to the one
gateway whose settlement crossed it, so the hook fires at most once per window per threshold
across a pool. The POST is retried (3 attempts, 1 s then 2 s apart) on a connection error or a
5xx; its body::

    {"type": "budget.soft_limit", "tenant": "acme", "budget": "tenant.usd", "metric": "usd",
     "window": "monthly", "limit": 5000000, "soft_limit": 4000000, "source": "plan free", "at": 1764590000}
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx

logger = logging.getLogger("batchgate.gateway")

ATTEMPTS = 3
FIRST_BACKOFF_S = 1.0
TIMEOUT_S = 5.0


class BudgetWebhook:
    """Posts soft-threshold crossings to `url` in the background."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._tasks: set[asyncio.Task[None]] = set()
        self._client: httpx.AsyncClient | None = None

    def crossed(self, tenant: str, budget: Any) -> None:
        """Called from a settlement (on the event loop): post without delaying it."""
        soft = None if budget.soft_ratio is None else int(budget.limit * budget.soft_ratio)
        body = {
            "type": "budget.soft_limit",
            "tenant": tenant,
            "budget": budget.name,
            "metric": budget.metric,
            "window": budget.window,
            "limit": budget.limit,
            "soft_limit": soft,
            "source": budget.source,
            "at": int(time.time()),
        }
        task = asyncio.get_running_loop().create_task(self._post(body))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _post(self, body: dict[str, Any]) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=TIMEOUT_S)
        delay = FIRST_BACKOFF_S
        for attempt in range(1, ATTEMPTS + 1):
            try:
                response = await self._client.post(self.url, json=body)
                if response.status_code < 500:
                    if response.status_code >= 400:
                        logger.warning("budget webhook refused (%d); not retried", response.status_code)
                    return
                problem = f"status {response.status_code}"
            except httpx.HTTPError as exc:
                problem = repr(exc)
            if attempt < ATTEMPTS:
                await asyncio.sleep(delay)
                delay *= 2
        logger.warning("budget webhook failed %d times (%s); the crossing is dropped", ATTEMPTS, problem)

    async def aclose(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
