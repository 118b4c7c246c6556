"""Small typed records that pass between the engine's stages and its callers.

The engine knows requests, priorities and deadlines; it knows nothing of tenants or HTTP.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol


class Priority(enum.IntEnum):
    """Scheduling class. Lower value is served first."""

    PAID = 0
    FREE = 1
    BATCH = 2  # Batch API lines: only the capacity paid and free leave (engine/scheduler/)


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length reached
    ABORT = "abort"  # the caller aborted (e.g. disconnected)
    ERROR = "error"  # the engine failed this sequence; see RequestOutput.error


GrammarKind = Literal["json_schema", "json_object", "lark"]


@dataclass(frozen=True)
class GrammarSpec:
    """What a sequence's output must match; hashable, the cache key.

    `source`: for `json_schema`, the schema as compact JSON text, its key order kept (the order of
    `properties` is the order the output's fields are generated in); for `json_object`, ""; for
    `lark`, the grammar text (llguidance's Lark dialect, which embeds JSON schemas: `%json {...}`).
    `strict` (JSON schemas): a keyword the engine does not implement is an error; not strict, it
    is ignored (the rest still constrains). `json_only` (Lark): the output is JSON and fixed text,
    no free text (where `}` would be content), so a sequence near max_tokens may be steered to
    close it as JSON (engine/grammar/closing.py); the JSON kinds always are.
    """

    kind: GrammarKind
    source: str = ""
    strict: bool = True
    json_only: bool = False
    # Lark: named grammars the source references as `@name` (name, Lark text), e.g. a custom tool's.
    subgrammars: tuple[tuple[str, str], ...] = ()

    @classmethod
    def json_schema(cls, schema: dict[str, Any], strict: bool = True) -> GrammarSpec:
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), strict)

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object")

    @classmethod
    def lark(
        cls, grammar: str, json_only: bool = False, subgrammars: tuple[tuple[str, str], ...] = ()
    ) -> GrammarSpec:
        return cls("lark", grammar, json_only=json_only, subgrammars=subgrammars)

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        """The whole output matches `pattern` (a Lark grammar of one regex terminal)."""
        return cls("lark", regex_as_lark(pattern))


def regex_as_lark(pattern: str) -> str:
    """A Lark grammar whose language is `pattern`'s (a regex as a `/.../` terminal)."""
    return "start: /" + pattern.replace("\\/", "/").replace("/", "\\/") + "/\n"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings. Validated on construction (InvalidRequestError names the field)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    # Constrained output (engine/grammar/): every choice's text matches it; None: free text.
    grammar: GrammarSpec | None = None
    # Speculative decoding (engine/speculative/): False turns it off for this request. `prediction`:
    # the output's expected tokens (OpenAI's Predicted Outputs), a draft source.
    speculative: bool = True
    prediction: tuple[int, ...] = ()
    # The output's text without the tokenizer's special tokens (as vLLM's option); False keeps
    # those a model's format writes (Mistral's [TOOL_CALLS], gpt-oss's channels). Stop tokens
    # never are text.
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        checks: list[tuple[bool, str, str]] = [
            (self.max_tokens >= 1, "max_tokens", "max_tokens must be >= 1"),
            (0.0 <= self.temperature <= 2.0 + 1e-9, "temperature", "temperature must be in [0, 2]"),
            (0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]"),
            (self.top_k >= -1, "top_k", "top_k must be -1, 0 or positive"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "presence_penalty must be in [-2, 2]"),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                "frequency_penalty",
                "frequency_penalty must be in [-2, 2]",
            ),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens", "min_tokens must be in [0, max_tokens]"),
            (0 <= self.top_logprobs <= 20, "top_logprobs", "top_logprobs must be in [0, 20]"),
            (1 <= self.n <= 128, "n", "n must be in [1, 128]"),
            (all(s for s in self.stop), "stop", "stop strings must be non-empty"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message, param=param)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    def stop_ids(self, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
        """The token ids that end the output: the model's EOS (unless `ignore_eos`) and `stop_token_ids`."""
        return (() if self.ignore_eos else eos_token_ids) + self.stop_token_ids


class AdapterVersion(Protocol):
    """One loaded version of a LoRA adapter (engine/lora.py's LoraAdapter), as a request names it."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> int: ...

    @property
    def content_hash(self) -> str: ...


@dataclass
class GenerationRequest:
    """What a caller submits: prompt token ids plus sampling settings and scheduling hints."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: Priority = Priority.PAID
    # Seconds from arrival by which the request must have started (first prefill chunk scheduled).
    # None: no deadline.
    queue_deadline_s: float | None = None
    # Fair-share key within a priority class (e.g. a tenant id); opaque to the engine.
    fairness_key: str = ""
    # Prefix-cache namespace: requests share cached prompt blocks only with requests of the same
    # salt (the gateway passes the tenant, so tenants cannot observe each other's prompts).
    cache_salt: str = ""
    # The LoRA adapter version it runs with (`resolve_lora`), pinned by the engine from admission
    # to the end; None: the base model.
    lora: AdapterVersion | None = None


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    # The most likely alternatives at this step, best first (empty unless top_logprobs > 0).
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """One increment of one choice of a request, delivered after an engine iteration.

    `new_text` is the detokenized text added since the previous output for this choice; it never
    ends inside a multi-byte character and never contains (part of) a matched stop string.
    `finish_reason` is set on the last output of a choice and on no other.
    """

    request_id: str
    index: int  # choice index, 0..n-1
    new_token_ids: tuple[int, ...]
    new_text: str
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: FinishReason | None = None
    # Prompt tokens whose K/V came from the prefix cache when this choice was first admitted.
    num_cached_tokens: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    # Speculative decoding (engine/speculative/), this choice so far: draft tokens verified, those
    # accepted, and of the request's predicted output (SamplingParams.prediction) the tokens taken.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_accepted_prediction_tokens: int = 0
    error: EngineError | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineError(Exception):
    """Base of the engine's error family. `code` is stable and mapped to HTTP by the gateway."""

    code = "engine_error"


class InvalidRequestError(EngineError):
    """The request itself is malformed (an empty prompt, a token id outside the vocabulary, a
    sampling setting out of range); the message says what. `param`, when set, names the offending
    SamplingParams field (the OpenAI field of the same name)."""

    code = "invalid_request"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class DuplicateRequestError(EngineError):
    """A request id already in the engine (or the embedding queue). The caller chooses the ids
    (the gateway generates them), so this is the caller's bug; the gateway leaves the code unmapped
    and answers a generic 500."""

    code = "duplicate_request_id"


class PromptTooLongError(EngineError):
    code = "context_length_exceeded"


class EngineOverloadedError(EngineError):
    """The request cannot start before its queue deadline. `retry_after_s` is a hint for the caller."""

    code = "server_overloaded"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineDeadError(EngineError):
    code = "engine_unavailable"


class GrammarError(EngineError, ValueError):
    """A grammar (JSON schema, tool-call grammar) cannot be compiled; the message names why."""

    code = "invalid_grammar"


class LoraError(EngineError, ValueError):
    """A LoRA adapter that cannot be served (bad files, wrong base shapes, unsupported settings);
    the message names the adapter and the problem."""

    code = "invalid_adapter"


class LoraNotFoundError(EngineError):
    """No adapter of that name is loaded (or it was unloaded before the request reached the engine)."""

    code = "adapter_not_found"


class LoraInUseError(EngineError):
    """An unload asked not to wait, while requests still use the adapter."""

    code = "adapter_in_use"


class GenerationFailedError(EngineError):
    """A failure in an engine step ended this request (see `StepStage`).

    Built with `for_request`: the message is generic and names only this request's id, never the
    failure's text (which may quote another request's data); the details go to the server log."""

    code = "generation_failed"

    @classmethod
    def for_request(cls, request_id: str) -> GenerationFailedError:
        return cls(f"generation failed for request {request_id}; see the server log")


class StepStage(enum.StrEnum):
    """The part of an engine step that failed; the label of the step-failure counter."""

    SCHEDULE = "schedule"  # building the batch and its bookkeeping (admission, expiry, progress)
    FORWARD = "forward"  # the forward pass
    SAMPLING = "sampling"  # choosing each sequence's next token from the logits
    OUTPUT = "output"  # appending the token, stop checks, detokenization, the output record


@dataclass(frozen=True)
class EngineHealth:
    """Liveness of the engine loop, from the heartbeat its thread updates.

    `alive`: the loop is running (False once it died or was shut down; `reason` says which).
    `stalled_s`: seconds since the loop last made progress while work was waiting; 0 when idle.
    """

    alive: bool
    stalled_s: float = 0.0
    reason: str = ""

    def problem(self, stall_timeout_s: float) -> str | None:
        """Why a liveness probe should fail, or None: the loop is not running, or work has waited
        longer than `stall_timeout_s` with no step."""
        if not self.alive:
            return self.reason or "the engine is not running"
        if self.stalled_s > stall_timeout_s:
            return (
                f"the engine made no progress for {self.stalled_s:.0f}s while work was waiting "
                f"(stall timeout {stall_timeout_s:g}s)"
            )
        return None


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    output_tokens_per_s: float  # over a recent window
    num_preemptions: int
    num_waiting_tokens: int  # prompt tokens not yet prefilled, over waiting and running
    num_running_tokens: int  # tokens still to generate (max_tokens left) over running sequences
    waiting_by_priority: dict[str, int] = field(default_factory=dict)
    running_by_priority: dict[str, int] = field(default_factory=dict)
    # "deadline_at_arrival": refused at submit because the wait estimate exceeded the deadline;
    # "deadline_in_queue": waited past the deadline without starting.
    refusals_by_reason: dict[str, int] = field(default_factory=dict)
    last_batch_size: int = 0
    total_steps: int = 0
    waiting_by_bucket: dict[str, int] = field(default_factory=dict)  # over classes, by prompt length
    waiting_by_priority_and_bucket: dict[str, dict[str, int]] = field(default_factory=dict)
    num_priority_preemptions: int = 0  # of num_preemptions, those made for a higher class
    num_fairness_preemptions: int = 0  # of num_preemptions, those made for another tenant's turn
    prefill_tokens_per_s: float = 0.0  # per busy second, over recent steps
    decode_steps_per_s: float = 0.0  # steps per busy second, over recent steps
    batching: str = "continuous"
    prefix_cache_queried_tokens: int = 0  # tokens of admitted sequences looked up in the cache
    prefix_cache_hit_tokens: int = 0  # of those, found there (not computed)
    # Failed engine steps (or one sequence's output processing) so far, by `StepStage` value.
    step_failures_by_stage: dict[str, int] = field(default_factory=dict)
    # LoRA adapters (engine/lora.py): bytes of adapter weights held (loaded versions and those
    # still pinned by requests), the names resident in a slot, and requests waiting for a slot.
    lora_bytes: int = 0
    loras_resident: tuple[str, ...] = ()
    num_waiting_for_adapter: int = 0
    # Speculative decoding (engine/speculative/): drafts verified, their tokens, the tokens accepted,
    # and drafts by accepted tokens (index i: i of its tokens accepted).
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_draft: tuple[int, ...] = ()
