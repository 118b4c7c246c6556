"""The seam between the request pipeline and whatever serves a model: the `Backend` protocol and
the small typed records that cross it.

    pipeline:  parse -> authenticate -> resolve model -> backend.plan(work) -> admit -> plan.execute(call)
    backends:  EngineBackend (gateway/local/engine_backend.py: the in-process engine),
               EmbeddingBackend (gateway/local/embedding_backend.py: the in-process batcher),
               ReplicaBackend (gateway/pool/relay.py: remote replicas over HTTP)

What differs per endpoint inside a backend is the backend's own table, filled in by the endpoint
table (gateway/endpoints.py): this module names no API family.

The pipeline (gateway/pipeline.py) knows only this module: it never asks which kind of backend
it talks to. A backend turns a parsed request (`Work`) into a `Plan` (the tokens to reserve, and
how to run it) without side effects, so a request it refuses (400) costs nothing; once admitted,
`Plan.execute` runs it and answers with a whole `Body` or a `Stream` of SSE frames. Everything a
backend opens for a request it hands to `Call.on_close`; the pipeline closes the call once, on
every path (success, error, client disconnect, backend failure).
"""

from __future__ import annotations

import enum
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from starlette.requests import Request
from starlette.responses import Response

from gateway.admission import Caller
from gateway.errors import OPENAI, UNAVAILABLE_RETRY_AFTER_S, APIError, Dialect, ErrorKind
from gateway.telemetry import ChatSpan

if TYPE_CHECKING:
    from tenancy.tokens import TokenCounter

logger = logging.getLogger("batchgate.gateway")


class APIRequest(Protocol):
    """A parsed request body, as its endpoint's parser returns it: each API family has its own
    type; the pipeline reads only these two fields."""

    @property
    def model(self) -> str: ...

    @property
    def user(self) -> str | None: ...


def new_id(prefix: str) -> str:
    """A request's id: `chatcmpl-<hex>`; a prefix ending in "_" is OpenAI's newer style (`resp_<hex>`)."""
    return f"{prefix}{uuid.uuid4().hex}" if prefix.endswith("_") else f"{prefix}-{uuid.uuid4().hex}"


class Task(enum.Enum):
    """What a served model does; an endpoint asks for one."""

    GENERATE = "generate"  # chat and completions
    EMBED = "embed"


@dataclass(frozen=True)
class Endpoint:
    """One public endpoint: what it is called, what it asks of a model, how its body parses."""

    path: str  # where clients send it
    upstream_path: str  # where a replica takes it (an alias relays to its original)
    task: Task
    operation: str  # the span's gen_ai.operation.name
    id_prefix: str  # of the response id
    parse: Callable[[Any], APIRequest]
    span: Callable[[Work], ChatSpan]
    stateful: bool = False  # its requests go through the pipeline's `State` hooks
    count_only: bool = False  # answers the prompt's token count; generates nothing, charges nothing
    # What a relaying gateway holds for it (gateway/pool/relay.py): its own token counts.
    relay_hold: Callable[[Work, TokenCounter], Awaitable[RelayHold]] | None = None
    countable: bool = False  # a replica counts its exact prompt for a gateway (`/v1/internal/count`)
    usage_in_stream: bool = False  # its stream's terminal event carries usage unasked
    dialect: Dialect = OPENAI  # its protocol's errors, stream end and key header (gateway/errors.py)


@dataclass(frozen=True)
class RelayHold:
    """What a gateway holds for a request it relays: prompt tokens (its own count), completion
    tokens over all choices, and the completion tokens per choice a replica may use (0: no cap)."""

    num_prompt_tokens: int
    max_tokens: int
    max_tokens_per_choice: int = 0


@dataclass
class Work:
    """One parsed, authenticated request for a resolved model, before admission."""

    endpoint: Endpoint
    request: APIRequest
    body: dict[str, Any]  # the JSON as the client sent it (a replica gets it as is)
    caller: Caller
    model: str
    request_id: str
    # Conversations a client's WebSocket keeps (gateway/responses/websocket.py): a
    # previous_response_id found here continues without the store (`store: false` included).
    cached: Mapping[str, tuple[dict[str, Any], ...]] | None = None

    @property
    def stream(self) -> bool:
        return bool(getattr(self.request, "stream", False))


