"""Stored histories (gateway/responses/store.py, redis_store.py): format 2 stores each response's
own items once and links it to its parent, on SQLite and Redis alike; a parent deleted or evicted
outlives it for the records that link to it, and goes with the last of them; the tenant's bound
counts the records it can read; format 1 (the default) stays what the previous release reads."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from starlette.testclient import TestClient

from gateway.responses.redis_store import RedisStore
from gateway.responses.request import InConversation, Parent, ResponsesRequest
from gateway.responses.store import (
    SQLITE_FILE,
    ResponseStore,
    SQLiteStore,
    StoredConversation,
    StoredResponse,
    load_response,
    save_response,
)
from tests.gateway.conftest import client_for
from tests.gateway.fakes import FakeEngine

TENANT = "acme"


def turn(i: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Turn `i`'s response (one output message) and its input items (one user message)."""
    text = f"turn {i} " + "words " * 20
    inputs = [
        {
            "type": "message",
            "id": f"msg_in{i}",
            "role": "user",
            "content": [{"type": "input_text", "text": text}],
        }
    ]
    output = [
        {
            "type": "message",
            "id": f"msg_out{i}",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text}],
        }
    ]
    return {"id": f"resp_{i}", "object": "response", "status": "completed", "output": output}, inputs


def items_of_turns(num_turns: int) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for i in range(num_turns):
        response, inputs = turn(i)
        items += [*inputs, *response["output"]]
    return items


async def continue_chain(store: ResponseStore, i: int, previous: str | None, version: int = 2) -> None:
    """Store turn `i` continuing `previous` as the server does: history from its lookup, linked."""
    history: list[dict[str, Any]] = []
    parent = None
    if previous is not None:
        loaded = await load_response(store, TENANT, previous)
        assert loaded is not None
        history = loaded.conversation()
        parent = Parent(previous, len(history), loaded.response) if loaded.version == 2 else None
    response, inputs = turn(i)
    await save_response(store, TENANT, StoredResponse(response, inputs, history, parent=parent), version)


@pytest.fixture(params=["sqlite", "redis"])
async def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    """A factory of one kind of store (bound per call), and a count of every record it holds,
    hidden parents included."""
    made: list[ResponseStore] = []
    url = request.getfixturevalue("redis_url") if request.param == "redis" else ""
    client = redis.Redis.from_url(url) if url else None

    def make(bound: int = 100) -> tuple[ResponseStore, Any]:
        if client is None:
            sqlite = SQLiteStore(tmp_path / SQLITE_FILE, max_num_responses=bound)
            made.append(sqlite)
            return sqlite, sqlite.count
        made.append(RedisStore(url, ttl_s=600, max_num_responses=bound))
        # Records are `{tenant:acme}:stored:<id>` (readable) and `{tenant:acme}:part:<id>` (hidden).
        return made[-1], lambda: len(client.keys("{tenant:acme}:*:resp_*"))

    yield make
    for store in made:
        await store.aclose()
    if client is not None:
        client.close()


async def test_a_chain_stores_each_item_once_and_reads_whole(make_store: Any) -> None:
    store, count = make_store()
    for i in range(30):
        await continue_chain(store, i, f"resp_{i - 1}" if i else None)
    last = await load_response(store, TENANT, "resp_29")
    assert last is not None and last.conversation() == items_of_turns(30)
    assert last.response == turn(29)[0]  # its fields shared with its parent's stored once
    assert list(last.response) == list(turn(29)[0])  # in their order
    assert last.parent == Parent("resp_28", 58) and last.version == 2
    chain = await store.chain(TENANT, "resp_29")
    assert chain is not None and len(chain) == 30 == count()  # each record once
    stored = sum(len(raw) for raw in chain)
    items = sum(len(orjson.dumps(item)) for item in items_of_turns(30))
    assert stored <= 2 * items, (stored, items)


