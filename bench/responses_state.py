"""What resolving stored state adds to a request: the time of `ResponsesState.prepare` and `wrap`
(gateway/responses/state.py), the functions the pipeline runs before its backend, each call timed
by a monotonic span, for a `previous_response_id` (its chain written turn by turn, as the server
writes it, in each stored format: 1 holds every response's whole history, 2 only its own items
and a link) and a `conversation` of 10-50 turns, on the SQLite store and on Redis (a real
redis-server on a free port), built as the server builds them, on the server's event loop (uvloop).
Then the bytes a `--bytes-turns` chain stores in each format, against the bytes of its items, and
those of a conversation of as many turns, each a response created with `conversation` (the
conversation record and its responses' records together).

    .venv/bin/python -m bench.responses_state [--turns 10,25,50] [--lookups 300] [--bytes-turns 100]

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

Format 1's rows are the previous release's layout (its lookup reads one record of the whole
history): the baseline, measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import redis.asyncio as aioredis

from bench.cpu import CpuMeter
from gateway.admission import Caller
from gateway.backend import Body, Call, Plan, Reply, Work
from gateway.drain import Drain
from gateway.endpoints import RESPONSES
from gateway.metrics import Metrics
from gateway.responses.background import BackgroundRuns
from gateway.responses.compaction import Compactor, Sealer, load_key
from gateway.responses.conversations import Conversations, Turn
from gateway.responses.output import skeleton
from gateway.responses.request import Parent, parse_responses_request
from gateway.responses.state import ResponsesState, build_store
from gateway.responses.store import (
    SQLITE_FILE,
    ResponseStore,
    StoredConversation,
    StoredResponse,
    load_response,
    save_response,
)
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


def _conversation(turns: int) -> StoredConversation:
    """A conversation of `turns` turns."""
    conversation = {"id": f"conv_{turns:032d}", "object": "conversation", "created_at": 0, "metadata": {}}
    return StoredConversation(conversation, [item for i in range(turns) for item in _turn(i)])


# The response object as the server stores it: the request's settings echoed (one function tool).
_REQUEST = parse_responses_request(
    {
        "model": "m",
        "input": "x",
        "tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}],
    }
)


def _response(response_id: str, previous: str | None, output: list[dict[str, Any]]) -> dict[str, Any]:
    request = _REQUEST.model_copy(update={"previous_response_id": previous})
    return {**skeleton(request, response_id, 0, "m"), "status": "completed", "output": output}


async def _write_chain(store: ResponseStore, tenant: str, turns: int, version: int) -> str:
    """`turns` responses, each continuing the one before, written as the server writes them in
    format `version`; the last one's id."""
    previous: StoredResponse | None = None
    for i in range(turns):
        *inputs, answer = _turn(i)
        response_id = f"resp_{turns:04d}_{i:027d}"
        response = _response(response_id, previous.response_id if previous else None, [answer])
        history = previous.conversation() if previous is not None else []
        parent = None
        if previous is not None and previous.version == 2:
            parent = Parent(previous.response_id, len(history), previous.response)
        await save_response(store, tenant, StoredResponse(response, inputs, history, parent=parent), version)
        previous = await load_response(store, tenant, response_id)
        assert previous is not None
    assert previous is not None
    return previous.response_id


async def _write_conversation(state: ResponsesState, tenant: str, turns: int, version: int) -> None:
    """`turns` responses created with `conversation`, written as the server writes them in format
    `version` (gateway/responses/state.py: the response, then its turn joins the conversation)."""
    conversation_id = f"conv_{turns:032d}"
    empty = {"id": conversation_id, "object": "conversation", "created_at": 0, "metadata": {}}
    await state.conversations.save(tenant, StoredConversation(empty, []))
    for i in range(turns):
        *inputs, answer = _turn(i)
        conversation = await state.conversations.load(tenant, conversation_id)
        history = list(conversation.items)
        response = _response(f"resp_c{turns:04d}_{i:026d}", None, [answer])
        record = StoredResponse(response, inputs, history, parent=conversation.head)
        await save_response(state.store, tenant, record, version)
        turn = Turn(response["id"], response, [item.get("id") for item in history])
        await state.conversations.append(tenant, conversation_id, [*inputs, answer], turn)


async def _stored_bytes(name: str, where: str, tenant: str) -> int:
    """The bytes of `tenant`'s records as the store holds them (each record's JSON)."""
    if name.startswith("SQLite"):
        import sqlite3

        with sqlite3.connect(where) as db:
            (num,) = db.execute(
                "SELECT SUM(LENGTH(record)) FROM responses WHERE tenant = ?", (tenant,)
            ).fetchone()
        return int(num or 0)
    client = aioredis.Redis.from_url(where)
    total = 0
    for kind in ("resp_", "conv_"):
        async for key in client.scan_iter(match="{tenant:" + tenant + "}:*:" + kind + "*"):
            is_hash = await client.type(key) == b"hash"
            total += await (client.hstrlen(key, "record") if is_hash else client.strlen(key))
    await client.aclose()
    return total


async def _unused(call: Call) -> Reply:
    return Body({})


