"""A rolling upgrade of the stored-response format (gateway/responses/store.py): with the default
--responses-store-format 1 the previous release reads every record this one writes; this one reads
both formats; and a pool of an old and a new gateway on one Redis (real servers, the previous
release's code from git) serves one conversation with 0 errors, through the flip to format 2."""

from __future__ import annotations

import dataclasses
import os
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from gateway.responses.redis_store import RedisStore
from gateway.responses.request import InConversation, Parent
from gateway.responses.store import (
    SQLITE_FILE,
    SQLiteStore,
    StoredConversation,
    StoredResponse,
    load_response,
)
from tests.conftest_redis import free_port
from tests.gateway.conftest import client_for

ROOT = Path(__file__).resolve().parents[2]
# The last release before format 2 (main at c464252): the "old" gateway of the mixed pool.
PREVIOUS_RELEASE = "c4642529b525401d4e37d10c40b1d3db99e1cf07"


class OldStoredResponse:
    """The previous release's reader, frozen: `StoredResponse.loads(raw).conversation()` as it was
    (gateway/responses/store.py at PREVIOUS_RELEASE), over `store.get`."""

    @staticmethod
    def conversation(raw: bytes) -> list[dict[str, Any]]:
        data = orjson.loads(raw)
        response, input_items, history = data["response"], data["input_items"], data["history"]
        return [*history, *input_items, *response.get("output", ())]


def old_dumps(response: Any, input_items: Any, history: Any, lease_until: float | None) -> bytes:
    """The previous release's `StoredResponse.dumps`, frozen."""
    record = {"response": response, "input_items": input_items, "history": history}
    if lease_until is not None:
        record["lease_until"] = lease_until
    return orjson.dumps(record)


@pytest.mark.parametrize("lease_until", [None, 1796473050.5])
def test_format_1_is_the_previous_releases_records_byte_for_byte(lease_until: float | None) -> None:
    """Whatever writes format 1 (a turn, a background run's lease and status, a cancel), with or
    without a parent to link to: the bytes the previous release wrote and reads."""
    response = {"id": "resp_2", "object": "response", "status": "in_progress", "output": []}
    inputs = [{"type": "message", "id": "msg_2", "role": "user", "content": "hi"}]
    history = [{"type": "message", "id": "msg_1", "role": "user", "content": "before"}]
    parent = Parent("resp_1", 1, {"id": "resp_1", "object": "response"})
    record = StoredResponse(response, inputs, history, lease_until, parent=parent)
    assert record.dumps(1) == old_dumps(response, inputs, history, lease_until)


