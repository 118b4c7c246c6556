"""Several models in one server process, end to end with the openai SDK over real HTTP: two
in-process engines from a models file (the same tiny model under two names, with different
settings) and a third model proxied to a replica, each answering as its own model."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.settings import Settings, load_models_file
from tests.gateway.conftest import LiveServer
from tests.gateway.fakes import FakeEngine

TOKEN = "internal-t0ken"
MODELS = """
[[models]]
name = "tiny-a"
model = "{path}"
dtype = "float32"
max_model_len = 256
kv_cache_memory_bytes = "16MiB"
max_num_seqs = 4

[[models]]
name = "tiny-b"
model = "{path}"
dtype = "float32"
max_model_len = 128
kv_cache_memory_bytes = "8MiB"
max_num_seqs = 2
"""
MSG = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    models_file = tmp_path_factory.mktemp("models") / "models.toml"
    models_file.write_text(MODELS.format(path=tiny_model_dir))
    replica = LiveServer(
        create_app(
            Settings(embedding_model="none", internal_token=TOKEN),
            engine=FakeEngine(model_name="proxied-model"),
        )
    )
    settings = Settings(
        models_file=str(models_file),
        upstreams=(replica.base_url,),
        internal_token=TOKEN,
        health_interval_s=0.2,
        embedding_model="none",
    )
    gateway = LiveServer(create_app(settings))
    try:
        with httpx.Client(base_url=gateway.base_url, timeout=5) as http:
            deadline = time.monotonic() + 120  # both tiny engines load in a few seconds
            while http.get("/ready").status_code != 200 and time.monotonic() < deadline:
                assert http.get("/health").status_code == 200  # live while loading
                threading.Event().wait(0.05)  # polls another thread's progress; not a clock
            assert http.get("/ready").status_code == 200, http.get("/ready").text
        yield gateway
    finally:
        gateway.stop()
        replica.stop()


@pytest.fixture
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def test_the_models_file_reads_each_models_own_settings(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text(MODELS.format(path="/m"))
    a, b = load_models_file(str(path))
    assert (a.name, a.task, a.source, a.overrides["max_num_seqs"]) == ("tiny-a", "generate", "/m", 4)
    assert b.overrides["kv_cache_memory_bytes"] == 8 << 20 and b.overrides["max_model_len"] == 128
    settings = Settings(models_file=str(path)).for_model(b)
    assert (settings.served_model_name, settings.max_num_seqs, settings.model) == ("tiny-b", 2, "/m")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('[[models]]\nname = "x"\n', "exactly one of model or embedding_model"),
        ('[[models]]\nname = "x"\nmodel = "bundled"\ncolour = 1\n', "'colour' is not a setting"),
        ('[[models]]\nname = "x"\nmodel = "a"\n[[models]]\nname = "x"\nmodel = "b"\n', "declared twice"),
        ('[[models]]\nmodel = "a"\n', "needs a name"),
        ("models = 1\n", "expected only [[models]], [[loras]] and [[aliases]] tables"),
        ('[[models]]\nname = "x"\nmodel = "a"\nmax_num_seqs = 0\n', "max_num_seqs"),
    ],
)
def test_a_bad_models_file_fails_at_start_naming_the_problem(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "models.toml"
    path.write_text(body)
    with pytest.raises(ValueError) as info:
        Settings(models_file=str(path))
    assert message in str(info.value)


def test_models_lists_every_model(client: openai.OpenAI) -> None:
    assert sorted(m.id for m in client.models.list().data) == ["proxied-model", "tiny-a", "tiny-b"]
    assert client.models.retrieve("tiny-b").id == "tiny-b"


@pytest.mark.parametrize("model", ["tiny-a", "tiny-b", "proxied-model"])
def test_each_model_answers_as_itself(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(model=model, messages=MSG, max_tokens=8)
    assert r.model == model and r.choices[0].message.content
    assert r.usage is not None and 1 <= r.usage.completion_tokens <= 8
    chunks = list(
        client.chat.completions.create(
            model=model, messages=MSG, max_tokens=8, stream=True, stream_options={"include_usage": True}
        )
    )
    assert {c.model for c in chunks} == {model}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    text = client.completions.create(model=model, prompt="The sea is", max_tokens=4)
    assert text.model == model and text.choices[0].text is not None


def test_each_model_keeps_its_own_settings(client: openai.OpenAI) -> None:
    long_prompt = [{"role": "user", "content": "sea " * 150}]  # over tiny-b's 128 tokens, within tiny-a's 256
    r = client.chat.completions.create(model="tiny-a", messages=long_prompt, max_tokens=2)
    assert r.usage is not None and r.usage.prompt_tokens > 128
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny-b", messages=long_prompt, max_tokens=2)
    assert bad.value.code == "context_length_exceeded" and "128" in bad.value.message


def test_an_unknown_model_is_a_404_naming_the_served_ones(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=2)
    assert missing.value.code == "model_not_found"
    for name in ("tiny-a", "tiny-b", "proxied-model"):
        assert f"`{name}`" in missing.value.message


def test_generate_is_the_completions_alias(server: LiveServer) -> None:
    body: dict[str, Any] = {"model": "tiny-a", "prompt": "The sea is", "max_tokens": 4, "temperature": 0}
    alias = httpx.post(server.base_url + "/v1/generate", json=body, timeout=30).json()
    original = httpx.post(server.base_url + "/v1/completions", json=body, timeout=30).json()
    assert alias["object"] == "text_completion" and alias["model"] == "tiny-a"
    assert alias["choices"][0]["text"] == original["choices"][0]["text"]
    assert alias["usage"] == original["usage"]


def test_the_openapi_document_names_every_chat_model(server: LiveServer) -> None:
    doc = httpx.get(server.base_url + "/openapi.json", timeout=10).json()
    for request in ("ChatCompletionRequest", "CompletionRequest"):
        model = doc["components"]["schemas"][request]["properties"]["model"]
        assert sorted(model["enum"]) == ["proxied-model", "tiny-a", "tiny-b"]
    assert "/v1/generate" in doc["paths"]
