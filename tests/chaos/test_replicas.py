"""Replicas failing under a proxy gateway, as real processes: one killed (SIGKILL) and one frozen
(SIGSTOP, then SIGCONT) while requests and streams run."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.chaos.conftest import metric, start_gateway, start_replica, upstreams, wait_ready
from tests.chaos.helpers import chat_body, stream_chat


def test_killed_and_frozen_replicas_under_load(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Every request ends exactly once: the stream on the killed replica with an SSE error event
    and [DONE]; requests sent to it before their first byte fail over; requests during the freeze
    wait or get a clean 503; and once the frozen replica resumes it is routed to at once."""
    replicas = [start_replica(f"replica{i}", tmp_path, tiny_model_dir) for i in range(2)]
    # A long health interval: before the fix the frozen replica stayed marked down until its next
    # poll (up to 3 s after it resumed), and every request meanwhile got "503 No healthy upstream".
    gateway = start_gateway(tmp_path, replicas, "--health-interval", "3")
    killed, frozen = replicas
    try:
        wait_ready([*replicas, gateway])
        deadline = time.monotonic() + 30
        while not all(u["healthy"] for u in upstreams(gateway)):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert metric(gateway.url, "batchgate_upstreams") == 2
        assert metric(gateway.url, "batchgate_upstreams_healthy") == 2
        model = httpx.get(gateway.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        # One long stream on each replica (least outstanding work spreads them).
        long = [stream_chat(gateway.url, chat_body(model, f"long {i}", 1500)) for i in range(2)]
        for s in long:
            assert s.first_event.wait(60)
        assert sorted(u["inflight"] for u in upstreams(gateway)) == [1, 1]

        def one(i: int) -> int:
            with httpx.Client(base_url=gateway.url, timeout=60) as http:
                return http.post("/v1/chat/completions", json=chat_body(model, f"load {i}", 4)).status_code

        with httpx.Client(base_url=gateway.url, timeout=60) as http, ThreadPoolExecutor(4) as pool:
            running = [pool.submit(one, i) for i in range(8)]
            killed.kill()
            running += [pool.submit(one, i) for i in range(8, 16)]  # fail over to the survivor
            # The pool runs 4 at a time: let these end before the freeze, or the queued ones would
            # meet the frozen replica too (and may rightly get a 503).
            failed_over = [f.result(timeout=60) for f in running]
            frozen.proc.send_signal(signal.SIGSTOP)
            running = [pool.submit(one, i) for i in range(16, 20)]  # wait on the frozen one, or 503
            deadline = time.monotonic() + 20
            while any(u["healthy"] for u in upstreams(gateway)):  # its poll times out after 3 s
                assert time.monotonic() < deadline, "the frozen replica was never marked down"
                time.sleep(0.05)
            assert metric(gateway.url, "batchgate_upstreams_healthy") == 0

            frozen.proc.send_signal(signal.SIGCONT)
            after = [
                http.post("/v1/chat/completions", json=chat_body(model, f"back {i}", 2)) for i in range(5)
            ]
            assert [a.status_code for a in after] == [200] * 5, after[0].text
            statuses = [f.result(timeout=60) for f in running]

        assert failed_over == [200] * 16, failed_over  # failover before the first byte
        assert set(statuses) <= {200, 503}, statuses
        assert metric(gateway.url, "batchgate_upstreams_healthy") == 1

        for s in long:
            assert s.done.wait(60)
            assert s.error is None and s.status == 200 and s.ended_with_done
        cut = [s for s in long if s.error_events]
        assert len(cut) == 1  # the stream of the killed replica, with an OpenAI-shaped error
        assert cut[0].error_events[0]["error"]["type"] == "server_error"
        assert [s for s in long if not s.error_events][0].finish_reasons == ["length"]
    finally:
        frozen.proc.send_signal(signal.SIGCONT)
        for p in [gateway, *replicas]:
            p.stop()
