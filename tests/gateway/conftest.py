from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.fakes import FakeEngine

AppFactory = Callable[..., Starlette]


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def make_app(fake_engine: FakeEngine) -> AppFactory:
    def make(engine: Any = None, tenancy: Any = None, embedder: Any = None, **settings: Any) -> Starlette:
        settings.setdefault("keep_alive_s", 5.0)
        # Only embedding tests pay for an embedding model: they pass one (`embedder`).
        settings.setdefault("embedding_model", "none")
        return create_app(
            Settings(**settings), engine=engine or fake_engine, tenancy=tenancy, embedder=embedder
        )

    return make


@pytest.fixture
async def client(make_app: AppFactory) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=make_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


def client_for(app: Starlette) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def stream_through(
    app: Any, path: str, body: dict[str, Any]
) -> tuple[asyncio.Queue[bytes], asyncio.Task[None]]:
    """POST `body` to `path` straight through the ASGI app (httpx's ASGI transport would
    wait for the whole body); the body's chunks arrive in the queue as the app sends them."""
    chunks: asyncio.Queue[bytes] = asyncio.Queue()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
        "server": ("test", 80),
        "client": ("client", 1),
    }
    pending = [json.dumps(body).encode()]
    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        if pending:
            return {"type": "http.request", "body": pending.pop(), "more_body": False}
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            await chunks.put(message["body"])

    return chunks, asyncio.get_running_loop().create_task(app(scope, receive, send))


# -- a real server: uvicorn on a free port, in a background thread, over the real engine -----------


class LiveServer:
    """A uvicorn server running `app` on 127.0.0.1 in a daemon thread; `stop()` ends it."""

    def __init__(self, app: Starlette) -> None:
        import socket
        import threading

        import uvicorn

        # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets that say they are TCP,
        # and without it every response waits ~40 ms for a delayed ACK (Nagle).
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self._thread.start()
        started = threading.Event()
        for _ in range(1000):  # bounded wait for start-up (a few ms in practice)
            if self.server.started or not self._thread.is_alive():
                break
            started.wait(0.01)
        if not self.server.started:
            raise RuntimeError("uvicorn did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=15)
        self._sock.close()


class TinyServer:
    def __init__(self, engine: Any, server: LiveServer) -> None:
        self.engine = engine
        self.server = server
        self.base_url = server.base_url
        self.model = engine.model_name

    def openai(self, **kwargs: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0, **kwargs)

    def wait_idle(self, timeout_s: float = 20.0) -> Any:
        """Poll engine stats until nothing runs or waits and every KV block is free (or fail)."""
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.engine.stats()
            if (
                stats.num_running == 0
                and stats.num_waiting == 0
                and stats.num_free_blocks == stats.num_total_blocks
            ):
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout_s}s: {stats}")
            time.sleep(0.02)


def tiny_async_engine(model_dir: Any, served_model_name: str = "tiny") -> Any:
    """A started AsyncEngine over the tiny model (512 tokens of context, 32 MiB of KV cache)."""
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig

    return AsyncEngine.from_config(
        EngineConfig.of(
            model=str(model_dir),
            served_model_name=served_model_name,
            dtype="float32",
            max_model_len=512,
            kv_cache_memory_bytes=32 << 20,
        )
    )


TINY_MAX_MODEL_LEN = 1024
TINY_MAX_NUM_SEQS = 16


def serve_model(model_dir: Any, max_model_len: int, max_num_seqs: int) -> Iterator[TinyServer]:
    """The gateway over the real engine with the model in `model_dir`, served by uvicorn."""
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig

    engine = AsyncEngine.from_config(
        EngineConfig.of(
            model=str(model_dir),
            dtype="float32",
            device="cpu",
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            kv_cache_memory_bytes=64 * 1024 * 1024,
        )
    )
    server = LiveServer(create_app(Settings(keep_alive_s=1.0, embedding_model="none"), engine=engine))
    try:
        yield TinyServer(engine, server)
    finally:
        server.stop()
        engine.shutdown()


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir: Any) -> Iterator[TinyServer]:
    """The gateway over the real engine with the tiny random model, served by uvicorn."""
    yield from serve_model(tiny_model_dir, TINY_MAX_MODEL_LEN, TINY_MAX_NUM_SEQS)


@pytest.fixture(scope="module")
def real_server(real_model_dir: Any) -> Iterator[TinyServer]:
    """The gateway over the real engine with the bundled SmolLM2-135M (2,048 tokens of context)."""
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig

    engine = AsyncEngine.from_config(
        EngineConfig.of(model=str(real_model_dir), max_model_len=2048, kv_cache_memory_bytes=128 << 20)
    )
    server = LiveServer(create_app(Settings(keep_alive_s=1.0), engine=engine))
    try:
        yield TinyServer(engine, server)
    finally:
        server.stop()
        engine.shutdown()
