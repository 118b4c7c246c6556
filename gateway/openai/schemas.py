"""The response shapes, written once: typed dicts the builders return and the OpenAPI document's source.

Each class is a `TypedDict`, so a body is still a plain dict at runtime (a stream builds one per
token; a model instance would cost a construction and a dump each), while mypy checks every
builder's dict literal against its shape. gateway/openapi/ turns these classes into the
document's response components with pydantic (class name = component name, docstring =
description; `Annotated[..., Field(...)]` metadata becomes JSON Schema keywords such as `minimum`),
and tests validate real responses and stream chunks against that document.

Optional keys are `NotRequired`; a key that is always sent but may be null is `X | None`.
`typing_extensions.TypedDict`: pydantic needs it on Python < 3.12.
"""

from __future__ import annotations

from typing import Annotated, Literal, NotRequired

from pydantic import ConfigDict, Field, with_config
from typing_extensions import TypedDict

from gateway.errors import Error

NonNegativeInt = Annotated[int, Field(ge=0)]
Byte = Annotated[int, Field(ge=0, le=255)]

CompletionFinishReason = Literal["stop", "length"]
ChatFinishReason = Literal["stop", "length", "tool_calls"]

# -- usage ------------------------------------------------------------------------------------


class PromptTokensDetails(TypedDict):
    """`cached_tokens`: prompt tokens whose K/V came from the prefix cache."""

    cached_tokens: NonNegativeInt


class CompletionTokensDetails(TypedDict):
    """With a `prediction`: its tokens the output took, and the rest (as OpenAI reports them)."""

    accepted_prediction_tokens: NonNegativeInt
    rejected_prediction_tokens: NonNegativeInt


class Usage(TypedDict):
    prompt_tokens: NonNegativeInt
    completion_tokens: NonNegativeInt
    total_tokens: NonNegativeInt
    prompt_tokens_details: NotRequired[PromptTokensDetails]
    completion_tokens_details: NotRequired[CompletionTokensDetails]


# -- logprobs ---------------------------------------------------------------------------------


class TopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[Byte] | None


class TokenLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[Byte] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(TypedDict):
    content: list[TokenLogprob] | None
    refusal: NotRequired[list[TokenLogprob] | None]


class CompletionLogprobs(TypedDict):
    """The legacy API's parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[NonNegativeInt]


# -- tool calls -------------------------------------------------------------------------------


class CalledFunction(TypedDict):
    name: str
    arguments: Annotated[str, Field(description="the arguments as JSON text")]


class MessageToolCall(TypedDict):
    id: str
    type: Literal["function"]
    function: CalledFunction


class FunctionDelta(TypedDict):
    name: NotRequired[str]
    arguments: NotRequired[str]


@with_config(ConfigDict(extra="forbid"))
class ToolCallDelta(TypedDict):
    """a streamed call: index, id, type and name first, then argument fragments"""

    index: NonNegativeInt
    id: NotRequired[str]
    type: NotRequired[Literal["function"]]
    function: NotRequired[FunctionDelta]


# -- chat -------------------------------------------------------------------------------------


class ChatCompletionMessage(TypedDict):
    role: Literal["assistant"]
    content: str | None
    refusal: NotRequired[str | None]
    tool_calls: NotRequired[list[MessageToolCall]]
    # The model's reasoning before its answer (Qwen3's <think>, gpt-oss's analysis channel), as
    # vLLM and DeepSeek name it; only where the model reasoned.
    reasoning_content: NotRequired[str]


class ChatCompletionChoice(TypedDict):
    index: NonNegativeInt
    message: ChatCompletionMessage
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason


class ChatCompletion(TypedDict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: NotRequired[str | None]
    choices: list[ChatCompletionChoice]
    usage: Usage


@with_config(ConfigDict(extra="forbid"))
class ChatCompletionDelta(TypedDict):
    """What one chunk adds to a choice's message: the role first, then content or tool-call parts."""

    role: NotRequired[Literal["assistant"]]
    content: NotRequired[str | None]
    refusal: NotRequired[str | None]
    tool_calls: NotRequired[list[ToolCallDelta]]
    reasoning_content: NotRequired[str]


class ChatCompletionChunkChoice(TypedDict):
    index: NonNegativeInt
    delta: ChatCompletionDelta
    logprobs: NotRequired[ChatLogprobs | None]
    finish_reason: ChatFinishReason | None


