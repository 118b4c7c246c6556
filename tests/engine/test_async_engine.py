"""AsyncEngine: the loop thread, streams, abort on close, the event loop never blocked."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.async_engine import AsyncEngine
from engine.client import EngineClient, EngineStream
from engine.config import EngineConfig
from engine.types import (
    DuplicateRequestError,
    EngineDeadError,
    EngineHealth,
    EngineOverloadedError,
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    Priority,
    PromptTooLongError,
    SamplingParams,
)
from tests.engine.factories import FakeClock
from tests.engine.helpers import tiny_engine


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[AsyncEngine]:
    eng = AsyncEngine.from_config(
        EngineConfig.of(
            model=str(tiny_model_dir),
            dtype="float32",
            block_size=4,
            kv_cache_memory_bytes=8 << 20,
            max_num_seqs=8,
        )
    )
    yield eng
    eng.shutdown()


async def wait_idle(engine: AsyncEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine not idle: {engine.stats()}")


async def test_it_and_its_streams_implement_the_engine_client(engine: AsyncEngine) -> None:
    assert isinstance(engine, EngineClient)
    stream = engine.submit(GenerationRequest("c", [5, 6, 7], SamplingParams(max_tokens=2)))
    assert isinstance(stream, EngineStream)
    assert [o async for o in stream][-1].finished
    await wait_idle(engine)


async def test_stream_yields_incremental_outputs_then_finishes(engine: AsyncEngine) -> None:
    stream = engine.submit(
        GenerationRequest("s", list(range(100, 120)), SamplingParams(max_tokens=9, ignore_eos=True))
    )
    outs = [o async for o in stream]
    assert [len(o.new_token_ids) for o in outs] == [1] * 9
    assert outs[-1].finish_reason == FinishReason.LENGTH and all(o.finish_reason is None for o in outs[:-1])
    await wait_idle(engine)


async def test_n_choices_interleave_and_all_finish(engine: AsyncEngine) -> None:
    params = SamplingParams(max_tokens=5, n=3, temperature=1.0, seed=7, ignore_eos=True)
    outs = [o async for o in engine.submit(GenerationRequest("n3", list(range(10, 20)), params))]
    assert sorted({o.index for o in outs}) == [0, 1, 2]
    assert sum(o.finished for o in outs) == 3
    await wait_idle(engine)


async def test_closing_a_stream_aborts_and_frees_blocks(engine: AsyncEngine) -> None:
    stream = engine.submit(
        GenerationRequest("gone", list(range(50, 90)), SamplingParams(max_tokens=500, ignore_eos=True))
    )
    got = 0
    async for _ in stream:
        got += 1
        if got == 3:
            break
    await stream.aclose()
    await wait_idle(engine)


async def test_concurrent_requests_and_a_responsive_loop(engine: AsyncEngine) -> None:
    async def one(i: int) -> int:
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        stream = engine.submit(GenerationRequest(f"c{i}", [5 + i] * (10 + i), params))
        return sum([len(o.new_token_ids) async for o in stream])

    async def ticker() -> float:
        worst, last = 0.0, time.monotonic()
        for _ in range(50):
            await asyncio.sleep(0.005)
            now = time.monotonic()
            worst, last = max(worst, now - last), now
        return worst

    results = await asyncio.gather(*(one(i) for i in range(12)), ticker())
    assert results[:12] == [40] * 12
    assert results[12] < 0.05, f"event loop stalled for {results[12] * 1000:.0f} ms"
    await wait_idle(engine)


async def test_submit_raises_at_once_for_a_too_long_prompt(engine: AsyncEngine) -> None:
    with pytest.raises(PromptTooLongError):
        engine.submit(GenerationRequest("long", [1] * 10, SamplingParams(max_tokens=engine.max_model_len)))


async def test_submit_raises_typed_errors_for_a_bad_request(engine: AsyncEngine) -> None:
    vocab = engine.engine.spec.vocab_size
    with pytest.raises(InvalidRequestError, match=rf"prompt token ids must be in \[0, {vocab}\)") as bad:
        engine.submit(GenerationRequest("vocab", [vocab], SamplingParams(max_tokens=2)))
    assert bad.value.code == "invalid_request"
    with pytest.raises(InvalidRequestError, match="at least one token"):
        engine.submit(GenerationRequest("empty", [], SamplingParams(max_tokens=2)))
    stream = engine.submit(GenerationRequest("dup", [3] * 4, SamplingParams(max_tokens=2, ignore_eos=True)))
    with pytest.raises(DuplicateRequestError, match="'dup' is already in the engine"):
        engine.submit(GenerationRequest("dup", [3] * 4, SamplingParams(max_tokens=2, ignore_eos=True)))
    assert [o.finish_reason for o in [o async for o in stream]][-1] == FinishReason.LENGTH
    await wait_idle(engine)


async def test_shutdown_fails_pending_requests(tiny_model_dir: Path) -> None:
    eng = AsyncEngine.from_config(
        EngineConfig.of(model=str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=4 << 20)
    )
    stream = eng.submit(
        GenerationRequest("p", [3] * 8, SamplingParams(max_tokens=10_000 // 4, ignore_eos=True))
    )
    first = await stream.__anext__()
    assert first.finish_reason is None
    await asyncio.to_thread(eng.shutdown)
    rest = [o async for o in stream]
    assert rest[-1].finish_reason == FinishReason.ERROR and isinstance(rest[-1].error, EngineDeadError)
    with pytest.raises(EngineDeadError):
        eng.submit(GenerationRequest("q", [3], SamplingParams()))


async def test_overload_is_refused_at_submit_fast_and_paid_still_starts(tiny_model_dir: Path) -> None:
    eng = AsyncEngine.from_config(
        EngineConfig.of(
            model=str(tiny_model_dir),
            dtype="float32",
            block_size=4,
            kv_cache_memory_bytes=8 << 20,
            max_num_seqs=2,
            default_queue_deadline_s=0.5,
        )
    )
    try:
        long = SamplingParams(max_tokens=4000, ignore_eos=True)
        busy = [
            eng.submit(GenerationRequest(f"busy{i}", [7 + i] * 12, long, priority=Priority.FREE))
            for i in range(2)
        ]
        for stream in busy:
            await stream.__anext__()  # both run; the engine has measured a few steps
        while eng.stats().total_steps < 5:
            await asyncio.sleep(0.01)
        # Both slots are taken for ~4000 steps: a free request with a 0.5 s deadline cannot start.
        # Refused in submit itself, without waiting for a step.
        start = time.perf_counter()
        with pytest.raises(EngineOverloadedError) as info:
            eng.submit(
                GenerationRequest("late", [3] * 8, SamplingParams(max_tokens=4), priority=Priority.FREE)
            )
        assert time.perf_counter() - start < 0.05
        assert info.value.retry_after_s >= 1.0
        assert eng.stats().refusals_by_reason.get("deadline_at_arrival") == 1
        # A paid request is admitted and starts at once: it preempts a free sequence.
        paid = eng.submit(GenerationRequest("paid", [3] * 8, SamplingParams(max_tokens=3, ignore_eos=True)))
        outs = [o async for o in paid]
        assert outs[-1].finish_reason == FinishReason.LENGTH and outs[-1].num_output_tokens == 3
        assert eng.stats().num_priority_preemptions >= 1
        for stream in busy:
            await stream.aclose()
        await wait_idle(eng)
    finally:
        eng.shutdown()


async def test_a_burst_between_snapshots_counts_itself_as_ahead(tiny_model_dir: Path) -> None:
    eng = AsyncEngine.from_config(
        EngineConfig.of(
            model=str(tiny_model_dir),
            dtype="float32",
            block_size=4,
            kv_cache_memory_bytes=8 << 20,
            max_num_seqs=1,
        )
    )
    try:
        warm = eng.submit(GenerationRequest("warm", [5] * 8, SamplingParams(max_tokens=8, ignore_eos=True)))
        _ = [o async for o in warm]
        await wait_idle(eng)
        # An idle engine with measured rates; 50 requests of 3000 tokens arrive in one event-loop tick.
        # Each sees the ones accepted before it, so the later ones are refused, not left to expire.
        params = SamplingParams(max_tokens=3000, ignore_eos=True)
        accepted, refused = [], 0
        for i in range(50):
            try:
                accepted.append(
                    eng.submit(
                        GenerationRequest(
                            f"b{i}", [9] * 8, params, queue_deadline_s=0.2, priority=Priority.FREE
                        )
                    )
                )
            except EngineOverloadedError:
                refused += 1
        assert accepted and refused > 0
        for stream in accepted:
            await stream.aclose()
        await wait_idle(eng)
    finally:
        eng.shutdown()


# ---- faults and liveness ----------------------------------------------------------------------


async def test_a_forward_fault_ends_its_batch_with_generic_errors_and_the_loop_goes_on(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The victim's batch fails once: every stream still ends exactly once, each failed one with
    its own request id and no exception text; the others finish; the loop serves the next one."""
    original = engine.engine.runner.forward
    fired = []

    def faulty(out: Any) -> Any:
        if not fired and any(c.seq.request_id == "victim" for c in out.chunks):
            fired.append(True)
            raise RuntimeError("secret text of the victim's batch")
        return original(out)

    monkeypatch.setattr(engine.engine.runner, "forward", faulty)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    names = ["victim", "x1", "x2", "x3"]
    streams = [engine.submit(GenerationRequest(n, [20 + i] * 9, params)) for i, n in enumerate(names)]

    async def drain(stream: Any) -> list[Any]:
        return [o async for o in stream]

    results = dict(zip(names, await asyncio.gather(*(drain(s) for s in streams)), strict=True))
    assert fired
    for name, outs in results.items():
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True], name
        last = outs[-1]
        if last.finish_reason == FinishReason.ERROR:
            assert str(last.error) == f"generation failed for request {name}; see the server log"
        else:
            assert last.finish_reason == FinishReason.LENGTH and last.num_output_tokens == 6
    assert results["victim"][-1].finish_reason == FinishReason.ERROR
    await wait_idle(engine)
    after = [o async for o in engine.submit(GenerationRequest("after", [5] * 9, params))]
    assert after[-1].finish_reason == FinishReason.LENGTH
    assert engine.health().alive and engine.stats().step_failures_by_stage["forward"] >= 1