def links_unknown_added(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The history a record holds, as format 2's first release read it (gateway/responses/store.py
    `_added` at f25d9db, before a response could name its conversation's items), frozen."""
    added: list[dict[str, Any]] = record["history"] if record.get("v", 1) == 1 else record["added_history"]
    return added


def test_a_record_naming_its_conversation_fails_the_reader_that_knows_no_such_names() -> None:
    """A response created with `conversation` names the items before it in format 2: this release
    reads the name back; format 2's first release, which knows no such names, fails on the record
    (a 503 its client retries on another gateway) instead of continuing it with no history."""
    response = {"id": "resp_2", "object": "response", "status": "completed", "output": []}
    inputs = [{"type": "message", "id": "msg_2", "role": "user", "content": "hi"}]
    history = [{"type": "message", "id": "msg_1", "role": "user", "content": "before"}]
    link = InConversation("conv_1", "msg_1")
    named = StoredResponse(response, inputs, history, in_conversation=link).dumps(2)
    assert StoredResponse.loads(named).in_conversation == link
    with pytest.raises(KeyError):
        links_unknown_added(orjson.loads(named))
    whole = StoredResponse(response, inputs, history).dumps(2)  # the same turn, its history held
    assert links_unknown_added(orjson.loads(whole)) == history


def test_a_conversation_naming_its_head_fails_the_readers_that_know_no_heads() -> None:
    """In format 2 a conversation names its latest response instead of holding the items through
    it: the readers before this release (`StoredConversation.loads` at 52b05c6, frozen: its object
    and `items`) fail on the record (a 503 their client retries) instead of reading no items; with
    no head, or in format 1, it is the record they read."""
    items = [{"type": "message", "id": "msg_1", "role": "user", "content": "before"}]
    conversation = {"id": "conv_1", "object": "conversation", "created_at": 0, "metadata": {}}
    head = Parent("resp_1", 1, {"id": "resp_1", "object": "response"})
    named = StoredConversation(conversation, items, head)

    def old_items(raw: bytes) -> list[dict[str, Any]]:
        data = orjson.loads(raw)
        conversation_items: list[dict[str, Any]] = data["items"]
        return conversation_items

    with pytest.raises(KeyError):
        old_items(named.dumps(2))
    assert old_items(named.dumps(1)) == items
    assert old_items(dataclasses.replace(named, head=None).dumps(2)) == items


def old_get(where: str, tenant: str, response_id: str) -> bytes | None:
    """The previous release's `get` of either store: its key, or its row, as is."""
    if where.startswith("redis://"):
        client = redis.Redis.from_url(where)
        try:
            raw: Any = client.get("{tenant:" + tenant + "}:stored:" + response_id)
        finally:
            client.close()
        return None if raw is None else bytes(raw)
    with sqlite3.connect(where) as db:
        row = db.execute(
            "SELECT record FROM responses WHERE tenant = ? AND id = ?", (tenant, response_id)
        ).fetchone()
    return None if row is None else bytes(row[0])


def texts(conversation: list[dict[str, Any]]) -> list[str]:
    """The user's messages of a conversation, in order."""
    return [i["content"][0]["text"] for i in conversation if i.get("role") == "user"]


async def converse(client: httpx.AsyncClient, previous: str | None, turns: int) -> list[str]:
    ids = []
    for i in range(turns):
        body: dict[str, Any] = {"model": "fake-model", "input": f"turn {i}"}
        if previous is not None:
            body["previous_response_id"] = previous
        r = await client.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        previous = r.json()["id"]
        ids.append(previous)
    return ids


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
async def test_the_previous_release_reads_what_format_1_writes_and_this_one_reads_both(
    kind: str, make_app: Any, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if kind == "redis":
        where = request.getfixturevalue("redis_url")
        settings: dict[str, Any] = {"redis_url": where}
        store: Any = RedisStore(where, ttl_s=600, max_num_responses=100)
    else:
        settings = {"storage_dir": str(tmp_path)}
        where = str(tmp_path / SQLITE_FILE)
    async with client_for(make_app(**settings)) as old_format:  # the default: format 1
        first = await converse(old_format, None, 4)
    if kind == "sqlite":
        store = SQLiteStore(tmp_path / SQLITE_FILE, max_num_responses=100)
    for response_id in first:
        raw = old_get(where, "", response_id)
        assert raw is not None
        new = await load_response(store, "", response_id)
        assert new is not None and new.version == 1
        assert OldStoredResponse.conversation(raw) == new.conversation()
    await store.aclose()

    async with client_for(make_app(**settings, responses_store_format="2")) as new_format:
        later = await converse(new_format, first[-1], 3)  # continues a format 1 record
    if kind == "sqlite":
        store = SQLiteStore(tmp_path / SQLITE_FILE, max_num_responses=100)
    last = await load_response(store, "", later[-1])
    assert last is not None and last.version == 2 and last.parent is not None
    assert len(last.conversation()) == 2 * 7  # every turn's input and output, in order
    assert texts(last.conversation()) == [f"turn {i}" for i in [0, 1, 2, 3, 0, 1, 2]]
    await store.aclose()
    # Why format 1 stays the default until every gateway runs this release: the previous one
    # cannot read format 2: it fails (Redis: a hash, not its string; SQLite: no `history`), it
    # never reads a conversation short of its parents' items.
    with pytest.raises((redis.ResponseError, KeyError)):
        raw = old_get(where, "", later[-1])
        assert raw is not None
        OldStoredResponse.conversation(raw)


# -- a mixed-version pool: real servers on one real redis-server --------------------------------

# A gateway over the fake engine, from whichever tree is on its path: argv redis URL, port, format.
_SERVE = """
import sys
import uvicorn
from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.fakes import FakeEngine
settings = {"redis_url": sys.argv[1], "embedding_model": "none"}
if sys.argv[3] != "-":
    settings["responses_store_format"] = sys.argv[3]
engine = FakeEngine(max_model_len=4096)  # room for the whole conversation
uvicorn.run(create_app(Settings(**settings), engine=engine), host="127.0.0.1",
            port=int(sys.argv[2]), log_level="warning")
"""


def _serve(tree: Path, redis_url: str, store_format: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    process = subprocess.Popen(
        [sys.executable, "-c", _SERVE, redis_url, str(port), store_format], cwd=tree, env=env
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # start-up: imports, then the port opens
        if process.poll() is not None:
            raise RuntimeError(f"the gateway from {tree} exited with {process.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return process, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"the gateway from {tree} did not start")


@pytest.fixture
def previous_release(tmp_path: Path) -> Path:
    """The previous release's tree, from git (a fresh clone has it, as CI's)."""
    found = subprocess.run(["git", "cat-file", "-e", PREVIOUS_RELEASE], cwd=ROOT, capture_output=True)
    if found.returncode != 0:
        pytest.skip(f"this checkout has no commit {PREVIOUS_RELEASE} (the previous release)")
    tree = tmp_path / "previous"
    tree.mkdir()
    archive = subprocess.run(["git", "archive", PREVIOUS_RELEASE], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


@pytest.fixture
def servers() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        process.terminate()
        process.wait(timeout=15)


def test_a_mixed_version_pool_serves_one_conversation_with_no_errors(
    redis_url: str, previous_release: Path, servers: list[subprocess.Popen[bytes]]
) -> None:
    """Old and new gateways on one Redis take turns on one conversation (by `previous_response_id`,
    then one of `/v1/conversations`); then, every gateway on this release, the flip to format 2
    (gateways on either setting at once) goes on with it."""
    gateways = {}
    for name, tree, store_format in [
        ("old", previous_release, "-"),
        ("new", ROOT, "-"),  # the default: format 1
        ("flipped", ROOT, "2"),
    ]:
        process, url = _serve(tree, redis_url, store_format)
        servers.append(process)
        gateways[name] = url
    order = ["old", "new"] * 4 + ["new", "flipped"] * 3
    previous = None
    statuses = []
    with httpx.Client(timeout=30) as http:
        for i, name in enumerate(order):
            body: dict[str, Any] = {"model": "fake-model", "input": f"turn {i}"}
            if previous is not None:
                body["previous_response_id"] = previous
            r = http.post(gateways[name] + "/v1/responses", json=body)
            statuses.append(r.status_code)
            if r.status_code != 200:
                continue
            previous = r.json()["id"]
            for other in ("old", "new") if name != "flipped" else ("new",):  # any gateway retrieves it
                assert http.get(f"{gateways[other]}/v1/responses/{previous}").status_code == 200
        # And a conversation (`/v1/conversations`) the same way: in format 2 it names its head.
        conv = http.post(gateways["old"] + "/v1/conversations", json={}).json()["id"]
        for i, name in enumerate(order):
            body = {"model": "fake-model", "input": f"said {i}", "conversation": conv}
            statuses.append(http.post(gateways[name] + "/v1/responses", json=body).status_code)
        query = {"order": "asc", "limit": 100}
        listed = http.get(f"{gateways['new']}/v1/conversations/{conv}/items", params=query)
        assert texts(listed.json()["data"]) == [f"said {i}" for i in range(len(order))]
    assert statuses == [200] * 2 * len(order)
    store = RedisStore(redis_url, ttl_s=600, max_num_responses=100)

    async def last() -> tuple[list[dict[str, Any]], bytes | None]:
        assert previous is not None
        record = await load_response(store, "", previous)
        named = await store.get("", conv)
        await store.aclose()
        assert record is not None
        return record.conversation(), named

    import asyncio

    conversation, named = asyncio.run(last())
    assert named is not None and orjson.loads(named)["head"].startswith("resp_")  # the flipped one's
    assert texts(conversation) == [f"turn {i}" for i in range(len(order))]
    assert len(conversation) == 2 * len(order)
