"""10,000 stored responses through a real server with the embedded store (SQLite in
--storage-dir, bounded by --responses-max-stored): the store stays within its bound, least
recently used out, each eviction counted in `batchgate_response_store_evictions_total`, and the
server's RSS stays flat once the store is full.

    .venv/bin/python -m bench.responses_rss [--responses 10000] [--bound 1000]

The gateway runs in this process over the fake engine (tests/gateway/fakes.py: the engine is not
what is measured), served by uvicorn; each request continues the previous response
(`previous_response_id`) for 10 turns, then a new conversation starts, so reads, writes and
evictions all happen. RSS is this process's, read from /proc every 1,000 responses (after the
fake engine's own record of every request is cleared: it is the test fake's, not the gateway's).
"""

from __future__ import annotations

import argparse
import gc
import re
import tempfile
import time
from pathlib import Path

import httpx

from bench.cpu import CpuMeter
from gateway.app import create_app
from gateway.responses.store import SQLITE_FILE, SQLiteStore
from gateway.settings import Settings
from tests.gateway.conftest import LiveServer
from tests.gateway.fakes import FakeEngine


def rss_mib() -> float:
    status = Path("/proc/self/status").read_text()
    found = re.search(r"VmRSS:\s+(\d+) kB", status)
    return int(found.group(1)) / 1024 if found else float("nan")


def main(num_responses: int, bound: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(
            keep_alive_s=5.0, embedding_model="none", storage_dir=tmp, responses_max_stored=bound
        )
        engine = FakeEngine(max_model_len=4096)
        server = LiveServer(create_app(settings, engine=engine))
        meter = CpuMeter()
        meter.start()
        started = time.perf_counter()
        previous: str | None = None
        print("| responses | stored | evictions (metric) | RSS MiB |\n|---:|---:|---:|---:|")
        try:
            with httpx.Client(base_url=server.base_url, timeout=30) as client:
                for i in range(1, num_responses + 1):
                    body: dict[str, object] = {
                        "model": "fake-model",
                        "input": f"turn {i}: " + "word " * 40,
                        "max_output_tokens": 8,
                    }
                    if previous is not None and i % 10:
                        body["previous_response_id"] = previous
                    r = client.post("/v1/responses", json=body)
                    assert r.status_code == 200, r.text
                    previous = r.json()["id"]
                    if i % 1000 == 0:
                        engine.submitted.clear()  # the fake keeps every request for tests: not ours
                        engine.streams.clear()
                        gc.collect()
                        metrics = client.get("/metrics").text
                        found = re.search(r"^batchgate_response_store_evictions_total (\S+)$", metrics, re.M)
                        evictions = float(found.group(1)) if found else 0.0
                        stored = SQLiteStore(Path(tmp) / SQLITE_FILE, bound).count()
                        print(f"| {i} | {stored} | {evictions:.0f} | {rss_mib():.1f} |", flush=True)
                        assert stored <= bound
        finally:
            server.stop()
        elapsed = time.perf_counter() - started
        usage = meter.stop()
        print(f"\n{num_responses} responses in {elapsed:.0f} s; others' CPU share {usage.others_busy:.0%}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--responses", type=int, default=10_000)
    parser.add_argument("--bound", type=int, default=1000)
    args = parser.parse_args()
    main(args.responses, args.bound)
