"""A hostile tenant against a real server (uvicorn, the tiny model, tenancy), once with the
embedded store and once with Redis: the probe of issue 43 as tests. Each numbered finding of the
issue is a test named after it (each failed on main 2775e1f), beside the isolation cases that
already held, so they keep holding.

1. one tenant's writes never evict another's stored responses or conversations
2. every route that creates state costs the tenant's request budget; conversations, files and
   batches are bounded per tenant (batch outputs count)
3. a chunked upload stops at the file limit as it streams, and nothing is spooled to disk
4. batch run slots go round the tenants
5. the internal routes are closed with tenants (and the CLI refuses to start without a token)
6. a batch line nested too deep or with half a surrogate pair is that line's error
7. an admin tenant update keeps the file's keys; adapters load only from the roots, for tenants
   that exist, and the errors say nothing of what is on disk
8. the budget webhook is signed, and a redirect is neither followed nor delivered
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from gateway import cli
from gateway.app import create_app
from gateway.cli import build_tenancy
from gateway.settings import Settings
from tenancy import hash_key
from tests.gateway.conftest import LiveServer, client_for, tiny_async_engine

MODEL = "tiny"
ADMIN_KEY = "sk-sec-admin"
SECRET = "whsec_" + base64.b64encode(b"the budget hook's own secret....").decode()
MAX_FILE_BYTES = 1 << 20
MAX_STORED = 5
MAX_ITEMS = 8
MAX_CONVERSATION_BYTES = 16 * 1024
MAX_FILES = 4
QUOTA = 1_500_000
MAX_OPEN_BATCHES = 2
MAX_QUEUED_LINES = 100
TENANT_NAMES = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy")


def key(name: str) -> str:
    return f"sk-sec-{name}"


TENANTS = "\n".join(
    [
        "[plans.paid]",
        'priority = "paid"',
        "tokens_per_minute = 1000000",
        "requests_per_minute = 100000",
        "max_concurrent_requests = 64",
        "queue_deadline_seconds = 30",
        "[plans.tight]",  # mallory's: two requests a minute
        'priority = "paid"',
        "tokens_per_minute = 1000000",
        "requests_per_minute = 2",
        "max_concurrent_requests = 4",
        "queue_deadline_seconds = 30",
        "[plans.watched]",  # judy's: a budget whose soft threshold the first request crosses
        'priority = "paid"',
        "tokens_per_minute = 1000000",
        "requests_per_minute = 100000",
        "max_concurrent_requests = 64",
        "queue_deadline_seconds = 30",
        "budget_tokens = 100000",
        'budget_window = "daily"',
        "budget_soft_ratio = 0.0001",
        "[plans.one_file]",  # dave's: a plan's own bound over the gateway's
        'priority = "paid"',
        "tokens_per_minute = 1000000",
        "requests_per_minute = 100000",
        "max_concurrent_requests = 64",
        "queue_deadline_seconds = 30",
        "max_files = 1",
        *(
            f'[tenants.{n}]\nplan = "{"one_file" if n == "dave" else "watched" if n == "judy" else "paid"}"\n'
            f'keys = ["{hash_key(key(n))}"]'
            for n in TENANT_NAMES
        ),
        f'[tenants.mallory]\nplan = "tight"\nkeys = ["{hash_key(key("mallory"))}"]',
    ]
)


# -- the servers ------------------------------------------------------------------------------------


@dataclass
class Hit:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Counted:
    """The app, counting the request body bytes each request gave it and the status it answered."""

    app: Any
    received: list[int] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        index = len(self.received)
        self.received.append(0)

        async def counting() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                self.received[index] += len(message.get("body", b""))
            return message

        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start":
                self.statuses.append(message["status"])
            await send(message)

        await self.app(scope, counting, sending)


@dataclass
class Server:
    store: str
    live: LiveServer
    app: Any
    counted: Counted
    workdir: Path
    redis_url: str | None
    hits: list[Hit]

    @property
    def url(self) -> str:
        return self.live.base_url

    def http(self, name: str | None) -> httpx.Client:
        headers = {} if name is None else {"authorization": f"Bearer {key(name)}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[LiveServer, list[Hit]]]:
    """The budget webhook's receiver: it answers every POST with a redirect."""
    hits: list[Hit] = []

    async def hook(request: Request) -> Response:
        hits.append(Hit(request.url.path, dict(request.headers), await request.body()))
        return (
            RedirectResponse("/elsewhere", status_code=307)
            if request.url.path == "/hook"
            else JSONResponse({})
        )

    app = Starlette(
        routes=[Route("/hook", hook, methods=["POST"]), Route("/elsewhere", hook, methods=["POST"])]
    )
    server = LiveServer(app)
    try:
        yield server, hits
    finally:
        server.stop()