async def test_a_deleted_or_evicted_parent_is_kept_for_its_children_until_the_last_goes(
    make_store: Any,
) -> None:
    store, count = make_store(bound=3)
    for i in range(6):
        await continue_chain(store, i, f"resp_{i - 1}" if i else None)
    # resp_0..2 were evicted (the bound counts readable records) but resp_3 links to them.
    assert await store.num_stored(TENANT) == 3 and count() == 6
    assert await store.get(TENANT, "resp_0") is None and await load_response(store, TENANT, "resp_0") is None
    assert not await store.delete(TENANT, "resp_0")  # hidden: not the tenant's to delete again
    assert await store.delete(TENANT, "resp_4")  # deleted under its child
    assert await store.get(TENANT, "resp_4") is None
    resolved = await load_response(store, TENANT, "resp_5")
    assert resolved is not None and resolved.conversation() == items_of_turns(6)
    assert count() == 6
    assert await store.delete(TENANT, "resp_5")  # its hidden parent goes with it, resp_3 stays
    assert count() == 4 and await store.num_stored(TENANT) == 1
    resolved = await load_response(store, TENANT, "resp_3")
    assert resolved is not None and resolved.conversation() == items_of_turns(4)
    assert await store.delete(TENANT, "resp_3")  # the last: every hidden ancestor goes
    assert count() == 0 and await store.num_stored(TENANT) == 0


async def test_branches_share_their_parent_and_a_parent_gone_before_the_write_is_stored_whole(
    make_store: Any,
) -> None:
    store, count = make_store()
    await continue_chain(store, 0, None)
    await continue_chain(store, 1, "resp_0")
    await continue_chain(store, 2, "resp_0")  # a second branch from resp_0: stored once, shared
    assert count() == 3
    assert await store.delete(TENANT, "resp_0")
    assert await store.delete(TENANT, "resp_1")
    assert count() == 2  # resp_0 hidden, still needed by resp_2
    branch = await load_response(store, TENANT, "resp_2")
    assert branch is not None and branch.history == items_of_turns(1)
    assert await store.delete(TENANT, "resp_2") and count() == 0

    # A parent evicted between the lookup and the write: the record holds its whole history.
    await continue_chain(store, 0, None)
    loaded = await load_response(store, TENANT, "resp_0")
    assert loaded is not None and await store.delete(TENANT, "resp_0")
    response, inputs = turn(1)
    record = StoredResponse(response, inputs, loaded.conversation(), parent=Parent("resp_0", 2))
    await save_response(store, TENANT, record, 2)
    again = await load_response(store, TENANT, "resp_1")
    assert again is not None and again.conversation() == items_of_turns(2) and again.parent is None


async def test_a_record_written_again_keeps_its_children(make_store: Any) -> None:
    """A background run writes its record several times (queued, in progress, done): the records
    that link to it keep resolving, and it is not counted twice."""
    store, count = make_store()
    await continue_chain(store, 0, None)
    await continue_chain(store, 1, "resp_0")
    await continue_chain(store, 2, "resp_1")
    middle = await load_response(store, TENANT, "resp_1")
    assert middle is not None
    for version in (2, 1, 2):  # written again in either format
        await save_response(store, TENANT, middle, version)
    assert count() == 3
    last = await load_response(store, TENANT, "resp_2")
    assert last is not None and last.conversation() == items_of_turns(3)
    for key in ("resp_0", "resp_1", "resp_2"):
        assert await store.delete(TENANT, key)
    assert count() == 0


def _user_texts(conversation: list[dict[str, Any]]) -> list[str]:
    return [i["content"][0]["text"] for i in conversation if i.get("role") == "user"]