@dataclass
class Usage:
    """What a request used, as its backend learns it; settled once when the call closes.

    `served`: the backend produced an answer (a 200); only then are tokens charged: a request
    refused or failed before that is refunded whole. `final`: the counts are exact as they
    stand (a relayed stream's are an estimate until the replica's usage comes, and its release
    may still correct them), so a stream can settle at its `[DONE]`."""

    num_prompt_tokens: int
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0  # of the prompt tokens, those served from the prefix cache
    served: bool = False
    response_id: str | None = None
    final: bool = True


@dataclass
class Call:
    """An admitted request as its backend sees it: the work, its usage, its span, and what to
    release when it ends (`on_close`; run once, last registered first)."""

    work: Work
    usage: Usage
    span: ChatSpan
    http: Request | None  # None: a Batch API line (no client connection)
    keep_alive_s: float
    _cleanups: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    def on_close(self, cleanup: Callable[[], Awaitable[None]]) -> None:
        self._cleanups.append(cleanup)

    async def release(self) -> None:
        """Run the backend's cleanups (the pipeline calls this once, shielded)."""
        cleanups, self._cleanups = self._cleanups, []
        for cleanup in reversed(cleanups):
            try:
                await cleanup()
            except Exception:  # noqa: BLE001 - every cleanup must run
                logger.exception("%s: releasing a backend resource failed", self.work.request_id)


@dataclass
class Body:
    """A whole response: `payload` (a JSON object, or bytes relayed as they came), its status."""

    payload: Mapping[str, object] | bytes
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Stream:
    """A 200 event stream: SSE frames ending with `data: [DONE]`. `ready`: its first frame is
    already there (else the response starts with a keep-alive while the request waits)."""

    frames: AsyncIterator[bytes]
    ready: bool
    headers: dict[str, str] = field(default_factory=dict)
    # The event a drain deadline ends it with, when not the chat-shaped `error` (gateway/drain.py).
    stop_frame: Callable[[], bytes] | None = None


Reply = Body | Stream


@dataclass
class Plan:
    """What admission reserves for a request, and how its backend will run it once admitted."""

    num_prompt_tokens: int
    max_num_tokens: int  # completion tokens reserved beyond the prompt (0 for embeddings)
    execute: Callable[[Call], Awaitable[Reply]]


@dataclass(frozen=True)
class ModelCard:
    """One entry of /v1/models."""

    id: str
    created: int
    task: Task | None = None  # None: a replica's model (the replica knows)
    owner: str | None = None  # a LoRA adapter's tenant: listed and served to it alone (gateway/loras.py)


@dataclass(frozen=True)
class NotReady:
    """Why a backend cannot take requests: /ready's `status` ("loading", "error" or
    "unavailable") and `detail`, and the 503 a request meets meanwhile."""

    status: str
    detail: str
    message: str  # the sentence a refused request gets
    retry_after_s: float = UNAVAILABLE_RETRY_AFTER_S

    def error(self) -> APIError:
        return APIError(ErrorKind.UNAVAILABLE, self.message, retry_after_s=self.retry_after_s)


class State(Protocol):
    """What a stateful endpoint (the Responses API) adds around its backend: `prepare` after
    authentication resolves stored state into the work (404 for an id the tenant has not got);
    `wrap` returns the plan whose `execute` also stores the answer (gateway/responses/state.py)."""

    async def prepare(self, work: Work) -> None: ...

    def wrap(self, work: Work, plan: Plan) -> Plan: ...

    def in_background(self, work: Work) -> bool:
        """Whether the admitted `work` runs on without its client (`run_in_background`)."""
        ...

    async def run_in_background(
        self, work: Work, plan: Plan, call: Call, close: Callable[[], Awaitable[None]]
    ) -> Response:
        """Start the run (it calls `close` when it ends) and answer the client at once."""
        ...


class Backend(Protocol):
    """Serves one or more models. Contract: `plan` has no side effects (it may tokenize, count,
    compile a grammar, and raise APIError 400/503); `Plan.execute` registers everything it opens
    with `Call.on_close` before it can fail or be cancelled; `start`/`aclose` bracket its life."""

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    def models(self) -> list[ModelCard]:
        """The models it serves now (loading or unhealthy: none)."""
        ...

    async def find(self, model: str) -> bool:
        """Whether it serves `model` (a replica set may probe replicas that were down)."""
        ...

    def problem(self) -> str | None:
        """Why the process should be restarted (/health 503), or None."""
        ...

    async def not_ready(self) -> NotReady | None:
        """Why it cannot take requests now (/ready 503), or None."""
        ...

    async def plan(self, work: Work) -> Plan: ...
