"""What resolving stored state adds to a request: the time of `ResponsesState.prepare` and `wrap`
(gateway/responses/state.py), the functions the pipeline runs before its backend, each call timed
by a monotonic span, for a `previous_response_id` and a `conversation` of 10-50 turns, on the
SQLite store and on Redis (a real redis-server on a free port), built as the server builds them,
on the server's event loop (uvloop).

    .venv/bin/python -m bench.responses_state [--turns 10,25,50] [--lookups 300] [--baseline DIR]

Each turn is a user message, a function call, its output and an answer (~80 words in all). Every
sample of a lookup is taken beside its controls, in a shuffled order, so that all of them see the
same load on the machine:

- "no state": the same spans for the same request without `previous_response_id` or
  `conversation`, what every request pays; a lookup adds its span less this one;
- "busy loop": a pure-Python loop calibrated to the lookup's p50 that touches no store: its p99 is
  what preemption alone adds to work of that length on this machine;
- "PING" (Redis): a bare round trip to the same redis-server on a client of its own: its p99 is
  what waiting on another process (scheduled on the same loaded cores) adds to any round trip.

"cpu" is the lookup's own CPU time on the event loop's thread: its wall time less preemption and
waiting (on Redis, or on a worker thread where a store read runs in one).

`--baseline DIR` first measures the code of another checkout (DIR, e.g. `git archive main | tar
-x -C DIR`) with this same bench, in a child process, then this tree's: the same spans, one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from bench.cpu import CpuMeter
from gateway.admission import Caller
from gateway.backend import Body, Call, Plan, Reply, Work
from gateway.drain import Drain
from gateway.endpoints import RESPONSES
from gateway.metrics import Metrics
from gateway.responses.background import BackgroundRuns
from gateway.responses.compaction import Compactor, Sealer, load_key
from gateway.responses.conversations import Conversations
from gateway.responses.state import ResponsesState, build_store
from gateway.responses.store import StoredConversation, StoredResponse
from gateway.settings import Settings

WORDS = "the quick brown fox jumps over the lazy dog " * 2
TENANT = "bench"


def _turn(i: int) -> list[dict[str, Any]]:
    call = f"call_{i:024d}"
    return [
        {
            "type": "message",
            "id": f"msg_u{i:030d}",
            "role": "user",
            "status": "completed",
            "content": [{"type": "input_text", "text": WORDS}],
        },
        {
            "type": "function_call",
            "id": f"fc_{i:030d}",
            "call_id": call,
            "name": "lookup",
            "arguments": '{"q":"x"}',
        },
        {"type": "function_call_output", "id": f"fco_{i:030d}", "call_id": call, "output": WORDS},
        {
            "type": "message",
            "id": f"msg_a{i:030d}",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": WORDS * 2, "annotations": []}],
        },
    ]


def _records(turns: int) -> tuple[StoredResponse, StoredConversation]:
    """A stored response whose conversation is `turns` turns, and a conversation of them."""
    history = [item for i in range(turns - 1) for item in _turn(i)]
    *inputs, answer = _turn(turns - 1)
    response = {"id": f"resp_{turns:032d}", "object": "response", "status": "completed", "output": [answer]}
    conversation = {"id": f"conv_{turns:032d}", "object": "conversation", "created_at": 0, "metadata": {}}
    return StoredResponse(response, inputs, history), StoredConversation(
        conversation, [*history, *inputs, answer]
    )


async def _unused(call: Call) -> Reply:
    return Body({})


def _work(body: dict[str, Any]) -> Work:
    return Work(RESPONSES, RESPONSES.parse(body), body, Caller(TENANT), "m", "resp_bench")


async def _span(state: ResponsesState, body: dict[str, Any], num_items: int) -> tuple[float, float]:
    """The wall and thread CPU time (ms) of the state's hooks for one request with `body`, whose
    history must come out `num_items` items long (so a span is never of a lookup that failed)."""
    work = _work(body)  # parsing the body is every request's, outside the span
    start, cpu = time.perf_counter(), time.thread_time()
    await state.prepare(work)
    state.wrap(work, Plan(1, 1, _unused))
    wall, cpu = (time.perf_counter() - start) * 1e3, (time.thread_time() - cpu) * 1e3
    assert len(work.request.history) == num_items, (len(work.request.history), num_items)
    return wall, cpu


def _spin(iterations: int) -> float:
    start = time.perf_counter()
    total = 0
    for i in range(iterations):
        total += i
    return (time.perf_counter() - start) * 1e3


def _calibrate(target_ms: float) -> Callable[[], float]:
    """A busy loop as long as `target_ms` on an idle core (the fastest of a few runs)."""
    iterations = 1000
    while (best := min(_spin(iterations) for _ in range(5))) < 0.2:
        iterations *= 4
    n = max(1, int(iterations * target_ms / best))
    return lambda: _spin(n)


def _stats(times: list[float]) -> str:
    ordered = sorted(times)
    return (
        f"{statistics.median(ordered):.3f} | {ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]:.3f}"
    )


async def _measure(
    state: ResponsesState,
    body: dict[str, Any],
    num_items: int,
    plain: dict[str, Any],
    n: int,
    ping: Callable[[], Awaitable[Any]] | None,
) -> list[str]:
    for _ in range(20):  # warm: connections, the script cache, the page cache
        await _span(state, body, num_items)
    median = statistics.median(w for w, _ in [await _span(state, body, num_items) for _ in range(30)])
    spin = _calibrate(median)
    wall, cpu, none, loop, trips = [], [], [], [], []
    for _ in range(n):
        order = ["lookup", "none", "loop"] + (["ping"] if ping is not None else [])
        random.shuffle(order)
        for kind in order:
            if kind == "lookup":
                w, c = await _span(state, body, num_items)
                wall.append(w)
                cpu.append(c)
            elif kind == "none":
                none.append((await _span(state, plain, 0))[0])
            elif kind == "loop":
                loop.append(spin())
            else:
                assert ping is not None
                start = time.perf_counter()
                await ping()
                trips.append((time.perf_counter() - start) * 1e3)
    return [_stats(wall), _stats(cpu), _stats(none), _stats(loop), _stats(trips) if trips else "- | -"]


async def main(turns: list[int], n: int, label: str) -> None:
    from tests.conftest_redis import find_redis_server, free_port

    meter = CpuMeter()
    meter.start()

    port = free_port()
    redis = subprocess.Popen(
        [find_redis_server(), "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    pinger = aioredis.Redis.from_url(url)
    try:
        await asyncio.sleep(0.3)
        with tempfile.TemporaryDirectory() as tmp:
            states = []
            for name, settings in [
                ("SQLite (file)", Settings(storage_dir=tmp)),
                ("Redis", Settings(redis_url=url)),
            ]:
                store = build_store(settings, Metrics())
                conversations = Conversations(store, settings.max_body_bytes)
                background = BackgroundRuns(store, settings.responses_background_lease_s, Drain())
                compactor = Compactor(Sealer(load_key(None, tmp)))
                states.append(
                    (
                        name,
                        ResponsesState(
                            store, conversations, background, 1.0, compactor, settings.max_body_bytes
                        ),
                    )
                )
            print(
                "| store | lookup | turns | record KiB | p50 ms | p99 ms | cpu p50 | cpu p99 "
                "| no state p50 | p99 | busy loop p50 | p99 | PING p50 | p99 |\n|---|---|---:|---:|"
                + "---:|"
                * 10
            )
            plain = {"model": "m", "input": "and then?"}
            for k in turns:
                response, conversation = _records(k)
                for name, state in states:
                    await state.store.put(TENANT, response.response_id, response.dumps())
                    await state.store.put(TENANT, conversation.conversation_id, conversation.dumps())
                    for param, ref, size in [
                        ("previous_response_id", response.response_id, len(response.dumps())),
                        ("conversation", conversation.conversation_id, len(conversation.dumps())),
                    ]:
                        ping = pinger.ping if name == "Redis" else None
                        row = await _measure(state, {**plain, param: ref}, 4 * k, plain, n, ping)
                        print(f"| {name} | {param} | {k} | {size / 1024:.1f} | " + " | ".join(row) + " |")
            for _, state in states:
                await state.aclose()
    finally:
        await pinger.aclose()
        redis.terminate()
        redis.wait()
    usage = meter.stop()
    print(f"\ncode: {label}; {usage.wall_s:.0f} s, others' CPU share {usage.others_busy:.2f}\n", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", default="10,25,50")
    parser.add_argument("--lookups", type=int, default=300)
    parser.add_argument("--baseline", help="another checkout whose code to measure first")
    parser.add_argument("--label", default=str(Path(__file__).resolve().parents[1]))
    args = parser.parse_args()
    if args.baseline:
        # The child imports gateway/ from DIR: it runs there, with DIR on its path, this file.
        argv = [__file__, "--turns", args.turns, "--lookups", str(args.lookups), "--label", args.baseline]
        script = f"import runpy, sys; sys.argv = {argv!r}; runpy.run_path({__file__!r}, run_name='__main__')"
        env = {**os.environ, "PYTHONPATH": args.baseline}
        subprocess.run([sys.executable, "-c", script], cwd=args.baseline, env=env, check=True)
    import uvloop  # the server's loop: uvicorn's "auto" picks uvloop where it is installed

    uvloop.run(main([int(t) for t in args.turns.split(",")], args.lookups, args.label))
