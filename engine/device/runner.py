"""Everything that touches the device on one rank: the forward pass over its model and KV cache, and
(on rank 0) sampling. Built by engine/device/worker.py; the engine drives it one scheduled step at a time."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Hashable
from typing import NamedTuple

import torch

from engine.device.cuda_graphs import DecodeGraphs
from engine.device.models.decoder import DecoderModel
from engine.device.parallel import LoraSlotChange, ParallelExecutor
from engine.lora import LoraAdapter
from engine.sampler import SamplingRow
from engine.sampler import sample as sample_logits
from engine.sequence import Sequence
from engine.speculative.verify import verify
from engine.step import ForwardBatch, SchedulerOutput, StepInputs, StepResult, forward_batch, pack

# Steps of at most this many tokens may run differently where the engine's threads take every CPU
# the process may use: the server's event loop and its clients then share those CPUs, and a
# parallel region whose partner thread is descheduled waits a scheduler tick. Such a step runs on
# the engine thread alone, on all threads through OpenMP, or with the matmuls on the engine thread
# and helpers whose work it takes back when they are descheduled (engine/device/csrc/steal_pool.h).
# Which is fastest depends on the machine and its load (docs/BENCHMARKS.md), so SmallStepThreads
# measures them while serving. At most the pool's rows (qmatmul_x86.cpp).
SERIAL_STEP_MAX_TOKENS = 4


class StepThreads(NamedTuple):
    """How a small step runs: the engine thread's OpenMP threads, and its matmul helpers."""

    openmp: int
    helpers: int = 0


class SmallStepThreads:
    """The threads for small steps, chosen by measurement: a trial times small steps on the
    candidates in turns, one step each (so a change of load during the trial weighs on all alike),
    each from its start to the next step's (so what a step's threads cost the server around it
    counts too), `TRIAL_ROUNDS` rounds, and keeps the one with the lower median. The next trial
    comes after `keep` more small steps on it, doubling from `FIRST_KEEP_STEPS` to `KEEP_STEPS`: the
    first choice is made while the server warms up and must not hold for long. A trial's cost is
    bounded: (candidates - 1) * TRIAL_ROUNDS of every KEEP_STEPS + candidates * TRIAL_ROUNDS small
    steps, once the interval has grown, run on a slower candidate."""

    TRIAL_ROUNDS = 16
    FIRST_KEEP_STEPS = 128
    KEEP_STEPS = 2048

    def __init__(self, candidates: tuple[Hashable, ...]) -> None:
        self.candidates = candidates
        self.chosen = candidates[0]
        self._trial: list[list[float]] = [[] for _ in candidates]
        self._keep = self.FIRST_KEEP_STEPS // 2  # doubled when a trial ends
        self._kept = self._keep  # a trial starts with the first small step

    def threads(self) -> Hashable:
        """The candidate the next small step runs on: in a trial, the one timed least so far."""
        if self._kept < self._keep:
            return self.chosen
        timed = [len(t) for t in self._trial]
        return self.candidates[timed.index(min(timed))]

    def record(self, threads: Hashable, seconds: float) -> None:
        """A small step's time on candidate `threads`, from its start to the next step's."""
        if self._kept < self._keep:
            self._kept += 1
            return
        self._trial[self.candidates.index(threads)].append(seconds)
        if all(len(t) >= self.TRIAL_ROUNDS for t in self._trial):
            medians = [statistics.median(t) for t in self._trial]
            self.chosen = self.candidates[medians.index(min(medians))]
            self._trial = [[] for _ in self.candidates]
            self._keep = min(2 * self._keep, self.KEEP_STEPS)
            self._kept = 0


