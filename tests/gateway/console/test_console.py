"""The console's security and its pages over HTTP (gateway/console/): off without an admin key;
only a session opens it (never a key, a tenant's or the admin's, in a header); a change without the
session's CSRF token is a 403; sessions end when idle, at their age limit, and at logout (the
console's clock moved, no sleeps); without Redis, the pages say what needs it and show the rest.
tests/gateway/console/test_console_browser.py drives the same pages in a real browser."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from gateway.app import create_app
from gateway.batches.store import StoredBatch
from gateway.console.sessions import COOKIE, MAX_FAILED_LOGINS
from gateway.settings import Settings
from tests.gateway.conftest import client_for
from tests.gateway.console.conftest import ADMIN_KEY, KEYS, console_app, csrf_of, log_in
from tests.gateway.fakes import FakeEngine
from tests.gateway.test_admin_state import stored_batch

PAGES = (
    "/ui/tenants",
    "/ui/tenants/acme",
    "/ui/plans",
    "/ui/plans/free",
    "/ui/keys",
    "/ui/usage",
    "/ui/live",
    "/ui/live/panel",
    "/ui/batches",
    "/ui/adapters",
    "/ui/prices",
    "/ui/audit",
)


@pytest.fixture
async def client(tmp_path: Path, redis_url: str) -> AsyncIterator[httpx.AsyncClient]:
    app = console_app(tmp_path, redis_url)
    async with client_for(app) as c:
        c.app = app  # type: ignore[attr-defined]
        yield c


async def test_off_without_an_admin_key() -> None:
    app = create_app(Settings(embedding_model="none"), engine=FakeEngine())
    assert app.state.console is None
    async with client_for(app) as c:
        for path in ("/ui", "/ui/login", "/ui/tenants", "/ui/static/console.css"):
            assert (await c.get(path)).status_code == 404, path
        assert (await c.post("/ui/login", data={"admin_key": "x"})).status_code == 404


async def test_only_a_session_opens_it_never_a_key(client: httpx.AsyncClient) -> None:
    for key in (KEYS["acme"], ADMIN_KEY):
        page = await client.get("/ui/tenants", headers={"authorization": f"Bearer {key}"})
        assert page.status_code == 303 and page.headers["location"].startswith("/ui/login?next=/ui/tenants")
    refused = await log_in(client, KEYS["acme"])  # a tenant's key is no admin key
    assert refused.status_code == 401 and "not the admin key" in refused.text
    assert COOKIE not in refused.headers.get("set-cookie", "")
    assert (await client.get("/ui/tenants")).status_code == 303


async def test_the_login_sets_a_strict_http_only_cookie_and_pages_a_strict_policy(
    client: httpx.AsyncClient,
) -> None:
    login = await client.get("/ui/login")
    assert 'type="password"' in login.text and 'autocomplete="off"' in login.text
    answer = await log_in(client)
    assert answer.status_code == 303 and answer.headers["location"] == "/ui/tenants"
    cookie = answer.headers["set-cookie"].lower()
    for part in ("httponly", "samesite=strict", "path=/ui", "max-age=28800"):
        assert part in cookie, cookie
    assert ADMIN_KEY not in answer.text and ADMIN_KEY not in answer.headers["set-cookie"]
    page = await client.get("/ui/tenants")
    assert page.status_code == 200 and ADMIN_KEY not in page.text
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert page.headers["cache-control"] == "no-store" and page.headers["x-frame-options"] == "DENY"


async def test_after_the_login_only_a_console_page_never_another_site(client: httpx.AsyncClient) -> None:
    for wanted, landed in (
        ("/ui/usage?width=1d", "/ui/usage?width=1d"),
        ("//evil.example/ui/", "/ui/tenants"),
        ("https://evil.example/", "/ui/tenants"),
        ("/ui//evil.example", "/ui/tenants"),
    ):
        answer = await client.post("/ui/login", data={"admin_key": ADMIN_KEY, "next": wanted})
        assert answer.headers["location"] == landed, wanted


async def test_every_page_renders_with_redis(client: httpx.AsyncClient) -> None:
    await log_in(client)
    await client.post(
        "/v1/chat/completions",
        json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        headers={"authorization": f"Bearer {KEYS['acme']}"},
    )
    for path in PAGES:
        page = await client.get(path)
        assert page.status_code == 200, (path, page.text[:2000])
        assert 'class="flash error"' not in page.text, path
    csv = await client.get("/ui/usage.csv", params={"width": "1h"})
    assert csv.headers["content-type"].startswith("text/csv")
    assert "attachment" in csv.headers["content-disposition"]
    assert csv.text.splitlines()[0].startswith("start_time,end_time,project_id,model")
    assert any(line.split(",")[2:4] == ["acme", "fake-model"] for line in csv.text.splitlines()[1:])


async def test_a_change_needs_the_sessions_csrf_token(client: httpx.AsyncClient) -> None:
    await log_in(client)
    token = csrf_of((await client.get("/ui/plans")).text)
    change = {"name": "free", "priority": "free", "tokens_per_minute": "100", "requests_per_minute": "7"}
    change |= {"max_concurrent_requests": "1", "queue_deadline_seconds": "5"}
    for refused in ({}, {"csrf_token": "forged"}, {"csrf_token": ""}):
        answer = await client.post("/ui/plans/save", data={**change, **refused})
        assert answer.status_code == 403, refused
        assert "CSRF" in answer.text
    forged_header = await client.post("/ui/plans/save", data=change, headers={"x-csrf-token": "forged"})
    assert forged_header.status_code == 403
    plan = await client.get("/admin/plans/free", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert plan.json()["requests_per_minute"] == 600  # nothing changed
    assert (await client.post("/ui/logout")).status_code == 403  # logging out is a change too

    saved = await client.post("/ui/plans/save", data={**change, "csrf_token": token})
    assert saved.status_code == 303 and saved.headers["location"] == "/ui/plans/free"
    by_header = await client.post("/ui/plans/save", data=change, headers={"x-csrf-token": token})
    assert by_header.status_code == 303
    plan = await client.get("/admin/plans/free", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert plan.json()["requests_per_minute"] == 7
    assert "Plan free saved." in (await client.get("/ui/plans/free")).text
    audit = (await client.get("/admin/audit", headers={"authorization": f"Bearer {ADMIN_KEY}"})).json()
    assert [e["action"] for e in audit["data"]] == ["plan.put", "plan.put"]  # the API audits the console


async def test_a_refusal_by_the_api_is_said_on_the_page(client: httpx.AsyncClient) -> None:
    await log_in(client)
    token = csrf_of((await client.get("/ui/tenants")).text)
    answer = await client.post(
        "/ui/tenants/save", data={"csrf_token": token, "create": "1", "name": "newco", "plan": "gold"}
    )
    assert answer.status_code == 303
    page = await client.get(answer.headers["location"])
    assert "unknown plan &#39;gold&#39;" in page.text and 'class="flash error"' in page.text
    bad_number = await client.post(
        "/ui/plans/save", data={"csrf_token": token, "name": "p", "create": "1", "tokens_per_minute": "many"}
    )
    assert bad_number.status_code == 303
    assert "priority: is required" in (await client.get("/ui/plans")).text


async def test_the_session_ends_when_idle_and_at_its_age_limit(client: httpx.AsyncClient) -> None:
    console = client.app.state.console  # type: ignore[attr-defined]
    now = [1000.0]
    console.clock = lambda: now[0]
    idle, lifetime = console.sessions.idle_s, console.sessions.max_s
    await log_in(client)
    now[0] += idle - 1
    assert (await client.get("/ui/plans")).status_code == 200  # use renews it
    now[0] += idle - 1
    assert (await client.get("/ui/live/panel", headers={"hx-request": "true"})).status_code == 200
    now[0] += 2  # the panel's own refreshes are no use: idle since the plans page
    ended = await client.get("/ui/live/panel", headers={"hx-request": "true"})
    assert ended.status_code == 200 and ended.headers["hx-redirect"].startswith("/ui/login?next=/ui/live")
    gone = await client.get("/ui/plans")
    assert gone.status_code == 303 and gone.headers["location"].endswith("&ended=1")
    assert "Your session has ended" in (await client.get(gone.headers["location"])).text

    await log_in(client)
    start = now[0]
    while now[0] + idle / 2 < start + lifetime:
        now[0] += idle / 2
        assert (await client.get("/ui/plans")).status_code == 200
    now[0] = start + lifetime
    assert (await client.get("/ui/plans")).status_code == 303  # however busy
    assert len(console.sessions) == 0


async def test_logout_ends_the_session_for_good(client: httpx.AsyncClient) -> None:
    await log_in(client)
    cookie = client.cookies[COOKIE]
    token = csrf_of((await client.get("/ui/tenants")).text)
    out = await client.post("/ui/logout", data={"csrf_token": token})
    assert out.status_code == 303 and out.headers["location"] == "/ui/login?ended=logout"
    assert COOKIE not in client.cookies
    client.cookies.set(COOKIE, cookie, path="/ui")  # the old cookie, replayed
    assert (await client.get("/ui/tenants")).status_code == 303


async def test_failed_logins_are_throttled(client: httpx.AsyncClient) -> None:
    for _ in range(MAX_FAILED_LOGINS):
        assert (await log_in(client, "bg-guess")).status_code == 401
    assert (await log_in(client, ADMIN_KEY)).status_code == 429  # refused before the key is read
    console = client.app.state.console  # type: ignore[attr-defined]
    later = console.clock() + 61
    console.clock = lambda: later
    assert (await log_in(client, ADMIN_KEY)).status_code == 303


async def test_without_redis_the_pages_say_what_needs_it_and_show_the_rest(tmp_path: Path) -> None:
    app = console_app(tmp_path)
    async with client_for(app) as client:
        await log_in(client)
        chat = await client.post(
            "/v1/chat/completions",
            json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            headers={"authorization": f"Bearer {KEYS['globex']}"},
        )
        used = chat.json()["usage"]["total_tokens"]
        for path in ("/ui/tenants", "/ui/plans", "/ui/keys", "/ui/prices", "/ui/audit"):
            page = await client.get(path)
            assert page.status_code == 404 and "What needs Redis" in page.text, path
            assert "--redis-url" in page.text
        usage = await client.get("/ui/usage")  # the embedded ledger
        assert usage.status_code == 200
        charts = json.loads(usage.text.split('id="usage-data">')[1].split("</script>")[0])["charts"]
        assert [(d["label"], sum(d["data"])) for d in charts["tokens"]["datasets"]] == [("globex", used)]
        for path in ("/ui/live", "/ui/batches", "/ui/adapters"):
            assert (await client.get(path)).status_code == 200, path


async def test_each_change_goes_through_the_admin_api(client: httpx.AsyncClient) -> None:
    """Tenants, prices, keys, batches and adapters changed from the console's forms: each lands
    where the admin API puts it, and says so on the next page."""
    await log_in(client)
    token = csrf_of((await client.get("/ui/tenants")).text)
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}

    async def change(action: str, **fields: str) -> str:
        answer = await client.post(action, data={"csrf_token": token, **fields})
        assert answer.status_code == 303, (action, answer.text[:500])
        return (await client.get(answer.headers["location"])).text

    budget = {"budget_tokens": "5000", "budget_window": "daily"}
    made = await change("/ui/tenants/save", create="1", name="initech", plan="paid", **budget)
    assert "Tenant initech created." in made and "of 5,000 tokens" in made
    again = await change("/ui/tenants/save", create="1", name="initech", plan="free")
    assert "exists already" in again
    assert (await client.get("/admin/tenants/initech", headers=admin)).json()["plan"] == "paid"
    assert "Tenant initech deleted." in await change("/ui/tenants/delete", name="initech")

    priced = await change("/ui/prices/save", model="other/model", input="0.5", output="2")
    assert "The price of other/model saved" in priced
    assert (await client.get("/admin/prices/other/model", headers=admin)).json()["output"] == 2.0
    assert "The price of other/model deleted." in await change("/ui/prices/delete", model="other/model")

    issued = await client.post("/ui/keys/issue", data={"csrf_token": token, "tenant": "globex", "name": "ci"})
    assert issued.headers["cache-control"] == "no-store" and "shown this once" in issued.text
    key_hash = issued.text.split("hash <code>")[1].split("</code>")[0]
    rotated = await client.post("/ui/keys/rotate", data={"csrf_token": token, "key_hash": key_hash})
    assert rotated.status_code == 200 and "shown this once" in rotated.text
    keys = (await client.get("/admin/tenants/globex/keys", headers=admin)).json()["data"]
    active = [k["key_hash"] for k in keys if k["name"] == "ci" and k["active"]]
    assert len(active) == 1 and active != [key_hash]  # the old one revoked, the new one issued

    refused = await change("/ui/adapters/load", name="ad", path="/nowhere")
    assert 'class="flash error"' in refused  # no --lora-root: the API loads from no path

    store = client.app.state.gateway.batches.store  # type: ignore[attr-defined]
    await store.put_batch(StoredBatch("acme", "key_a", stored_batch("batch_console", 1000)))
    cancelled = await change("/ui/batches/cancel", batch_id="batch_console", tenant="acme")
    assert "Batch batch_console of acme: cancelling." in cancelled
    page = await client.get("/ui/batches/batch_console", params={"tenant": "acme"})
    assert page.status_code == 200 and "cancelling" in page.text
