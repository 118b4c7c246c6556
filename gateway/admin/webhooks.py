"""The budget webhook: a POST when a settlement crosses a budget's soft threshold; and the rest of
what a crossing does (a counter and a log line) and the budget gauges' reading (`BudgetAlerts`).

    --budget-webhook-url https://billing.example.com/hooks/batchgate

Redis (or the in-process store) reports each crossing once per budget and window, to the one
gateway whose settlement crossed it, so the hook fires at most once per window per threshold
across a pool. The POST is retried (3 attempts, 1 s then 2 s apart) on a connection error or a
5xx; it counts as delivered only on a 2xx: a redirect is not followed (the body would go where
the hook's owner did not say) and is logged as a failure, as a 4xx is. Its body::

    {"type": "budget.soft_limit", "tenant": "acme", "budget": "tenant.usd", "metric": "usd",
     "window": "monthly", "limit": 5000000, "soft_limit": 4000000, "source": "plan free", "at": 1764590000}

Signed, with `--budget-webhook-secret`, as Standard Webhooks (and OpenAI's webhooks) sign: the
headers `webhook-id` (one per notice, the same on each retry), `webhook-timestamp` (Unix seconds
of the attempt) and `webhook-signature: v1,<base64 HMAC-SHA256 of "<id>.<timestamp>.<body>">`,
keyed by the secret (`whsec_<base64>`: the decoded bytes; any other text: its UTF-8 bytes). A
receiver recomputes it over the raw body and refuses a timestamp more than 5 minutes off
(docs/TENANCY.md has the check).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

import httpx

from gateway.metrics import BudgetUse, Metrics

if TYPE_CHECKING:
    from tenancy.service import Tenancy

logger = logging.getLogger("batchgate.gateway")

ATTEMPTS = 3
FIRST_BACKOFF_S = 1.0
TIMEOUT_S = 5.0


def signing_key(secret: str) -> bytes:
    """The HMAC key of a secret: `whsec_<base64>` decoded (Standard Webhooks), else its UTF-8 bytes."""
    if secret.startswith("whsec_"):
        try:
            return base64.b64decode(secret.removeprefix("whsec_"), validate=True)
        except ValueError:
            pass
    return secret.encode("utf-8")


def sign(key: bytes, message_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` value of one delivery."""
    digest = hmac.new(key, f"{message_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def signed_headers(secret: str | None, message_id: str, body: bytes, now: float) -> dict[str, str]:
    """The headers of one delivery of `body`: its id and time, and its signature with a secret."""
    timestamp = int(now)
    headers = {
        "content-type": "application/json",
        "webhook-id": message_id,
        "webhook-timestamp": str(timestamp),
    }
    if secret:
        headers["webhook-signature"] = sign(signing_key(secret), message_id, timestamp, body)
    return headers


class BudgetWebhook:
    """Posts soft-threshold crossings to `url` in the background, signed with `secret` if any."""

    def __init__(self, url: str, secret: str | None = None) -> None:
        self.url = url
        self.secret = secret
        self._tasks: set[asyncio.Task[None]] = set()
        self._client: httpx.AsyncClient | None = None
        self.delivered = 0  # notices a 2xx took (tests read it)

    @property
    def sending(self) -> int:
        """Notices whose posting (retries included) has not ended yet."""
        return len(self._tasks)

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
            self._client = httpx.AsyncClient(timeout=TIMEOUT_S, follow_redirects=False)
        payload = json.dumps(body, separators=(",", ":")).encode()
        message_id = f"msg_{uuid.uuid4().hex}"
        delay = FIRST_BACKOFF_S
        for attempt in range(1, ATTEMPTS + 1):
            try:
                headers = signed_headers(self.secret, message_id, payload, time.time())
                response = await self._client.post(self.url, content=payload, headers=headers)
                status = response.status_code
                if 200 <= status < 300:
                    self.delivered += 1
                    return
                if status < 500:  # a redirect or a refusal: sending it again changes nothing
                    what = "redirected (not followed)" if 300 <= status < 400 else "refused"
                    logger.warning("budget webhook %s (%d); not delivered, not retried", what, status)
                    return
                problem = f"status {status}"
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


def plan_label(tenant: Any) -> str:
    """A tenant's plan as a metrics label (bounded: paid, free, open)."""
    return "open" if tenant is None else ("free" if tenant.plan.priority == "free" else "paid")


class BudgetAlerts:
    """A soft threshold crossed: the metric, a log line and the webhook (if any); and every
    tenant's budgets now, for the budget gauges."""

    def __init__(self, tenancy: Tenancy, metrics: Metrics, webhook: BudgetWebhook | None) -> None:
        self.tenancy = tenancy
        self.metrics = metrics
        self.webhook = webhook

    def crossed(self, tenant_name: str, budget: Any) -> None:
        self.metrics.soft_crossed(plan_label(self.tenancy.config.tenant(tenant_name)), budget.metric)
        logger.info("tenant %s crossed the soft threshold of its %s budget", tenant_name, budget.name)
        if self.webhook is not None:
            self.webhook.crossed(tenant_name, budget)

    async def read_use(self) -> dict[tuple[str, str], BudgetUse]:
        """Every tenant's budgets now, summed by plan and metric."""
        out: dict[tuple[str, str], BudgetUse] = {}
        for tenant in list(self.tenancy.config.tenants.values()):
            if not self.tenancy.budgets_of(tenant):
                continue
            for state in await self.tenancy.budget_states(tenant):
                row = out.setdefault((plan_label(tenant), state.budget.metric), BudgetUse())
                row.used += state.used
                row.limit += state.budget.limit
                if state.budget.limit:
                    row.max_ratio = max(row.max_ratio, state.used / state.budget.limit)
        return out
