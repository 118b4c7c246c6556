"""Faults injected into each stage of a real tiny-model engine's step (OutputProcessor.contain).

What must hold whatever fails: only the sequences the failure concerns end, each with a generic
error that names only its own request id (the exception's text goes to the log, never to a
caller); every choice ends exactly once; blocks and waiting counters return to zero; the engine
serves the next request.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import engine.device.runner as runner_module
from engine.llm_engine import LLMEngine
from engine.types import FinishReason, GenerationFailedError, GenerationRequest, RequestOutput
from tests.engine.helpers import greedy, run_all, tiny_engine, tokens_of

SECRET = "secret-of-another-tenant"
PROMPTS = {name: list(range(300 + 13 * i, 318 + 13 * i)) for i, name in enumerate("abcd")}

Outputs = dict[tuple[str, int], list[RequestOutput]]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    # Three slots: requests a, b, c run together and d waits outside their batch.
    return tiny_engine(tiny_model_dir, max_num_seqs=3)


@pytest.fixture(scope="module")
def expected(engine: LLMEngine) -> dict[str, list[int]]:
    """Each request's tokens when nothing fails."""
    outputs = run_all(engine, requests())
    return {key[0]: tokens_of(outs) for key, outs in outputs.items()}


@pytest.fixture(autouse=True)
def idle_after(engine: LLMEngine) -> Iterator[None]:
    yield
    assert_idle(engine)


def requests(max_tokens: int = 8) -> list[GenerationRequest]:
    return [GenerationRequest(name, prompt, greedy(max_tokens)) for name, prompt in PROMPTS.items()]


def failures(engine: LLMEngine) -> dict[str, int]:
    return dict(engine.stats().step_failures_by_stage)


def fail_on_call(n: int, original: Any) -> Any:
    """`original`, except that its `n`-th call raises with text that must never reach a caller."""
    calls = [0]

    def faulty(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == n:
            raise RuntimeError(f"{SECRET}: tensor of request a")
        return original(*args, **kwargs)

    return faulty


def assert_ended_once(outputs: Outputs) -> None:
    for key, outs in outputs.items():
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True], key


def assert_failed_generically(outs: list[RequestOutput], request_id: str) -> None:
    last = outs[-1]
    assert last.finish_reason == FinishReason.ERROR
    assert isinstance(last.error, GenerationFailedError)
    assert str(last.error) == f"generation failed for request {request_id}; see the server log"
    assert last.new_text == ""


def assert_idle(engine: LLMEngine) -> None:
    assert not engine.has_unfinished()
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert (stats.num_waiting, stats.num_running, stats.num_waiting_tokens) == (0, 0, 0)
    assert not engine.output_processor.seqs and not engine.output_processor.detoks


def serves_the_next_request(engine: LLMEngine, expected: dict[str, list[int]]) -> None:
    outs = run_all(engine, [GenerationRequest("after", PROMPTS["a"], greedy(8))])[("after", 0)]
    assert outs[-1].finish_reason == FinishReason.LENGTH and tokens_of(outs) == expected["a"]


@pytest.mark.parametrize("stage", ["forward", "sampling"])
def test_a_fault_in_the_batch_fails_that_batch_only(
    engine: LLMEngine,
    expected: dict[str, list[int]],
    stage: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The forward pass and sampling run the batch as one: a fault fails its sequences (a, b, c),
    each with its own id only; d, waiting outside the batch, is served as if nothing happened."""
    before = failures(engine)
    if stage == "forward":
        monkeypatch.setattr(engine.runner.model, "forward", fail_on_call(3, engine.runner.model.forward))
    else:
        monkeypatch.setattr(runner_module, "sample_logits", fail_on_call(3, runner_module.sample_logits))
    with caplog.at_level(logging.ERROR, logger="engine.output_processor"):
        outputs = run_all(engine, requests())
    assert_ended_once(outputs)
    for name in "abc":
        assert_failed_generically(outputs[(name, 0)], name)
    assert outputs[("d", 0)][-1].finish_reason == FinishReason.LENGTH
    assert tokens_of(outputs[("d", 0)]) == expected["d"]
    after = failures(engine)
    assert after[stage] == before[stage] + 1
    assert sum(after.values()) == sum(before.values()) + 1
    # The details are in the server log, with the requests they ended.
    assert SECRET in caplog.text and "a#0, b#0, c#0" in caplog.text
    assert_idle(engine)
    serves_the_next_request(engine, expected)


def test_an_output_fault_fails_only_its_sequence(
    engine: LLMEngine, expected: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Detokenizing b's third token raises: b ends with an error, a, c and d (a and c in b's
    batches) finish with exactly the tokens they get when nothing fails."""
    before = failures(engine)
    for request in requests():
        engine.add_request(request)
    detok = engine.output_processor.detoks[("b", 0)]
    monkeypatch.setattr(detok, "add", fail_on_call(3, detok.add))
    outputs: Outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault((out.request_id, out.index), []).append(out)
    assert_ended_once(outputs)
    assert_failed_generically(outputs[("b", 0)], "b")
    assert len(outputs[("b", 0)]) == 3  # two tokens, then the error
    for name in "acd":
        assert outputs[(name, 0)][-1].finish_reason == FinishReason.LENGTH
        assert tokens_of(outputs[(name, 0)]) == expected[name], name
    assert failures(engine)["output"] == before["output"] + 1
    serves_the_next_request(engine, expected)


def test_a_fault_after_a_choice_finished_but_before_its_output_still_ends_it_once(
    engine: LLMEngine, expected: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first choice to reach max_tokens is taken out of the scheduler, then the bookkeeping
    after it fails: it ends with one error output, not silence and not two finals."""
    meter = engine.counters.meter
    monkeypatch.setattr(meter, "record_finish", fail_on_call(1, meter.record_finish))
    outputs = run_all(engine, requests())
    assert_ended_once(outputs)
    reasons = sorted(outs[-1].finish_reason for outs in outputs.values())
    assert reasons == [FinishReason.ERROR] + [FinishReason.LENGTH] * 3
    serves_the_next_request(engine, expected)


def test_a_scheduling_fault_in_the_middle_of_an_admission_leaves_nothing_behind(
    engine: LLMEngine, expected: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """c is taken off the waiting queue and given blocks (its cached prefix among them), then
    admission fails before it runs: the running sequences and c end with an error, d (cleanly
    waiting) is served, and no block, slot or waiting count is left behind."""
    run_all(engine, [GenerationRequest("warm", PROMPTS["c"], greedy(2))])  # c's prefix is cached
    before = failures(engine)
    for request in requests():
        engine.add_request(request)
    c = engine.output_processor.seqs["c"][0]

    def admitted_halfway() -> None:
        assert c.block_table and c.num_computed_tokens > 0  # the cached prefix was taken
        raise RuntimeError(SECRET)

    monkeypatch.setattr(c, "mark_admitted", admitted_halfway)
    outputs: Outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault((out.request_id, out.index), []).append(out)
    assert_ended_once(outputs)
    for name in "abc":
        assert_failed_generically(outputs[(name, 0)], name)
    assert tokens_of(outputs[("d", 0)]) == expected["d"]
    assert failures(engine)["schedule"] == before["schedule"] + 1
    serves_the_next_request(engine, expected)
