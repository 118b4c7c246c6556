"""One choice of one request, followed from arrival to finish."""

from __future__ import annotations

import enum
import itertools
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from engine.types import FinishReason, GrammarError, Priority, SamplingParams

if TYPE_CHECKING:
    from engine.grammar.interface import CompiledGrammar, Grammar
    from engine.lora import LoraAdapter


class SequenceStatus(enum.IntEnum):
    """Ordered: every status above PREEMPTED is finished (as in vLLM v1)."""

    WAITING = 0
    WAITING_FOR_GRAMMAR = 1  # queued in the scheduler, not schedulable until its grammar compiled
    WAITING_FOR_ADAPTER = 2  # queued outside the batch until its LoRA adapter has a slot
    RUNNING = 3
    PREEMPTED = 4
    FINISHED_STOPPED = 5
    FINISHED_LENGTH = 6
    FINISHED_ABORTED = 7
    FINISHED_ERROR = 8

    @property
    def finished(self) -> bool:
        return self > SequenceStatus.PREEMPTED


FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: FinishReason.STOP,
    SequenceStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    SequenceStatus.FINISHED_ABORTED: FinishReason.ABORT,
    SequenceStatus.FINISHED_ERROR: FinishReason.ERROR,
}

_admission_counter = itertools.count()


def compile_failure(future: Future[CompiledGrammar]) -> BaseException | None:
    """A done compile's failure (None if it succeeded); a cancelled one (engine shutdown) fails too."""
    if future.cancelled():
        return GrammarError("the grammar's compile was cancelled")
    return future.exception()


class Sequence:
    """Token ids, progress, block table and scheduling facts of one generated choice.

    `num_computed_tokens` counts tokens whose K/V are in the cache. The tokens still to compute are
    `token_ids[num_computed_tokens:]`: the rest of the prompt while prefilling, else the one token
    sampled last step. After preemption `num_computed_tokens` is 0 and everything is recomputed
    (except what the prefix cache still holds). Admission may start it above 0: the cached prefix.
    """

    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        priority: Priority = Priority.PAID,
        arrival_time: float = 0.0,
        deadline: float | None = None,
        fairness_key: str = "",
        cache_salt: str = "",
        generator: torch.Generator | None = None,
        lora: LoraAdapter | None = None,
    ) -> None:
        self.request_id = request_id
        self.index = index
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling = sampling
        self.priority = priority
        self.arrival_time = arrival_time
        self.deadline = deadline
        self.fairness_key = fairness_key
        self.cache_salt = cache_salt  # prefix-cache namespace (engine/block_manager.py)
        self.generator = generator
        # The adapter version it computes with (pinned for its whole life, engine/lora.py) and
        # its resident slot while running (-1: none, or the base model).
        self.lora = lora
        self.lora_slot = -1
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        # Prefix caching (engine/block_manager.py): hashes of the full blocks (memo), how many of
        # the held blocks are registered, and the prompt tokens found cached at first admission.
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0
        self.num_cached_tokens = 0
        self.admission_order = -1  # set each time it is (re)admitted to running
        self.num_preemptions = 0
        self.started = False  # first prefill chunk has been scheduled (deadline met)
        # A constrained sequence (sampling.grammar) waits for its grammar's compile
        # (WAITING_FOR_GRAMMAR), then has its own parser state of it (`start_grammar`).
        self.grammar_compile: Future[CompiledGrammar] | None = None
        self.grammar: Grammar | None = None
        # Speculative decoding (engine/speculative/): draft tokens verified and accepted so far.
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # Its final output was built: the choice is over for its caller. (`finished` says the
        # scheduler is done with it; the two differ only until the engine builds that output.)
        self.ended = False

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id}#{self.index}, {self.status.name}, "
            f"computed={self.num_computed_tokens}/{len(self.token_ids)}, blocks={len(self.block_table)})"
        )

    @property
    def seq_id(self) -> tuple[str, int]:
        return (self.request_id, self.index)

    @property
    def cache_namespace(self) -> str:
        """The prefix cache's namespace: the salt, and the adapter's content (a prefix computed
        with one adapter, or one version of it, is never another's)."""
        return self.cache_salt if self.lora is None else f"{self.cache_salt}\0lora:{self.lora.content_hash}"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than one token left to compute: a prompt (or a recompute after preemption)."""
        return self.num_uncomputed_tokens > 1

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return FINISH_REASONS.get(self.status)

    def mark_admitted(self) -> None:
        self.status = SequenceStatus.RUNNING
        self.admission_order = next(_admission_counter)
        self.started = True

    def start_grammar(self) -> GrammarError | None:
        """Once its grammar's compile is done: its own parser state of it, or (returned) why
        there is none."""
        future, self.grammar_compile = self.grammar_compile, None
        assert future is not None and future.done()
        exc = compile_failure(future)
        if exc is not None:
            return exc if isinstance(exc, GrammarError) else GrammarError(f"grammar: {exc}")
        self.grammar = future.result().new_grammar()
        return None

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
