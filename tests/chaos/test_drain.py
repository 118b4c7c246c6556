"""SIGTERM with requests in flight: a drain, not a cut (gateway/drain.py), on a real server process."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx

from tests.chaos.helpers import chat_body, stream_chat
from tests.pool.conftest import replica_args, start, wait_ready

DRAIN_TIMEOUT_S = 2.0
LONG_MAX_TOKENS = 4000  # far more than the tiny model makes in DRAIN_TIMEOUT_S


def test_sigterm_drains_in_flight_streams_then_exits_0(tmp_path: Path, tiny_model_dir: Path) -> None:
    args = [*replica_args(tiny_model_dir), "--max-model-len", "4096", "--kv-cache-memory", "32MiB"]
    server = start("drained", [*args, "--drain-timeout", str(DRAIN_TIMEOUT_S)], tmp_path)
    try:
        wait_ready([server])
        with httpx.Client(base_url=server.url, timeout=30) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            short = [stream_chat(server.url, chat_body(model, f"short {i}", 16)) for i in range(3)]
            long = stream_chat(server.url, chat_body(model, "long", LONG_MAX_TOKENS))
            for s in [*short, long]:
                assert s.first_event.wait(60), "a stream did not start"

            server.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            ready = http.get("/ready")
            while ready.status_code == 200 and time.monotonic() - signalled < 1.0:
                ready = http.get("/ready")  # the flip is immediate; this only bounds the wait
            assert (ready.status_code, ready.json()["detail"]) == (503, "draining")

            refused = http.post("/v1/chat/completions", json=chat_body(model, "too late", 4))
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "server_overloaded"

        for s in short:  # finished normally during the drain
            assert s.done.wait(30)
            assert s.error is None and s.status == 200
            assert s.finish_reasons == ["length"] and not s.error_events
            assert s.ended_with_done

        assert long.done.wait(30)
        # Cut at the deadline with an OpenAI-shaped error event and [DONE], not a broken connection.
        assert long.error is None, long.error
        assert long.finish_reasons == []
        assert [e["error"]["type"] for e in long.error_events] == ["server_error"]
        assert long.ended_with_done
        assert time.monotonic() - signalled >= DRAIN_TIMEOUT_S - 0.5

        assert server.proc.wait(timeout=30) == 0
    finally:
        server.kill()
    log = server.log.read_text()
    assert "Traceback" not in log, log[-4000:]
