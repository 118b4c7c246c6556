"""Chaos: faults injected into a real engine step under concurrent streams, over real HTTP.

A real server (uvicorn, the gateway, the engine on the tiny model) serves several streams at once;
one request, the victim, meets a fault once it has streamed a few tokens: in the forward pass of
its batch, in its output processing (detokenization), in the sampling of its batch. Whatever the
stage: every request ends exactly once (its result, or one error, then `[DONE]`); a failed one's
error names its own request id and nothing else (no exception text, no other request's id); the
engine's blocks and waiting counts return to zero; and the server goes on serving, `/health` 200.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.detokenizer import IncrementalDetokenizer
from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.conftest import LiveServer, TinyServer
from tests.gateway.helpers import parse_sse

SECRET = "secret text of the victim"
MARKER = "POISONED"  # in the victim's prompt
NUM_INNOCENT = 3
MAX_TOKENS = 12
FAULT_AFTER_TOKENS = 2  # the victim has streamed this many tokens when the fault hits
GENERIC = re.compile(r"generation failed for request (\S+); see the server log")


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[TinyServer]:
    """A server of its own: faults are injected into its engine."""
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig

    engine = AsyncEngine.from_config(
        EngineConfig.of(
            model=str(tiny_model_dir),
            dtype="float32",
            device="cpu",
            max_model_len=512,
            max_num_seqs=8,
            kv_cache_memory_bytes=16 * 1024 * 1024,
        )
    )
    live = LiveServer(create_app(Settings(keep_alive_s=1.0, embedding_model="none"), engine=engine))
    try:
        yield TinyServer(engine, live)
    finally:
        live.stop()
        engine.shutdown()


class Fault:
    """Fires once: the first time the victim is past FAULT_AFTER_TOKENS output tokens."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._victims: dict[int, bool] = {}
        self.fired = False

    def is_victim(self, prompt_token_ids: list[int]) -> bool:
        key = hash(tuple(prompt_token_ids))
        if key not in self._victims:
            self._victims[key] = MARKER in self._tokenizer.decode(prompt_token_ids)
        return self._victims[key]

    def hits(self, seqs: list[Any]) -> bool:
        if self.fired:
            return False
        self.fired = any(
            s.num_output_tokens >= FAULT_AFTER_TOKENS and self.is_victim(s.token_ids[: s.num_prompt_tokens])
            for s in seqs
        )
        return self.fired


def inject(stage: str, server: TinyServer, monkeypatch: pytest.MonkeyPatch) -> Fault:
    """Arm a fault in one stage of the engine's step (the runner's forward pass or sampling, or the
    detokenizer), raising with text that must never reach a client."""
    engine = server.engine.engine
    fault = Fault(engine.tokenizer)
    if stage in ("forward", "sample"):
        original = getattr(engine.runner, stage)

        def faulty_step(out: Any, *args: Any) -> Any:
            if fault.hits([c.seq for c in out.chunks]):
                raise RuntimeError(SECRET)
            return original(out, *args)

        monkeypatch.setattr(engine.runner, stage, faulty_step)
    else:
        init, add = IncrementalDetokenizer.__init__, IncrementalDetokenizer.add

        def tagged_init(self: Any, tokenizer: Any, prompt_ids: list[int], *rest: Any, **kw: Any) -> None:
            init(self, tokenizer, prompt_ids, *rest, **kw)
            self.victim = fault.is_victim(prompt_ids)
            self.num_added = 0

        def faulty_add(self: Any, token_id: int) -> bool:
            self.num_added += 1
            if self.victim and self.num_added > FAULT_AFTER_TOKENS and not fault.fired:
                fault.fired = True
                raise RuntimeError(SECRET)
            return add(self, token_id)

        monkeypatch.setattr(IncrementalDetokenizer, "__init__", tagged_init)
        monkeypatch.setattr(IncrementalDetokenizer, "add", faulty_add)
    return fault


@dataclass
class Ending:
    """How one request ended, read from its whole response."""

    status: int
    ids: set[str]  # the completion ids it was given (chunks', or the header's)
    finished: bool  # ended with a finish_reason (and, streamed, then [DONE])
    error: dict[str, Any] | None  # the one error it ended with


def ending_of(response: httpx.Response) -> Ending:
    assert SECRET not in response.text
    if response.status_code != 200:  # failed before its first byte: one JSON error
        return Ending(response.status_code, set(), False, response.json()["error"])
    events, _ = parse_sse(response.text)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    errors = [e for e in events[:-1] if "error" in e]
    chunks = [e for e in events[:-1] if "error" not in e]
    ids = {c["id"] for c in chunks} | {response.headers["x-request-id"]}
    finishes = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    # Exactly one end: a finish or an error (as the last event before [DONE]), never both.
    assert len(finishes) + len(errors) == 1, events
    if errors:
        assert events[-2] is errors[0]
    return Ending(200, ids, bool(finishes), errors[0]["error"] if errors else None)


async def chat(
    http: httpx.AsyncClient, server: TinyServer, content: str, stream: bool = True
) -> httpx.Response:
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    return await http.post("/v1/chat/completions", json=body)


def assert_generic(error: dict[str, Any], own_ids: set[str], all_ids: set[str]) -> None:
    assert error["code"] == "generation_failed" and error["type"] == "server_error"
    m = GENERIC.fullmatch(error["message"])
    assert m is not None, error["message"]
    if own_ids:  # a streamed request: the id it was given
        assert m.group(1) in own_ids
    assert m.group(1) not in all_ids - own_ids  # never another request's


def step_failures(text: str, stage: str) -> float:
    line = f'batchgate_engine_step_failures_total{{stage="{stage}"}} '
    return float(next(x for x in text.splitlines() if x.startswith(line)).split()[-1])


@pytest.mark.parametrize(
    ("stage", "label"), [("forward", "forward"), ("output", "output"), ("sample", "sampling")]
)
async def test_a_fault_ends_what_it_concerns_once_and_the_server_goes_on(
    server: TinyServer, stage: str, label: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
        failures_before = step_failures((await http.get("/metrics")).text, label)
        fault = inject(stage, server, monkeypatch)
        contents = [f"{MARKER}: tell me about {stage}"] + [
            f"innocent {i}: tell me a story" for i in range(NUM_INNOCENT)
        ]
        responses = await asyncio.gather(*(chat(http, server, c) for c in contents))
        assert fault.fired
        endings = [ending_of(r) for r in responses]
        all_ids = set().union(*(e.ids for e in endings))
        victim, innocents = endings[0], endings[1:]
        # The victim had streamed tokens: its stream ends with one generic error event, [DONE].
        assert victim.status == 200 and victim.error is not None
        assert_generic(victim.error, victim.ids, all_ids)
        for ending in innocents:
            if stage == "output":  # one sequence's own processing: nobody else is touched
                assert ending.finished and ending.error is None
            elif ending.error is not None:  # in the victim's batch: failed the same way, with its own id
                assert_generic(ending.error, ending.ids, all_ids)
            else:
                assert ending.finished
        stats = await asyncio.to_thread(server.wait_idle)
        assert stats.num_waiting_tokens == 0 and stats.num_running_tokens == 0
        metrics = (await http.get("/metrics")).text
        assert step_failures(metrics, label) == failures_before + 1
        assert "batchgate_engine_up 1.0" in metrics
        # The engine goes on.
        monkeypatch.undo()
        follow_up = await chat(http, server, "and now?", stream=False)
        assert follow_up.status_code == 200
        assert follow_up.json()["choices"][0]["finish_reason"] == "length"
        assert (await http.get("/health")).json() == {"status": "ok"}