@pytest.fixture(scope="module", params=["sqlite", "redis"])
def server(
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    receiver: tuple[LiveServer, list[Hit]],
) -> Iterator[Server]:
    store = request.param
    workdir = tmp_path_factory.mktemp(f"security-{store}")
    (workdir / "tenants.toml").write_text(TENANTS)
    (workdir / "loras" / "empty").mkdir(parents=True)
    redis_url = None
    if store == "redis":
        redis_url = request.getfixturevalue("redis_server").rsplit("/", 1)[0] + "/9"
        redis.Redis.from_url(redis_url).flushdb()
    settings = Settings(
        tenants=str(workdir / "tenants.toml"),
        redis_url=redis_url,
        storage_dir=str(workdir / "storage"),
        admin_key_hash=hash_key(ADMIN_KEY),
        budget_webhook_url=receiver[0].base_url + "/hook",
        budget_webhook_secret=SECRET,
        lora_roots=(str(workdir / "loras"),),
        max_file_bytes=MAX_FILE_BYTES,
        responses_max_stored=MAX_STORED,
        conversation_max_items=MAX_ITEMS,
        conversation_max_bytes=MAX_CONVERSATION_BYTES,
        max_files=MAX_FILES,
        storage_quota_bytes=QUOTA,
        batch_max_open=MAX_OPEN_BATCHES,
        batch_max_queued_lines=MAX_QUEUED_LINES,
        batch_max_running=1,
        keep_alive_s=1.0,
        embedding_model="none",
    )
    engine = tiny_async_engine(tiny_model_dir, MODEL)
    app = create_app(settings, engine=engine, tenancy=build_tenancy(settings), owns_tenancy=True)
    counted = Counted(app)
    live = LiveServer(counted)  # type: ignore[arg-type]
    try:
        yield Server(store, live, app, counted, workdir, redis_url, receiver[1])
    finally:
        live.stop()
        engine.shutdown()
        if redis_url is not None:
            redis.Redis.from_url(redis_url).flushdb()


# -- helpers ----------------------------------------------------------------------------------------


def conversation(http: httpx.Client, items: int = 0, text: str = "hi") -> httpx.Response:
    body = {"items": [{"type": "message", "role": "user", "content": text} for _ in range(items)]}
    return http.post("/v1/conversations", json=body)


def upload(http: httpx.Client, data: bytes, purpose: str = "batch") -> httpx.Response:
    return http.post("/v1/files", files={"file": ("input.jsonl", data)}, data={"purpose": purpose})


