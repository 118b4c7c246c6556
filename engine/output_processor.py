"""A step's outputs: each sampled token processed, the one place a choice ends, fault containment.

Every accepted request ends in exactly one finished output per choice (stop, length, abort or
error), and every terminal path frees its blocks through `SchedulerInterface.finish`, in `finish`.

Faults. A step has four stages (`StepStage`): scheduling, the forward pass, sampling, and output
processing. An exception in any of them ends only the sequences it concerns: the one sequence
whose output processing failed, else the step's batch (the forward pass and sampling run the batch
as one, so they cannot tell whose row broke them). Each ends with a `GenerationFailedError` that
names only its own request id; the exception and the request ids go to the server log; the step
failure is counted by stage; the engine goes on with the rest. All of it happens in `contain`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from engine.deadlines import estimate_wait_s
from engine.detokenizer import IncrementalDetokenizer
from engine.lora import LoraRegistry
from engine.scheduler.interface import SchedulerInterface
from engine.sequence import Sequence, SequenceStatus
from engine.stats import EngineCounters
from engine.step import StepResult
from engine.types import (
    EngineError,
    EngineOverloadedError,
    GenerationFailedError,
    GrammarError,
    Priority,
    RequestOutput,
    StepStage,
    TokenLogprob,
)

logger = logging.getLogger(__name__)


class OutputProcessor:
    """The choices in flight, by request id, with their detokenizers; engine thread only.

    `add` takes a request's choices; `process` turns a step's sampled tokens into outputs; `abort`,
    `fail_grammar` and `expire` end choices from outside a step's batch; `contain` ends what a
    failed stage concerns. Each of them ends choices through `finish`.
    """

    def __init__(
        self,
        scheduler: SchedulerInterface,
        loras: LoraRegistry,
        counters: EngineCounters,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        clock: Callable[[], float],
        prediction_matched: Callable[[Sequence], int] = lambda seq: 0,
    ) -> None:
        self.scheduler = scheduler
        self.loras = loras
        self.counters = counters
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.clock = clock
        self.prediction_matched = prediction_matched  # a choice's accepted prediction tokens
        self.seqs: dict[str, list[Sequence]] = {}
        self.detoks: dict[tuple[str, int], IncrementalDetokenizer] = {}

    def add(self, request_id: str, seqs: list[Sequence], detoks: list[IncrementalDetokenizer]) -> None:
        """Follow the choices of `request_id` (each with its detokenizer) until each has ended."""
        self.seqs[request_id] = seqs
        for seq, detok in zip(seqs, detoks, strict=True):
            self.detoks[seq.seq_id] = detok

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Finish every unfinished choice of `request_id` as aborted; unknown ids are ignored."""
        outputs = []
        for seq in list(self.seqs.get(request_id, [])):
            if not seq.ended:
                end = functools.partial(self.finish, seq, SequenceStatus.FINISHED_ABORTED)
                outputs += self._guarded(StepStage.OUTPUT, seq, end)
        return outputs

    # ---- a step's sampled tokens ----------------------------------------------------------------

    def process(self, result: StepResult) -> list[RequestOutput]:
        """Each sampled sequence's new tokens: append, check stops, detokenize, build the output. A
        failure in one sequence's processing ends that sequence only."""
        outputs = []
        for seq, tokens, logprobs in zip(result.seqs, result.tokens, result.logprobs, strict=True):
            if seq.finished:  # aborted between scheduling and now
                continue
            advance = functools.partial(self._advance, seq, tokens, logprobs)
            outputs += self._guarded(StepStage.OUTPUT, seq, advance)
        return outputs

    def _advance(
        self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob | None]
    ) -> RequestOutput:
        """Append `tokens` (one, or a verified draft's and one more) until one ends the choice."""
        p = seq.sampling
        detok = self.detoks[seq.seq_id]
        stop_ids = p.stop_ids(self.eos_token_ids)
        status = None
        taken = 0
        for token in tokens:
            taken += 1
            seq.append_token(token)
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
            if status is not None:
                break
        new_ids = tuple(tokens[:taken])
        kept = tuple(lp for lp in logprobs[:taken] if lp is not None)
        if status is None:
            return self._output(seq, new_ids, detok.take(final=False), kept)
        return self.finish(seq, status, new_ids, kept)

    # ---- the sequences the scheduler took out ---------------------------------------------------

    def fail_grammar(self, failed: tuple[tuple[Sequence, GrammarError], ...]) -> list[RequestOutput]:
        """Fail the sequences whose grammar failed to compile, each with its GrammarError."""
        outputs = []
        for seq, error in failed:
            end = functools.partial(self.finish, seq, SequenceStatus.FINISHED_ERROR, error=error)
            outputs += self._guarded(StepStage.SCHEDULE, seq, end)
        return outputs

    def expire(self, expired: tuple[Sequence, ...]) -> list[RequestOutput]:
        """Fail sequences that waited past their queue deadline, with a Retry-After hint: how much
        longer than its deadline a fresh request of the same class and key would wait now."""
        if not expired:
            return []
        now = self.clock()
        load = self.counters.load_snapshot()
        waits: dict[tuple[Priority, str], float] = {}
        outputs = []
        for seq in expired:
            self.counters.count_refusal("deadline_in_queue")
            key = (seq.priority, seq.fairness_key)
            if key not in waits:
                waits[key] = estimate_wait_s(load, seq.priority, seq.fairness_key) or 0.0
            deadline_s = (seq.deadline if seq.deadline is not None else now) - seq.arrival_time
            error = EngineOverloadedError(
                f"the request waited {now - seq.arrival_time:.1f}s and could not start before its "
                f"queue deadline",
                retry_after_s=max(1.0, waits[key] - deadline_s),
            )
            end = functools.partial(self.finish, seq, SequenceStatus.FINISHED_ERROR, error=error)
            outputs += self._guarded(StepStage.SCHEDULE, seq, end)
        return outputs

    # ---- faults ---------------------------------------------------------------------------------

    def _guarded(
        self, stage: StepStage, seq: Sequence, make: Callable[[], RequestOutput]
    ) -> list[RequestOutput]:
        """`[make()]`: the next output of `seq`; if that raises, `seq` alone ends with an error."""
        try:
            return [make()]
        except Exception as exc:  # noqa: BLE001 - contained to this sequence
            return self.contain(stage, exc, [seq])

    def contain(
        self, stage: StepStage, exc: Exception, concerned: list[Sequence] | None
    ) -> list[RequestOutput]:
        """The one place a failure in a step is handled: count it, log it with its details, and end
        the `concerned` sequences with a generic error each (None: the scheduler failed before it had
        a batch, so every sequence whose state it may have left half-done). Any choice that the
        scheduler had finished but whose final output was not yet built (`ended` still False: the
        failure came in between) gets its error output here too, so every choice ends exactly once."""
        self.counters.step_failures[stage] += 1
        if concerned is None:
            concerned = self._unsettled()
        half_ended = (s for seqs in self.seqs.values() for s in seqs if s.finished)
        ending = [s for s in dict.fromkeys([*concerned, *half_ended]) if not s.ended]
        logger.error(
            "engine step failed in stage %s; ending %d sequence(s) with an error: %s",
            stage.value,
            len(ending),
            ", ".join(f"{s.request_id}#{s.index}" for s in ending) or "none",
            exc_info=exc,
        )
        return [
            self.finish(
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
        for seqs in self.seqs.values():
            for seq in seqs:
                if seq.finished:
                    continue
                clean = (
                    seq in sched.compiling
                    or seq in sched.parked
                    or (seq in sched.waiting and not seq.block_table and seq.num_computed_tokens == 0)
                )
                if seq in sched.running or not clean:
                    unsettled.append(seq)
        return unsettled

    # ---- outputs --------------------------------------------------------------------------------

    def _output(
        self,
        seq: Sequence,
        new_ids: tuple[int, ...],
        text: str,
        logprobs: tuple[TokenLogprob, ...] = (),
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
            logprobs=logprobs,
            num_draft_tokens=seq.num_draft_tokens,
            num_accepted_draft_tokens=seq.num_accepted_tokens,
            num_accepted_prediction_tokens=self.prediction_matched(seq) if seq.sampling.prediction else 0,
            error=error,
        )

    def finish(
        self,
        seq: Sequence,
        status: SequenceStatus,
        new_ids: tuple[int, ...] = (),
        logprobs: tuple[TokenLogprob, ...] = (),
        error: EngineError | None = None,
    ) -> RequestOutput:
        """The one place a choice ends: blocks freed, bookkeeping dropped, final output built.

        An error ends it without its held-back text (the detokenizer may be what failed). `ended`
        is set last: a failure part-way leaves the choice for `contain` to end with an error."""
        detok = self.detoks[seq.seq_id]
        text = detok.take(final=True) if error is None else ""
        self.scheduler.finish(seq, status)
        if seq.lora is not None:  # `finish` ran once for this choice (ended is still False)
            lora, seq.lora = seq.lora, None
            self.loras.unpin(lora)
        if status in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH):
            self.counters.meter.record_finish(seq.num_output_tokens, seq.sampling.max_tokens)
        out = self._output(seq, new_ids, text, logprobs, error)
        del self.detoks[seq.seq_id]
        seq.ended = True
        siblings = self.seqs.get(seq.request_id, [])
        if all(s.ended for s in siblings):
            self.seqs.pop(seq.request_id, None)
        return out