class ChatCompletionChunk(TypedDict):
    """With stream_options.include_usage every chunk carries `usage`: null but on the last."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: NotRequired[str | None]
    choices: list[ChatCompletionChunkChoice]
    usage: NotRequired[Usage | None]


# -- legacy completions -----------------------------------------------------------------------


class CompletionChoice(TypedDict):
    index: NonNegativeInt
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: CompletionFinishReason | None


class Completion(TypedDict):
    """A whole text completion, or one stream chunk of it (`usage` as for chat chunks)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: NotRequired[str | None]
    choices: list[CompletionChoice]
    usage: NotRequired[Usage | None]


# -- embeddings -------------------------------------------------------------------------------


class Embedding(TypedDict):
    object: Literal["embedding"]
    index: NonNegativeInt
    embedding: Annotated[
        list[float] | str,
        Field(description="float: the numbers; base64: their little-endian float32 bytes"),
    ]


class EmbeddingUsage(TypedDict):
    prompt_tokens: NonNegativeInt
    total_tokens: NonNegativeInt


class CreateEmbeddingResponse(TypedDict):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


# -- models, errors, health -------------------------------------------------------------------


class Model(TypedDict):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(TypedDict):
    object: Literal["list"]
    data: list[Model]


class Status(TypedDict):
    """/health and /ready. `model`: the served model (in process); `upstreams` and `models`: the
    healthy replicas and the models they serve (proxy); `detail`: why not ready."""

    status: str
    model: NotRequired[str]
    detail: NotRequired[str]
    upstreams: NotRequired[NonNegativeInt]
    models: NotRequired[list[str]]


# -- the Responses API (gateway/responses/output.py builds these; OpenAI's names) ---------------


class ResponseOutputText(TypedDict):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, object]]
    logprobs: list[dict[str, object]]


class ResponseOutputMessage(TypedDict):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[ResponseOutputText]


class ResponseFunctionToolCall(TypedDict):
    id: str
    type: Literal["function_call"]
    status: Literal["in_progress", "completed", "incomplete"]
    call_id: str
    name: str
    arguments: Annotated[str, Field(description="the arguments as JSON text")]
    namespace: NotRequired[str]


class ResponseCustomToolCall(TypedDict):
    id: str
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: Annotated[str, Field(description="the tool's input as the model wrote it (in its grammar)")]


class ResponseInputTokensDetails(TypedDict):
    cached_tokens: NonNegativeInt
    cache_write_tokens: NonNegativeInt


class ResponseOutputTokensDetails(TypedDict):
    reasoning_tokens: NonNegativeInt


class ResponseUsage(TypedDict):
    """`input_tokens_details.cached_tokens`: input tokens whose K/V came from the prefix cache."""

    input_tokens: NonNegativeInt
    input_tokens_details: ResponseInputTokensDetails
    output_tokens: NonNegativeInt
    output_tokens_details: ResponseOutputTokensDetails
    total_tokens: NonNegativeInt


class ResponseError(TypedDict):
    code: str
    message: str


class IncompleteDetails(TypedDict):
    reason: Literal["max_output_tokens"]


