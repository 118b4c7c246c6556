"""The Files and Batches APIs end to end: the official openai SDK over real HTTP (uvicorn), the real
engine (tiny model) and embedding model, tenancy with two tenants and the ledger in the storage
directory. The SDK's own types validate every object; each output line's body validates as the
endpoint's response type."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types import Batch, CreateEmbeddingResponse, FileObject
from openai.types.chat import ChatCompletion

from engine.embeddings.model import EmbeddingModel
from engine.embeddings.policy import BatchLimits
from gateway.app import create_app
from gateway.cli import build_tenancy
from gateway.local.embedding_backend import EmbeddingService
from gateway.settings import Settings
from tenancy import hash_key
from tests.gateway.conftest import LiveServer, tiny_async_engine

MODEL = "tiny"
EMBEDDER = "all-MiniLM-L6-v2"
MAX_FILE_BYTES = 64 * 1024
QUOTA = 200 * 1024
TENANTS = f"""
[prices.tiny]
input = 1.0
output = 4.0
batch_multiplier = 0.5

[plans.paid]
priority = "paid"
tokens_per_minute = 1000000
requests_per_minute = 100000
max_concurrent_requests = 100
queue_deadline_seconds = 30
storage_quota_bytes = {QUOTA}
batch_max_concurrent_lines = 4

[tenants.alice]
plan = "paid"
keys = ["{hash_key("sk-alice")}"]

[tenants.bob]
plan = "paid"
keys = ["{hash_key("sk-bob")}"]

