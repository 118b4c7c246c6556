"""The synchronous engine: requests in, one scheduled step at a time, outputs out.

Not thread-safe: AsyncEngine drives it from one thread. Every accepted request ends in exactly
one finished output per choice (stop, length, abort or error), and every terminal path frees its
blocks through `SchedulerInterface.finish` (engine/scheduler/).

Constrained requests (`SamplingParams.grammar`) wait in the scheduler (WAITING_FOR_GRAMMAR) until
their grammar is compiled (`GrammarCache`, a worker thread): the batch never waits for a compile. A
grammar that fails to compile fails only its request.

Faults. A step has four stages (`StepStage`): scheduling, the forward pass, sampling, and output
processing. An exception in any of them ends only the sequences it concerns: the one sequence
whose output processing failed, else the step's batch (the forward pass and sampling run the batch
as one, so they cannot tell whose row broke them). Each ends with a `GenerationFailedError` that
names only its own request id; the exception and the request ids go to the server log; the step
failure is counted by stage; the engine goes on with the rest. All of it happens in `_contain`.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.deadlines import (
    DEADLINE_MARGIN,
    LoadSnapshot,
    PendingWork,
    RunningLoad,
    ServiceMeter,
    estimate_wait_s,
)
from engine.detokenizer import IncrementalDetokenizer
from engine.device.worker import EngineWorker
from engine.grammar import CompiledGrammar, GrammarCache, LLGuidanceBackend, MaskFiller, MaskRow, closing_due
from engine.lora import LoraAdapter, LoraError, LoraRegistry, LoraSlots
from engine.resolve import resolve
from engine.scheduler import build_scheduler
from engine.scheduler.interface import SchedulerInterface
from engine.sequence import Sequence, SequenceStatus, compile_failure
from engine.step import SchedulerOutput, StepResult
from engine.types import (
    DuplicateRequestError,
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    EngineStats,
    GenerationFailedError,
    GenerationRequest,
    GrammarError,
    GrammarSpec,
    InvalidRequestError,
    Priority,
    PromptTooLongError,
    RequestOutput,
    SamplingParams,
    StepStage,
    TokenLogprob,
)

logger = logging.getLogger(__name__)

_THROUGHPUT_WINDOW_S = 10.0
# With nothing to run but compiles in flight, the step waits this long for one (not a busy loop).
_GRAMMAR_WAIT_S = 0.005


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        clock: Callable[[], float] = time.monotonic,
        worker: EngineWorker | None = None,
    ) -> None:
        """`config`'s "auto" settings are decided here, once (engine/resolve.py). `worker`: one already
        started (`EngineWorker.start(resolve(config, in_memory_model=True), model)`: bench/gpu_check.py
        starts one on a model with random weights), instead of loading `config.model.model`."""
        self.config = config
        self.clock = clock
        if config.model.num_threads:
            torch.set_num_threads(config.model.num_threads)
        worker = worker if worker is not None else EngineWorker.start(resolve(config))
        device, dtype, weight_format = worker.device, worker.dtype, worker.weight_format
        self.model_name = config.model.served_model_name or worker.name
        self.tokenizer = worker.tokenizer
        self.spec = worker.spec
        self.dtype, self.device = dtype, device
        self.runner = worker.runner
        num_blocks, max_len = self.runner.num_blocks, self.runner.max_model_len
        self.max_model_len = max_len
        # LoRA adapters: every loaded version (CPU memory), and the slots a step may mix.
        self.loras = LoraRegistry(self.spec)
        self.lora_slots = LoraSlots(config.model.max_loras, self.runner.set_lora_slot)
        blocks = BlockManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler: SchedulerInterface = build_scheduler(config.scheduler, blocks, clock, self.lora_slots)
        self.block_manager = self.scheduler.blocks
        # The step's grammar mask, filled during the forward pass on a GPU (engine/grammar.py).
        self.masks = MaskFiller(self.spec.vocab_size, overlap=device.type == "cuda")
        self._seqs: dict[str, list[Sequence]] = {}
        self._detok: dict[tuple[str, int], IncrementalDetokenizer] = {}
        self._recent: deque[tuple[float, int]] = deque()
        self._recent_tokens = 0  # the sum of `_recent`'s token counts (stats() runs every step)
        self.meter = ServiceMeter()
        # Refusals are counted on the engine thread (expiry) and on callers' threads (at arrival).
        self._refusals: dict[str, int] = {}
        self._refusals_lock = threading.Lock()
        self._last_batch_size = 0
        self._num_steps = 0
        self._step_failures = dict.fromkeys(StepStage, 0)
        self.grammars = GrammarCache(
            LLGuidanceBackend(self.tokenizer, self.spec.vocab_size, tuple(self.spec.eos_token_ids))
        )
        ranks = config.parallel.tensor_parallel_size
        logger.info(
            "engine ready: %s, %s on %s%s%s, KV cache %.0f MiB (%s, %d blocks of %d tokens, %s), "
            "max_model_len %d, prefix caching %s",
            self.model_name,
            dtype,
            device,
            f" x {ranks} ranks" if ranks > 1 else "",
            weight_format.describe(),
            self.runner.kv_cache_bytes / 2**20,
            self.runner.kv_caches[0][0].dtype,
            num_blocks,
            config.cache.block_size,
            "committed now, in the process's RSS" if device.type == "cpu" else "device memory",
            max_len,
            "on" if config.cache.enable_prefix_caching else "off",
        )

    # ---- requests -----------------------------------------------------------------------------

    def validate(self, request: GenerationRequest) -> None:
        """Raise the error a request would get at admission; safe to call from any thread."""
        prompt = request.prompt_token_ids
        if not prompt:
            raise InvalidRequestError("the prompt must contain at least one token")
        vocab = self.spec.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t in request.sampling.logit_bias):
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab})", param="logit_bias")
        total = len(prompt) + request.sampling.max_tokens
        if total > self.max_model_len:
            raise PromptTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{total} were requested ({len(prompt)} in the prompt + {request.sampling.max_tokens} "
                f"for the completion); reduce the prompt or max_tokens"
            )

    def load_lora(self, name: str, path: str) -> LoraAdapter:
        """Load (or replace) adapter `name` from a PEFT folder; from any thread (it reads files).
        Running requests keep the version they pinned; new ones get this one."""
        if self.config.model.max_loras == 0:
            raise LoraError("this engine serves no LoRA adapters (max_loras is 0)")
        return self.loras.load(name, path)

    def grammar(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """The compiled `spec` (a Future; cached); from any thread. The gateway awaits it before
        admission so a bad schema is a 400 up front; its failure is a GrammarError."""
        return self.grammars.get(spec)

    def queue_deadline_s(self, request: GenerationRequest) -> float | None:
        """Seconds from arrival by which `request` must start: its own, else the configured default;
        none for the batch class, which waits for whatever capacity interactive traffic leaves."""
        if request.priority is Priority.BATCH:
            return None
        if request.queue_deadline_s is not None:
            return request.queue_deadline_s
        return self.config.scheduler.default_queue_deadline_s

    def check_arrival(
        self,
        request: GenerationRequest,
        load: LoadSnapshot | None = None,
        pending: PendingWork | None = None,
    ) -> None:
        """Raise EngineOverloadedError (and count it) if `request` could not start before its queue
        deadline. From any thread with a published `load` (AsyncEngine passes its latest snapshot
        and the requests accepted since); without one, from the engine thread on live state."""
        deadline_s = self.queue_deadline_s(request)
        if deadline_s is None:
            return
        load = load if load is not None else self.load_snapshot()
        wait_s = estimate_wait_s(load, request.priority, request.fairness_key, pending)
        if wait_s is None or wait_s <= DEADLINE_MARGIN * deadline_s:
            return
        self._count_refusal("deadline_at_arrival")
        raise EngineOverloadedError(
            f"the server is overloaded: this request would wait about {wait_s:.1f}s to start, "
            f"too close to or beyond its queue deadline of {deadline_s:g}s",
            retry_after_s=max(1.0, wait_s - DEADLINE_MARGIN * deadline_s),
        )

    def add_request(self, request: GenerationRequest) -> None:
        """Queue every choice of `request`, or none of them (raises before anything is queued)."""
        self.validate(request)
        lora = request.lora
        if lora is not None and not isinstance(lora, LoraAdapter):
            raise InvalidRequestError(f"the adapter {lora.name!r} was not loaded by this engine")
        if request.request_id in self._seqs:
            raise DuplicateRequestError(f"request_id {request.request_id!r} is already in the engine")
        now = self.clock()
        deadline_s = self.queue_deadline_s(request)
        p = request.sampling
        seqs = []
        for i in range(p.n):
            generator = None
            if p.seed is not None and not p.greedy:
                generator = torch.Generator(device=self.device).manual_seed(p.seed + i)
            seq = Sequence(
                request.request_id,
                i,
                request.prompt_token_ids,
                p,
                priority=request.priority,
                arrival_time=now,
                deadline=None if deadline_s is None else now + deadline_s,
                fairness_key=request.fairness_key,
                cache_salt=request.cache_salt,
                generator=generator,
                lora=lora,
            )
            seqs.append(seq)
        future = self.grammars.get(p.grammar) if p.grammar is not None else None
        failed = compile_failure(future) if future is not None and future.done() else None
        if failed is not None:
            raise failed  # a schema known to be bad: refused before it is accepted
        detoks = [IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, p.stop) for _ in seqs]
        if lora is not None:
            for _ in seqs:  # one pin per choice; LoraNotFoundError if it was unloaded meanwhile
                self.loras.pin(lora)
        self._seqs[request.request_id] = seqs
        for seq, detok in zip(seqs, detoks, strict=True):
            self._detok[seq.seq_id] = detok
            seq.grammar_compile = future  # the scheduler holds it back until its grammar is ready
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Finish every unfinished choice of `request_id` as aborted; unknown ids are ignored."""
        outputs = []
        for seq in list(self._seqs.get(request_id, [])):
            if not seq.ended:
                end = functools.partial(self._finish, seq, SequenceStatus.FINISHED_ABORTED)
                outputs += self._guarded(StepStage.OUTPUT, seq, end)
        return outputs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def failure(self) -> str | None:
        """Why this engine can run no more steps (a tensor-parallel rank died), or None."""
        return self.runner.failure

    def close(self) -> None:
        """Release what outlives the object: the other ranks of a tensor-parallel replica."""
        self.runner.close()

    # ---- the step -----------------------------------------------------------------------------

    @property
    def num_steps(self) -> int:
        """Steps that ran a batch so far."""
        return self._num_steps

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, forward, sample, advance, process outputs. Never raises for a
        fault in a stage: what it concerns ends with an error (see the module docstring)."""
        start = self.clock()
        outputs: list[RequestOutput] = []
        stage = StepStage.SCHEDULE
        out: SchedulerOutput | None = None
        try:
            out = self.scheduler.schedule().by_adapter()
            outputs.extend(self._grammar_failed_outputs(out.grammar_failed))
            outputs.extend(self._expired_outputs(out.expired))
            if out.is_empty:
                if self.scheduler.compiling and not outputs:  # nothing to run but compiles
                    self.scheduler.wait_for_grammar(_GRAMMAR_WAIT_S)
                return outputs
            self._num_steps += 1
            self._last_batch_size = len(out.chunks)
            stage = StepStage.FORWARD
            mask = self.masks.start([self._mask_row(s) for s in out.sampled])
            logits = self.runner.forward(out)
            stage = StepStage.SAMPLING
            result = self.runner.sample(out, logits, mask.result())
            stage = StepStage.SCHEDULE
            self.scheduler.update(out)
            stage = StepStage.OUTPUT
            outputs.extend(self._process(result))
            if not self.scheduler.has_unfinished():
                self.runner.idle()
        except EngineDeadError:
            raise  # a tensor-parallel rank is gone (engine/device/parallel.py): this engine cannot go on
        except Exception as exc:  # noqa: BLE001 - a failed stage fails what it concerns, not the engine
            batch = None if out is None else [c.seq for c in out.chunks] + list(out.ended)
            return outputs + self._contain(stage, exc, batch)
        try:
            self._record_step(start, out, result)
        except Exception as exc:  # noqa: BLE001 - rates are bookkeeping that concerns no sequence
            self._contain(StepStage.SCHEDULE, exc, [])
        return outputs

    @staticmethod
    def _mask_row(seq: Sequence) -> MaskRow:
        """`seq`'s row of the step's grammar mask: its grammar, and whether to close the output."""
        if seq.grammar is None:
            return None
        return seq.grammar, closing_due(seq.sampling.max_tokens, seq.num_output_tokens)

    def _record_step(self, start: float, out: SchedulerOutput, result: StepResult) -> None:
        now = self.clock()
        self.meter.record_step(
            now - start, sum(c.num_tokens for c in out.prefills), sum(c.num_tokens for c in out.decodes)
        )
        self.scheduler.record_step(out, now - start)  # trains the step-time budget's cost model
        self._recent.append((now, len(result.tokens)))
        self._recent_tokens += len(result.tokens)
        while self._recent and self._recent[0][0] < now - _THROUGHPUT_WINDOW_S:
            self._recent_tokens -= self._recent.popleft()[1]

    def _process(self, result: StepResult) -> list[RequestOutput]:
        """Each sampled sequence's new token: append, check stops, detokenize, build the output. A
        failure in one sequence's processing ends that sequence only."""
        outputs = []
        for seq, token, logprob in zip(result.seqs, result.tokens, result.logprobs, strict=True):
            if seq.finished:  # aborted between scheduling and now
                continue
            advance = functools.partial(self._advance, seq, token, logprob)
            outputs += self._guarded(StepStage.OUTPUT, seq, advance)
        return outputs

    def _advance(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> RequestOutput:
        seq.append_token(token)
        p = seq.sampling
        detok = self._detok[seq.seq_id]
        status = None
        stop_ids = p.stop_ids(self.spec.eos_token_ids)
        if seq.grammar is not None and not seq.grammar.accept_token(token):
            # The mask allowed only what the grammar accepts; reaching here is a bug, not input: it
            # ends this sequence through the one failure path (_guarded: logged, counted, generic).
            raise RuntimeError(f"the grammar rejected sampled token {token}")
        if token in stop_ids and seq.num_output_tokens > p.min_tokens:
            status = SequenceStatus.FINISHED_STOPPED
        elif detok.add(token):
            status = SequenceStatus.FINISHED_STOPPED
        elif seq.grammar is not None and seq.grammar.is_terminated():
            status = SequenceStatus.FINISHED_STOPPED  # the output is complete (e.g. JSON closed)
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            status = SequenceStatus.FINISHED_LENGTH
        if status is None:
            return self._output(seq, (token,), detok.take(final=False), logprob)
        return self._finish(seq, status, (token,), logprob)

    def _guarded(
        self, stage: StepStage, seq: Sequence, make: Callable[[], RequestOutput]
    ) -> list[RequestOutput]:
        """`[make()]`: the next output of `seq`; if that raises, `seq` alone ends with an error."""
        try:
            return [make()]
        except Exception as exc:  # noqa: BLE001 - contained to this sequence
            return self._contain(stage, exc, [seq])

    def _contain(
        self, stage: StepStage, exc: Exception, concerned: list[Sequence] | None
    ) -> list[RequestOutput]:
        """The one place a failure in a step is handled: count it, log it with its details, and end
        the `concerned` sequences with a generic error each (None: the scheduler failed before it had
        a batch, so every sequence whose state it may have left half-done). Any choice that the
        scheduler had finished but whose final output was not yet built (`ended` still False: the
        failure came in between) gets its error output here too, so every choice ends exactly once."""
        self._step_failures[stage] += 1
        if concerned is None:
            concerned = self._unsettled()
        half_ended = (s for seqs in self._seqs.values() for s in seqs if s.finished)
        ending = [s for s in dict.fromkeys([*concerned, *half_ended]) if not s.ended]
        logger.error(
            "engine step failed in stage %s; ending %d sequence(s) with an error: %s",
            stage.value,
            len(ending),
            ", ".join(f"{s.request_id}#{s.index}" for s in ending) or "none",
            exc_info=exc,
        )
        return [
            self._finish(
                seq, SequenceStatus.FINISHED_ERROR, error=GenerationFailedError.for_request(seq.request_id)
            )
            for seq in ending
        ]

    def _unsettled(self) -> list[Sequence]:
        """After scheduling failed midway: the sequences whose state can no longer be trusted. Every
        running one (the batch was being built from them) and every other unfinished one that is
        not waiting cleanly (out of the queue, or queued with blocks or progress: caught midway
        through admission). Clean waiting ones stay queued."""
        sched = self.scheduler
        unsettled = []
        for seqs in self._seqs.values():
            for seq in seqs:
                if seq.finished:
                    continue
                clean = seq in sched.compiling or seq in sched.parked or (
                    seq in sched.waiting and not seq.block_table and seq.num_computed_tokens == 0
                )
                if seq in sched.running or not clean:
                    unsettled.append(seq)
        return unsettled

    def _output(
        self,
        seq: Sequence,
        new_ids: tuple[int, ...],
        text: str,
        logprob: Any = None,
        error: EngineError | None = None,
    ) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            index=seq.index,
            new_token_ids=new_ids,
            new_text=text,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            finish_reason=seq.finish_reason,
            logprobs=(logprob,) if logprob is not None else (),
            error=error,
        )

    def _finish(
        self,
        seq: Sequence,
        status: SequenceStatus,
        new_ids: tuple[int, ...] = (),
        logprob: Any = None,
        error: EngineError | None = None,
    ) -> RequestOutput:
        """The one place a choice ends: blocks freed, bookkeeping dropped, final output built.

        An error ends it without its held-back text (the detokenizer may be what failed). `ended`
        is set last: a failure part-way leaves the choice for `_contain` to end with an error."""
        detok = self._detok[seq.seq_id]
        text = detok.take(final=True) if error is None else ""
        self.scheduler.finish(seq, status)
        if seq.lora is not None:  # `finish` ran once for this choice (ended is still False)
            lora, seq.lora = seq.lora, None
            self.loras.unpin(lora)
        if status in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH):
            self.meter.record_finish(seq.num_output_tokens, seq.sampling.max_tokens)
        out = self._output(seq, new_ids, text, logprob, error)
        del self._detok[seq.seq_id]
        seq.ended = True
        siblings = self._seqs.get(seq.request_id, [])
        if all(s.ended for s in siblings):
            self._seqs.pop(seq.request_id, None)
        return out

    def _grammar_failed_outputs(
        self, failed: tuple[tuple[Sequence, GrammarError], ...]
    ) -> list[RequestOutput]:
        """Fail the sequences whose grammar failed to compile, each with its GrammarError."""
        outputs = []
        for seq, error in failed:
            end = functools.partial(self._finish, seq, SequenceStatus.FINISHED_ERROR, error=error)
            outputs += self._guarded(StepStage.SCHEDULE, seq, end)
        return outputs

    def _expired_outputs(self, expired: tuple[Sequence, ...]) -> list[RequestOutput]:
        """Fail sequences that waited past their queue deadline, with a Retry-After hint: how much
        longer than its deadline a fresh request of the same class and key would wait now."""
        if not expired:
            return []
        now = self.clock()
        load = self.load_snapshot()
        waits: dict[tuple[Priority, str], float] = {}
        outputs = []
        for seq in expired:
            self._count_refusal("deadline_in_queue")
            key = (seq.priority, seq.fairness_key)
            if key not in waits:
                waits[key] = estimate_wait_s(load, seq.priority, seq.fairness_key) or 0.0
            deadline_s = (seq.deadline if seq.deadline is not None else now) - seq.arrival_time
            error = EngineOverloadedError(
                f"the request waited {now - seq.arrival_time:.1f}s and could not start before its "
                f"queue deadline",
                retry_after_s=max(1.0, waits[key] - deadline_s),
            )
            end = functools.partial(self._finish, seq, SequenceStatus.FINISHED_ERROR, error=error)
            outputs += self._guarded(StepStage.SCHEDULE, seq, end)
        return outputs

    def _count_refusal(self, reason: str) -> None:
        with self._refusals_lock:
            self._refusals[reason] = self._refusals.get(reason, 0) + 1

    def refusal_counts(self) -> dict[str, int]:
        """Refusals by reason so far; safe from any thread."""
        with self._refusals_lock:
            return dict(self._refusals)

    # ---- introspection --------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """A snapshot of queues, rates and counters; engine thread only (AsyncEngine publishes it).

        Cost is independent of the number of waiting requests (the queue keeps counters).
        """
        running = self.scheduler.running
        waiting = self.scheduler.waiting
        span = (self._recent[-1][0] - self._recent[0][0]) if len(self._recent) > 1 else 0.0
        return EngineStats(
            num_running=len(running),
            num_waiting=len(waiting),
            num_free_blocks=self.block_manager.num_free_blocks,
            num_total_blocks=self.block_manager.num_blocks,
            block_size=self.block_manager.block_size,
            output_tokens_per_s=(self._recent_tokens / span) if span > 0 else 0.0,
            num_preemptions=self.scheduler.num_preemptions,
            num_waiting_tokens=sum(waiting.tokens_by_priority().values())
            + sum(s.num_uncomputed_tokens for s in running if s.is_prefilling),
            num_running_tokens=sum(s.sampling.max_tokens - s.num_output_tokens for s in running),
            waiting_by_priority=waiting.count_by_priority(),
            running_by_priority={
                p.name.lower(): sum(1 for s in running if s.priority == p) for p in Priority
            },
            refusals_by_reason=self.refusal_counts(),
            last_batch_size=self._last_batch_size,
            total_steps=self._num_steps,
            waiting_by_bucket=waiting.count_by_bucket(),
            waiting_by_priority_and_bucket=waiting.count_by_priority_and_bucket(),
            num_priority_preemptions=self.scheduler.num_priority_preemptions,
            num_fairness_preemptions=self.scheduler.num_fairness_preemptions,
            prefill_tokens_per_s=self.meter.prefill_tokens_per_s,
            decode_steps_per_s=self.meter.decode_steps_per_s,
            batching=self.config.scheduler.batching,
            prefix_cache_queried_tokens=self.block_manager.num_queried_tokens,
            prefix_cache_hit_tokens=self.block_manager.num_hit_tokens,
            step_failures_by_stage={stage.value: n for stage, n in self._step_failures.items()},
            lora_bytes=self.loras.nbytes,
            loras_resident=tuple(a.name for a in self.lora_slots.resident()),
            num_waiting_for_adapter=len(self.scheduler.parked),
        )

    def load_snapshot(self) -> LoadSnapshot:
        """What the arrival estimate needs, frozen; engine thread only (AsyncEngine publishes it)."""
        waiting = self.scheduler.waiting
        return LoadSnapshot(
            max_num_seqs=self.config.scheduler.max_num_seqs,
            max_num_batched_tokens=self.config.scheduler.max_num_batched_tokens,
            seconds_per_token=self.meter.seconds_per_token,
            seconds_per_step=self.meter.seconds_per_step,
            completion_ratio=self.meter.completion_ratio,
            waiting_by_key=waiting.count_by_key(),
            waiting_tokens=waiting.tokens_by_priority(),
            waiting_decode_tokens=waiting.decode_tokens_by_priority(),
            running=tuple(
                RunningLoad(
                    s.priority,
                    s.num_uncomputed_tokens if s.is_prefilling else 0,
                    max(0, s.sampling.max_tokens - s.num_output_tokens),
                )
                for s in self.scheduler.running
            ),
        )

    # ---- offline convenience --------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[list[int]]:
        """Run `prompts` to completion (benchmarks, tests); returns each first choice's output ids."""
        ids = [f"offline-{i}" for i in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts, strict=True):
            self.add_request(GenerationRequest(request_id, prompt, sampling))
        results: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_unfinished():
            for out in self.step():
                if out.index == 0:
                    results[out.request_id].extend(out.new_token_ids)
        return [results[i] for i in ids]
