"""The runner's KV cache: committed when built, and no memory grown by serving."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.device import kv_cache


def resident_bytes(tensor: torch.Tensor) -> tuple[int, int]:
    """(size, resident bytes) of the memory mapping that holds `tensor`, from /proc/self/smaps."""
    address = tensor.data_ptr()
    inside = False
    size = 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if not head.endswith(":"):  # a mapping's header: "start-end perms offset dev inode [path]"
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "Size:":
                size = int(line.split()[1]) * 1024
            elif inside and head == "Rss:":
                return size, int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds address {address:#x}")


def test_cpu_kv_cache_is_zeroed_and_committed_when_built() -> None:
    # Committed as blocks were first written, the cache made RSS climb for as long as new prompts
    # came (issue 15); now all of it is resident from the start.
    cache = kv_cache.zeroed_cache((2, 256, 16, 128), torch.float32, torch.device("cpu"))  # 4 MiB
    size, resident = resident_bytes(cache)
    assert size >= cache.numel() * cache.element_size() == 4 << 20
    assert resident == size
    assert not cache.any()


def test_serving_unique_prompts_grows_no_kv_memory_and_keeps_no_request_state(tiny_model_dir: Path) -> None:
    from engine.types import GenerationRequest
    from tests.engine.helpers import greedy, run_all, tiny_engine

    engine = tiny_engine(tiny_model_dir, enable_prefix_caching=True, kv_cache_memory_bytes=4 << 20)
    caches = [t for kv in engine.runner.kv_caches for t in kv]
    committed = [resident_bytes(t)[1] for t in caches]
    assert sum(committed) >= engine.runner.kv_cache_bytes  # before any request
    for round_ in range(3):
        requests = [
            GenerationRequest(
                f"r{round_}-{i}", [(round_ * 97 + i * 31 + j) % 4000 + 1 for j in range(40)], greedy(6)
            )
            for i in range(12)
        ]
        outputs = run_all(engine, requests)
        assert len(outputs) == 12 and all(outs[-1].finished for outs in outputs.values())
        assert [resident_bytes(t)[1] for t in caches] == committed
        # Per-request state is dropped when a request ends; the prefix cache is bounded by the blocks.
        assert engine.output_processor.seqs == {} and engine.output_processor.detoks == {}
        assert engine.block_manager.num_cached_blocks <= engine.block_manager.num_blocks
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_small_steps_run_on_the_engine_thread_alone_where_its_threads_take_every_cpu(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each step sets the engine thread's OpenMP threads: all of them for a step of more than
    SERIAL_STEP_MAX_TOKENS tokens, the small-step candidate's count for a smaller one (the first
    trial takes them in turns); nothing where CPUs are spare."""
    from engine.device import runner as runner_module
    from engine.device.native import native_kernels
    from engine.types import GenerationRequest
    from tests.engine.helpers import greedy, run_all, tiny_engine

    calls: list[int] = []

    class Recording:  # the native kernels, with set_caller_threads recorded
        def __getattr__(self, name: str) -> Any:
            return getattr(native_kernels(), name)

        def set_caller_threads(self, n: int) -> None:
            calls.append(n)
            native_kernels().set_caller_threads(n)

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(runner_module, "_all_cpus_taken", lambda n: False)
        assert tiny_engine(tiny_model_dir, kernels="native").runner.serial_max_tokens == 0
        monkeypatch.setattr(runner_module, "_all_cpus_taken", lambda n: True)
        assert tiny_engine(tiny_model_dir, kernels="torch").runner.serial_max_tokens == 0
        engine = tiny_engine(tiny_model_dir, kernels="native")
        assert engine.runner.serial_max_tokens == runner_module.SERIAL_STEP_MAX_TOKENS
        engine.runner.model.kernels = Recording()
        run_all(engine, [GenerationRequest("a", list(range(100, 120)), greedy(5))])
    finally:
        torch.set_num_threads(threads)
        native_kernels().set_caller_threads(threads)
    # The 20-token prefill on both, then a decode token a step on the candidates in turns: the
    # engine thread alone, both through OpenMP, the engine thread with a helper, alone again.
    assert calls == [2, 1, 2, 1, 1]