[tenants.capped]
plan = "paid"
keys = ["{hash_key("sk-capped")}"]
budget_usd = 0.0001           # 100 micro-dollars: room for a few lines at the batch price
budget_window = "daily"
"""
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}},
    },
}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    workdir = tmp_path_factory.mktemp("batches")
    (workdir / "tenants.toml").write_text(TENANTS)
    settings = Settings(
        tenants=str(workdir / "tenants.toml"),
        storage_dir=str(workdir / "storage"),
        keep_alive_s=1.0,
        max_file_bytes=MAX_FILE_BYTES,
    )
    engine = tiny_async_engine(tiny_model_dir, MODEL)
    embedder = EmbeddingService(EmbeddingModel.load(None), BatchLimits())
    app = create_app(
        settings, engine=engine, embedder=embedder, tenancy=build_tenancy(settings), owns_tenancy=True
    )
    live = LiveServer(app)
    try:
        yield live
    finally:
        live.stop()
        engine.shutdown()
        embedder.shutdown()


def sdk(server: LiveServer, key: str = "sk-alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def chat_line(custom_id: str, **body: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 12, **body}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def wait_done(client: openai.OpenAI, batch_id: str, timeout_s: float = 60.0) -> Batch:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status} after {timeout_s}s: {batch}"
        time.sleep(0.05)


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).content.splitlines()]


def run_batch(client: openai.OpenAI, lines: list[dict[str, Any]], endpoint: str) -> Batch:
    upload = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id,
        endpoint=endpoint,
        completion_window="24h",
        metadata={"job": "nightly"},  # type: ignore[arg-type]
    )
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    return wait_done(client, batch.id)


def test_a_chat_batch_with_response_format_and_tools_lines(server: LiveServer) -> None:
    client = sdk(server)
    response_format = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    lines = [
        chat_line("plain", temperature=0),
        chat_line("json", response_format=response_format, max_tokens=40),
        chat_line("tools", tools=[TOOL], tool_choice="required", max_tokens=40),
        chat_line("too-long", max_tokens=100_000),  # refused by the pipeline: that line's error
    ]
    batch = run_batch(client, lines, "/v1/chat/completions")
    assert batch.status == "completed", batch
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
        4,
        3,
        1,
    )
    outputs = {line["custom_id"]: line for line in lines_of(client, batch.output_file_id)}
    errors = {line["custom_id"]: line for line in lines_of(client, batch.error_file_id)}
    assert sorted(outputs) == ["json", "plain", "tools"] and list(errors) == ["too-long"]
    bodies = {cid: ChatCompletion.model_validate(line["response"]["body"]) for cid, line in outputs.items()}
    for line in outputs.values():
        assert line["id"].startswith("batch_req_") and line["error"] is None
        assert line["response"]["status_code"] == 200
    content = bodies["json"].choices[0].message.content
    assert content is not None and set(json.loads(content)) == {"city"}
    calls = bodies["tools"].choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    refused = errors["too-long"]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["type"] == "invalid_request_error"
    usage = [b.usage for b in bodies.values() if b.usage is not None]
    assert batch.usage is not None
    assert batch.usage.input_tokens == sum(u.prompt_tokens for u in usage)
    assert batch.usage.output_tokens == sum(u.completion_tokens for u in usage)
    # The ledger holds the lines as batch work, at half the price.
    spent = httpx.get(
        server.base_url + "/v1/usage",
        params={"start_time": int(time.time()) - 3600, "group_by": "batch"},
        headers={"authorization": "Bearer sk-alice"},
    ).json()
    results = [r for bucket in spent["data"] for r in bucket["results"] if r.get("batch")]
    assert sum(r["output_tokens"] for r in results) >= batch.usage.output_tokens
    assert (
        FileObject.model_validate(client.files.retrieve(batch.output_file_id or "")).purpose == "batch_output"
    )


def test_an_embeddings_batch(server: LiveServer) -> None:
    client = sdk(server)
    texts = ["the first", "a second text", "third"]
    lines = [
        {
            "custom_id": f"e{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": EMBEDDER, "input": t},
        }
        for i, t in enumerate(texts)
    ]
    batch = run_batch(client, lines, "/v1/embeddings")
    assert batch.status == "completed" and batch.error_file_id is None
    out = lines_of(client, batch.output_file_id)
    assert [line["custom_id"] for line in out] == ["e0", "e1", "e2"]
    direct = client.embeddings.create(model=EMBEDDER, input=texts[1]).data[0].embedding
    body = CreateEmbeddingResponse.model_validate(out[1]["response"]["body"])
    assert body.data[0].embedding == pytest.approx(direct, abs=1e-5)


def test_bad_lines_fail_the_batch_naming_each_line(server: LiveServer) -> None:
    client = sdk(server)
    good = chat_line("ok")
    raw = jsonl([good])
    raw += b"{not json\n"
    raw += jsonl([chat_line("ok"), chat_line("m", model="no-such-model") | {"custom_id": "m"}])
    raw += jsonl([{**chat_line("u"), "url": "/v1/embeddings"}])
    upload = client.files.create(file=("bad.jsonl", io.BytesIO(raw)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = wait_done(client, batch.id)
    assert batch.status == "failed" and batch.errors is not None and batch.errors.data
    found = {(e.line, e.code) for e in batch.errors.data}
    assert found == {(2, "invalid_json_line"), (3, "duplicate_custom_id"), (5, "mismatched_endpoint")}
    # Structural errors first; the model is checked once the lines parse.
    upload = client.files.create(
        file=(
            "model.jsonl",
            io.BytesIO(jsonl([good, {**chat_line("m"), "body": {**good["body"], "model": "nope"}}])),
        ),
        purpose="batch",
    )
    batch = wait_done(
        client,
        client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id,
    )
    assert batch.status == "failed" and batch.errors is not None and batch.errors.data
    assert [(e.line, e.code, e.param) for e in batch.errors.data] == [(2, "model_not_found", "body.model")]


def test_bad_requests_are_refused_at_create(server: LiveServer) -> None:
    alice, bob = sdk(server), sdk(server, "sk-bob")
    upload = alice.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat_line("a")]))), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="Invalid value for .endpoint.: Input should be"):
        alice.batches.create(input_file_id=upload.id, endpoint="/v1/moderations", completion_window="24h")
    with pytest.raises(openai.NotFoundError):  # another tenant's file is not there
        bob.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        bob.files.retrieve(upload.id)
    with pytest.raises(openai.NotFoundError):
        bob.files.content(upload.id)
    with pytest.raises(openai.APIStatusError) as oversize:
        alice.files.create(file=("big.jsonl", io.BytesIO(b"x" * (MAX_FILE_BYTES + 1))), purpose="batch")
    assert oversize.value.status_code == 413
    user_data = alice.files.create(file=("notes.txt", io.BytesIO(b"hello")), purpose="user_data")
    with pytest.raises(openai.BadRequestError, match="purpose 'batch'"):
        alice.batches.create(
            input_file_id=user_data.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    with pytest.raises(openai.BadRequestError):
        alice.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="1h")  # type: ignore[arg-type]


def test_files_are_listed_paged_deleted_and_held_to_the_quota(server: LiveServer) -> None:
    bob = sdk(server, "sk-bob")
    ids = [
        bob.files.create(file=(f"{i}.txt", io.BytesIO(b"x" * 100)), purpose="user_data").id for i in range(3)
    ]
    page = bob.files.list(limit=2, order="asc", purpose="user_data")
    assert [f.id for f in page.data] == ids[:2] and page.has_more
    assert [f.id for f in bob.files.list(order="asc", purpose="user_data")] == ids  # the SDK pages on
    assert bob.files.content(ids[0]).content == b"x" * 100
    deleted = bob.files.delete(ids[0])
    assert deleted.deleted and deleted.id == ids[0]
    with pytest.raises(openai.NotFoundError):
        bob.files.retrieve(ids[0])
    for _ in range(QUOTA // MAX_FILE_BYTES):
        bob.files.create(file=("f.bin", io.BytesIO(b"y" * MAX_FILE_BYTES)), purpose="user_data")
    with pytest.raises(openai.BadRequestError, match="quota"):
        bob.files.create(file=("f.bin", io.BytesIO(b"y" * MAX_FILE_BYTES)), purpose="user_data")


def test_batches_are_listed_newest_first_and_cancelled(server: LiveServer) -> None:
    client = sdk(server, "sk-bob")
    # 40 lines at 4 in flight: cancelled while most wait; each custom_id still ends in one line.
    lines = [chat_line(f"c{i}", max_tokens=64, ignore_eos=True) for i in range(40)]
    upload = client.files.create(file=("c.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    first = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    second = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    listed = client.batches.list(limit=1)
    assert [b.id for b in listed.data] == [second.id] and listed.has_more
    assert [b.id for b in client.batches.list(after=second.id, limit=1).data] == [first.id]
    cancelled = client.batches.cancel(first.id)
    assert cancelled.status == "cancelling"
    client.batches.cancel(second.id)
    for batch_id in (first.id, second.id):
        batch = wait_done(client, batch_id)
        assert batch.status == "cancelled" and batch.cancelled_at and batch.cancelling_at
        out = lines_of(client, batch.output_file_id) + lines_of(client, batch.error_file_id)
        assert sorted(line["custom_id"] for line in out) == sorted(f"c{i}" for i in range(40))
        stopped = [line for line in out if line["error"] is not None]
        assert stopped and all(line["error"]["code"] == "batch_cancelled" for line in stopped)
    with pytest.raises(openai.BadRequestError, match="Cannot cancel"):
        client.batches.cancel(first.id)


def test_lines_left_at_expiry_end_in_batch_expired_lines(server: LiveServer) -> None:
    """The completion window passes mid-batch (the runner's clock moved 24 h on, no sleep): the
    lines in flight finish, every line not started gets a `batch_expired` error line, and the
    batch ends `expired`, with one line per custom_id."""
    app: Any = server.server.config.app
    batches = app.state.gateway.batches
    real_clock = batches.clock
    client = sdk(server)
    lines = [chat_line(f"x{i}", max_tokens=32, ignore_eos=True) for i in range(24)]
    upload = client.files.create(file=("x.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    created = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    try:
        deadline = time.monotonic() + 60
        while (counts := client.batches.retrieve(created.id).request_counts) is None or counts.completed < 2:
            assert time.monotonic() < deadline, "no line completed"
            time.sleep(0.02)
        batches.clock = lambda: real_clock() + 24 * 3600 + 1
        batch = wait_done(client, created.id)
    finally:
        batches.clock = real_clock
    assert batch.status == "expired" and batch.expired_at and batch.expires_at
    assert batch.expired_at >= batch.expires_at
    served = lines_of(client, batch.output_file_id)
    expired = lines_of(client, batch.error_file_id)
    assert sorted(line["custom_id"] for line in served + expired) == sorted(f"x{i}" for i in range(24))
    assert len(served) >= 2 and expired
    assert all(line["error"]["code"] == "batch_expired" and line["response"] is None for line in expired)
    assert all(line["response"]["body"]["usage"]["completion_tokens"] == 32 for line in served)
    counts = batch.request_counts
    assert counts is not None and (counts.total, counts.completed, counts.failed) == (
        24,
        len(served),
        len(expired),
    )


def test_a_hard_budget_stops_the_batch_with_insufficient_quota_lines(server: LiveServer) -> None:
    client = sdk(server, "sk-capped")
    batch = run_batch(client, [chat_line(f"q{i}") for i in range(12)], "/v1/chat/completions")
    assert batch.status == "completed" and batch.request_counts is not None
    served = lines_of(client, batch.output_file_id)
    refused = lines_of(client, batch.error_file_id)
    assert served and refused and batch.request_counts.completed == len(served)
    assert sorted(line["custom_id"] for line in served + refused) == sorted(f"q{i}" for i in range(12))
    for line in refused:  # refused at admission (a 429 line), or not started once one was
        code = line["error"]["code"] if line["error"] else line["response"]["body"]["error"]["code"]
        assert code == "insufficient_quota"
        assert line["response"] is None or line["response"]["status_code"] == 429
    spent = httpx.get(
        server.base_url + "/v1/usage",
        params={"start_time": int(time.time()) - 3600},
        headers={"authorization": "Bearer sk-capped"},
    ).json()
    assert sum(r["cost_micros"] for bucket in spent["data"] for r in bucket["results"]) <= 100


def test_the_objects_match_the_openapi_document(server: LiveServer) -> None:
    client = sdk(server)
    batch = run_batch(client, [chat_line("one")], "/v1/chat/completions")
    doc = httpx.get(server.base_url + "/openapi.json").json()
    auth = {"authorization": "Bearer sk-alice"}
    for path, name in (
        (f"/v1/batches/{batch.id}", "Batch"),
        ("/v1/batches?limit=2", "BatchList"),
        (f"/v1/files/{batch.output_file_id}", "FileObject"),
        ("/v1/files?limit=3", "FileList"),
    ):
        body = httpx.get(server.base_url + path, headers=auth).json()
        schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
        jsonschema.Draft202012Validator(schema).validate(body)
    unknown = httpx.post(
        server.base_url + "/v1/files",
        headers=auth,
        files={"file": ("a.txt", b"x")},
        data={"purpose": "user_data", "tenant": "bob"},
    )
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "tenant"
