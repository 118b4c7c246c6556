"""A 20-turn tool-call rollout over the Responses API, WebSocket mode against HTTP: what each turn
costs outside the model.

    .venv/bin/python -m bench.responses_ws [--turns 20] [--rounds 5] [--model bundled|tiny]

A real server (uvicorn on a free port, the real engine with the bundled SmolLM2-135M, or the tiny
random model of the tests; the response store in SQLite in a temporary storage directory, as
`batchgate serve --storage-dir` keeps it). Each turn is a forced `get_weather` function call and,
in the next turn, its output; turn 1 is the user's question. Streamed in both modes:

- HTTP: `POST /v1/responses` with `stream: true` and `previous_response_id` (stored: the only way
  to continue over HTTP), one keep-alive connection (httpx);
- WebSocket: one socket (websockets), each turn a `response.create` with `previous_response_id`
  and `store: false` (continued from the socket's own cache, as agents such as Codex run);
- WebSocket, stored: the same with `store: true`, to show what the store costs on the socket.

A turn's end-to-end time is from sending it to reading its `response.completed`; its engine time
is the engine's own, from `submit` to the request's last output (a wrapper of the engine client);
the overhead is the difference: parsing, state, rendering and tokenizing the prompt, admission,
the store, events, the transport. The modes run in turns, round by round, so that every mode sees
the same load on the machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from websockets.sync.client import connect

from engine.types import GenerationRequest, RequestOutput
from gateway.app import create_app
from gateway.settings import Settings

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
FORCED = {"type": "function", "name": "get_weather"}
QUESTION = "Check the weather in Paris, then again, until I say stop."
MAX_OUTPUT_TOKENS = 24
# A turn ends at its terminal event (a random model's call may run into max_output_tokens).
_TERMINAL = ('{"type":"response.completed"', '{"type":"response.incomplete"')
_FAILED = ('{"type":"response.failed"', '{"type":"error"')


class _TimedStream:
    """An engine stream that notes when its request's last output came."""

    def __init__(self, inner: Any, started: float, done: Callable[[float], None]) -> None:
        self._inner = inner
        self._started = started
        self._done = done
        self.request_id = inner.request_id

    def __aiter__(self) -> _TimedStream:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            return await self._inner.__anext__()
        except StopAsyncIteration:
            self._done(time.perf_counter() - self._started)
            raise

    async def aclose(self) -> None:
        await self._inner.aclose()


