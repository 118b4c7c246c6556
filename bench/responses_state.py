"""What resolving `previous_response_id` adds to a request: the store read, decoding the record
and parsing its conversation into items (gateway/responses_state.py `prepare`), by the
conversation's length, on the SQLite store and on Redis, side by side in one run.

    .venv/bin/python -m bench.responses_state [--turns 1,10,50] [--lookups 300]

A request without `previous_response_id` does none of this, so each figure is the cost the
lookup adds. Each turn is a user message, a function call, its output and an answer (~80 words
in all); Redis runs as a real redis-server on a free port.

Each length also gets a control row: a pure-Python loop calibrated to that length's SQLite p50,
timed the same way in the same run. It touches no store and parses nothing, so its p99 is what
preemption alone adds on this machine (on a shared one, most of a lookup's p99).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from gateway.response_store import RedisStore, ResponseStore, SQLiteStore, StoredResponse
from gateway.responses_request import parse_items

WORDS = "the quick brown fox jumps over the lazy dog " * 2


def _turn(i: int) -> list[dict[str, Any]]:
    call = f"call_{i:024d}"
    return [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": WORDS}]},
        {"type": "function_call", "call_id": call, "name": "lookup", "arguments": '{"q":"x"}'},
        {"type": "function_call_output", "call_id": call, "output": WORDS},
        {
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": WORDS * 2, "annotations": []}],
        },
    ]


def _record(turns: int) -> StoredResponse:
    history = [item for i in range(turns - 1) for item in _turn(i)]
    *inputs, answer = _turn(turns - 1)
    response = {"id": f"resp_{turns}", "object": "response", "status": "completed", "output": [answer]}
    return StoredResponse(response, inputs, history)


async def _lookups(store: ResponseStore, key: str, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        raw = await store.get("bench", key)
        assert raw is not None
        parse_items(StoredResponse.loads(raw).conversation())
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _control(target_ms: float, n: int) -> list[float]:
    """`n` timings of a busy loop as long as `target_ms` on an idle core."""
    iterations = 1000
    while True:  # calibrate: the fastest of a few runs, as an idle core would take it
        best = min(_spin(iterations) for _ in range(5))
        if best >= 0.2:
            break
        iterations *= 4
    iterations = max(1, int(iterations * target_ms / best))
    return [_spin(iterations) for _ in range(n)]


def _spin(iterations: int) -> float:
    start = time.perf_counter()
    total = 0
    for i in range(iterations):
        total += i
    return (time.perf_counter() - start) * 1e3


def _row(name: str, turns: int, size: int, times: list[float]) -> str:
    times.sort()
    p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
    return f"| {name} | {turns} | {size / 1024:.1f} | {statistics.median(times):.3f} | {p99:.3f} |"


async def main(turns: list[int], n: int) -> None:
    from tests.conftest_redis import find_redis_server, free_port

    port = free_port()
    redis = subprocess.Popen(
        [find_redis_server(), "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        await asyncio.sleep(0.3)
        with tempfile.TemporaryDirectory() as tmp:
            stores: list[tuple[str, ResponseStore]] = [
                ("SQLite (file)", SQLiteStore(Path(tmp) / "responses.sqlite3", 10_000)),
                ("Redis", RedisStore(f"redis://127.0.0.1:{port}/0", 3600, 10_000)),
            ]
            print("| store | turns | record KiB | p50 ms | p99 ms |\n|---|---:|---:|---:|---:|")
            for k in turns:
                record = _record(k)
                medians = []
                for name, store in stores:
                    await store.put("bench", record.response_id, record.dumps())
                    await _lookups(store, record.response_id, 10)  # warm
                    times = await _lookups(store, record.response_id, n)
                    medians.append(statistics.median(times))
                    print(_row(name, k, len(record.dumps()), times))
                print(_row("(control) busy loop", k, 0, _control(medians[0], n)))
            for _, store in stores:
                await store.aclose()
    finally:
        redis.terminate()
        redis.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", default="1,10,50")
    parser.add_argument("--lookups", type=int, default=300)
    args = parser.parse_args()
    asyncio.run(main([int(t) for t in args.turns.split(",")], args.lookups))
