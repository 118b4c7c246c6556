"""SIGTERM with requests in flight: a drain, not a cut (gateway/drain.py), on a real server process."""

from __future__ import annotations

import json
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import redis

from gateway.pool.relay import REPORT_TIMEOUT_S
from tests.chaos.conftest import AUTH, INTERNAL, live_leases, start_gateway, start_replica, upstreams
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
            model = http.get("/v1/models", headers=AUTH).json()["data"][0]["id"]
            # A long non-streaming request: its response has not started when the deadline comes.
            with ThreadPoolExecutor(1) as pool:
                gathered = pool.submit(
                    httpx.post,
                    server.url + "/v1/chat/completions",
                    json=chat_body(model, "long, not streamed", LONG_MAX_TOKENS),
                    timeout=60,
                )
                deadline = time.monotonic() + 30
                while http.get("/v1/internal/stats", headers=INTERNAL).json()["num_running"] != 1:
                    assert time.monotonic() < deadline, "the non-streaming request did not start"
                    time.sleep(0.02)
                short = [stream_chat(server.url, chat_body(model, f"short {i}", 32)) for i in range(3)]
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

                cut = gathered.result(timeout=60)  # answered, not dropped, at the deadline
                assert cut.status_code == 503 and cut.json()["error"]["type"] == "server_error"

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


def test_drain_through_a_proxy_gateway(tmp_path: Path, tiny_model_dir: Path, redis_url: str) -> None:
    """A draining replica gets no new requests (they go to the other, no 503 reaches a client),
    its stream ends with the error event through the gateway; a client leaving a request stuck on
    a frozen replica frees its lease at once; the gateway drains its own streams on SIGTERM."""
    drain = ["--drain-timeout", str(DRAIN_TIMEOUT_S)]
    replicas = [start_replica(f"replica{i}", tmp_path, tiny_model_dir, *drain) for i in range(2)]
    gateway = start_gateway(tmp_path, replicas, *drain, "--health-interval", "3", redis_url=redis_url)
    draining, staying = replicas
    observer = redis.Redis.from_url(redis_url)
    try:
        wait_ready([*replicas, gateway])
        deadline = time.monotonic() + 30
        while not all(u["healthy"] for u in upstreams(gateway)):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        model = httpx.get(gateway.url + "/v1/models", headers=AUTH, timeout=10).json()["data"][0]["id"]
        long = [
            stream_chat(gateway.url, chat_body(model, f"long {i}", LONG_MAX_TOKENS), AUTH) for i in range(2)
        ]
        for s in long:
            assert s.first_event.wait(60)
        assert sorted(u["inflight"] for u in upstreams(gateway)) == [1, 1]  # one on each replica

        draining.proc.send_signal(signal.SIGTERM)
        with httpx.Client(base_url=gateway.url, timeout=60, headers=AUTH) as http:
            statuses = [
                http.post("/v1/chat/completions", json=chat_body(model, f"n{i}", 2)).status_code
                for i in range(6)
            ]
        assert statuses == [200] * 6
        assert draining.proc.wait(timeout=30) == 0
        cut = [s for s in long if s.done.is_set()]
        assert len(cut) == 1 and cut[0].error is None and cut[0].ended_with_done
        assert [e["error"]["type"] for e in cut[0].error_events] == ["server_error"]
        assert live_leases(observer, "acme") == 1

        # A request stuck before its first byte on a frozen replica; its client leaves.
        staying.proc.send_signal(signal.SIGSTOP)
        try:
            payload = json.dumps(chat_body(model, "stuck", 8)).encode()
            head = (
                "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                f"Authorization: {AUTH['authorization']}\r\nContent-Length: {len(payload)}\r\n\r\n"
            )
            sock = socket.create_connection(("127.0.0.1", gateway.port))
            sock.sendall(head.encode() + payload)
            deadline = time.monotonic() + 10
            while live_leases(observer, "acme") != 2:
                assert time.monotonic() < deadline, "the stuck request was not admitted"
                time.sleep(0.02)
            sock.close()
            # It settles first with what the replica used: asking the frozen one waits out its
            # report timeout (exact billing), and then the lease goes.
            deadline = time.monotonic() + REPORT_TIMEOUT_S + 2.0
            while live_leases(observer, "acme") != 1:
                assert time.monotonic() < deadline, "the lease of a client that left was kept"
                time.sleep(0.02)
        finally:
            staying.proc.send_signal(signal.SIGCONT)

        gateway.proc.send_signal(signal.SIGTERM)
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
            signalled = time.monotonic()
            ready = http.get("/ready")
            while ready.status_code == 200 and time.monotonic() - signalled < 1.0:
                ready = http.get("/ready")
            assert (ready.status_code, ready.json()["detail"]) == (503, "draining")
            refused = http.post("/v1/chat/completions", json=chat_body(model, "late", 2), headers=AUTH)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        rest = [s for s in long if s is not cut[0]][0]
        assert rest.done.wait(30)
        assert rest.error is None and rest.ended_with_done
        assert [e["error"]["type"] for e in rest.error_events] == ["server_error"]
        assert gateway.proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 5
        while live_leases(observer, "acme") != 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        for p in [gateway, *replicas]:
            p.proc.send_signal(signal.SIGCONT)
            p.kill()
        observer.close()


def test_a_native_crash_leaves_every_thread_s_stack_in_the_log(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A server killed by a fatal signal (as a kernel's SIGSEGV or SIGFPE would) says where each
    thread was, rather than ending with an empty log."""
    server = start("crashed", replica_args(tiny_model_dir), tmp_path)
    try:
        wait_ready([server])
        server.proc.send_signal(signal.SIGSEGV)
        assert server.proc.wait(timeout=30) == -signal.SIGSEGV
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    log = server.log.read_text()
    assert "Fatal Python error: Segmentation fault" in log
    assert "gateway/cli.py" in log and "engine/async_engine.py" in log  # the main and engine threads