async def test_the_server_links_each_turn_over_http_and_over_the_socket(
    make_app: Any, tmp_path: Path
) -> None:
    """With --responses-store-format 2, a continuation is stored linked to what it continued,
    whether its history came from the store (HTTP) or from a socket's own cache."""
    engine = FakeEngine(max_model_len=4096)  # room for the whole conversation
    app = make_app(engine=engine, storage_dir=str(tmp_path), responses_store_format="2")
    async with client_for(app) as client:
        previous = None
        for i in range(3):
            body = {
                "model": "fake-model",
                "input": f"http {i}",
                "instructions": "Be brief.",
                "temperature": 0.5,
            }
            r = await client.post("/v1/responses", json={**body, "previous_response_id": previous})
            assert r.status_code == 200, r.text
            previous = r.json()["id"]
            retrieved = await client.get(f"/v1/responses/{previous}")
            assert retrieved.json() == r.json()  # the response object as answered
            assert list(retrieved.json()) == list(r.json())
    with TestClient(app) as sync, sync.websocket_connect("/v1/responses") as ws:
        for i in range(3):
            frame = {"type": "response.create", "model": "fake-model", "input": f"socket {i}"}
            ws.send_text(json.dumps({**frame, "previous_response_id": previous}))
            while (event := json.loads(ws.receive_text()))["type"] != "response.completed":
                assert event["type"] != "error", event
            previous = event["response"]["id"]
    store = SQLiteStore(tmp_path / SQLITE_FILE, max_num_responses=100)
    assert previous is not None
    chain = await store.chain("", previous)
    assert chain is not None and len(chain) == 6  # every turn's record, each linked to the last
    last = StoredResponse.from_chain(chain)
    assert last is not None and last.version == 2
    assert _user_texts(last.conversation()) == [f"http {i}" for i in range(3)] + [
        f"socket {i}" for i in range(3)
    ]
    assert len(last.conversation()) == 12
    # The settings echoed in every response (instructions here) are stored once, in the first.
    assert b"Be brief." in chain[-1] and all(b"Be brief." not in raw for raw in chain[1:-1])
    await store.aclose()


def test_a_response_object_keeps_only_what_differs_from_its_parents_and_reads_back_exactly() -> None:
    root = {
        "id": "resp_0",
        "object": "response",
        "tools": ["t"] * 50,
        "temperature": 1,
        "x": None,
        "output": [],
    }
    middle = {**root, "id": "resp_1", "output": [{"type": "message"}]}
    last = {"id": "resp_2", "object": "response", "tools": ["t"] * 50, "temperature": 1.0, "output": []}
    raws = [StoredResponse(root, [], []).dumps(2)]
    for response, before in [(middle, root), (last, middle)]:
        parent = Parent(str(before["id"]), 0, before)
        raws.insert(0, StoredResponse(response, [], [], parent=parent).dumps(2))
    stored = [orjson.loads(raw)["response"] for raw in raws]
    assert "tools" not in stored[0] and "tools" not in stored[1]  # stored once, in the root
    assert stored[0]["temperature"] == 1.0 and "x" not in stored[0]  # 1.0 is not 1 in JSON
    for i, response in enumerate([last, middle, root]):
        got = StoredResponse.from_chain(raws[i:])
        assert got is not None and got.response == response and list(got.response) == list(response)
    got = StoredResponse.from_chain(raws)
    assert got is not None and isinstance(got.response["temperature"], float)
    assert "x" not in got.response  # dropped since its parent: not taken from the root
    assert StoredResponse.from_chain(raws[:2]) is None  # an ancestor missing: no partial read


async def test_on_redis_a_record_keeps_its_ancestors_as_long_as_itself(redis_url: str) -> None:
    """Each write extends its ancestors' TTL to its own, so no older link lapses first."""
    store = RedisStore(redis_url, ttl_s=600, max_num_responses=100)
    client = redis.Redis.from_url(redis_url)
    try:
        await continue_chain(store, 0, None)
        await continue_chain(store, 1, "resp_0")
        assert await store.delete(TENANT, "resp_0")  # hidden, kept for resp_1
        client.expire("{tenant:acme}:part:resp_0", 5)
        client.expire("{tenant:acme}:stored:resp_1", 5)
        await continue_chain(store, 2, "resp_1")
        assert (
            client.ttl("{tenant:acme}:part:resp_0") > 500 and client.ttl("{tenant:acme}:stored:resp_1") > 500
        )
        assert client.type("{tenant:acme}:stored:resp_2") == b"hash"
    finally:
        client.close()
        await store.aclose()


@pytest.mark.parametrize("status", ["completed", "in_progress"])
async def test_a_continuation_links_only_to_a_final_response(make_app: Any, status: str) -> None:
    """A background response still running is written again when it ends (its output, its
    status): what continues it meanwhile is stored whole, never linked to a record that changes."""
    from gateway.admission import Caller
    from gateway.backend import Work
    from gateway.endpoints import RESPONSES

    state = make_app(responses_store_format="2").state.gateway.responses
    response, inputs = turn(0)
    await save_response(state.store, "", StoredResponse({**response, "status": status}, inputs, []), 2)
    body = {"model": "fake-model", "input": "next", "previous_response_id": "resp_0"}
    work = Work(RESPONSES, RESPONSES.parse(body), body, Caller(""), "fake-model", "resp_1")
    await state.prepare(work)
    assert isinstance(work.request, ResponsesRequest) and len(work.request.history) == 2
    linked = work.request.history_parent
    assert (linked is not None and linked.response_id == "resp_0") == (status == "completed")