class TimedEngine:
    """The engine client, with each request's engine time (submit -> its stream's end) noted."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.engine_s: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def submit(self, request: GenerationRequest) -> Any:
        started = time.perf_counter()
        return _TimedStream(self._engine.submit(request), started, self.engine_s.append)


def _serve(app: Any) -> tuple[uvicorn.Server, threading.Thread, str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(2000):
        if server.started:
            break
        time.sleep(0.005)
    return server, thread, f"127.0.0.1:{sock.getsockname()[1]}"


def _turn_input(turn: int, call: dict[str, Any] | None) -> Any:
    if call is None:
        return QUESTION
    return [{"type": "function_call_output", "call_id": call["call_id"], "output": f"sunny, {15 + turn} C"}]


def _body(model: str, turn: int, call: dict[str, Any] | None, previous: str | None) -> dict[str, Any]:
    body = {
        "model": model,
        "input": _turn_input(turn, call),
        "tools": [TOOL],
        "tool_choice": FORCED,
        "max_output_tokens": MAX_OUTPUT_TOKENS,
        "temperature": 0,
    }
    if previous is not None:
        body["previous_response_id"] = previous
    return body


def _call_of(response: dict[str, Any]) -> dict[str, Any]:
    calls = [i for i in response["output"] if i["type"] == "function_call"]
    assert calls, f"no function call in turn: {response['output']}"
    return dict(calls[0])


def rollout_http(base: str, model: str, turns: int) -> list[float]:
    times = []
    previous, call = None, None
    with httpx.Client(base_url=f"http://{base}", timeout=120) as client:
        for turn in range(turns):
            body = {**_body(model, turn, call, previous), "stream": True}
            start = time.perf_counter()
            response = None
            with client.stream("POST", "/v1/responses", json=body) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    assert not line[6:].startswith(_FAILED), line[:2000]
                    if line.startswith("data: {") and line[6:].startswith(_TERMINAL):
                        response = json.loads(line[6:])["response"]
            times.append(time.perf_counter() - start)
            assert response is not None, "no terminal event"
            previous, call = response["id"], _call_of(response)
    return times


def rollout_ws(base: str, model: str, turns: int, store: bool) -> list[float]:
    times = []
    previous, call = None, None
    with connect(f"ws://{base}/v1/responses", max_size=None) as ws:
        for turn in range(turns):
            frame = {"type": "response.create", **_body(model, turn, call, previous), "store": store}
            start = time.perf_counter()
            ws.send(json.dumps(frame))
            while True:
                message = ws.recv(timeout=120)
                assert not message.startswith(_FAILED), message[:2000]
                if message.startswith(_TERMINAL):
                    break
            times.append(time.perf_counter() - start)
            response = json.loads(message)["response"]
            previous, call = response["id"], _call_of(response)
    return times


def _model_dir(kind: str) -> Path:
    from tests.tiny_model import bundled_dir, make_tiny_model

    bundled = bundled_dir(Path.home() / ".cache" / "batchgate")
    if kind == "bundled":
        return bundled
    return make_tiny_model(Path(tempfile.mkdtemp(prefix="bench-tiny-")), bundled)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", choices=("bundled", "tiny"), default="bundled")
    args = parser.parse_args()

    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig

    engine = AsyncEngine.from_config(
        EngineConfig.of(
            model=str(_model_dir(args.model)), max_model_len=4096, kv_cache_memory_bytes=256 << 20
        )
    )
    timed = TimedEngine(engine)
    storage = tempfile.mkdtemp(prefix="bench-responses-ws-")
    app = create_app(Settings(storage_dir=storage, embedding_model="none", keep_alive_s=5.0), engine=timed)
    server, thread, base = _serve(app)
    model = engine.model_name
    modes: dict[str, Callable[[], list[float]]] = {
        "http": lambda: rollout_http(base, model, args.turns),
        "websocket": lambda: rollout_ws(base, model, args.turns, store=False),
        "websocket_stored": lambda: rollout_ws(base, model, args.turns, store=True),
    }
    try:
        for run in modes.values():  # warm-up: kernels, grammar cache, connections
            run()
        results: dict[str, dict[str, list[float]]] = {
            m: {"e2e": [], "engine": [], "overhead": []} for m in modes
        }
        for _ in range(args.rounds):
            for name, run in modes.items():
                timed.engine_s.clear()
                e2e = run()
                assert len(timed.engine_s) == len(e2e), (len(timed.engine_s), len(e2e))
                results[name]["e2e"] += e2e
                results[name]["engine"] += timed.engine_s
                results[name]["overhead"] += [t - e for t, e in zip(e2e, timed.engine_s, strict=True)]
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        engine.shutdown()
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"# {when}, revision {revision.stdout.strip()}, {platform.processor() or platform.machine()}")
    print(f"# {args.turns} turns x {args.rounds} rounds per mode, model {args.model}, milliseconds per turn")
    print("| mode | e2e p50 | engine p50 | overhead p50 | overhead p90 | overhead mean |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        o = [t * 1e3 for t in r["overhead"]]
        e2e, eng = statistics.median(r["e2e"]) * 1e3, statistics.median(r["engine"]) * 1e3
        p50, p90, mean = statistics.median(o), _percentile(o, 0.9), statistics.mean(o)
        print(f"| {name} | {e2e:.1f} | {eng:.1f} | {p50:.2f} | {p90:.2f} | {mean:.2f} |")
    http, ws = (statistics.median(results[m]["overhead"]) for m in ("http", "websocket"))
    print(f"\nWebSocket's per-turn overhead (p50) is {(1 - ws / http) * 100:.0f}% lower than HTTP's.")


if __name__ == "__main__":
    main()
