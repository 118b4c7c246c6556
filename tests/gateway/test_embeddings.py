"""`POST /v1/embeddings` in process: OpenAI's shapes and limits, over the real all-MiniLM-L6-v2
behind the real batcher (a wrapper injects failures and holds calls where a test needs it)."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import threading
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import tenancy
from engine.embeddings.model import EmbeddingModel
from engine.embeddings.policy import BatchLimits
from gateway import telemetry
from gateway.local.embedding_backend import EmbeddingService, _encode
from gateway.openai.bodies import embedding_list
from tests.gateway.conftest import AppFactory, client_for
from tests.gateway.helpers import ASGICall, validate

MODEL = "all-MiniLM-L6-v2"


class Steered:
    """The real model, with a gate that holds calls and a marker token id that makes a call raise."""

    FAIL_TOKEN = 13  # an unused id in MiniLM's vocabulary ([unused8])

    def __init__(self, model: EmbeddingModel) -> None:
        self.model = model
        self.name, self.dimensions = model.name, model.dimensions
        self.max_input_tokens, self.vocab_size = model.max_input_tokens, model.vocab_size
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.calls: list[list[list[int]]] = []

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return self.model.tokenize(texts)

    def truncate(self, ids: list[int], num_tokens: int, *, text: bool) -> list[int]:
        return self.model.truncate(ids, num_tokens, text=text)

    def embed(self, batch: list[list[int]]) -> list[list[float]]:
        self.calls.append(batch)
        self.entered.set()
        assert self.gate.wait(10)
        if any(self.FAIL_TOKEN in ids for ids in batch):
            raise RuntimeError("injected model failure")
        return self.model.embed(batch)


@pytest.fixture(scope="session")
def minilm() -> EmbeddingModel:
    return EmbeddingModel.load(None)


@pytest.fixture
def steered(minilm: EmbeddingModel) -> Any:
    model = Steered(minilm)
    service = EmbeddingService(model, BatchLimits(max_wait_s=0.0))
    yield model, service
    model.gate.set()
    service.shutdown()


def floats(b64: str) -> list[float]:
    raw = base64.b64decode(b64)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


async def test_float_and_base64_in_openai_shape(make_app: AppFactory, steered: Any, minilm: Any) -> None:
    _, service = steered
    async with client_for(make_app(embedder=service)) as c:
        texts = ["The food was delicious.", "Das Essen war köstlich.", "a"]
        r = await c.post("/v1/embeddings", json={"model": MODEL, "input": texts, "encoding_format": "float"})
        assert r.status_code == 200, r.text
        body = r.json()
        validate(body, "CreateEmbeddingResponse")
        assert body["object"] == "list" and body["model"] == MODEL
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        assert all(d["object"] == "embedding" and len(d["embedding"]) == 384 for d in body["data"])
        expected = minilm.embed(minilm.tokenize(texts))
        for got, want in zip(body["data"], expected, strict=True):
            assert got["embedding"] == pytest.approx(want, abs=1e-6)
        num_tokens = sum(len(ids) for ids in minilm.tokenize(texts))
        assert body["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}

        r = await c.post("/v1/embeddings", json={"model": MODEL, "input": texts, "encoding_format": "base64"})
        decoded = [floats(d["embedding"]) for d in r.json()["data"]]
        for got, want in zip(decoded, expected, strict=True):
            assert got == pytest.approx(want, abs=1e-6)  # little-endian float32, as the SDK decodes

        # A string, token ids, and lists of token ids are inputs too; `dimensions` may be the size.
        ids = minilm.tokenize(["hello world"])[0]
        for given in ("hello world", ids, [ids, ids]):
            r = await c.post("/v1/embeddings", json={"model": MODEL, "input": given, "dimensions": 384})
            assert r.status_code == 200, r.text
            for d in r.json()["data"]:
                assert d["embedding"] == pytest.approx(expected_for(minilm, "hello world"), abs=1e-6)

        r = await c.get("/v1/models")
        assert [m["id"] for m in r.json()["data"]] == ["fake-model", MODEL]
        assert (await c.get(f"/v1/models/{MODEL}")).json()["id"] == MODEL


def expected_for(minilm: EmbeddingModel, text: str) -> list[float]:
    return minilm.embed(minilm.tokenize([text]))[0]


async def test_the_400s_and_404s_name_the_problem(make_app: AppFactory, steered: Any) -> None:
    _, service = steered
    window = service.max_input_tokens
    cases: list[tuple[dict[str, Any], int, str, str]] = [
        ({"input": ""}, 400, "input", "empty"),
        ({"input": [""]}, 400, "input", "empty"),
        ({"input": []}, 400, "input", "not empty"),
        ({"input": [1, "a"]}, 400, "input", "must be a string"),
        ({"input": ["x"] * 2049}, 400, "input", "at most 2048"),
        ({"input": [[101] * 8193]}, 400, "input", "at most 8192 tokens are allowed per input"),
        ({"input": [[101] * 8000] * 38}, 400, "input", "at most 300000 tokens are allowed per request"),
        ({"input": [[101] * (window + 1)]}, 400, "input", f"{window}-token window"),
        ({"input": [[101, 100277, 102]]}, 400, "input", "check_embedding_ctx_length=False"),
        ({"input": "hi", "dimensions": 256}, 400, "dimensions", "384 dimensions"),
        ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format", ""),
        ({"input": "hi", "truncate_prompt_tokens": window + 1}, 400, "truncate_prompt_tokens", "window"),
        ({"input": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", "-1"),
        ({"input": "hi", "extra": 1}, 400, "extra", "Unrecognized"),
        ({"input": "hi", "model": "fake-model"}, 400, "model", "chat model"),
        ({"input": "hi", "model": "nope"}, 404, "model", "does not exist"),
    ]
    async with client_for(make_app(embedder=service)) as c:
        for extra, status, param, words in cases:
            r = await c.post("/v1/embeddings", json={"model": MODEL, **extra})
            assert r.status_code == status, (extra, r.text)
            error = r.json()["error"]
            assert error["param"] == param and words in error["message"], (extra, error)
        assert (await c.post("/v1/embeddings", json={"input": "hi"})).json()["error"]["param"] == "model"
        # The chat endpoints point an embedding model to /v1/embeddings.
        r = await c.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        )
        assert r.status_code == 400 and "/v1/embeddings" in r.json()["error"]["message"]
    # No embedding model at all: a 404 that says so.
    async with client_for(make_app()) as c:
        r = await c.post("/v1/embeddings", json={"model": MODEL, "input": "hi"})
        assert r.status_code == 404 and "serves no embedding model" in r.json()["error"]["message"]


async def test_truncation_opt_in_keeps_the_window(make_app: AppFactory, steered: Any, minilm: Any) -> None:
    _, service = steered
    text = "word " * 400
    async with client_for(make_app(embedder=service)) as c:
        r = await c.post("/v1/embeddings", json={"model": MODEL, "input": text})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = await c.post("/v1/embeddings", json={"model": MODEL, "input": text, "truncate_prompt_tokens": -1})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 256
        want = minilm.embed([minilm.truncate(minilm.tokenize([text])[0], 256, text=True)])[0]
        assert r.json()["data"][0]["embedding"] == pytest.approx(want, abs=1e-6)
        r = await c.post("/v1/embeddings", json={"model": MODEL, "input": text, "truncate_prompt_tokens": 10})
        assert r.json()["usage"]["prompt_tokens"] == 10


async def test_a_failed_batch_is_a_500_for_its_requests_only(make_app: AppFactory, steered: Any) -> None:
    model, service = steered
    async with client_for(make_app(embedder=service)) as c:
        model.gate.clear()
        first = asyncio.ensure_future(c.post("/v1/embeddings", json={"model": MODEL, "input": "first"}))
        await asyncio.to_thread(model.entered.wait, 10)
        # Queued together behind the held call: one batch, failed by the marker token.
        bad = asyncio.ensure_future(
            c.post("/v1/embeddings", json={"model": MODEL, "input": [[101, Steered.FAIL_TOKEN, 102]]})
        )
        mate = asyncio.ensure_future(c.post("/v1/embeddings", json={"model": MODEL, "input": "batch mate"}))
        while service.batcher.stats().num_queued_inputs < 2:
            await asyncio.sleep(0.005)
        model.gate.set()
        assert (await first).status_code == 200
        for response in (await bad, await mate):
            assert response.status_code == 500
            error = response.json()["error"]
            assert error["type"] == "server_error"
            assert response.headers["x-request-id"] in error["message"]
            assert "injected" not in error["message"]
        r = await c.post("/v1/embeddings", json={"model": MODEL, "input": "after"})
        assert r.status_code == 200  # the batcher goes on
        metrics = (await c.get("/metrics")).text
        assert "batchgate_embedding_batch_inputs_count 3.0" in metrics
        assert "batchgate_embedding_model_seconds_count 3.0" in metrics
        assert "batchgate_embedding_queue_wait_seconds_count 4.0" in metrics


async def test_a_disconnected_client_has_its_inputs_dropped(make_app: AppFactory, steered: Any) -> None:
    model, service = steered
    app = make_app(embedder=service)
    async with client_for(app) as c:
        model.gate.clear()
        first = asyncio.ensure_future(c.post("/v1/embeddings", json={"model": MODEL, "input": "first"}))
        await asyncio.to_thread(model.entered.wait, 10)
        call = ASGICall(app, "/v1/embeddings", {"model": MODEL, "input": ["gone"] * 5}).start()
        while service.batcher.stats().num_queued_inputs < 5:
            await asyncio.sleep(0.005)
        call.disconnect()
        await call.wait_until(lambda c: c.task.done())
        assert service.batcher.stats().num_queued_inputs == 0
        model.gate.set()
        assert (await first).status_code == 200
        assert len(model.calls) == 1


async def test_tokens_count_against_the_tenant_and_deadlines_refuse_fast(
    make_app: AppFactory, steered: Any, tmp_path: Path
) -> None:
    model, service = steered
    path = tmp_path / "tenants.toml"
    path.write_text(
        f"""