async def test_on_redis_a_record_unused_for_its_ttl_goes_at_the_next_write_kept_for_its_children(
    redis_url: str,
) -> None:
    """Its children's writes keep its hash alive; once unused for the TTL it is no longer the
    tenant's to read (nor counted), but still resolves for them."""
    store = RedisStore(redis_url, ttl_s=600, max_num_responses=100)
    client = redis.Redis.from_url(redis_url)
    try:
        await continue_chain(store, 0, None)
        await continue_chain(store, 1, "resp_0")
        client.zadd("{tenant:acme}:stored", {"resp_0": 1.0})  # last used long ago (1970)
        assert await store.num_stored(TENANT) == 1
        await continue_chain(store, 2, "resp_1")
        assert await store.get(TENANT, "resp_0") is None and client.exists("{tenant:acme}:part:resp_0")
        last = await load_response(store, TENANT, "resp_2")
        assert last is not None and last.conversation() == items_of_turns(3)
        assert await store.num_stored(TENANT) == 2
    finally:
        client.close()
        await store.aclose()


def _turns_seen(prompt: str, num_turns: int) -> list[int]:
    """The conversation turns (`turn N `) a prompt holds, in the order it holds them."""
    seen = [(prompt.index(f"turn {i} "), i) for i in range(num_turns) if f"turn {i} " in prompt]
    return [i for _, i in sorted(seen)]


