"""LoRA adapters served end to end: real uvicorn, the real engine (tiny model), a real
redis-server, the openai SDK. Each tenant sees and uses only its own adapters (and the public
ones); the admin API loads, replaces and unloads them at run time; a request keeps the adapter
version it started with; an unload gives the memory back."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from gateway import telemetry
from gateway.app import create_app
from gateway.cli import build_tenancy
from gateway.settings import Settings
from tenancy import hash_key
from tests.engine.helpers import hf_greedy
from tests.gateway.conftest import LiveServer
from tests.lora_adapters import TENANTS, make_adapter, peft_reference

BASE = "tiny"
ADMIN_KEY = "bg-admin-lora"
EOS = 2


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    root = tmp_path_factory.mktemp("e2e-loras")
    return {n: make_adapter(base, root / n, r=8, alpha=8, seed=seed) for seed, n in enumerate("abcd")}


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path,
    redis_server: str,
    adapters: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Any]:
    root = tmp_path_factory.mktemp("lora-e2e")
    (root / "tenants.toml").write_text(TENANTS.format(acme=hash_key("sk-acme"), beta=hash_key("sk-beta")))
    owned = f'[[loras]]\nname = "acme-tuned"\npath = "{adapters["b"]}"\ntenant = "acme"\n'
    (root / "models.toml").write_text(owned)
    settings = Settings(
        tenants=str(root / "tenants.toml"),
        redis_url=redis_server,
        models_file=str(root / "models.toml"),
        loras=(f"public-tuned={adapters['a']}",),
        admin_key_hash=hash_key(ADMIN_KEY),
        lora_roots=(str(adapters["a"].parent),),
        keep_alive_s=1.0,
        embedding_model="none",
    )
    engine = AsyncEngine.from_config(
        EngineConfig.of(
            model=str(tiny_model_dir),
            served_model_name=BASE,
            dtype="float32",
            max_model_len=512,
            kv_cache_memory_bytes=32 << 20,
        )
    )
    live = LiveServer(create_app(settings, engine=engine, tenancy=build_tenancy(settings), owns_tenancy=True))
    live.engine = engine  # type: ignore[attr-defined]
    try:
        yield live
    finally:
        live.stop()
        engine.shutdown()


def client(server: Any, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)


def admin(server: Any, method: str, path: str, body: Any = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {ADMIN_KEY}"}
    return httpx.request(method, server.base_url + path, json=body, headers=headers, timeout=30)


@pytest.fixture(scope="module")
def prompt(server: Any) -> list[int]:
    return list(server.engine.tokenizer.encode("Once upon a time"))


def reference(tiny_model_dir: Path, adapter: Path, prompt: list[int], n: int) -> list[int]:
    tokens = hf_greedy(peft_reference(tiny_model_dir, adapter), prompt, n)
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


def text_of(server: Any, tokens: list[int]) -> str:
    return str(server.engine.tokenizer.decode([t for t in tokens if t != EOS]))


def completion(server: Any, key: str, model: str, prompt: list[int], n: int) -> str:
    out = client(server, key).completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0)
    return out.choices[0].text


def test_each_tenant_lists_only_its_own_adapters_and_the_public_ones(server: Any) -> None:
    assert httpx.get(server.base_url + "/v1/models").status_code == 401  # with tenants, a key is needed
    acme = {m.id for m in client(server, "sk-acme").models.list()}
    beta = {m.id for m in client(server, "sk-beta").models.list()}
    assert acme == {BASE, "public-tuned", "acme-tuned"} and beta == {BASE, "public-tuned"}
    with pytest.raises(openai.NotFoundError):
        client(server, "sk-beta").models.retrieve("acme-tuned")
    assert client(server, "sk-acme").models.retrieve("acme-tuned").id == "acme-tuned"


def test_another_tenant_s_adapter_is_a_404_like_an_unknown_model(server: Any, prompt: list[int]) -> None:
    messages = []
    for model in ("acme-tuned", "no-such-adapter"):
        with pytest.raises(openai.NotFoundError) as info:
            completion(server, "sk-beta", model, prompt, 4)
        assert info.value.code == "model_not_found"
        messages.append(info.value.message.replace(model, "M"))
    assert messages[0] == messages[1]  # nothing tells an owned adapter from a name nobody serves


def test_adapters_equal_transformers_and_peft_through_http(
    server: Any, prompt: list[int], tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    texts = {}
    for model, key, folder in (("public-tuned", "sk-beta", "a"), ("acme-tuned", "sk-acme", "b")):
        texts[model] = completion(server, key, model, prompt, 12)
        assert texts[model] == text_of(server, reference(tiny_model_dir, adapters[folder], prompt, 12))
    assert len({completion(server, "sk-acme", BASE, prompt, 12), *texts.values()}) == 3


def test_the_span_names_the_adapter_version(
    server: Any, prompt: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(telemetry, "_enabled", True)
    monkeypatch.setattr("opentelemetry.trace.get_tracer", lambda name, *a, **k: provider.get_tracer(name))
    completion(server, "sk-acme", "acme-tuned", prompt, 2)
    adapter = server.engine.resolve_lora("acme-tuned")
    (span,) = [s for s in exporter.get_finished_spans() if s.attributes.get("batchgate.lora.id")]
    assert span.attributes["batchgate.lora.id"] == adapter.id
    assert span.attributes["batchgate.lora.content_hash"] == adapter.content_hash


def test_admin_loads_replaces_and_unloads_and_requests_keep_their_version(
    server: Any, prompt: list[int], tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    held = admin(server, "GET", "/admin/loras").json()["bytes_held"][BASE]
    loaded = admin(server, "PUT", "/admin/loras/beta-tuned", {"path": str(adapters["c"]), "tenant": "beta"})
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["owner"] == "beta" and loaded.json()["version"] == 1
    assert "beta-tuned" in {m.id for m in client(server, "sk-beta").models.list()}
    assert "beta-tuned" not in {m.id for m in client(server, "sk-acme").models.list()}
    assert admin(server, "GET", "/admin/loras").json()["bytes_held"][BASE] == held + loaded.json()["bytes"]

    n = 200  # long enough that the replace below lands while the stream is still generating
    v1_text = text_of(server, reference(tiny_model_dir, adapters["c"], prompt, n))
    v2_text = text_of(server, reference(tiny_model_dir, adapters["d"], prompt, n))
    v1 = server.engine.resolve_lora("beta-tuned")
    stream = client(server, "sk-beta").completions.create(
        model="beta-tuned", prompt=prompt, max_tokens=n, temperature=0, stream=True
    )
    chunks = iter(stream)
    first = next(chunks).choices[0].text
    busy = admin(server, "DELETE", "/admin/loras/beta-tuned?wait=false")
    assert busy.status_code == 409 and "in use" in busy.json()["error"]["message"]
    replaced = admin(server, "PUT", "/admin/loras/beta-tuned", {"path": str(adapters["d"]), "tenant": "beta"})
    assert replaced.json()["version"] == 2
    assert v1.users > 0  # the stream was still running when its adapter was replaced
    assert completion(server, "sk-beta", "beta-tuned", prompt, n) == v2_text  # new requests: v2
    assert first + "".join(c.choices[0].text for c in chunks) == v1_text  # the stream: v1 throughout
    assert v1.released

    gone = admin(server, "DELETE", "/admin/loras/beta-tuned")
    assert gone.status_code == 200 and gone.json()["released"] is True
    with pytest.raises(openai.NotFoundError):
        completion(server, "sk-beta", "beta-tuned", prompt, 2)
    assert admin(server, "GET", "/admin/loras").json()["bytes_held"][BASE] == held
    assert admin(server, "DELETE", "/admin/loras/beta-tuned").status_code == 404

    # Each change is in the admin audit log, beside the tenant and key changes (the 409 and the
    # 404 changed nothing, so they are not).
    audit = admin(server, "GET", "/admin/audit?limit=1000").json()["data"]
    mine = [e for e in audit if e["target"] == "lora:beta-tuned"][:3]
    assert [e["action"] for e in reversed(mine)] == ["lora.load", "lora.replace", "lora.unload"]
    load, replace, unload = reversed(mine)
    assert all(e["actor"].startswith("admin@") for e in mine)
    assert (load["detail"]["owner"], load["detail"]["version"]) == ("beta", 1)
    assert replace["detail"]["version"] == 2
    assert replace["detail"]["content_hash"] == replaced.json()["content_hash"]
    assert unload["detail"] == {"model": BASE, "owner": "beta", "released": True}
    assert ADMIN_KEY not in json.dumps(audit) and "sk-beta" not in json.dumps(audit)


def test_bad_admin_calls_are_clear_errors(server: Any, adapters: dict[str, Path]) -> None:
    assert httpx.get(server.base_url + "/admin/loras").status_code == 401
    empty = adapters["a"].parent / "empty"
    empty.mkdir(exist_ok=True)
    missing = admin(server, "PUT", "/admin/loras/x", {"path": str(empty)})
    assert missing.status_code == 400 and "adapter_config.json" in missing.json()["error"]["message"]
    assert admin(server, "PUT", "/admin/loras/x", {"tenant": "acme"}).status_code == 400
    assert admin(server, "PUT", f"/admin/loras/{BASE}", {"path": str(empty)}).status_code == 400


def test_hot_replace_and_unload_under_concurrent_streams_never_mix_versions(
    server: Any, prompt: list[int], tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    """The CI version of the stress run: rounds of 8 concurrent streams over 2 tenants' adapters
    and the base; while every stream of a round is running, one adapter is replaced and another
    loaded or unloaded. Each stream must equal the reference of the version it started with."""
    n = 32
    refs = {f: text_of(server, reference(tiny_model_dir, adapters[f], prompt, n)) for f in "acd"}
    refs["base"] = completion(server, "sk-acme", BASE, prompt, n)
    held = admin(server, "GET", "/admin/loras").json()["bytes_held"][BASE]
    folders = ["c", "d", "c"]

    def put(name: str, folder: str, tenant: str | None = None) -> None:
        body = {"path": str(adapters[folder]), "tenant": tenant}
        assert admin(server, "PUT", f"/admin/loras/{name}", body).status_code == 200

    def stream(key: str, model: str, started: threading.Semaphore) -> str:
        request = client(server, key).completions.create
        chunks = iter(request(model=model, prompt=prompt, max_tokens=n, temperature=0, stream=True))
        first = next(chunks).choices[0].text
        started.release()
        return first + "".join(c.choices[0].text for c in chunks)

    put("swap", "c", "acme")
    with ThreadPoolExecutor(8) as pool:
        for round_, folder in enumerate(folders):
            started = threading.Semaphore(0)
            jobs = [("sk-acme", "swap", folder)] * 4 + [("sk-beta", "public-tuned", "a")] * 2
            jobs += [("sk-acme", BASE, "base")] * 2
            futures = [(pool.submit(stream, key, model, started), want) for key, model, want in jobs]
            for _ in jobs:
                assert started.acquire(timeout=30)
            # every stream of the round runs: replace `swap`, and load or unload another adapter
            put("swap", folders[(round_ + 1) % len(folders)], "acme")
            if round_ % 2 == 0:
                put("extra", "d")
            else:
                assert admin(server, "DELETE", "/admin/loras/extra?timeout_s=0").status_code == 200
            for future, want in futures:
                assert future.result(timeout=60) == refs[want]
    admin(server, "DELETE", "/admin/loras/extra")
    assert admin(server, "DELETE", "/admin/loras/swap").json()["released"] is True
    assert admin(server, "GET", "/admin/loras").json()["bytes_held"][BASE] == held


@pytest.mark.parametrize(
    ("models_file", "loras", "problem"),
    [
        ('[[loras]]\nname = "x"\n', (), "needs a path"),
        ('[[loras]]\nname = "x"\npath = "/a"\nowner = "acme"\n', (), "unknown field"),
        ('[[loras]]\nname = "x"\npath = "/a"\n', ("x=/b",), "declared twice"),
        ("", ("no-path",), "BATCHGATE_LORAS: expected NAME=PATH"),
    ],
)
def test_bad_adapter_declarations_fail_at_start(
    tmp_path: Path, models_file: str, loras: tuple[str, ...], problem: str
) -> None:
    path = tmp_path / "models.toml"
    path.write_text(models_file)
    environ = {"BATCHGATE_MODELS_FILE": str(path), "BATCHGATE_LORAS": ",".join(loras)}
    with pytest.raises(ValueError, match=problem):
        Settings.load(environ=environ)


def test_adapters_the_admin_api_loaded_come_back_after_a_restart(
    tiny_model_dir: Path, redis_server: str, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """What the admin API loads is recorded in the storage directory: a new server over it is not
    ready until it has loaded it again (for the same owner); what it unloaded stays unloaded."""
    (tmp_path / "tenants.toml").write_text(TENANTS.format(acme=hash_key("sk-acme"), beta=hash_key("sk-beta")))
    settings = Settings(
        tenants=str(tmp_path / "tenants.toml"),
        redis_url=redis_server,
        admin_key_hash=hash_key(ADMIN_KEY),
        lora_roots=(str(adapters["a"].parent),),
        storage_dir=str(tmp_path / "storage"),
        embedding_model="none",
    )

    def start() -> Any:
        config = EngineConfig.of(
            model=str(tiny_model_dir), served_model_name=BASE, dtype="float32", max_model_len=512
        )
        engine = AsyncEngine.from_config(config)
        app = create_app(settings, engine=engine, tenancy=build_tenancy(settings), owns_tenancy=True)
        live = LiveServer(app)
        live.engine = engine  # type: ignore[attr-defined]
        return live

    def listed(live: Any, key: str) -> set[str]:
        return {m.id for m in client(live, key).models.list()}

    def stop(live: Any) -> None:
        live.stop()
        live.engine.shutdown()

    first = start()
    try:
        for name, adapter in (("kept", "c"), ("dropped", "d")):
            body = {"path": str(adapters[adapter]), "tenant": "acme"}
            assert admin(first, "PUT", f"/admin/loras/{name}", body).status_code == 200
        assert admin(first, "DELETE", "/admin/loras/dropped").status_code == 200
    finally:
        stop(first)
    second = start()
    try:
        deadline = time.monotonic() + 30
        while (ready := httpx.get(second.base_url + "/ready", timeout=10)).status_code != 200:
            assert ready.json()["detail"] == "restoring LoRA adapters" and time.monotonic() < deadline
        assert listed(second, "sk-acme") == {BASE, "kept"} and listed(second, "sk-beta") == {BASE}
        out = client(second, "sk-acme").completions.create(model="kept", prompt="hi", max_tokens=2)
        assert out.model == "kept" and out.usage.completion_tokens == 2
    finally:
        stop(second)