async def test_health_tells_a_stuck_loop_from_an_idle_one(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No step while work waits counts as stalled (by the injected clock); idle time never does."""
    clock = FakeClock(1000.0)
    eng = AsyncEngine(tiny_engine(tiny_model_dir), clock=clock)
    entered, release = threading.Event(), threading.Event()
    original = eng.engine.runner.forward

    def stuck(out: Any) -> Any:
        entered.set()
        release.wait(30)  # safety net only: the test releases it
        return original(out)

    monkeypatch.setattr(eng.engine.runner, "forward", stuck)
    assert eng.health() == EngineHealth(alive=False, reason="the engine loop is not running")
    eng.start()
    try:
        assert eng.health() == EngineHealth(alive=True, stalled_s=0.0)
        clock.advance(3600)  # an hour idle is not a stall
        assert eng.health().stalled_s == 0.0
        stream = eng.submit(GenerationRequest("slow", [4] * 9, SamplingParams(max_tokens=2, ignore_eos=True)))
        assert await asyncio.to_thread(entered.wait, 30)
        clock.advance(61)
        health = eng.health()
        assert health.alive and health.stalled_s == 61.0
        assert health.problem(stall_timeout_s=120) is None
        assert health.problem(stall_timeout_s=60) == (
            "the engine made no progress for 61s while work was waiting (stall timeout 60s)"
        )
        release.set()
        outs = [o async for o in stream]
        assert outs[-1].finish_reason == FinishReason.LENGTH
        await wait_idle(eng)
        assert eng.health() == EngineHealth(alive=True, stalled_s=0.0)
    finally:
        release.set()
        eng.shutdown()
    assert eng.health() == EngineHealth(alive=False, reason="the engine was shut down")


async def test_a_dead_loop_fails_its_requests_and_says_so(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Something outside a step's stages fails on the loop thread: the loop ends, every pending
    request gets an error, and health and submit report the death without its exception text."""
    eng = AsyncEngine(tiny_engine(tiny_model_dir))

    def broken_stats() -> Any:
        raise RuntimeError("secret text")

    monkeypatch.setattr(eng.engine, "stats", broken_stats)
    eng.start()
    try:
        stream = eng.submit(GenerationRequest("d", [4] * 9, SamplingParams(max_tokens=50, ignore_eos=True)))
        outs = [o async for o in stream]
        assert outs[-1].finish_reason == FinishReason.ERROR and isinstance(outs[-1].error, EngineDeadError)
        health = eng.health()
        assert not health.alive and health.problem(stall_timeout_s=60) == health.reason
        assert health.reason == "the engine loop died (RuntimeError); see the server log"
        with pytest.raises(EngineDeadError) as info:
            eng.submit(GenerationRequest("e", [4] * 9, SamplingParams()))
        assert "secret" not in str(info.value) and not eng.ready
    finally:
        eng.shutdown()