async def stored_bytes(kind: str, url: str | None, tmp_path: Path) -> int:
    """Every record's bytes in the store, hidden parts included."""
    if kind == "sqlite":
        with sqlite3.connect(tmp_path / SQLITE_FILE) as db:
            return int(db.execute("SELECT SUM(LENGTH(record)) FROM responses").fetchone()[0])
    client = redis.Redis.from_url(url or "")
    try:
        total = 0
        for key in client.keys("*:stored:*") + client.keys("*:part:*"):
            raw = client.hget(key, "record") if client.type(key) == b"hash" else client.get(key)
            total += len(raw or b"")
        return total
    finally:
        client.close()


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
async def test_a_conversation_names_its_latest_response_and_stores_each_item_once(
    make_app: Any, tmp_path: Path, request: pytest.FixtureRequest, kind: str
) -> None:
    """With format 2, a conversation names its latest stored response (its head) instead of
    holding the items through it, and each response created with `conversation` links to the head
    before it: over 100 turns no record grows and the store holds at most 2x the items' bytes. The
    conversation lists every item; a `previous_response_id` continuation reads its response's own
    history; an item added by the items API waits in the tail for the next turn; a response deleted
    is kept for the conversation; an item deleted from the head's part stores the conversation whole
    again; the conversation deleted, what only it kept goes."""
    url = request.getfixturevalue("redis_url") if kind == "redis" else None
    where: dict[str, Any] = {"redis_url": url} if url else {"storage_dir": str(tmp_path)}
    engine = FakeEngine(max_model_len=1 << 20)
    app = make_app(engine=engine, responses_store_format="2", **where)
    store: ResponseStore = (
        RedisStore(url, ttl_s=600, max_num_responses=1000)
        if url
        else SQLiteStore(tmp_path / SQLITE_FILE, max_num_responses=1000)
    )

    async def prompt_of(body: dict[str, Any]) -> str:
        r = await client.post("/v1/responses", json={"model": "fake-model", **body})
        assert r.status_code == 200, r.text
        return engine.tokenizer.decode(engine.submitted[-1].prompt_token_ids)

    async def record_of(key: str) -> dict[str, Any]:
        raw = await store.get("", key)
        assert raw is not None
        return dict(orjson.loads(raw))

    async def listed() -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        after: dict[str, str] = {}
        while True:
            query = {"order": "asc", "limit": "100", **after}
            page = (await client.get(f"/v1/conversations/{conv}/items", params=query)).json()
            items += page["data"]
            if not page["has_more"]:
                return items
            after = {"after": items[-1]["id"]}

    async with client_for(app) as client:
        conv = (await client.post("/v1/conversations", json={})).json()["id"]
        for i in range(100):
            prompt = await prompt_of({"input": f"turn {i} " + "words " * 20, "conversation": conv})
            assert _turns_seen(prompt, 100) == list(range(i + 1))
        record = await record_of(conv)
        assert "items" not in record and record["tail"] == [] and record["head"].startswith("resp_")
        items = await listed()
        assert len(items) == 200 and [i["role"] for i in items] == ["user", "assistant"] * 100
        # Each response's record holds its own turn only, so none grows with the turns before it.
        chain = await store.chain("", record["head"])
        assert chain is not None and len(chain) == 100
        sizes = [len(raw) for raw in chain[:-1]]  # (the first holds the settings all inherit)
        assert max(sizes) <= min(sizes) + 64, sizes
        assert all(b"turn %d " % (98 - k) not in raw for k, raw in enumerate(chain[:-1]))
        total, items_bytes = await stored_bytes(kind, url, tmp_path), len(orjson.dumps(items))
        assert total <= 2 * items_bytes, (total, items_bytes)
        ids = [orjson.loads(raw)["response"]["id"] for raw in chain[::-1]]

        # A continuation reads its response's history.
        prompt = await prompt_of({"input": "next", "previous_response_id": ids[49]})
        assert _turns_seen(prompt, 100) == list(range(50)) and "next" in prompt

        # An item added waits in the tail; the next turn takes it in and becomes the head.
        added = {"type": "message", "role": "user", "content": "an added note"}
        r = await client.post(f"/v1/conversations/{conv}/items", json={"items": [added]})
        assert r.status_code == 200, r.text
        assert (await record_of(conv))["tail"][0]["content"][0]["text"] == "an added note"
        prompt = await prompt_of({"input": "turn 100 after the note", "conversation": conv})
        assert prompt.index("turn 99 ") < prompt.index("an added note") < prompt.index("turn 100 ")
        record = await record_of(conv)
        assert record["tail"] == [] and record["head"] not in ids

        # The head deleted as a response: a 404 for its id, kept for the conversation, whose next
        # turn links to it still.
        assert (await client.delete(f"/v1/responses/{record['head']}")).status_code == 200
        assert (await client.get(f"/v1/responses/{record['head']}")).status_code == 404
        assert len(await listed()) == 203
        prompt = await prompt_of({"input": "after the head went", "conversation": conv})
        assert prompt.index("turn 100 after the note") < prompt.index("after the head went")
        assert len(await listed()) == 205 and (await record_of(conv))["head"] != record["head"]

        # An item of the head's part deleted: the conversation is stored whole without it; the
        # responses keep their own histories (turn 10 stays in turn 49's).
        r = await client.delete(f"/v1/conversations/{conv}/items/{items[20]['id']}")
        assert r.status_code == 200, r.text
        whole = await record_of(conv)
        assert len(whole["items"]) == 204 and items[20]["id"] not in {i["id"] for i in whole["items"]}
        assert [i["id"] for i in await listed()] == [i["id"] for i in whole["items"]]
        prompt = await prompt_of({"input": "again", "previous_response_id": ids[49]})
        assert _turns_seen(prompt, 100) == list(range(50))
        prompt = await prompt_of({"input": "turn 101 ", "conversation": conv})
        seen = _turns_seen(prompt, 102)
        assert 10 not in seen and 11 in seen and 101 in seen
        assert "head" in await record_of(conv)

        # The conversation deleted: what only it kept goes (the response deleted above).
        before = await stored_bytes(kind, url, tmp_path)
        assert (await client.delete(f"/v1/conversations/{conv}")).status_code == 200
        assert (await client.get(f"/v1/conversations/{conv}")).status_code == 404
        assert await stored_bytes(kind, url, tmp_path) < before
        assert (await client.get(f"/v1/responses/{ids[99]}")).status_code == 200
    await store.aclose()
    engine.submitted.clear()  # 100 turns' prompts: not left for the tests after (their GC pauses)


