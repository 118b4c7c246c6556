"""LoRA adapters in a pool: a gateway in front of two replicas, each a real uvicorn server over
its own engine (the tiny model, fp32), a real redis-server, the openai SDK. The gateway owns the
adapters' ownership (its models file and admin API), lists each to its owner only, routes a
request to the replica holding its adapter, and loads it on one when none does."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from gateway.app import create_app
from gateway.cli import build_tenancy
from gateway.settings import Settings
from tenancy import hash_key
from tests.engine.helpers import hf_greedy
from tests.gateway.conftest import LiveServer
from tests.lora_adapters import TENANTS, make_adapter, peft_reference

BASE = "tiny"
TOKEN = "pool-lora-internal"
ADMIN_KEY = "bg-admin-pool-lora"
EOS = 2


@dataclass
class Pool:
    gateway: LiveServer
    replicas: list[LiveServer]
    engines: list[AsyncEngine]
    adapters: dict[str, Path]
    prompt: list[int]


def _replica(model_dir: Path, root: Path, name: str, models_file: str) -> tuple[LiveServer, AsyncEngine]:
    (root / f"{name}.toml").write_text(models_file)
    settings = Settings(
        internal_token=TOKEN, models_file=str(root / f"{name}.toml"), embedding_model="none", keep_alive_s=1.0
    )
    engine = AsyncEngine.from_config(
        EngineConfig.of(
            model=str(model_dir),
            served_model_name=BASE,
            dtype="float32",
            max_model_len=512,
            kv_cache_memory_bytes=16 << 20,
        )
    )
    return LiveServer(create_app(settings, engine=engine)), engine


def _lora(name: str, path: Path | str, tenant: str) -> str:
    return f'[[loras]]\nname = "{name}"\npath = "{path}"\ntenant = "{tenant}"\n'


@pytest.fixture(scope="module")
def pool(tiny_model_dir: Path, redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("pool-loras")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    adapters = {n: make_adapter(base, root / n, r=8, alpha=8, seed=seed) for seed, n in enumerate("abc")}
    # replica 0 holds `solo` (its own declaration); the gateway declares `acme-tuned`, which no
    # replica holds at start, and `broken`, whose folder does not exist
    started = [
        _replica(tiny_model_dir, root, "r0", _lora("solo", adapters["a"], "acme")),
        _replica(tiny_model_dir, root, "r1", ""),
    ]
    (root / "tenants.toml").write_text(TENANTS.format(acme=hash_key("sk-acme"), beta=hash_key("sk-beta")))
    (root / "gateway.toml").write_text(
        _lora("acme-tuned", adapters["b"], "acme") + _lora("broken", root / "missing", "acme")
    )
    settings = Settings(
        upstreams=tuple(server.base_url for server, _ in started),
        internal_token=TOKEN,
        tenants=str(root / "tenants.toml"),
        redis_url=redis_server,
        models_file=str(root / "gateway.toml"),
        admin_key_hash=hash_key(ADMIN_KEY),
        lora_roots=(str(root),),
        health_interval_s=0.2,
        keep_alive_s=1.0,
        embedding_model="none",
    )
    gateway = LiveServer(create_app(settings, tenancy=build_tenancy(settings), owns_tenancy=True))
    engines = [engine for _, engine in started]
    try:
        deadline = time.monotonic() + 30
        while not all(u["healthy"] for u in upstreams(gateway)):
            assert time.monotonic() < deadline, upstreams(gateway)
            time.sleep(0.05)
        prompt = list(engines[0].tokenizer.encode("Once upon a time"))
        yield Pool(gateway, [server for server, _ in started], engines, adapters, prompt)
    finally:
        gateway.stop()
        for server, engine in started:
            server.stop()
            engine.shutdown()


def upstreams(server: LiveServer) -> list[dict[str, Any]]:
    return list(
        httpx.get(server.base_url + "/v1/internal/upstreams", headers={"x-batchgate-internal": TOKEN}).json()
    )


def client(pool: Pool, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=pool.gateway.base_url + "/v1", api_key=key, max_retries=0)


def completion(pool: Pool, key: str, model: str, n: int = 12) -> str:
    out = client(pool, key).completions.create(model=model, prompt=pool.prompt, max_tokens=n, temperature=0)
    return out.choices[0].text


def reference(pool: Pool, model_dir: Path, folder: str, n: int = 12) -> str:
    tokens = hf_greedy(peft_reference(model_dir, pool.adapters[folder]), pool.prompt, n)
    tokens = tokens[: tokens.index(EOS)] if EOS in tokens else tokens
    return str(pool.engines[0].tokenizer.decode(tokens))


def holders(pool: Pool, name: str) -> dict[str, dict[str, Any]]:
    return {u["url"]: u["loras"][name] for u in upstreams(pool.gateway) if name in u["loras"]}


def sent(pool: Pool) -> dict[str, int]:
    return {u["url"]: u["num_sent"] for u in upstreams(pool.gateway)}


def admin(pool: Pool, method: str, path: str, body: Any = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {ADMIN_KEY}"}
    return httpx.request(method, pool.gateway.base_url + path, json=body, headers=headers, timeout=30)


def test_the_gateway_lists_each_adapter_to_its_owner_alone(pool: Pool) -> None:
    acme = {m.id for m in client(pool, "sk-acme").models.list()}
    beta = {m.id for m in client(pool, "sk-beta").models.list()}
    # `solo` only replica 0 declares (its owner as it reports it), the others only the gateway
    assert acme == {BASE, "solo", "acme-tuned", "broken"} and beta == {BASE}
    messages = []
    for model in ("solo", "acme-tuned", "no-such-adapter"):
        with pytest.raises(openai.NotFoundError):
            client(pool, "sk-beta").models.retrieve(model)
        with pytest.raises(openai.NotFoundError) as info:
            completion(pool, "sk-beta", model, 2)
        assert info.value.code == "model_not_found"
        messages.append(info.value.message.replace(model, "M"))
    assert len(set(messages)) == 1  # nothing tells an owned adapter from a name nobody serves
    assert client(pool, "sk-acme").models.retrieve("acme-tuned").id == "acme-tuned"


def test_a_request_goes_to_the_one_replica_holding_its_adapter(pool: Pool, tiny_model_dir: Path) -> None:
    (holder,) = holders(pool, "solo")
    before = sent(pool)
    for _ in range(4):
        assert completion(pool, "sk-acme", "solo") == reference(pool, tiny_model_dir, "a")
    after = sent(pool)
    assert {url: after[url] - before[url] for url in after} == {
        url: 4 if url == holder else 0 for url in after
    }
    assert list(holders(pool, "solo")) == [holder]  # not loaded anywhere else


def test_an_adapter_no_replica_holds_is_loaded_once_and_answers_as_local_mode(
    pool: Pool, tiny_model_dir: Path
) -> None:
    assert holders(pool, "acme-tuned") == {}
    want = reference(pool, tiny_model_dir, "b")
    with ThreadPoolExecutor(4) as threads:  # arriving together, they share one load
        texts = list(threads.map(lambda _: completion(pool, "sk-acme", "acme-tuned"), range(4)))
    assert texts == [want] * 4
    (held,) = holders(pool, "acme-tuned").values()
    assert held["version"] == 1
    assert completion(pool, "sk-acme", BASE) != want  # the adapter changes the answer


def test_an_adapter_that_cannot_be_loaded_is_a_clear_error(pool: Pool) -> None:
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as info:
            client(pool, "sk-acme").completions.create(
                model="broken", prompt=pool.prompt, max_tokens=2, stream=stream
            )
        assert info.value.status_code == 503
        assert info.value.code == "adapter_load_failed"
        assert "`broken`" in info.value.message and "adapter_config.json" in info.value.message
        assert info.value.response.headers["x-should-retry"] == "false"
    assert holders(pool, "broken") == {}
    assert completion(pool, "sk-acme", "solo", 2)  # the pool serves on


def test_the_admin_api_loads_and_unloads_an_adapter_across_the_pool(pool: Pool, tiny_model_dir: Path) -> None:
    loaded = admin(
        pool, "PUT", "/admin/loras/beta-tuned", {"path": str(pool.adapters["c"]), "tenant": "beta"}
    )
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["owner"] == "beta" and len(loaded.json()["replicas"]) == 1
    assert "beta-tuned" in {m.id for m in client(pool, "sk-beta").models.list()}
    assert "beta-tuned" not in {m.id for m in client(pool, "sk-acme").models.list()}
    assert completion(pool, "sk-beta", "beta-tuned") == reference(pool, tiny_model_dir, "c")
    listed = {a["id"]: a for a in admin(pool, "GET", "/admin/loras").json()["data"]}
    assert listed["beta-tuned"]["owner"] == "beta" and listed["solo"]["owner"] == "acme"

    gone = admin(pool, "DELETE", "/admin/loras/beta-tuned")
    assert gone.status_code == 200 and gone.json()["released"] is True
    assert holders(pool, "beta-tuned") == {}
    with pytest.raises(openai.NotFoundError):
        completion(pool, "sk-beta", "beta-tuned", 2)
    assert admin(pool, "DELETE", "/admin/loras/beta-tuned").status_code == 404
    bad = admin(pool, "PUT", "/admin/loras/x", {"path": str(pool.adapters["c"].parent / "nowhere")})
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
