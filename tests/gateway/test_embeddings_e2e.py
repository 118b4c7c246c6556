"""/v1/embeddings end to end: the official openai SDK and LangChain's OpenAIEmbeddings over real
HTTP, against an embedding-only server (`--model none`) with the real all-MiniLM-L6-v2, both
directly and through a gateway that proxies to it (the replica lists the model in /v1/models)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from engine.embeddings.model import EmbeddingModel
from engine.embeddings.policy import BatchLimits
from gateway.app import create_app
from gateway.local.embedding_backend import EmbeddingService
from gateway.settings import Settings
from tests.gateway.conftest import LiveServer
from tests.gateway.fakes import FakeEngine

MODEL = "all-MiniLM-L6-v2"
TOKEN = "embeddings-internal-token"
TEXTS = ["The food was delicious and the waiter...", "Ünïcödé and 日本語", "a"]


@pytest.fixture(scope="module")
def minilm() -> EmbeddingModel:
    return EmbeddingModel.load(None)


@pytest.fixture(scope="module")
def servers(minilm: EmbeddingModel) -> Iterator[dict[str, str]]:
    """{"in-process": url, "proxied": url}: an embedding replica, and a gateway in front of it."""
    service = EmbeddingService(minilm, BatchLimits())
    replica = LiveServer(create_app(Settings(model="none", internal_token=TOKEN), embedder=service))
    gateway = LiveServer(
        create_app(Settings(upstreams=(replica.base_url,), internal_token=TOKEN, health_interval_s=0.1))
    )
    try:
        deadline = time.monotonic() + 30
        while httpx.get(gateway.base_url + "/ready").status_code != 200:  # bounded: a poll or two
            assert time.monotonic() < deadline, "the gateway never saw the replica"
            time.sleep(0.05)
        yield {"in-process": replica.base_url, "proxied": gateway.base_url}
    finally:
        gateway.stop()
        replica.stop()
        service.shutdown()


@pytest.fixture(params=["in-process", "proxied"])
def base_url(request: pytest.FixtureRequest, servers: dict[str, str]) -> str:
    return servers[request.param]


def expected(minilm: EmbeddingModel, texts: list[str]) -> list[list[float]]:
    return minilm.embed(minilm.tokenize(texts))


def test_openai_sdk_with_its_defaults_and_with_floats(base_url: str, minilm: EmbeddingModel) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    assert MODEL in [m.id for m in client.models.list()]
    want = expected(minilm, TEXTS)
    for kwargs in ({}, {"encoding_format": "float"}):  # the SDK's default is base64, decoded by it
        reply = client.embeddings.create(model=MODEL, input=TEXTS, **kwargs)
        assert reply.model == MODEL and [d.index for d in reply.data] == [0, 1, 2]
        for got, w in zip(reply.data, want, strict=True):
            assert got.embedding == pytest.approx(w, abs=1e-6)
        assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(map(len, minilm.tokenize(TEXTS)))
    one = client.embeddings.create(model=MODEL, input="a")
    assert one.data[0].embedding == pytest.approx(want[2], abs=1e-6)


def test_langchain_openai_embeddings(base_url: str, minilm: EmbeddingModel) -> None:
    from langchain_openai import OpenAIEmbeddings

    lc = OpenAIEmbeddings(
        model=MODEL, base_url=base_url + "/v1", api_key="unused", check_embedding_ctx_length=False
    )
    want = expected(minilm, TEXTS)
    for got, w in zip(lc.embed_documents(TEXTS), want, strict=True):
        assert got == pytest.approx(w, abs=1e-6)
    assert lc.embed_query("a") == pytest.approx(want[2], abs=1e-6)


def test_limits_and_bad_inputs_are_400s(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    # What LangChain sends by default: OpenAI's own (cl100k) token ids, here outside the vocabulary.
    with pytest.raises(openai.BadRequestError) as bad:
        client.embeddings.create(model=MODEL, input=[[791, 4062, 14198, 39935]])
    assert "check_embedding_ctx_length=False" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.embeddings.create(model=MODEL, input=["x"] * 2049)
    assert "at most 2048" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.embeddings.create(model=MODEL, input="word " * 300)
    assert bad.value.code == "context_length_exceeded"
    reply = client.embeddings.create(
        model=MODEL, input="word " * 300, extra_body={"truncate_prompt_tokens": -1}
    )
    assert reply.usage.prompt_tokens == 256
    with pytest.raises(openai.BadRequestError) as bad:
        client.embeddings.create(model=MODEL, input="x", dimensions=128)
    assert bad.value.param == "dimensions"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="x")
    with pytest.raises(openai.BadRequestError) as bad:  # an embedding model, sent to chat
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert bad.value.param == "model" and "is an embedding model" in bad.value.message


def test_make_serve_loads_the_bundled_embedding_model_beside_the_chat_model() -> None:
    """The default settings load all-MiniLM-L6-v2 at start-up: /ready waits for it, /v1/models
    lists both models, and the app shuts its batcher down."""
    app = create_app(Settings(), engine=FakeEngine())
    assert Settings().embedding_model == "bundled"
    with TestClient(app) as client:
        deadline = time.monotonic() + 60
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, client.get("/ready").json()
            time.sleep(0.05)
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["fake-model", MODEL]
        r = client.post("/v1/embeddings", json={"model": MODEL, "input": "hi"})
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384
        service: Any = app.state.gateway.embedders[0].service
    assert not service.ready