def chat_line(custom_id: str, max_tokens: int = 4) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": max_tokens}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def jsonl(lines: list[Any]) -> bytes:
    return b"".join(
        (line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines
    )


def create_batch(http: httpx.Client, lines: list[Any]) -> httpx.Response:
    file = upload(http, jsonl(lines))
    assert file.status_code == 200, file.text
    body = {
        "input_file_id": file.json()["id"],
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    return http.post("/v1/batches", json=body)


def wait_batch(http: httpx.Client, batch_id: str, timeout_s: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        batch: dict[str, Any] = http.get(f"/v1/batches/{batch_id}").json()
        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.02)


def error(response: httpx.Response) -> dict[str, Any]:
    detail: dict[str, Any] = response.json()["error"]
    return detail


# -- 1. stored state: per tenant --------------------------------------------------------------------


def test_finding_1_one_tenant_cannot_evict_another_tenants_stored_state(server: Server) -> None:
    with server.http("bob") as bob, server.http("alice") as alice:
        body = {"model": MODEL, "input": "Hello", "max_output_tokens": 4}
        response = bob.post("/v1/responses", json=body)
        assert response.status_code == 200, response.text
        bobs = [
            f"/v1/responses/{response.json()['id']}",
            f"/v1/conversations/{conversation(bob).json()['id']}",
        ]
        alices = [conversation(alice).json()["id"] for _ in range(MAX_STORED + 2)]
        for path in bobs:
            assert bob.get(path).status_code == 200, path  # another tenant's writes evict nothing of bob's
        # alice's own least recently used went: her bound is hers
        assert [alice.get(f"/v1/conversations/{c}").status_code for c in alices[:2]] == [404, 404]
        assert alice.get(f"/v1/conversations/{alices[-1]}").status_code == 200
        limits = alice.get("/v1/usage").json()["limits"]
        assert limits["responses_max_stored"] == {"limit": MAX_STORED, "used": MAX_STORED}


# -- 2. every route that creates state costs a request; per-tenant bounds --------------------------


def test_finding_2_every_state_creating_route_costs_the_request_budget(server: Server) -> None:
    with server.http("mallory") as mallory:
        first = conversation(mallory)
        assert first.status_code == 200 and first.headers["x-ratelimit-limit-requests"] == "2"
        assert upload(mallory, jsonl([chat_line("a")])).status_code == 200
        refused = [
            conversation(mallory),
            mallory.post(f"/v1/conversations/{first.json()['id']}/items", json={"items": []}),
            upload(mallory, b"x"),
            mallory.post("/v1/batches", json={"input_file_id": "file-x", "endpoint": "/v1/chat/completions"}),
            mallory.post(
                "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
            ),
        ]
        for response in refused:
            assert response.status_code == 429, response.text
            assert error(response)["code"] == "rate_limit_exceeded" and "retry-after" in response.headers
        # reading is free: a tenant at its request budget still reads what it stored
        assert mallory.get(f"/v1/conversations/{first.json()['id']}").status_code == 200


def test_finding_2_a_conversation_is_bounded_in_items_and_bytes(server: Server) -> None:
    with server.http("ivan") as ivan:
        created = conversation(ivan, items=MAX_ITEMS - 2)
        assert created.status_code == 200
        items = f"/v1/conversations/{created.json()['id']}/items"
        message = {"type": "message", "role": "user", "content": "more"}
        assert ivan.post(items, json={"items": [message, message]}).status_code == 200
        over = ivan.post(items, json={"items": [message]})
        assert over.status_code == 400 and error(over)["code"] == "conversation_too_large"
        assert "conversation_max_items" in error(over)["message"] and error(over)["param"] == "items"
        big = conversation(ivan, items=1, text="z" * MAX_CONVERSATION_BYTES)
        assert big.status_code == 400 and "conversation_max_bytes" in error(big)["message"]
        # a response that would continue a full conversation is refused before it runs
        body = {
            "model": MODEL,
            "input": "Hello",
            "max_output_tokens": 4,
            "conversation": created.json()["id"],
        }
        turn = ivan.post("/v1/responses", json=body)
        assert turn.status_code == 400 and error(turn)["param"] == "conversation"
        assert len(ivan.get(items, params={"limit": 100}).json()["data"]) == MAX_ITEMS


def test_finding_2_files_are_bounded_in_number_and_bytes_and_batch_outputs_count(server: Server) -> None:
    with server.http("carol") as carol:
        chunk = b"a" * 600_000
        assert [upload(carol, chunk, "user_data").status_code for _ in range(2)] == [200, 200]
        over = upload(carol, chunk, "user_data")
        assert over.status_code == 400 and error(over)["code"] == "storage_quota_exceeded"
        assert "storage_quota_bytes" in error(over)["message"]
        assert upload(carol, jsonl([chat_line("one")])).status_code == 200
        line = upload(carol, b"{}", "user_data")  # file number 4 of 4
        assert line.status_code == 200
        fifth = upload(carol, b"{}", "user_data")
        assert fifth.status_code == 400 and error(fifth)["code"] == "file_limit_exceeded"
        # a batch would write an output file: at its bounds, the tenant creates none
        file_id = carol.get("/v1/files", params={"purpose": "batch"}).json()["data"][0]["id"]
        body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        refused = carol.post("/v1/batches", json=body)
        assert refused.status_code == 400 and "max_files" in error(refused)["message"]
        limits = carol.get("/v1/usage").json()["limits"]
        assert limits["max_files"] == {"limit": MAX_FILES, "used": MAX_FILES}
        assert limits["storage_quota_bytes"]["limit"] == QUOTA
    with server.http("dave") as dave:  # its plan's max_files = 1, over the gateway's 4
        assert upload(dave, b"{}", "user_data").status_code == 200
        assert error(upload(dave, b"{}", "user_data"))["code"] == "file_limit_exceeded"
        assert dave.get("/v1/usage").json()["limits"]["max_files"] == {"limit": 1, "used": 1}


def test_finding_2_open_batches_and_their_lines_are_bounded(server: Server) -> None:
    with server.http("heidi") as heidi:
        many = create_batch(heidi, [chat_line(f"l{i}") for i in range(MAX_QUEUED_LINES + 1)])
        assert many.status_code == 400 and "batch_max_queued_lines" in error(many)["message"]
        file_id = upload(heidi, jsonl([chat_line(f"l{i}", max_tokens=32) for i in range(20)])).json()["id"]
        body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        made = [heidi.post("/v1/batches", json=body) for _ in range(MAX_OPEN_BATCHES + 1)]
        assert [r.status_code for r in made] == [200] * MAX_OPEN_BATCHES + [400], made[-1].text
        assert (
            error(made[-1])["code"] == "batch_limit_exceeded"
            and "batch_max_open" in error(made[-1])["message"]
        )
        for batch in made[:-1]:
            assert wait_batch(heidi, batch.json()["id"])["status"] == "completed"


# -- 3. uploads stop at the limit as they stream ------------------------------------------------------


def test_finding_3_a_chunked_upload_stops_at_the_limit_and_nothing_is_spooled(
    server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spool))  # where a spooled file part would go
    files = server.workdir / "storage" / "files"
    before = set(files.iterdir()) if files.exists() else set()
    boundary = "sec-boundary"

    def body() -> Iterator[bytes]:  # 24 MiB without a Content-Length: chunked
        yield f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'.encode()
        disposition = 'form-data; name="file"; filename="a.jsonl"'
        yield f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode()
        for _ in range(24 * 16):
            yield b"y" * (64 * 1024)
        yield f"\r\n--{boundary}--\r\n".encode()

    seen = len(server.counted.received)
    headers = {
        "authorization": f"Bearer {key('grace')}",
        "content-type": f"multipart/form-data; boundary={boundary}",
    }
    try:
        response = httpx.post(server.url + "/v1/files", content=body(), headers=headers, timeout=60)
        assert response.status_code == 413 and error(response)["code"] == "request_too_large"
    except httpx.TransportError:
        pass  # the server answered 413 and closed while the client was still sending
    deadline = time.monotonic() + 10
    while len(server.counted.statuses) <= seen:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert server.counted.statuses[seen] == 413
    assert server.counted.received[seen] < 2 * MAX_FILE_BYTES  # refused before 2 MiB was read
    assert list(spool.iterdir()) == []  # nothing spooled outside the storage directory
    assert (set(files.iterdir()) if files.exists() else set()) == before  # nor kept in it


# -- 4. batch run slots go round the tenants ----------------------------------------------------------


def test_finding_4_batch_run_slots_go_round_the_tenants(server: Server) -> None:
    with server.http("erin") as erin, server.http("frank") as frank:
        slow = [chat_line(f"e{i}", max_tokens=64) for i in range(48)]
        first = create_batch(erin, slow).json()["id"]
        deadline = time.monotonic() + 60
        while erin.get(f"/v1/batches/{first}").json()["status"] == "validating":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        second = create_batch(erin, slow).json()["id"]  # both wait for the one slot: erin's first,
        other = create_batch(frank, [chat_line("f0")]).json()["id"]  # then frank's
        seen: list[tuple[str, str]] = []
        while True:
            states = (
                erin.get(f"/v1/batches/{second}").json()["status"],
                frank.get(f"/v1/batches/{other}").json()["status"],
            )
            if not seen or seen[-1] != states:
                seen.append(states)
            if states[1] == "completed":
                break
            assert time.monotonic() < deadline, seen
            time.sleep(0.01)
        # frank's one-line batch ran at the first free slot, before erin's second
        assert all(mine == "validating" or theirs == "completed" for mine, theirs in seen), seen
        assert any(mine == "validating" and theirs != "validating" for mine, theirs in seen), seen
        assert wait_batch(erin, second)["status"] == "completed"


# -- 5. the internal routes are closed with tenants ---------------------------------------------------


def test_finding_5_the_internal_routes_are_closed_with_tenants(server: Server) -> None:
    with server.http(None) as anonymous, server.http("alice") as alice:
        for path in ("/v1/internal/stats", "/v1/internal/upstreams", "/v1/internal/usage/x"):
            for client in (anonymous, alice):
                assert client.get(path).status_code == 401, path
        count = anonymous.post("/v1/internal/count", json={"model": MODEL, "prompt": "x"})
        assert count.status_code in (401, 404)
        stats = anonymous.get("/v1/internal/stats", headers={"authorization": f"Bearer {ADMIN_KEY}"})
        assert stats.status_code == 200 and "loras" in stats.json()  # the admin may read it


def test_finding_5_the_cli_refuses_tenants_without_an_internal_token(
    server: Server, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "serve", lambda settings, tenancy: 0)
    tenants = str(server.workdir / "tenants.toml")
    assert cli.main(["serve", "--tenants", tenants], environ={}) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--internal-token" in err
    assert cli.main(["serve", "--tenants", tenants, "--internal-token", "t"], environ={}) == 0


async def test_finding_5_without_tenants_an_anonymous_caller_sees_no_tenants_adapters(
    make_app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica without --internal-token (and so without tenants) answers /v1/internal/stats to
    anyone, but names no tenant: only the public adapters; its gateway (the token) sees all."""
    from gateway import loras

    held = {
        "acme-tuned": {"owner": "acme", "model": MODEL, "resident": True, "version": 1, "content_hash": "h1"},
        "public": {"owner": None, "model": MODEL, "resident": False, "version": 1, "content_hash": "h2"},
    }
    monkeypatch.setattr(loras, "held_report", lambda engines: held)
    for token, headers, expected in (
        (None, {}, {"public"}),
        ("t", {"x-batchgate-internal": "t"}, {"acme-tuned", "public"}),
    ):
        async with client_for(make_app(internal_token=token)) as client:
            stats = await client.get("/v1/internal/stats", headers=headers)
        assert stats.status_code == 200 and set(stats.json()["loras"]) == expected
        assert "acme" not in stats.text or token is not None


# -- 6. batch lines: depth and surrogates are the line's error ----------------------------------------


def test_finding_6_a_deep_or_invalid_unicode_line_is_that_lines_error(server: Server) -> None:
    deep = b'{"custom_id": "deep", "method": "POST", "url": "/v1/chat/completions", "body": ' + (
        b"[" * 50_000 + b"]" * 50_000 + b"}"
    )
    surrogate = json.dumps(chat_line("half")).replace("Hello", "a\\ud800b").encode()
    with server.http("grace") as grace:
        batch = wait_batch(grace, create_batch(grace, [chat_line("fine"), deep, surrogate]).json()["id"])
        assert batch["status"] == "failed"
        found = {(e["line"], e["code"]) for e in batch["errors"]["data"]}
        assert found == {(2, "invalid_json_line"), (3, "invalid_json_line")}, batch["errors"]
        assert "nest deeper" in batch["errors"]["data"][0]["message"]
        # the interactive API refuses the same body the same way
        refused = grace.post("/v1/chat/completions", content=surrogate[surrogate.index(b'{"model"') : -1])
        assert refused.status_code == 400 and "surrogate" in error(refused)["message"]


# -- 7. admin: keys kept, adapters from the roots for known tenants -----------------------------------


def test_finding_7_an_admin_tenant_update_keeps_the_files_keys(server: Server) -> None:
    if server.store != "redis":
        pytest.skip("the admin API keeps its changes in Redis")
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    with server.http(None) as http:
        put = http.put(
            "/admin/tenants/bob",
            json={"plan": "paid", "budget_usd": 50.0, "budget_window": "daily"},
            headers=admin,
        )
        assert put.status_code == 200, put.text
        assert put.json()["budget_usd"] == 50.0 and "keys" not in put.json()
    with server.http("bob") as bob:
        assert bob.get("/v1/models").status_code == 200  # the key the tenants file declares still works


def test_finding_7_adapters_load_only_from_the_roots_and_for_known_tenants(server: Server) -> None:
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    with server.http(None) as http:
        answers = [
            http.put("/admin/loras/x", json={"path": path}, headers=admin)
            for path in (
                "/etc",
                "/nonexistent/adapter",
                str(server.workdir / "loras" / ".." / "tenants.toml"),
            )
        ]
        assert {a.status_code for a in answers} == {400}
        assert len({a.json()["error"]["message"] for a in answers}) == 1  # nothing said about the disk
        assert error(answers[0])["param"] == "path"
        inside = str(server.workdir / "loras" / "empty")
        unknown = http.put("/admin/loras/x", json={"path": inside, "tenant": "nobody"}, headers=admin)
        assert unknown.status_code == 400 and error(unknown)["param"] == "tenant"
        assert "nobody" in error(unknown)["message"]


# -- 8. the budget webhook is signed; a redirect is not delivered -------------------------------------


def verify(secret: str, headers: Mapping[str, str], body: bytes, tolerance_s: float = 300) -> bool:
    """docs/TENANCY.md's check, as a receiver writes it."""
    msg_id, timestamp = headers["webhook-id"], headers["webhook-timestamp"]
    if abs(time.time() - int(timestamp)) > tolerance_s:
        return False
    hmac_key = (
        base64.b64decode(secret.removeprefix("whsec_")) if secret.startswith("whsec_") else secret.encode()
    )
    digest = hmac.new(hmac_key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    expected = base64.b64encode(digest).decode()
    signatures = headers["webhook-signature"].split()
    return any(hmac.compare_digest(expected, s.split(",", 1)[1]) for s in signatures if s.startswith("v1,"))


def test_finding_8_the_budget_webhook_is_signed_and_a_redirect_is_not_delivered(server: Server) -> None:
    server.hits.clear()
    with server.http("judy") as judy:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
        assert judy.post("/v1/chat/completions", json=body).status_code == 200
    deadline = time.monotonic() + 10
    webhook = server.app.state.gateway.webhook
    while not server.hits or webhook.sending:  # until the posting ended, retries included
        assert time.monotonic() < deadline, "the webhook was not called"
        time.sleep(0.02)
    assert [h.path for h in server.hits] == ["/hook"]  # the redirect was not followed, nor retried
    hit = server.hits[0]
    assert verify(SECRET, hit.headers, hit.body) and json.loads(hit.body)["tenant"] == "judy"
    assert webhook.delivered == 0


# -- the isolation that already held -------------------------------------------------------------------


def test_another_tenants_state_is_a_404_everywhere(server: Server) -> None:
    with server.http("alice") as alice, server.http("bob") as bob:
        conv = conversation(alice).json()["id"]
        file_id = upload(alice, b"{}", "user_data").json()["id"]
        response = alice.post(
            "/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2}
        ).json()["id"]
        for method, path in [
            ("GET", f"/v1/conversations/{conv}"),
            ("DELETE", f"/v1/conversations/{conv}"),
            ("GET", f"/v1/conversations/{conv}/items"),
            ("GET", f"/v1/files/{file_id}"),
            ("GET", f"/v1/files/{file_id}/content"),
            ("DELETE", f"/v1/files/{file_id}"),
            ("GET", f"/v1/responses/{response}"),
            ("DELETE", f"/v1/responses/{response}"),
            ("GET", f"/v1/responses/{response}/input_items"),
        ]:
            assert bob.request(method, path).status_code == 404, (method, path)
        assert file_id not in {f["id"] for f in bob.get("/v1/files").json()["data"]}
        continued = bob.post(
            "/v1/responses",
            json={"model": MODEL, "input": "Hi", "max_output_tokens": 2, "previous_response_id": response},
        )
        # As for an id that never existed: OpenAI's 400 previous_response_not_found.
        assert (
            continued.status_code == 400
            and continued.json()["error"]["code"] == "previous_response_not_found"
        )
        assert alice.get(f"/v1/conversations/{conv}").status_code == 200  # still there for alice


def test_no_raw_key_in_redis_or_the_metrics(server: Server) -> None:
    with server.http(None) as http:
        metrics = http.get("/metrics").text
    for name in (*TENANT_NAMES, "mallory"):
        assert key(name) not in metrics and f'"{name}"' not in metrics
    if server.redis_url is not None:
        keys = [k.decode() for k in redis.Redis.from_url(server.redis_url).scan_iter(count=1000)]
        assert keys and not any(key(name) in k for k in keys for name in TENANT_NAMES)