class Response(TypedDict):
    """A response of the Responses API, as created, streamed (created, in_progress and the
    terminal event) and retrieved; the request's settings are echoed."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]
    background: bool
    completed_at: int | None
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: int | None
    model: str
    output: list[ResponseOutputMessage | ResponseFunctionToolCall | ResponseCustomToolCall]
    parallel_tool_calls: bool
    previous_response_id: str | None
    conversation: dict[str, str] | None
    prompt_cache_key: str | None
    reasoning: dict[str, object]
    safety_identifier: str | None
    service_tier: str
    store: bool
    temperature: float
    presence_penalty: float
    frequency_penalty: float
    text: dict[str, object]
    tool_choice: str | dict[str, object]
    tools: list[dict[str, object]]
    top_logprobs: NonNegativeInt
    top_p: float
    truncation: Literal["auto", "disabled"]
    usage: ResponseUsage | None
    user: str | None
    metadata: dict[str, str]


class ResponseStreamEvent(TypedDict):
    """One event of a response's stream (`event: <type>` and this as its data): `response` on
    response.created / in_progress / completed / incomplete / failed, `item` on output_item.added /
    done, `delta` on the text and argument deltas, the whole `text` / `arguments` on their done."""

    type: str
    sequence_number: NonNegativeInt
    response: NotRequired[Response]
    output_index: NotRequired[NonNegativeInt]
    content_index: NotRequired[NonNegativeInt]
    item_id: NotRequired[str]
    item: NotRequired[ResponseOutputMessage | ResponseFunctionToolCall]
    part: NotRequired[ResponseOutputText]
    delta: NotRequired[str]
    text: NotRequired[str]
    name: NotRequired[str]
    arguments: NotRequired[str]
    logprobs: NotRequired[list[dict[str, object]]]


class ResponseItemList(TypedDict):
    """A page of a stored response's input items, in OpenAI's item shapes."""

    object: Literal["list"]
    data: list[dict[str, object]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ResponseDeleted(TypedDict):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


class ResponseCompaction(TypedDict):
    """`POST /v1/responses/compact`: the user messages, then one `compaction` item whose
    `encrypted_content` is opaque (gateway/responses/compaction.py)."""

    id: str
    object: Literal["response.compaction"]
    created_at: int
    output: list[dict[str, object]]
    usage: ResponseUsage


class Conversation(TypedDict):
    id: str
    object: Literal["conversation"]
    created_at: int
    metadata: dict[str, str]


class ConversationDeleted(TypedDict):
    id: str
    object: Literal["conversation.deleted"]
    deleted: Literal[True]


class InputTokenCount(TypedDict):
    object: Literal["response.input_tokens"]
    input_tokens: NonNegativeInt


# -- files and batches (gateway/batches/) ------------------------------------------------------


class FileObject(TypedDict):
    id: str
    object: Literal["file"]
    bytes: NonNegativeInt
    created_at: int
    filename: str
    purpose: Literal["batch", "user_data", "batch_output"]
    status: Literal["processed"]
    expires_at: int | None
    status_details: str | None


class FileList(TypedDict):
    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(TypedDict):
    id: str
    object: Literal["file"]
    deleted: Literal[True]


class BatchError(TypedDict):
    """A line the input's validation refused (`line` 1-based), or why the batch failed (`line` null)."""

    code: str
    line: int | None
    message: str
    param: str | None


class BatchErrors(TypedDict):
    object: Literal["list"]
    data: list[BatchError]


class BatchRequestCounts(TypedDict):
    total: NonNegativeInt
    completed: NonNegativeInt
    failed: NonNegativeInt


class BatchInputTokensDetails(TypedDict):
    cached_tokens: NonNegativeInt


class BatchUsage(TypedDict):
    """The sum of the batch's lines' usage."""

    input_tokens: NonNegativeInt
    input_tokens_details: BatchInputTokensDetails
    output_tokens: NonNegativeInt
    output_tokens_details: ResponseOutputTokensDetails
    total_tokens: NonNegativeInt


BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]


class Batch(TypedDict):
    id: str
    object: Literal["batch"]
    endpoint: str
    model: str | None
    errors: BatchErrors | None
    input_file_id: str
    completion_window: Literal["24h"]
    status: BatchStatus
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: BatchRequestCounts
    usage: BatchUsage
    metadata: dict[str, str] | None


class BatchList(TypedDict):
    object: Literal["list"]
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool


# -- the admin API (gateway/admin/api.py, gateway/loras.py) ----------------------------------------
# Plans, tenants and prices are the tenants file's tables as JSON (tenancy/config.py validates
# them and names a bad field in a 400); a table's fields are its keys there.

PositiveInt = Annotated[int, Field(ge=1)]
Dollars = Annotated[float, Field(ge=0)]
UnixSeconds = Annotated[float, Field(ge=0)]


@with_config(ConfigDict(extra="forbid"))
class BudgetFields(TypedDict):
    """A budget in money (integer micro-dollars once parsed) or tokens (input, cached included,
    plus output) over a UTC calendar window; the soft ratio reports crossing that share of it."""

    budget_usd: NotRequired[Dollars]
    budget_tokens: NotRequired[NonNegativeInt]
    budget_window: NotRequired[Literal["daily", "monthly", "none"]]
    budget_soft_ratio: NotRequired[Annotated[float, Field(gt=0, le=1)]]


