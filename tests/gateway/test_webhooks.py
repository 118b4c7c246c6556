"""The budget webhook (gateway/admin/webhooks.py) against a real HTTP receiver: each POST signed as
Standard Webhooks (and OpenAI's webhooks) sign, checkable with docs/TENANCY.md's snippet; a
redirect is neither followed nor counted as delivered (issue 43, finding 8)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from gateway.admin.webhooks import BudgetWebhook
from tests.gateway.conftest import LiveServer

SECRET = "whsec_" + base64.b64encode(b"the receiver's secret, 32 bytes!").decode()


def verify(secret: str, headers: Mapping[str, str], body: bytes, tolerance_s: float = 300) -> bool:
    """docs/TENANCY.md's check, as a receiver writes it: the raw body, the three headers."""
    msg_id, timestamp = headers["webhook-id"], headers["webhook-timestamp"]
    if abs(time.time() - int(timestamp)) > tolerance_s:
        return False
    key = base64.b64decode(secret.removeprefix("whsec_")) if secret.startswith("whsec_") else secret.encode()
    digest = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    expected = base64.b64encode(digest).decode()
    return any(
        hmac.compare_digest(expected, sig.split(",", 1)[1])
        for sig in headers["webhook-signature"].split()
        if sig.startswith("v1,")
    )


@dataclass
class Hit:
    path: str
    headers: dict[str, str]
    body: bytes


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[LiveServer, list[Hit]]]:
    hits: list[Hit] = []

    async def hook(request: Request) -> Response:
        hits.append(Hit(request.url.path, dict(request.headers), await request.body()))
        if request.url.path == "/moved":
            return RedirectResponse("/hook", status_code=307)
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/hook", hook, methods=["POST"]), Route("/moved", hook, methods=["POST"])])
    server = LiveServer(app)
    try:
        yield server, hits
    finally:
        server.stop()


@dataclass(frozen=True)
class Budget:
    name: str = "tenant.usd"
    metric: str = "usd"
    window: str = "monthly"
    limit: int = 5_000_000
    soft_ratio: float | None = 0.8
    source: str = "plan free"


async def cross(hook: BudgetWebhook) -> None:
    hook.crossed("acme", Budget())
    await hook.aclose()


async def test_each_post_is_signed_over_its_id_time_and_raw_body(receiver: Any) -> None:
    server, hits = receiver
    hits.clear()
    hook = BudgetWebhook(server.base_url + "/hook", SECRET)
    await cross(hook)
    assert hook.delivered == 1 and len(hits) == 1
    hit = hits[0]
    assert hit.headers["webhook-id"].startswith("msg_") and verify(SECRET, hit.headers, hit.body)
    assert json.loads(hit.body)["type"] == "budget.soft_limit" and json.loads(hit.body)["tenant"] == "acme"
    assert not verify("whsec_" + base64.b64encode(b"another secret").decode(), hit.headers, hit.body)
    assert not verify(SECRET, hit.headers, hit.body.replace(b"acme", b"acmf"))
    stale = {**hit.headers, "webhook-timestamp": str(int(time.time()) - 3600)}
    assert not verify(SECRET, stale, hit.body)


async def test_a_plain_text_secret_is_the_key_and_no_secret_sends_no_signature(receiver: Any) -> None:
    server, hits = receiver
    hits.clear()
    await cross(BudgetWebhook(server.base_url + "/hook", "plain-secret"))
    await cross(BudgetWebhook(server.base_url + "/hook"))
    assert verify("plain-secret", hits[0].headers, hits[0].body)
    assert "webhook-signature" not in hits[1].headers and "webhook-id" in hits[1].headers


async def test_a_redirect_is_not_followed_nor_delivered_nor_retried(receiver: Any) -> None:
    server, hits = receiver
    hits.clear()
    hook = BudgetWebhook(server.base_url + "/moved", SECRET)
    await cross(hook)
    assert hook.delivered == 0
    assert [h.path for h in hits] == ["/moved"]  # one attempt; /hook, where it points, never hit