def test_small_steps_take_the_thread_count_that_measured_faster_and_try_again_later() -> None:
    """A trial times TRIAL_ROUNDS small steps on each count, in turns, and keeps the faster (by
    median, so one stalled step does not decide); the next trial comes after FIRST_KEEP_STEPS steps
    on it, then after twice as many each time, up to KEEP_STEPS."""
    from engine.device.runner import SmallStepThreads

    chooser = SmallStepThreads((1, 2))
    rounds = chooser.TRIAL_ROUNDS

    def run(steps: int, seconds: dict[int, float], stall_every: int = 0) -> list[int]:
        used = []
        for i in range(steps):
            threads = chooser.threads()
            used.append(threads)
            stalled = stall_every and i % stall_every == 0
            chooser.record(threads, 1.0 if stalled else seconds[threads])
        return used

    # The first trial: the counts in turns; two threads faster (a stalled step now and then).
    assert run(2 * rounds, {1: 0.012, 2: 0.009}, stall_every=5) == [1, 2] * rounds
    assert chooser.chosen == 2
    keep = chooser.FIRST_KEEP_STEPS
    while keep < chooser.KEEP_STEPS:  # each trial finds the same, and the next one comes later
        assert run(keep, {1: 0.012, 2: 0.009}) == [2] * keep
        assert run(2 * rounds, {1: 0.012, 2: 0.009}) == [1, 2] * rounds
        keep *= 2
    assert run(chooser.KEEP_STEPS, {1: 0.012, 2: 0.009}) == [2] * chooser.KEEP_STEPS
    # The machine's load changed: one thread is faster now, and the next trial finds it.
    assert run(2 * rounds, {1: 0.010, 2: 0.016}) == [1, 2] * rounds
    assert chooser.chosen == 1
    assert set(run(chooser.KEEP_STEPS, {1: 0.010, 2: 0.016})) == {1}


def test_a_load_that_changes_during_a_trial_weighs_on_every_candidate_alike() -> None:
    """Two threads are faster throughout, but the machine gets twice as slow halfway through the
    trial (the server warming up, a neighbour starting): timed in turns, two threads still win,
    where timing one count's steps and then the other's would pick the one timed first."""
    from engine.device.runner import SmallStepThreads

    chooser = SmallStepThreads((1, 2))
    for i in range(2 * chooser.TRIAL_ROUNDS):
        threads = chooser.threads()
        slowdown = 1.0 if i < chooser.TRIAL_ROUNDS else 2.0
        chooser.record(threads, slowdown * {1: 0.012, 2: 0.009}[threads])
    assert chooser.chosen == 2


def test_a_small_step_is_timed_to_the_next_step_but_not_across_an_idle_engine(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each small step's time runs to the next step's start, except the last one before the engine
    has nothing left to run: the pause until the next request is not a step's cost."""
    from engine.device import runner as runner_module
    from engine.device.native import native_kernels
    from engine.types import GenerationRequest
    from tests.engine.helpers import greedy, run_all, tiny_engine

    monkeypatch.setattr(runner_module, "_all_cpus_taken", lambda n: True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = tiny_engine(tiny_model_dir, kernels="native")
        recorded: list[float] = []
        monkeypatch.setattr(engine.runner.small_step_threads, "record", lambda n, s: recorded.append(s))
        run_all(engine, [GenerationRequest("a", list(range(100, 120)), greedy(5))])
        assert len(recorded) == 3  # 4 decode steps: the first three, each to the next one's start
        run_all(engine, [GenerationRequest("b", list(range(200, 220)), greedy(5))])
    finally:
        torch.set_num_threads(threads)
        native_kernels().set_caller_threads(threads)
    assert len(recorded) == 6  # nothing from a's last step to b's prefill
