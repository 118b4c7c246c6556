"""The embedding batcher's policy with a fake model and an injected clock (no sleeps, no torch),
and its thread with a fake model (results, failure, disconnect)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.embeddings.batcher import EmbeddingBatcher
from engine.embeddings.policy import Batch, BatchLimits, BatchPolicy, EmbeddingRequest
from engine.types import (
    DuplicateRequestError,
    EngineOverloadedError,
    GenerationFailedError,
    InvalidRequestError,
    Priority,
)


def req(
    request_id: str, *lengths: int, priority: Priority = Priority.PAID, deadline: float | None = None
) -> EmbeddingRequest:
    # The first token id encodes (request, input): the fake vector says which input it embedded.
    inputs = tuple(tuple([tag(request_id) * 1000 + i] + [7] * (n - 1)) for i, n in enumerate(lengths))
    return EmbeddingRequest(request_id, inputs, priority, deadline)


def tag(request_id: str) -> int:
    return sum(map(ord, request_id))


def fake_vectors(batch: Batch) -> list[list[float]]:
    return [[float(ids[0]), float(len(ids))] for ids in batch.inputs]


def run(policy: BatchPolicy, now: float) -> Batch | None:
    batch = policy.next_batch(now)
    if batch is not None:
        policy.finish(batch, fake_vectors(batch), now + 0.001)
    return batch


def test_a_lone_request_at_an_idle_model_runs_at_once() -> None:
    policy = BatchPolicy(BatchLimits(max_wait_s=0.005))
    policy.add(req("a", 5), now=0.0)
    batch = policy.next_batch(now=0.0)  # no waiting for company
    assert batch is not None and batch.request_ids() == ["a"]


def test_a_malformed_or_repeated_request_is_a_typed_error() -> None:
    policy = BatchPolicy(BatchLimits())
    with pytest.raises(InvalidRequestError, match="every input must hold at least one token") as bad:
        policy.add(EmbeddingRequest("empty", ((5, 7), ()), Priority.PAID, None), now=0.0)
    assert bad.value.code == "invalid_request"
    with pytest.raises(InvalidRequestError):
        policy.add(EmbeddingRequest("none", (), Priority.PAID, None), now=0.0)
    policy.add(req("a", 3), now=0.0)
    with pytest.raises(DuplicateRequestError, match="'a' is already queued"):
        policy.add(req("a", 3), now=0.0)
    assert policy.num_queued_inputs == 1


def test_inputs_arriving_while_busy_wait_for_the_limit_then_close() -> None:
    policy = BatchPolicy(BatchLimits(max_wait_s=0.005))
    policy.add(req("a", 5), now=0.0)
    first = policy.next_batch(0.0)
    assert first is not None
    policy.add(req("b", 5), now=0.001)
    assert policy.next_batch(0.002) is None  # the model is busy
    policy.finish(first, fake_vectors(first), now=0.002)
    assert policy.next_batch(0.003) is None  # idle now, but "b" has waited 2 ms of 5
    assert policy.wake_at() == pytest.approx(0.006)
    policy.add(req("c", 5), now=0.004)
    assert policy.next_batch(0.0059) is None
    batch = policy.next_batch(0.006)
    assert batch is not None and batch.request_ids() == ["b", "c"]


def test_a_batch_closes_at_max_inputs_without_waiting() -> None:
    policy = BatchPolicy(BatchLimits(max_batch_inputs=4, max_wait_s=10.0))
    policy.add(req("x", 3), now=0.0)
    first = policy.next_batch(0.0)
    assert first is not None
    policy.add(req("a", 3, 3, 3), now=0.0)
    policy.finish(first, fake_vectors(first), 0.0)
    assert policy.next_batch(0.0) is None  # 3 inputs: not full, not old
    policy.add(req("b", 3, 3), now=0.0)  # 5 queued: more than a batch holds
    batch = policy.next_batch(0.0)
    assert batch is not None and len(batch.items) == 4
    assert policy.num_queued_inputs == 1


def test_a_batch_closes_at_max_padded_tokens() -> None:
    policy = BatchPolicy(BatchLimits(max_batch_tokens=100, max_wait_s=10.0))
    policy.add(req("x", 3), now=0.0)
    first = policy.next_batch(0.0)
    assert first is not None
    policy.add(req("a", 40, 40), now=0.0)
    policy.finish(first, fake_vectors(first), 0.0)
    assert policy.next_batch(0.0) is None  # 2 x 40 = 80 padded tokens fit: wait for more
    policy.add(req("b", 30), now=0.0)  # 3 x 40 = 120 > 100: full
    batch = policy.next_batch(0.0)
    assert batch is not None and batch.num_padded_tokens <= 100 and len(batch.items) == 2


def test_an_input_longer_than_the_token_budget_still_runs_alone() -> None:
    policy = BatchPolicy(BatchLimits(max_batch_tokens=10))
    policy.add(req("a", 50, 50), now=0.0)
    first = run(policy, 0.0)
    assert first is not None and len(first.items) == 1
    second = policy.next_batch(1.0)
    assert second is not None and len(second.items) == 1
    policy.finish(second, fake_vectors(second), 1.0)
    (done,) = policy.take_completions()
    assert len(done.vectors) == 2


def test_inputs_are_grouped_by_length_around_the_oldest() -> None:
    policy = BatchPolicy(BatchLimits(max_batch_inputs=3, max_wait_s=0.0))
    policy.add(req("x", 1), now=0.0)
    busy = policy.next_batch(0.0)
    assert busy is not None
    # The oldest (length 50) anchors the batch; its nearest lengths join it, not the short ones.
    policy.add(req("old", 50), now=0.1)
    policy.add(req("short", 2, 3, 4), now=0.2)
    policy.add(req("near", 48, 52), now=0.3)
    policy.finish(busy, fake_vectors(busy), 0.4)
    batch = policy.next_batch(1.0)
    assert batch is not None
    assert sorted(item.length for item in batch.items) == [48, 50, 52]
    batch2 = run(policy, 1.0)
    assert batch2 is None  # the first batch is still running
    policy.finish(batch, fake_vectors(batch), 1.1)
    batch2 = policy.next_batch(1.2)
    assert batch2 is not None and sorted(item.length for item in batch2.items) == [2, 3, 4]


def test_a_large_request_is_split_across_batches_and_reassembled_in_order() -> None:
    policy = BatchPolicy(BatchLimits(max_batch_inputs=4, max_wait_s=0.0))
    lengths = [7, 3, 9, 1, 5, 2, 8, 4, 6, 10]
    policy.add(req("big", *lengths), now=0.0)
    num_batches = 0
    while run(policy, float(num_batches)) is not None:
        num_batches += 1
    assert num_batches == 3
    (done,) = policy.take_completions()
    assert done.request_id == "big" and done.error is None
    assert [v[1] for v in done.vectors] == lengths  # each vector is its own input's, in order
    assert [v[0] for v in done.vectors] == [tag("big") * 1000.0 + i for i in range(10)]


def test_paid_inputs_go_before_free_ones() -> None:
    policy = BatchPolicy(BatchLimits(max_batch_inputs=2, max_wait_s=0.0))
    policy.add(req("x", 1), now=0.0)
    busy = policy.next_batch(0.0)
    assert busy is not None
    policy.add(req("free", 5, 5, priority=Priority.FREE), now=0.1)
    policy.add(req("paid", 5, priority=Priority.PAID), now=0.2)
    policy.finish(busy, fake_vectors(busy), 0.3)
    batch = policy.next_batch(0.3)
    assert batch is not None
    # The paid input first; the room left is filled from the free class.
    assert [item.owner.request.request_id for item in batch.items] == ["paid", "free"]


def test_a_failed_model_call_fails_exactly_its_batch_and_the_batcher_goes_on() -> None:
    policy = BatchPolicy(BatchLimits(max_batch_inputs=2, max_wait_s=0.0))
    policy.add(req("x", 1), now=0.0)
    busy = policy.next_batch(0.0)
    assert busy is not None
    policy.add(req("a", 4, 4), now=0.0)
    policy.add(req("b", 4), now=0.0)
    policy.finish(busy, fake_vectors(busy), 0.0)
    policy.take_completions()
    failing = policy.next_batch(0.1)
    assert failing is not None and failing.request_ids() == ["a"]
    record = policy.finish(failing, None, 0.2, error=RuntimeError("boom"))
    assert record.failed
    (failed,) = policy.take_completions()
    assert failed.request_id == "a" and isinstance(failed.error, GenerationFailedError)
    ok = run(policy, 0.3)
    assert ok is not None and ok.request_ids() == ["b"]
    (done,) = policy.take_completions()
    assert done.request_id == "b" and done.error is None and len(done.vectors) == 1


def test_an_aborted_request_is_dropped_before_it_runs() -> None:
    policy = BatchPolicy(BatchLimits(max_batch_inputs=2, max_wait_s=0.0))
    policy.add(req("a", 4, 4, 4), now=0.0)
    first = policy.next_batch(0.0)
    assert first is not None and len(first.items) == 2
    policy.add(req("b", 4), now=0.0)
    policy.abort("a")  # the client left while its first inputs ran
    assert policy.num_queued_inputs == 1
    policy.finish(first, fake_vectors(first), 0.1)
    assert policy.take_completions() == []  # nobody to tell
    batch = run(policy, 0.2)
    assert batch is not None and batch.request_ids() == ["b"]
    assert [c.request_id for c in policy.take_completions()] == ["b"]


def test_queue_deadlines_refuse_at_arrival_and_expire_in_the_queue() -> None:
    policy = BatchPolicy(BatchLimits(max_batch_inputs=100, max_wait_s=0.0))
    assert policy.estimate_wait_s(Priority.PAID, 0.0) is None  # nothing measured: admit
    policy.add(req("m", 100), now=0.0)
    run(policy, 0.0)  # 100 padded tokens in 1 ms: 10 us per token
    policy.take_completions()
    assert policy.seconds_per_token == pytest.approx(1e-5)
    policy.add(req("x", 1), now=1.0)
    busy = policy.next_batch(1.0)
    assert busy is not None
    policy.add(req("queued", *([500] * 40)), now=1.0)  # 20,000 tokens ahead: ~0.2 s
    with pytest.raises(EngineOverloadedError) as refused:
        policy.add(req("late", 10, deadline=0.1), now=1.0)
    assert refused.value.retry_after_s >= 1.0
    policy.add(req("free-ok", 10, priority=Priority.PAID, deadline=1.0), now=1.0)
    policy.add(req("expires", 10, priority=Priority.FREE, deadline=0.5), now=1.0)
    policy.finish(busy, fake_vectors(busy), 2.0)  # the running call took a whole second
    policy.take_completions()
    assert policy.next_batch(2.0) is not None  # "expires" waited 1 s > 0.5 s before starting
    (expired,) = policy.take_completions()
    assert expired.request_id == "expires" and isinstance(expired.error, EngineOverloadedError)


# -- the thread -------------------------------------------------------------------------------


class FakeModel:
    """Records each call; `gate` holds calls until set; `fail_on` makes calls holding it raise."""

    def __init__(self) -> None:
        self.calls: list[list[list[int]]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail_on: int | None = None

    def embed(self, batch: list[list[int]]) -> list[list[float]]:
        self.calls.append(batch)
        self.entered.set()
        self.gate.wait(10)
        if self.fail_on is not None and any(ids[0] // 1000 == self.fail_on for ids in batch):
            raise RuntimeError("injected failure")
        return [[float(ids[0]), float(len(ids))] for ids in batch]


async def test_the_thread_batches_concurrent_callers_and_survives_a_failed_call() -> None:
    model = FakeModel()
    records = []
    batcher = EmbeddingBatcher(model, BatchLimits(max_wait_s=0.0), on_batch=records.append).start()
    try:
        model.gate.clear()
        first = asyncio.ensure_future(batcher.embed(req("first", 3)))
        await asyncio.to_thread(model.entered.wait, 10)  # the lone request runs at once
        a = asyncio.ensure_future(batcher.embed(req("a", 3, 4)))
        model.fail_on = tag("bad")
        bad = asyncio.ensure_future(batcher.embed(req("bad", 5)))
        await asyncio.sleep(0)  # let both submit while the first call is held
        model.gate.set()
        assert (await first)[0][1] == 3.0
        with pytest.raises(GenerationFailedError):
            await bad
        # "a" shared the failing call: it fails too (exactly that batch's requests).
        with pytest.raises(GenerationFailedError):
            await a
        model.fail_on = None
        assert [v[1] for v in await batcher.embed(req("after", 2, 6))] == [2.0, 6.0]
        assert len(model.calls) == 3 and [r.failed for r in records] == [False, True, False]
    finally:
        batcher.shutdown()


async def test_a_cancelled_caller_has_its_waiting_inputs_dropped() -> None:
    model = FakeModel()
    batcher = EmbeddingBatcher(model, BatchLimits(max_wait_s=0.0)).start()
    try:
        model.gate.clear()
        first = asyncio.ensure_future(batcher.embed(req("first", 3)))
        await asyncio.to_thread(model.entered.wait, 10)
        gone = asyncio.ensure_future(batcher.embed(req("gone", 7, 7)))
        await asyncio.sleep(0)
        gone.cancel()  # the client disconnected while its inputs queued
        with pytest.raises(asyncio.CancelledError):
            await gone
        model.gate.set()
        await first
        await batcher.embed(req("next", 2))
        assert all(ids[0] // 1000 != tag("gone") for call in model.calls for ids in call)
    finally:
        batcher.shutdown()


async def test_a_model_built_by_the_batcher_is_built_on_the_thread_that_runs_it() -> None:
    threads: list[str] = []

    class ThreadModel(FakeModel):
        def embed(self, batch: list[list[int]]) -> list[list[float]]:
            threads.append(threading.current_thread().name)
            return super().embed(batch)

    def build() -> FakeModel:
        threads.append(threading.current_thread().name)
        return ThreadModel()

    batcher = EmbeddingBatcher(None, BatchLimits(max_wait_s=0.0), build=build).start()
    try:
        assert isinstance(batcher.model, ThreadModel)
        await batcher.embed(req("one", 3))
        assert threads == ["batchgate-embeddings", "batchgate-embeddings"]
    finally:
        batcher.shutdown()


def test_a_failed_build_is_raised_by_start_and_the_batcher_is_not_ready() -> None:
    def build() -> FakeModel:
        raise OSError("no weights here")

    batcher = EmbeddingBatcher(None, build=build)
    with pytest.raises(OSError, match="no weights here"):
        batcher.start()
    assert not batcher.ready
    with pytest.raises(TypeError):
        EmbeddingBatcher(FakeModel(), build=FakeModel)