[plans.free]
priority = "free"
tokens_per_minute = 150
requests_per_minute = 100
max_concurrent_requests = 8
queue_deadline_seconds = 0.5

[tenants.acme]
plan = "free"
keys = ["{tenancy.hash_key("sk-acme")}"]
"""
    )
    t = tenancy.Tenancy.from_settings(str(path), None)
    auth = {"Authorization": "Bearer sk-acme"}
    async with client_for(make_app(tenancy=t, embedder=service)) as c:
        r = await c.post("/v1/embeddings", json={"model": MODEL, "input": "hi"})
        assert r.status_code == 401
        r = await c.post("/v1/embeddings", json={"model": MODEL, "input": [[101] * 100]}, headers=auth)
        assert r.status_code == 200 and r.headers["x-ratelimit-limit-tokens"] == "150"
        assert (await t.usage())["acme"].prompt_tokens == 100
        r = await c.post("/v1/embeddings", json={"model": MODEL, "input": [[101] * 60]}, headers=auth)
        assert r.status_code == 429  # 100 + 60 > 150 tokens a minute

        # Queue deadline: with a slow model measured and work queued ahead, a fast 503 at arrival.
        model.gate.clear()
        model.entered.clear()
        service.batcher.policy.seconds_per_token = 0.1  # 30 tokens running: ~3 s > the 0.5 s deadline
        body = {"model": MODEL, "input": [[101] * 30]}
        held = asyncio.ensure_future(c.post("/v1/embeddings", json=body, headers=auth))
        await asyncio.to_thread(model.entered.wait, 10)
        r = await c.post("/v1/embeddings", json={"model": MODEL, "input": [[101] * 10]}, headers=auth)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_overloaded"
        assert int(r.headers["retry-after"]) >= 1
        model.gate.set()
        assert (await held).status_code == 200
    await t.aclose()


async def test_the_embeddings_span_has_the_genai_attributes(
    make_app: AppFactory, steered: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(telemetry, "_enabled", True)
    monkeypatch.setattr("opentelemetry.trace.get_tracer", lambda name, *a, **k: provider.get_tracer(name))
    _, service = steered
    async with client_for(make_app(embedder=service)) as c:
        r = await c.post(
            "/v1/embeddings", json={"model": MODEL, "input": ["a b", "c"], "encoding_format": "base64"}
        )
    (span,) = [s for s in exporter.get_finished_spans() if s.name.startswith("embeddings")]
    a = dict(span.attributes)
    assert span.name == f"embeddings {MODEL}"
    assert (a["gen_ai.operation.name"], a["gen_ai.request.model"]) == ("embeddings", MODEL)
    assert tuple(a["gen_ai.request.encoding_formats"]) == ("base64",)
    assert a["gen_ai.usage.input_tokens"] == r.json()["usage"]["prompt_tokens"] == 7
    assert a["gen_ai.response.id"] == r.headers["x-request-id"]
    assert [e.name for e in span.events] == ["gen_ai.admission", "gen_ai.completion"]


def test_the_json_body_is_plain_json_and_refuses_non_finite_numbers() -> None:
    body = embedding_list("m", ([0.5, -1e-05, 0.1234567890123],), None, 3)
    assert json.loads(_encode(body)) == body
    # orjson would write NaN as null; a faulty model's vector is an error (500), as with json.dumps.
    with pytest.raises(ValueError, match="not JSON compliant"):
        _encode(embedding_list("m", ([0.5, float("nan")],), None, 1))
