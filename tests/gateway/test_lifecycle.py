"""Start-up and shutdown: the model loads in the background; /health answers at once, /ready when loaded."""

from __future__ import annotations

import threading

from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.fakes import FakeEngine

BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def test_loading_then_ready_then_shutdown() -> None:
    release = threading.Event()
    engine = FakeEngine()

    def factory(settings: Settings) -> FakeEngine:
        assert release.wait(10)
        return engine

    app = create_app(Settings(embedding_model="none"), engine_factory=factory)
    with TestClient(app) as client:
        assert client.get("/health").json() == {"status": "ok"}
        r = client.get("/ready")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = client.post("/v1/chat/completions", json=BODY)
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert "loading" in r.json()["error"]["message"]
        assert client.get("/v1/models").status_code == 503
        assert client.get("/openapi.json").status_code == 200

        release.set()
        gateway = app.state.gateway
        for _ in range(1000):  # bounded: the loader thread hands the engine over promptly
            if gateway.engine is not None:
                break
            threading.Event().wait(0.01)
        assert client.get("/ready").json() == {
            "status": "ready",
            "model": "fake-model",
            "models": ["fake-model"],
        }
        assert client.post("/v1/chat/completions", json=BODY).status_code == 200
    assert not engine.ready  # the app built it, so the app shut it down


def test_failed_load_is_reported() -> None:
    def factory(settings: Settings) -> FakeEngine:
        raise ValueError("model path /nope does not exist")

    app = create_app(Settings(embedding_model="none"), engine_factory=factory)
    with TestClient(app) as client:
        gateway = app.state.gateway
        for _ in range(1000):
            if gateway.load_error is not None:
                break
            threading.Event().wait(0.01)
        r = client.get("/health")
        assert r.status_code == 503 and "/nope" in r.json()["detail"]
        assert client.get("/ready").json()["status"] == "error"
        r = client.post("/v1/chat/completions", json=BODY)
        assert r.status_code == 503 and "/nope" in r.json()["error"]["message"]


def test_given_engine_is_not_shut_down() -> None:
    engine = FakeEngine()
    with TestClient(create_app(Settings(embedding_model="none"), engine=engine)) as client:
        assert client.get("/ready").status_code == 200
    assert engine.ready
