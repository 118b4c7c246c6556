"""AsyncEngine: the loop thread, streams, abort on close, the event loop never blocked."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.types import (
    EngineDeadError,
    EngineOverloadedError,
    FinishReason,
    GenerationRequest,
    Priority,
    PromptTooLongError,
    SamplingParams,
)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[AsyncEngine]:
    eng = AsyncEngine.from_config(
        EngineConfig(
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


async def test_shutdown_fails_pending_requests(tiny_model_dir: Path) -> None:
    eng = AsyncEngine.from_config(
        EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=4 << 20)
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
        EngineConfig(
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
        EngineConfig(
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