@with_config(ConfigDict(extra="forbid"))
class PlanTable(BudgetFields):
    """A plan's limits (the tenants file's `[plans.NAME]`); the batch lane's fields are optional
    (unset: no limit), and so are the bounds on what a tenant keeps (unset: the gateway's setting
    of the same name; gateway/bounds.py)."""

    priority: Literal["paid", "free"]
    tokens_per_minute: PositiveInt
    requests_per_minute: PositiveInt
    max_concurrent_requests: PositiveInt
    queue_deadline_seconds: Annotated[float, Field(gt=0)]
    batch_tokens_per_minute: NotRequired[PositiveInt]
    batch_max_concurrent_lines: NotRequired[PositiveInt]
    batch_enqueued_tokens: NotRequired[PositiveInt]
    responses_max_stored: NotRequired[PositiveInt]
    conversation_max_items: NotRequired[PositiveInt]
    conversation_max_bytes: NotRequired[PositiveInt]
    max_files: NotRequired[PositiveInt]
    storage_quota_bytes: NotRequired[PositiveInt]
    batch_max_open: NotRequired[PositiveInt]
    batch_max_queued_lines: NotRequired[PositiveInt]
    batch_max_running_per_tenant: NotRequired[PositiveInt]
    websocket_max_open: NotRequired[PositiveInt]


@with_config(ConfigDict(extra="forbid"))
class TenantTable(BudgetFields):
    """A tenant (`[tenants.NAME]`): its plan, and budget_* fields that override the plan's. Keys
    are issued with the keys routes, not written here."""

    plan: str


@with_config(ConfigDict(extra="forbid"))
class PriceTable(TypedDict):
    """A model's price (`[prices."MODEL"]`), USD per 1M tokens; cached_input defaults to input,
    batch_multiplier (applied to Batch API lines) to 1."""

    input: Dollars
    output: Dollars
    cached_input: NotRequired[Dollars]
    batch_multiplier: NotRequired[Dollars]


class AdminPlan(PlanTable):
    object: Literal["plan"]
    id: str


class AdminPlanList(TypedDict):
    object: Literal["list"]
    data: list[AdminPlan]


class BudgetState(TypedDict):
    """A budget's use now: `used` settled, `reserved` held by requests in flight (their worst
    case), in micro-dollars or tokens (`metric`); times are Unix seconds (null: no window)."""

    scope: str
    metric: Literal["usd", "tokens"]
    window: Literal["daily", "monthly", "none"]
    limit: NonNegativeInt
    used: NonNegativeInt
    reserved: NonNegativeInt
    remaining: NonNegativeInt
    soft_limit: NonNegativeInt | None
    window_start: int | None
    resets_at: int | None
    source: str


class AdminTenant(TenantTable):
    """`budgets`: the tenant's budgets' state, on GET /admin/tenants/{name} only."""

    object: Literal["tenant"]
    id: str
    budgets: NotRequired[list[BudgetState]]


class AdminTenantList(TypedDict):
    object: Literal["list"]
    data: list[AdminTenant]


class AdminPrice(PriceTable):
    object: Literal["price"]
    id: str


class AdminPriceList(TypedDict):
    object: Literal["list"]
    data: list[AdminPrice]


class AdminDeleted(TypedDict):
    object: Literal["plan.deleted", "tenant.deleted", "price.deleted"]
    id: str
    deleted: bool


@with_config(ConfigDict(extra="forbid"))
class KeyCreateRequest(TypedDict):
    """A new key for the tenant: a label, an expiry (Unix seconds; null: none) and the key's own
    budgets; the body may be empty."""

    name: NotRequired[str]
    expires_at: NotRequired[UnixSeconds | None]
    budgets: NotRequired[BudgetFields | None]


@with_config(ConfigDict(extra="forbid"))
class KeyRotateRequest(TypedDict):
    """The new key's expiry (omitted: the old key's); the body may be empty."""

    expires_at: NotRequired[UnixSeconds | None]


class ApiKey(TypedDict):
    """What is stored about a key: its hash and metadata, never the key. `static`: from the
    tenants file; `active`: neither revoked nor expired."""

    key_hash: str
    key_id: str
    tenant: str
    name: str
    created_at: float | None
    expires_at: float | None
    static: bool
    budgets: BudgetFields
    active: bool


class ApiKeyList(TypedDict):
    object: Literal["list"]
    data: list[ApiKey]


class IssuedKey(TypedDict):
    """A key issued or rotated: `key` is shown this once (only its hash is stored)."""

    object: Literal["key"]
    key: str
    key_hash: str
    key_id: str
    tenant: str
    name: str
    expires_at: float | None


class KeyRevoked(TypedDict):
    object: Literal["key.revoked"]
    key_id: str
    tenant: str
    revoked: bool


class AuditEntry(TypedDict):
    """One change: who (`admin@<client address>`), what (`action` on `target`, with `detail`:
    the change, never a key), when (`at`, Unix seconds); `id` orders the entries."""

    id: str
    at: float
    actor: str
    action: str
    target: str
    detail: object