def _all_cpus_taken(threads: int) -> bool:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return threads >= cpus


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        device: torch.device,
        graphs: DecodeGraphs | None = None,
        executor: ParallelExecutor | None = None,
        attention_backend: str = "torch",
    ) -> None:
        """`executor`: on rank 0 of a tensor-parallel replica, its handle on the other ranks (each
        step is sent to them first); `graphs`: the decode step's CUDA graphs, where captured."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks  # those the block manager hands out (graphs pad into one more)
        self.device = device
        self.graphs = graphs
        self.executor = executor
        self.attention_backend = attention_backend
        self.eos_token_ids = model.spec.eos_token_ids
        self.kv_cache_bytes = sum(t.numel() * t.element_size() for kv in kv_caches for t in kv)
        self.argmax = None if model.kernels is None else model.kernels.argmax_rows
        # The engine thread's OpenMP threads per step (SERIAL_STEP_MAX_TOKENS), on one CPU rank.
        self.num_threads = torch.get_num_threads()
        serial = model.kernels is not None and executor is None and self.num_threads > 1
        self.serial_max_tokens = SERIAL_STEP_MAX_TOKENS if serial and _all_cpus_taken(self.num_threads) else 0
        n = self.num_threads
        self.small_step_threads = SmallStepThreads((StepThreads(1), StepThreads(n), StepThreads(1, n - 1)))
        self._small_step: tuple[Hashable, float] | None = None  # the last step's threads and start, if small

    def idle(self) -> None:
        """The engine has nothing left to run: the next step comes after a pause, which no small
        step's time may span."""
        self._small_step = None

    @property
    def failure(self) -> str | None:
        """Why this replica cannot run steps any more (a rank died), or None while it can."""
        return None if self.executor is None else self.executor.failure

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel replica; nothing to do on one rank."""
        if self.executor is not None:
            self.executor.shutdown()

    def set_lora_slot(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Install `adapter`'s weights in LoRA slot `slot` (None: empty it); between steps. On a
        tensor-parallel replica every rank installs its shard (a failure is fatal, as a step's)."""
        change = LoraSlotChange(slot, adapter)
        if self.executor is not None:
            self.executor.run(self.install_lora, change)
        else:
            self.install_lora(change)

    def install_lora(self, change: LoraSlotChange) -> None:
        """This rank's part of `set_lora_slot`."""
        self.model.set_lora_slot(change.slot, change.adapter)

    def forward_batch(self, inputs: StepInputs) -> ForwardBatch:
        """The step's tensors on this rank's device."""
        return forward_batch(inputs, self.block_size, self.device)

    # A step is two calls, so that the engine knows which of them failed (engine/llm_engine.py).

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput) -> torch.Tensor:
        """Run one scheduled step's forward pass (writing its K/V to the cache); returns the logits
        of every sequence whose chunk completes, in `sample`'s order.

        On a tensor-parallel replica any failure is fatal (EngineDeadError): the ranks' collectives
        would no longer pair up."""
        inputs = pack(out)
        if self.executor is not None:
            return self.executor.run(self.forward_inputs, inputs)
        if self.graphs is not None and not inputs.lora_slots and self.graphs.can_run(inputs):
            return self.graphs.run(inputs)
        if not self.serial_max_tokens:
            return self.model.forward(self.forward_batch(inputs), self.kv_caches)
        now = time.perf_counter()
        if self._small_step is not None:
            threads, start = self._small_step
            self.small_step_threads.record(threads, now - start)
        small = out.num_batched_tokens <= self.serial_max_tokens
        threads = self.small_step_threads.threads() if small else StepThreads(self.num_threads)
        assert isinstance(threads, StepThreads)
        self._small_step = (threads, now) if small else None
        self.model.kernels.set_caller_threads(threads.openmp)  # the step's sampling runs at the same count
        self.model.kernels.set_matmul_helpers(threads.helpers)
        return self.model.forward(self.forward_batch(inputs), self.kv_caches)

    @torch.inference_mode()
    def forward_inputs(self, inputs: StepInputs) -> torch.Tensor:
        """One forward pass over `inputs` (every rank of a tensor-parallel replica runs it)."""
        return self.model.forward(self.forward_batch(inputs), self.kv_caches)

    @torch.inference_mode()
    def sample(self, out: SchedulerOutput, logits: torch.Tensor, bitmask: torch.Tensor | None) -> StepResult:
        """Choose the next token of every sequence whose chunk completes, from `forward`'s logits;
        `bitmask`: the step's grammar mask, a row per logits row (None: no row is constrained). A
        decode with a draft gets the draft tokens it accepts and one more (engine/speculative/)."""
        seqs = out.sampled
        # The logits are this step's alone (a CUDA graph's output buffer is read by nothing after
        # this either, until the next replay rewrites it): the sampler may mask them in place.
        if not seqs:
            return StepResult(seqs, [], [])
        if out.has_drafts:
            drafts = [c.draft for c in out.decodes] + [() for c in out.prefills if c.completes]
            rows = [
                self._row(s, draft[:j])
                for s, draft in zip(seqs, drafts, strict=True)
                for j in range(len(draft) + 1)
            ]
            verified = verify(logits, rows, drafts, bitmask, self.argmax)
            return StepResult(seqs, [v.tokens for v in verified], [v.logprobs for v in verified])
        rows = [self._row(s) for s in seqs]
        tokens, logprobs = sample_logits(logits, rows, bitmask, overwrite=True, argmax=self.argmax)
        return StepResult(seqs, [[t] for t in tokens], [[lp] for lp in logprobs])

    def _row(self, seq: Sequence, draft: tuple[int, ...] = ()) -> SamplingRow:
        """`seq`'s sampling row, after the first tokens of its draft (`draft`) if any."""
        return SamplingRow(
            params=seq.sampling,
            output_token_ids=seq.output_token_ids + list(draft) if draft else seq.output_token_ids,
            stop_ids=seq.sampling.stop_ids(self.eos_token_ids),
            generator=seq.generator,
            constrained=seq.grammar is not None,
        )
