"""The synchronous engine: requests in, one scheduled step at a time, outputs out.

Not thread-safe: AsyncEngine drives it from one thread. Every accepted request ends in exactly
one finished output per choice (stop, length, abort or error); a step's outputs, the one place a
choice ends and the containment of a fault in any stage of a step are in `OutputProcessor`
(engine/output_processor.py); its counters and the snapshots it publishes are in
`EngineCounters` (engine/stats.py).

Constrained requests (`SamplingParams.grammar`) wait in the scheduler (WAITING_FOR_GRAMMAR) until
their grammar is compiled (`GrammarCache`, a worker thread): the batch never waits for a compile. A
grammar that fails to compile fails only its request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.deadlines import DEADLINE_MARGIN, LoadSnapshot, PendingWork, estimate_wait_s
from engine.detokenizer import IncrementalDetokenizer
from engine.device.worker import EngineWorker
from engine.grammar.backend import LLGuidanceBackend
from engine.grammar.interface import CompiledGrammar, GrammarCache
from engine.grammar.mask import MaskFiller, MaskRow, closing_due
from engine.lora import LoraAdapter, LoraError, LoraRegistry, LoraSlots
from engine.output_processor import OutputProcessor
from engine.resolve import resolve
from engine.scheduler import build_scheduler
from engine.scheduler.interface import SchedulerInterface
from engine.sequence import Sequence, compile_failure
from engine.speculative.speculator import Speculator
from engine.stats import EngineCounters
from engine.step import SchedulerOutput, StepResult
from engine.types import (
    DuplicateRequestError,
    EngineDeadError,
    EngineOverloadedError,
    EngineStats,
    GenerationRequest,
    GrammarSpec,
    InvalidRequestError,
    Priority,
    PromptTooLongError,
    RequestOutput,
    SamplingParams,
    StepStage,
)

logger = logging.getLogger(__name__)

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
        # The step's grammar mask, filled during the forward pass on a GPU (engine/grammar/mask.py).
        self.masks = MaskFiller(self.spec.vocab_size, overlap=device.type == "cuda")
        self.speculator = Speculator(config.speculative, self.block_manager, max_len)
        self.counters = EngineCounters(self.scheduler, self.loras, self.lora_slots, self.speculator.stats)
        self.output_processor = OutputProcessor(
            self.scheduler,
            self.loras,
            self.counters,
            self.spec.eos_token_ids,
            max_len,
            clock,
            self.speculator.prediction_matched,
        )
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
        self.counters.count_refusal("deadline_at_arrival")
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
        if request.request_id in self.output_processor.seqs:
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
        detoks = [
            IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, p.stop, p.skip_special_tokens)
            for _ in seqs
        ]
        if lora is not None:
            for _ in seqs:  # one pin per choice; LoraNotFoundError if it was unloaded meanwhile
                self.loras.pin(lora)
        self.output_processor.add(request.request_id, seqs, detoks)
        for seq in seqs:
            seq.grammar_compile = future  # the scheduler holds it back until its grammar is ready
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Finish every unfinished choice of `request_id` as aborted; unknown ids are ignored."""
        return self.output_processor.abort(request_id)

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
        return self.counters.num_steps

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, forward, sample, advance, process outputs. Never raises for a
        fault in a stage: what it concerns ends with an error (engine/output_processor.py)."""
        start = self.clock()
        outputs: list[RequestOutput] = []
        stage = StepStage.SCHEDULE
        out: SchedulerOutput | None = None
        try:
            out = self.scheduler.schedule().by_adapter()
            outputs.extend(self.output_processor.fail_grammar(out.grammar_failed))
            outputs.extend(self.output_processor.expire(out.expired))
            if out.is_empty:
                if self.scheduler.compiling and not outputs:  # nothing to run but compiles
                    self.scheduler.wait_for_grammar(_GRAMMAR_WAIT_S)
                return outputs
            out = self.speculator.plan(out)
            self.counters.count_batch(out)
            stage = StepStage.FORWARD
            # A drafted step's mask has a row per draft token, each after the ones before it.
            drafted_mask = self.speculator.bitmask(out, self.spec.vocab_size) if out.has_drafts else None
            mask = None if out.has_drafts else self.masks.start([self._mask_row(s) for s in out.sampled])
            logits = self.runner.forward(out)
            stage = StepStage.SAMPLING
            result = self.runner.sample(out, logits, drafted_mask if mask is None else mask.result())
            stage = StepStage.SCHEDULE
            self.scheduler.update(out)
            stage = StepStage.OUTPUT
            outputs.extend(self.output_processor.process(result))
            self.speculator.accepted(out, result)
            if not self.scheduler.has_unfinished():
                self.runner.idle()
        except EngineDeadError:
            raise  # a tensor-parallel rank is gone (engine/device/parallel.py): this engine cannot go on
        except Exception as exc:  # noqa: BLE001 - a failed stage fails what it concerns, not the engine
            batch = None if out is None else [c.seq for c in out.chunks] + list(out.ended)
            return outputs + self.output_processor.contain(stage, exc, batch)
        try:
            self._record_step(start, out, result)
        except Exception as exc:  # noqa: BLE001 - rates are bookkeeping that concerns no sequence
            self.output_processor.contain(StepStage.SCHEDULE, exc, [])
        return outputs

    @staticmethod
    def _mask_row(seq: Sequence) -> MaskRow:
        """`seq`'s row of the step's grammar mask: its grammar, and whether to close the output."""
        if seq.grammar is None:
            return None
        return seq.grammar, closing_due(seq.sampling.max_tokens, seq.num_output_tokens)

    def _record_step(self, start: float, out: SchedulerOutput, result: StepResult) -> None:
        now = self.clock()
        self.counters.record_step(now - start, now, out, result.num_tokens)
        self.scheduler.record_step(out, now - start)  # trains the step-time budget's cost model
        self.speculator.observe(out, now - start)  # and the drafts' row cost

    # ---- introspection --------------------------------------------------------------------------

    def refusal_counts(self) -> dict[str, int]:
        """Refusals by reason so far; safe from any thread."""
        return self.counters.refusal_counts()

    def stats(self) -> EngineStats:
        """A snapshot of queues, rates and counters; engine thread only (AsyncEngine publishes it)."""
        return self.counters.stats()

    def load_snapshot(self) -> LoadSnapshot:
        """What the arrival estimate needs, frozen; engine thread only (AsyncEngine publishes it)."""
        return self.counters.load_snapshot()

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