class AuditLog(TypedDict):
    """The newest changes, newest first."""

    object: Literal["list"]
    data: list[AuditEntry]


@with_config(ConfigDict(extra="forbid"))
class LoraLoadRequest(TypedDict):
    """Load (or replace) an adapter from its PEFT folder on the server, public or for one
    `tenant`, over `model` (omitted: the main chat model)."""

    path: str
    tenant: NotRequired[str | None]
    model: NotRequired[str | None]


class LoraAdapter(TypedDict):
    """A loaded adapter (a replace is a new `version`); `owner` null: public."""

    object: Literal["lora"]
    id: str
    model: str | None
    owner: str | None
    version: NonNegativeInt
    content_hash: str
    rank: PositiveInt
    target_modules: list[str]
    bytes: NonNegativeInt
    path: str


class LoraList(TypedDict):
    """Every adapter, and each in-process model's adapter bytes held."""

    object: Literal["list"]
    data: list[LoraAdapter]
    bytes_held: dict[str, NonNegativeInt]


class LoraDeleted(TypedDict):
    """`released`: whether the adapter's memory was freed before the answer (the last request
    using it ended within the wait)."""

    object: Literal["lora.deleted"]
    id: str
    deleted: bool
    released: bool


class AdminBatch(Batch):
    """A batch as its tenant's `/v1/batches` answers it, with the tenant (the admin's routes)."""

    tenant: str


class AdminBatchList(TypedDict):
    object: Literal["list"]
    data: list[AdminBatch]
    first_id: str | None
    last_id: str | None
    has_more: bool


class PriorityCounts(TypedDict):
    paid: NonNegativeInt
    free: NonNegativeInt
    batch: NonNegativeInt


class EngineCounts(TypedDict):
    """An engine's counts now: requests by priority class, KV-cache blocks (`kv_cache_usage`:
    the share in use), the last step's batch, output tokens/s over a recent window."""

    running: PriorityCounts
    waiting: PriorityCounts
    num_running: NonNegativeInt
    num_waiting: NonNegativeInt
    num_total_blocks: NonNegativeInt
    num_free_blocks: NonNegativeInt
    kv_cache_usage: Annotated[float, Field(ge=0, le=1)]
    last_batch_size: NonNegativeInt
    output_tokens_per_s: Annotated[float, Field(ge=0)]
    num_preemptions: NonNegativeInt
    total_steps: NonNegativeInt
    loras_resident: list[str]


class EngineState(TypedDict):
    """An in-process chat model: `status` ready, loading, error or unavailable (`detail`: why);
    `stats` null until its engine has loaded."""

    object: Literal["engine"]
    model: str | None
    status: str
    detail: str | None
    stats: EngineCounts | None


class EngineStateList(TypedDict):
    object: Literal["list"]
    data: list[EngineState]


class ReplicaAdapter(TypedDict):
    resident: bool
    version: NonNegativeInt


class Replica(TypedDict):
    """A pool replica as this gateway sees it: routed to (`healthy`) or not (`last_error`), the
    tokens it last reported waiting and running, the requests this gateway has open there."""

    url: str
    healthy: bool
    models: list[str]
    long_prompts: bool
    loras: dict[str, ReplicaAdapter]
    reported_tokens: NonNegativeInt
    inflight: NonNegativeInt
    num_sent: NonNegativeInt
    last_error: str | None


class ReplicaList(TypedDict):
    object: Literal["list"]
    data: list[Replica]


# The bodies the document names as responses; their nested classes come along as components.
RESPONSE_TYPES: tuple[type, ...] = (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CreateEmbeddingResponse,
    ModelList,
    Model,
    Error,
    Status,
    Response,
    ResponseStreamEvent,
    ResponseItemList,
    ResponseDeleted,
    ResponseCompaction,
    InputTokenCount,
    Conversation,
    ConversationDeleted,
    FileObject,
    FileList,
    FileDeleted,
    Batch,
    BatchList,
    PlanTable,
    TenantTable,
    PriceTable,
    AdminPlan,
    AdminPlanList,
    AdminTenant,
    AdminTenantList,
    AdminPrice,
    AdminPriceList,
    AdminDeleted,
    KeyCreateRequest,
    KeyRotateRequest,
    ApiKey,
    ApiKeyList,
    IssuedKey,
    KeyRevoked,
    AuditLog,
    LoraLoadRequest,
    LoraAdapter,
    LoraList,
    LoraDeleted,
    AdminBatch,
    AdminBatchList,
    EngineStateList,
    ReplicaList,
)
