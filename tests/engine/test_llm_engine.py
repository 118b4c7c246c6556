"""The synchronous engine on a tiny random model: every terminal path, and batching invariance."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.deadlines import ServiceMeter
from engine.llm_engine import LLMEngine
from engine.types import (
    DuplicateRequestError,
    EngineOverloadedError,
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    Priority,
    PromptTooLongError,
    SamplingParams,
)
from tests.engine.helpers import greedy, run_all, text_of, tiny_engine, tokens_of

PROMPTS = [list(range(200 + 7 * i, 220 + 11 * i)) for i in range(6)]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return tiny_engine(tiny_model_dir)


def assert_idle(engine: LLMEngine) -> None:
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def alone(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    return tokens_of(run_all(engine, [GenerationRequest("alone", prompt, params)])[("alone", 0)])


def test_preemption_under_kv_pressure_keeps_outputs(tiny_model_dir: Path, engine: LLMEngine) -> None:
    expected = [alone(engine, p, greedy(24)) for p in PROMPTS]
    # 40 blocks of 4 tokens hold 160 tokens; six sequences need up to ~290 together.
    per_block = 2 * 2 * 2 * 16 * 4 * 4  # K+V, layers, kv heads, head_dim, fp32 bytes, block_size
    small = tiny_engine(tiny_model_dir, kv_cache_memory_bytes=40 * per_block, max_model_len=160)
    assert small.block_manager.num_blocks == 40
    outputs = run_all(small, [GenerationRequest(f"p{i}", p, greedy(24)) for i, p in enumerate(PROMPTS)])
    assert small.scheduler.num_preemptions > 0
    for i in range(len(PROMPTS)):
        assert tokens_of(outputs[(f"p{i}", 0)]) == expected[i]
    assert_idle(small)


def test_shared_prefixes_under_kv_pressure_keep_outputs(tiny_model_dir: Path, engine: LLMEngine) -> None:
    """Prefix sharing, preemption and eviction at once: six prompts with a common 12-token start
    on a cache too small for all of them give what each gives alone on an uncached engine."""
    common = list(range(600, 612))
    prompts = [common + list(range(700 + 9 * i, 705 + 13 * i)) for i in range(6)]
    uncached = tiny_engine(tiny_model_dir, enable_prefix_caching=False)
    expected = [alone(uncached, p, greedy(24)) for p in prompts]
    per_block = 2 * 2 * 2 * 16 * 4 * 4  # K+V, layers, kv heads, head_dim, fp32 bytes, block_size
    small = tiny_engine(tiny_model_dir, kv_cache_memory_bytes=40 * per_block, max_model_len=160)
    outputs = run_all(small, [GenerationRequest(f"s{i}", p, greedy(24)) for i, p in enumerate(prompts)])
    assert small.scheduler.num_preemptions > 0
    assert small.block_manager.num_hit_tokens > 0
    for i in range(len(prompts)):
        assert tokens_of(outputs[(f"s{i}", 0)]) == expected[i]
    assert_idle(small)


def test_batching_does_not_change_results(engine: LLMEngine) -> None:
    expected = [alone(engine, p, greedy(16)) for p in PROMPTS[:3]]
    # Arrivals at different steps, mixed with sampled requests of other lengths.
    pending = [GenerationRequest(f"b{i}", p, greedy(16)) for i, p in enumerate(PROMPTS[:3])]
    others = [
        GenerationRequest(f"o{i}", list(range(50, 50 + 3 * i + 1)), SamplingParams(max_tokens=5 + i))
        for i in range(8)
    ]
    outputs: dict[tuple[str, int], list[Any]] = {}
    arrivals = {0: others[:4] + pending[:1], 3: pending[1:2] + others[4:], 7: pending[2:]}
    step = 0
    while engine.has_unfinished() or any(k >= step for k in arrivals):
        for r in arrivals.pop(step, []):
            engine.add_request(r)
        for out in engine.step():
            outputs.setdefault((out.request_id, out.index), []).append(out)
        step += 1
    for i in range(3):
        assert tokens_of(outputs[(f"b{i}", 0)]) == expected[i]
    assert_idle(engine)


def test_finish_reasons_and_counts(engine: LLMEngine) -> None:
    outs = run_all(engine, [GenerationRequest("len", PROMPTS[0], greedy(7))])[("len", 0)]
    assert [o.finish_reason for o in outs] == [None] * 6 + [FinishReason.LENGTH]
    assert outs[-1].num_output_tokens == 7 and outs[-1].num_prompt_tokens == len(PROMPTS[0])
    # A huge bias makes token 2 (EOS) certain; min_tokens masks it for the first 5 tokens.
    params = SamplingParams(max_tokens=20, temperature=0.0, logit_bias={2: 100.0}, min_tokens=5)
    outs = run_all(engine, [GenerationRequest("eos", PROMPTS[0], params)])[("eos", 0)]
    assert tokens_of(outs)[-1] == 2 and len(tokens_of(outs)) == 6
    assert outs[-1].finish_reason == FinishReason.STOP
    params = SamplingParams(max_tokens=20, temperature=0.0, logit_bias={777: 100.0}, stop_token_ids=(777,))
    outs = run_all(engine, [GenerationRequest("stopid", PROMPTS[0], params)])[("stopid", 0)]
    assert tokens_of(outs) == [777] and outs[-1].finish_reason == FinishReason.STOP
    assert_idle(engine)


def test_stop_string_spanning_tokens_is_cut(engine: LLMEngine) -> None:
    full = text_of(run_all(engine, [GenerationRequest("full", PROMPTS[1], greedy(30))])[("full", 0)])
    stop = full[len(full) // 2 : len(full) // 2 + 6]
    assert len(stop.strip()) > 0
    outs = run_all(engine, [GenerationRequest("cut", PROMPTS[1], greedy(30, stop=(stop,)))])[("cut", 0)]
    assert text_of(outs) == full[: full.index(stop)]
    assert outs[-1].finish_reason == FinishReason.STOP
    assert_idle(engine)


def test_seed_is_reproducible_and_independent_of_the_batch(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=1234, n=2, ignore_eos=True)
    first = run_all(engine, [GenerationRequest("s1", PROMPTS[2], params)])
    crowd = [
        GenerationRequest(f"c{i}", PROMPTS[i], SamplingParams(max_tokens=9, temperature=1.0))
        for i in range(4)
    ]
    second = run_all(engine, [*crowd, GenerationRequest("s2", PROMPTS[2], params)])
    for index in (0, 1):
        assert tokens_of(first[("s1", index)]) == tokens_of(second[("s2", index)])
    assert tokens_of(first[("s1", 0)]) != tokens_of(first[("s1", 1)])  # choices draw differently
    assert_idle(engine)


def test_abort_frees_blocks_and_others_finish(engine: LLMEngine) -> None:
    for i in range(3):
        engine.add_request(GenerationRequest(f"a{i}", PROMPTS[i], greedy(20)))
    for _ in range(4):
        engine.step()
    aborted = engine.abort_request("a1")
    assert [o.finish_reason for o in aborted] == [FinishReason.ABORT]
    assert engine.abort_request("a1") == [] and engine.abort_request("unknown") == []
    finals = []
    while engine.has_unfinished():
        finals += [o for o in engine.step() if o.finished]
    assert sorted(o.request_id for o in finals) == ["a0", "a2"]
    assert_idle(engine)


def test_validation_errors(engine: LLMEngine) -> None:
    with pytest.raises(PromptTooLongError) as info:
        engine.add_request(GenerationRequest("long", [5] * 10, greedy(engine.max_model_len)))
    assert str(engine.max_model_len) in str(info.value) and str(engine.max_model_len + 10) in str(info.value)
    # A malformed request is a typed EngineError with a stable code, never a bare ValueError.
    with pytest.raises(InvalidRequestError, match="at least one token") as bad:
        engine.add_request(GenerationRequest("empty", [], greedy(4)))
    assert bad.value.code == "invalid_request" and not isinstance(bad.value, ValueError)
    with pytest.raises(InvalidRequestError, match=r"prompt token ids must be in \[0, "):
        engine.add_request(GenerationRequest("vocab", [10**9], greedy(4)))
    with pytest.raises(InvalidRequestError, match="logit_bias token ids") as bad:
        engine.add_request(GenerationRequest("bias", [5], greedy(4, logit_bias={10**9: 1.0})))
    assert bad.value.param == "logit_bias"
    with pytest.raises(InvalidRequestError, match="max_tokens must be >= 1") as bad:
        SamplingParams(max_tokens=0)
    assert bad.value.param == "max_tokens"
    engine.add_request(GenerationRequest("twice", [5] * 4, greedy(4)))
    with pytest.raises(DuplicateRequestError, match="'twice' is already in the engine") as dup:
        engine.add_request(GenerationRequest("twice", [5] * 4, greedy(4)))
    assert dup.value.code == "duplicate_request_id"
    engine.abort_request("twice")
    assert_idle(engine)


def test_queue_deadline_expires_waiting_requests(tiny_model_dir: Path) -> None:
    now = {"t": 100.0}
    engine = tiny_engine(tiny_model_dir, max_num_seqs=1)
    engine.clock = engine.scheduler.clock = lambda: now["t"]
    engine.add_request(GenerationRequest("busy", PROMPTS[0], greedy(10)))
    engine.add_request(
        GenerationRequest("late", PROMPTS[1], greedy(10), priority=Priority.FREE, queue_deadline_s=2.0)
    )
    engine.step()
    now["t"] += 3.0
    outs = engine.step()
    late = [o for o in outs if o.request_id == "late"]
    assert len(late) == 1 and late[0].finish_reason == FinishReason.ERROR
    assert isinstance(late[0].error, EngineOverloadedError)
    assert engine.stats().refusals_by_reason == {"deadline_in_queue": 1}
    while engine.has_unfinished():
        engine.step()
    assert_idle(engine)


def test_a_batch_request_has_no_queue_deadline(tiny_model_dir: Path) -> None:
    now = {"t": 100.0}
    engine = tiny_engine(tiny_model_dir, max_num_seqs=1, default_queue_deadline_s=2.0)
    engine.clock = engine.scheduler.clock = lambda: now["t"]
    engine.add_request(GenerationRequest("busy", PROMPTS[0], greedy(6)))
    engine.add_request(
        GenerationRequest("line", PROMPTS[1], greedy(3), priority=Priority.BATCH, queue_deadline_s=1.0)
    )
    engine.step()
    now["t"] += 30.0
    outs: list[Any] = []
    while engine.has_unfinished():
        outs += engine.step()
    line = [o for o in outs if o.request_id == "line" and o.finished]
    assert len(line) == 1 and line[0].finish_reason == FinishReason.LENGTH
    assert engine.stats().refusals_by_reason == {}
    assert_idle(engine)


# ---- scheduling policy end to end -----------------------------------------------------------------


def test_paid_preempts_free_and_every_output_is_unchanged(engine: LLMEngine, tiny_model_dir: Path) -> None:
    expected = {i: alone(engine, PROMPTS[i], greedy(12)) for i in range(4)}
    two_slots = tiny_engine(tiny_model_dir, max_num_seqs=2)
    for i in (0, 1):
        two_slots.add_request(GenerationRequest(f"free{i}", PROMPTS[i], greedy(12), priority=Priority.FREE))
    outputs: dict[tuple[str, int], list[Any]] = {}
    for _ in range(3):
        for out in two_slots.step():
            outputs.setdefault((out.request_id, out.index), []).append(out)
    for i in (2, 3):
        two_slots.add_request(GenerationRequest(f"paid{i}", PROMPTS[i], greedy(12), priority=Priority.PAID))
    first_done: list[str] = []
    while two_slots.has_unfinished():
        for out in two_slots.step():
            outputs.setdefault((out.request_id, out.index), []).append(out)
            if out.finished:
                first_done.append(out.request_id)
    stats = two_slots.stats()
    assert stats.num_priority_preemptions == stats.num_preemptions == 2
    assert first_done[:2] == ["paid2", "paid3"]  # admitted after the free ones, finished before them
    for name, i in (("free0", 0), ("free1", 1), ("paid2", 2), ("paid3", 3)):
        assert tokens_of(outputs[(name, 0)]) == expected[i]  # recomputed, never garbled
        assert outputs[(name, 0)][-1].num_output_tokens == 12
    assert_idle(two_slots)


def test_static_batching_gives_the_same_outputs(engine: LLMEngine, tiny_model_dir: Path) -> None:
    expected = [alone(engine, p, greedy(6 + 3 * i)) for i, p in enumerate(PROMPTS[:4])]
    static = tiny_engine(tiny_model_dir, batching="static", max_num_seqs=2)
    outputs = run_all(
        static, [GenerationRequest(f"s{i}", p, greedy(6 + 3 * i)) for i, p in enumerate(PROMPTS[:4])]
    )
    for i in range(4):
        assert tokens_of(outputs[(f"s{i}", 0)]) == expected[i]
    assert static.stats().batching == "static"
    assert_idle(static)


def test_stats_show_queues_by_class_and_bucket(tiny_model_dir: Path) -> None:
    eng = tiny_engine(tiny_model_dir, max_num_seqs=1, length_buckets=(16, 64))
    lengths = {"a": 10, "b": 30, "c": 100, "d": 12}
    for name, n in lengths.items():
        priority = Priority.FREE if name in "bd" else Priority.PAID
        eng.add_request(GenerationRequest(name, [5] * n, greedy(2), priority=priority))
    stats = eng.stats()
    assert stats.num_waiting == 4 and stats.waiting_by_priority == {"paid": 2, "free": 2, "batch": 0}
    assert stats.waiting_by_bucket == {"<=16": 2, "<=64": 1, ">64": 1}
    assert stats.waiting_by_priority_and_bucket["free"] == {"<=16": 1, "<=64": 1, ">64": 0}
    assert stats.num_waiting_tokens == 152
    eng.step()
    stats = eng.stats()
    assert stats.num_running == 1 and stats.running_by_priority == {"paid": 1, "free": 0, "batch": 0}
    assert stats.decode_steps_per_s > 0 and stats.prefill_tokens_per_s > 0
    while eng.has_unfinished():
        eng.step()
    assert_idle(eng)


def test_a_request_that_cannot_start_in_time_is_refused_at_arrival(tiny_model_dir: Path) -> None:
    eng = tiny_engine(tiny_model_dir, max_num_seqs=2, default_queue_deadline_s=2.0)
    request = GenerationRequest("new", PROMPTS[0], greedy(4), priority=Priority.FREE)
    for i in range(6):
        eng.add_request(GenerationRequest(f"busy{i}", PROMPTS[i], greedy(200), priority=Priority.FREE))
    eng.counters.meter = ServiceMeter()
    eng.check_arrival(request)  # nothing measured yet: admitted
    eng.counters.meter.record_step(0.05, 0, 2)  # 50 ms a step: the 6 ahead need ~200 steps each on 2 slots
    with pytest.raises(EngineOverloadedError) as info:
        eng.check_arrival(request)
    assert info.value.retry_after_s > 1.0 and "queue deadline of 2s" in str(info.value)
    eng.check_arrival(GenerationRequest("paid", PROMPTS[0], greedy(4), priority=Priority.PAID))
    eng.check_arrival(GenerationRequest("patient", PROMPTS[0], greedy(4), queue_deadline_s=3600.0))
    assert eng.stats().refusals_by_reason == {"deadline_at_arrival": 1}
    for i in range(6):
        eng.abort_request(f"busy{i}")
    assert_idle(eng)


def test_policy_settings_are_validated() -> None:
    for bad in (
        dict(batching="dynamic"),
        dict(length_buckets=(64, 16)),
        dict(long_prefill_share=0.0),
        dict(max_preemptions_per_seq=-1),
        dict(default_queue_deadline_s=0.0),
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig.of(**bad)  # type: ignore[arg-type]


def test_prefix_caching_changes_no_output_and_reports_cached_tokens(
    engine: LLMEngine, tiny_model_dir: Path
) -> None:
    """A shared system-prompt-like prefix, then different tails; an exact repeat; a different salt.
    Token for token the same outputs (and logprobs within float error) as an engine without prefix
    caching, with the cached prompt tokens reported."""
    assert engine.config.cache.enable_prefix_caching  # the default
    uncached = tiny_engine(tiny_model_dir, enable_prefix_caching=False)
    system = list(range(300, 323))  # 23 tokens: 5 full blocks of 4
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=True, ignore_eos=True)

    def requests(tag: str) -> list[list[GenerationRequest]]:
        return [
            [GenerationRequest(f"{tag}-first", system + [5, 6, 7], params)],
            [
                GenerationRequest(f"{tag}-tail{i}", system + list(range(40 + i, 50 + 3 * i)), params)
                for i in range(3)
            ],
            [GenerationRequest(f"{tag}-repeat", system + [5, 6, 7], params)],
            [GenerationRequest(f"{tag}-salted", system + [5, 6, 7], params, cache_salt="other")],
        ]

    expected: dict[str, list[Any]] = {}
    for wave in requests("x"):
        for key, outs in run_all(uncached, wave).items():
            expected[key[0][2:]] = outs
    before = engine.block_manager.num_hit_tokens
    got: dict[str, list[Any]] = {}
    for wave in requests("y"):
        for key, outs in run_all(engine, wave).items():
            got[key[0][2:]] = outs
    for name, outs in expected.items():
        assert tokens_of(got[name]) == tokens_of(outs), name
        lp = [p.logprob for o in got[name] for p in o.logprobs]
        ref = [p.logprob for o in outs for p in o.logprobs]
        assert lp == pytest.approx(ref, abs=1e-4), name
        assert all(o.num_cached_tokens == 0 for o in outs)
    cached = {name: outs[-1].num_cached_tokens for name, outs in got.items()}
    assert cached["first"] in (0, 20)  # the module's engine may have seen this prefix already
    assert cached["tail0"] == cached["tail1"] == cached["tail2"] == 20
    assert cached["repeat"] == 24  # 26 tokens: 6 full blocks (the 7th, partial, is computed)
    assert cached["salted"] == 0
    assert engine.block_manager.num_hit_tokens - before == sum(cached.values())
    assert_idle(engine)


def test_a_conversation_s_next_turn_reuses_the_previous_answer(engine: LLMEngine) -> None:
    """Blocks filled while decoding are cached too: a follow-up whose prompt is the earlier
    prompt, the answer and a new message computes only the tail."""
    prompt = list(range(900, 923))
    first = run_all(engine, [GenerationRequest("turn1", prompt, greedy(20))])[("turn1", 0)]
    answer = tokens_of(first)
    follow_up = prompt + answer + [5, 6, 7]
    second = run_all(engine, [GenerationRequest("turn2", follow_up, greedy(4))])[("turn2", 0)]
    # Every full block of prompt + answer except the answer's last token, which was sampled but
    # never fed back (its K/V were never computed).
    block_size = engine.block_manager.block_size
    assert second[-1].num_cached_tokens == (len(prompt) + len(answer) - 1) // block_size * block_size
    assert second[-1].num_cached_tokens >= 40
    assert_idle(engine)


def test_waiting_counters_return_to_zero_after_prefix_cache_hits(engine: LLMEngine) -> None:
    """Requests that share a system prompt hit the prefix cache at admission; once they have all
    finished, the idle engine counts no waiting work (the arrival estimate reads these counters:
    a drift would refuse requests on an idle server), and a request with a deadline is accepted."""
    system = list(range(1200, 1241))  # 41 tokens: 10 full blocks of 4
    for wave in range(3):
        requests = [
            GenerationRequest(f"shared{wave}-{i}", system + [7 + i, 8 + wave], greedy(3), priority=priority)
            for i, priority in enumerate([Priority.PAID, Priority.FREE, Priority.PAID, Priority.FREE])
        ]
        outputs = run_all(engine, requests)
        assert all(outs[-1].finish_reason == FinishReason.LENGTH for outs in outputs.values())
    assert engine.block_manager.num_hit_tokens > 0
    stats = engine.stats()
    assert (stats.num_waiting, stats.num_running) == (0, 0)
    assert stats.num_waiting_tokens == 0 and stats.num_running_tokens == 0
    assert set(stats.waiting_by_priority.values()) == {0}
    assert set(stats.waiting_by_bucket.values()) == {0}
    load = engine.load_snapshot()
    assert set(load.waiting_tokens.values()) == {0}
    assert set(load.waiting_decode_tokens.values()) == {0}
    engine.check_arrival(GenerationRequest("next", system + [9], greedy(3), queue_deadline_s=0.001))
    assert_idle(engine)