async def test_a_response_that_names_its_conversations_items_is_still_continued(
    make_app: Any, tmp_path: Path
) -> None:
    """52b05c6 stored a response created with `conversation` naming the conversation's items before
    it (`conversation_history`) instead of holding them: a continuation reads them back from the
    conversation, and is refused with a 400 naming the parameter once they are deleted."""
    engine = FakeEngine(max_model_len=1 << 20)
    app = make_app(engine=engine, responses_store_format="2", storage_dir=str(tmp_path))
    store = SQLiteStore(tmp_path / SQLITE_FILE, max_num_responses=100)
    before = [
        {
            "type": "message",
            "id": f"msg_b{i}",
            "role": "user",
            "content": [{"type": "input_text", "text": f"turn {i} "}],
        }
        for i in range(2)
    ]
    response, inputs = turn(2)
    conversation = {"id": "conv_legacy", "object": "conversation", "created_at": 0, "metadata": {}}
    await store.put(
        "", "conv_legacy", StoredConversation(conversation, [*before, *inputs, *response["output"]]).dumps()
    )
    named = StoredResponse(response, inputs, before, in_conversation=InConversation("conv_legacy", "msg_b1"))
    assert await store.put_linked("", "resp_2", named.dumps(2), None)
    async with client_for(app) as client:
        body = {"model": "fake-model", "input": "next", "previous_response_id": "resp_2"}
        assert (await client.post("/v1/responses", json=body)).status_code == 200
        assert _turns_seen(engine.tokenizer.decode(engine.submitted[-1].prompt_token_ids), 3) == [0, 1, 2]
        for item in ("msg_b1", "msg_in2"):  # its anchor, then its own first item
            assert (await client.delete(f"/v1/conversations/conv_legacy/items/{item}")).status_code == 200
        r = await client.post("/v1/responses", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    await store.aclose()


async def test_a_conversations_background_unstored_and_compacted_turns_keep_it_whole(make_app: Any) -> None:
    """In format 2: a background turn becomes the conversation's head once it ends; a `store:
    false` turn and one whose history was compacted are not its history whole, so their items wait
    in the tail, and the next turn takes them in; the conversation lists every turn in order."""
    engine = FakeEngine(max_model_len=1 << 16)
    engine.reply = lambda request, index: "summary-or-answer"
    app = make_app(engine=engine, responses_store_format="2")
    async with client_for(app) as client:

        async def turn_in(text: str, **body: Any) -> dict[str, Any]:
            r = await client.post(
                "/v1/responses",
                json={
                    "model": "fake-model",
                    "input": text,
                    "conversation": conv,
                    "max_output_tokens": 8,
                    **body,
                },
            )
            assert r.status_code == 200, r.text
            return dict(r.json())

        async def head() -> tuple[str | None, int]:
            state = app.state.gateway.conversations
            stored = await state.load("", conv)
            return (stored.head.response_id if stored.head else None), len(stored.items) - (
                stored.head.num_items if stored.head else 0
            )

        conv = (await client.post("/v1/conversations", json={})).json()["id"]
        first = await turn_in("turn 0 ")
        assert await head() == (first["id"], 0)
        queued = await turn_in("turn 1 ", background=True)
        assert queued["status"] == "queued"
        for _ in range(500):  # the fake engine answers at once; the run ends within a few loops
            if (await client.get(f"/v1/responses/{queued['id']}")).json()["status"] == "completed":
                break
            await asyncio.sleep(0.01)
        assert await head() == (queued["id"], 0)
        await turn_in("turn 2 ", store=False)
        assert await head() == (queued["id"], 2)
        await turn_in(
            "turn 3 " + "long " * 60, context_management=[{"type": "compaction", "compact_threshold": 50}]
        )
        assert await head() == (queued["id"], 4)
        last = await turn_in("turn 4 ")
        assert await head() == (last["id"], 0)
        prompt = engine.tokenizer.decode(engine.submitted[-1].prompt_token_ids)
        assert _turns_seen(prompt, 5) == [0, 1, 2, 3, 4]
        page = (
            await client.get(f"/v1/conversations/{conv}/items", params={"order": "asc", "limit": 100})
        ).json()
        said = [i["content"][0]["text"][:7] for i in page["data"] if i["role"] == "user"]
        assert said == [f"turn {i} " for i in range(5)]