def _work(body: dict[str, Any], tenant: str = TENANT) -> Work:
    return Work(RESPONSES, RESPONSES.parse(body), body, Caller(tenant), "m", "resp_bench")


async def _span(
    state: ResponsesState, body: dict[str, Any], num_items: int, tenant: str = TENANT
) -> tuple[float, float]:
    """The wall and thread CPU time (ms) of the state's hooks for one request with `body`, whose
    history must come out `num_items` items long (so a span is never of a lookup that failed)."""
    work = _work(body, tenant)  # parsing the body is every request's, outside the span
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
    tenant: str,
) -> list[str]:
    for _ in range(20):  # warm: connections, the script cache, the page cache
        await _span(state, body, num_items, tenant)
    median = statistics.median(w for w, _ in [await _span(state, body, num_items, tenant) for _ in range(30)])
    spin = _calibrate(median)
    wall, cpu, none, loop, trips = [], [], [], [], []
    for _ in range(n):
        order = ["lookup", "none", "loop"] + (["ping"] if ping is not None else [])
        random.shuffle(order)
        for kind in order:
            if kind == "lookup":
                w, c = await _span(state, body, num_items, tenant)
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


async def main(turns: list[int], n: int, bytes_turns: int, label: str) -> None:
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
            states = []  # (store, format, state): one store of each kind, a tenant per format
            for name, settings, where in [
                ("SQLite (file)", Settings(storage_dir=tmp), str(Path(tmp) / SQLITE_FILE)),
                ("Redis", Settings(redis_url=url), url),
            ]:
                store = build_store(settings, Metrics())
                compactor = Compactor(Sealer(load_key(None, tmp)))
                for version in (1, 2):
                    conversations = Conversations(store, settings.max_body_bytes, store_format=version)
                    background = BackgroundRuns(
                        store, settings.responses_background_lease_s, Drain(), version
                    )
                    state = ResponsesState(
                        store,
                        conversations,
                        background,
                        1.0,
                        compactor,
                        settings.max_body_bytes,
                        store_format=version,
                    )
                    states.append((name, where, version, state))
            print(
                "| store | format | lookup | turns | read KiB | p50 ms | p99 ms | cpu p50 | cpu p99 "
                "| no state p50 | p99 | busy loop p50 | p99 | PING p50 | p99 |\n|---|---|---|---:|---:|"
                + "---:|"
                * 10
            )
            plain = {"model": "m", "input": "and then?"}
            for k in turns:
                for name, _, version, state in states:
                    tenant = f"{TENANT}{version}"
                    ping = pinger.ping if name == "Redis" else None
                    last = await _write_chain(state.store, tenant, k, version)
                    chain = await state.store.chain(tenant, last)
                    size = sum(len(raw) for raw in chain or ())
                    body = {**plain, "previous_response_id": last}
                    row = await _measure(state, body, 4 * k, plain, n, ping, tenant)
                    print(
                        f"| {name} | {version} | previous_response_id | {k} | {size / 1024:.1f} | "
                        + " | ".join(row)
                        + " |"
                    )
                    if version == 1:  # one record of its items
                        conversation = _conversation(k)
                        await state.store.put(tenant, conversation.conversation_id, conversation.dumps())
                        size = len(conversation.dumps())
                    else:  # its latest response's chain and its own record (links and no items)
                        await _write_conversation(state, tenant, k, version)
                        conversation_id = f"conv_{k:032d}"
                        size = sum(len(raw) for raw in await state.store.chain(tenant, conversation_id) or ())
                    body = {**plain, "conversation": f"conv_{k:032d}"}
                    row = await _measure(state, body, 4 * k, plain, n, ping, tenant)
                    print(
                        f"| {name} | {version} | conversation | {k} | {size / 1024:.1f} | "
                        + " | ".join(row)
                        + " |"
                    )
            items = sum(len(orjson.dumps(item)) for i in range(bytes_turns) for item in _turn(i))
            print(
                f"\nA chain of {bytes_turns} turns ({4 * bytes_turns} items, "
                f"{items / 1024:.1f} KiB of items' JSON):\n\n"
                "| store | format | continued by | stored KiB | stored / items |\n|---|---|---|---:|---:|"
            )
            for name, where, version, state in states:
                chain, conversation = f"bytes{version}p", f"bytes{version}c"
                await _write_chain(state.store, chain, bytes_turns, version)
                await _write_conversation(state, conversation, bytes_turns, version)
                for how, tenant in (("previous_response_id", chain), ("conversation", conversation)):
                    stored = await _stored_bytes(name, where, tenant)
                    print(f"| {name} | {version} | {how} | {stored / 1024:.1f} | {stored / items:.2f} |")
            for _, _, version, state in states:
                if version == 2:  # the two formats' states share their store
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
    parser.add_argument("--bytes-turns", type=int, default=100)
    parser.add_argument("--label", default=str(Path(__file__).resolve().parents[1]))
    args = parser.parse_args()
    import uvloop  # the server's loop: uvicorn's "auto" picks uvloop where it is installed

    uvloop.run(main([int(t) for t in args.turns.split(",")], args.lookups, args.bytes_turns, args.label))
