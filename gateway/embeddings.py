"""`POST /v1/embeddings`: OpenAI's embeddings endpoint over the dynamic batcher, or proxied.

    read body -> parse (400) -> authenticate (401) -> model check (404) -> tokenize and check the
      limits (400) -> admit (429) -> batcher (503 at arrival, 500 on a failed batch) -> respond

What OpenAI's API defines, exactly: `input` as a string, a list of strings, a list of token ids or
a list of token-id lists; `encoding_format` `float` or `base64` (little-endian float32, which the
official SDK asks for by default and decodes itself); `dimensions` (only the model's own size:
these models cannot shorten their vectors); `user`. Limits, each a 400 naming it: 2048 inputs per
request, 8192 tokens per input, 300,000 tokens per request. An input longer than the model's
window is a 400 unless the request sets vLLM's `truncate_prompt_tokens` (k: keep the first k
tokens, a text's closing [SEP] kept; -1: the model's window). Token ids are used as given
(a text's [CLS] ... [SEP] come from the tokenizer; ids are the caller's to frame).

The tokens embedded count against the tenant's token limit like prompt tokens. This module is the
endpoint's own part (request model, checks, response shape, the served model and its batcher);
the app (gateway/app.py) and the proxy (gateway/pool.py) each route to it with a few lines.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import math
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol, TypeVar

import anyio
import orjson
from pydantic import BeforeValidator, Field, ValidationError, WithJsonSchema
from starlette.requests import Request
from starlette.responses import Response

from engine.embeddings.batcher import BatchLimits, BatchRecord, EmbeddingBatcher, EmbeddingRequest
from engine.types import EngineError, EngineOverloadedError, GenerationFailedError
from gateway import admission, responses, telemetry
from gateway.body import read_json
from gateway.errors import APIError, ErrorKind, from_engine_error, invalid_request
from gateway.protocol import _StrictModel, _validation_error, prompt_schema

logger = logging.getLogger("batchgate.embeddings")
T = TypeVar("T")

# OpenAI's limits for /v1/embeddings.
MAX_INPUTS = 2048
MAX_TOKENS_PER_INPUT = 8192
MAX_TOKENS_PER_REQUEST = 300_000
# Texts longer than this (characters, in all) are tokenized in a worker thread.
TOKENIZE_INLINE_MAX_CHARS = 4096
LANGCHAIN_HINT = (
    "Clients that send OpenAI's own token ids instead of text (LangChain's OpenAIEmbeddings does by "
    "default) should send text: in LangChain, pass check_embedding_ctx_length=False."
)


def _input(value: Any) -> Any:
    """str | list[str] | list[int] | list[list[int]] -> a tuple of inputs (str or token-id tuple)."""

    def is_id(t: Any) -> bool:
        return (isinstance(t, int) and not isinstance(t, bool)) or (isinstance(t, float) and t.is_integer())

    shape = "must be a string, an array of strings, an array of token ids or an array of token-id arrays"
    if isinstance(value, str):
        if not value:
            raise ValueError("must not be an empty string")
        return (value,)
    if not isinstance(value, list) or not value:
        raise ValueError(shape + " (not empty)")
    if all(isinstance(v, str) for v in value):
        if any(not v for v in value):
            raise ValueError("must not hold an empty string")
        return tuple(value)
    if all(is_id(t) for t in value):
        return (tuple(int(t) for t in value),)
    if all(isinstance(v, list) and v and all(is_id(t) for t in v) for v in value):
        return tuple(tuple(int(t) for t in v) for v in value)
    raise ValueError(shape)


def input_schema(vocab_size: int | None = None) -> dict[str, Any]:
    """JSON schema of `input`; with `vocab_size`, token ids are bounded by it."""
    return prompt_schema(vocab_size, max_items=MAX_INPUTS)


Input = Annotated[tuple[str | tuple[int, ...], ...], BeforeValidator(_input), WithJsonSchema(input_schema())]


class EmbeddingsRequest(_StrictModel):
    """OpenAI's create-embeddings body, plus vLLM's `truncate_prompt_tokens`."""

    model: str
    input: Input
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None


def parse_embeddings_request(body: Any) -> EmbeddingsRequest:
    """Validate a decoded JSON body; APIError(400) names the bad field and the limit it breaks."""
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    try:
        req = EmbeddingsRequest.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    if len(req.input) > MAX_INPUTS:
        raise invalid_request(
            f"'input' holds {len(req.input)} inputs; at most {MAX_INPUTS} are allowed per request.",
            param="input",
        )
    if req.truncate_prompt_tokens == 0:
        raise invalid_request(
            "'truncate_prompt_tokens' must be -1 (the model's window) or a positive token count.",
            param="truncate_prompt_tokens",
        )
    return req


# -- the served model ------------------------------------------------------------------------


class EmbeddingModelLike(Protocol):
    """What `EmbeddingService` needs of a model (engine/embeddings/model.py's EmbeddingModel)."""

    name: str
    dimensions: int
    max_input_tokens: int
    vocab_size: int

    def tokenize(self, texts: list[str]) -> list[list[int]]: ...

    def truncate(self, ids: list[int], num_tokens: int, *, text: bool) -> list[int]: ...

    def embed(self, batch: list[list[int]]) -> list[list[float]]: ...


class EmbeddingService:
    """One embedding model served under `name`, with its batcher (started here, stopped by
    `shutdown`)."""

    def __init__(
        self,
        model: EmbeddingModelLike,
        limits: BatchLimits | None = None,
        *,
        name: str | None = None,
    ) -> None:
        self.model = model
        self.name: str = name or model.name
        self.dimensions: int = model.dimensions
        self.max_input_tokens: int = model.max_input_tokens
        self.vocab_size: int = model.vocab_size
        self._on_batch: Callable[[BatchRecord], None] | None = None
        self.batcher = EmbeddingBatcher(model, limits, on_batch=self._observe).start()

    def _observe(self, record: BatchRecord) -> None:
        if self._on_batch is not None:
            self._on_batch(record)

    def observe_with(self, on_batch: Callable[[BatchRecord], None]) -> None:
        """Send batch records to `on_batch` (the app's metrics) from now on."""
        self._on_batch = on_batch

    @classmethod
    def load(cls, path: str | None, limits: BatchLimits, device: str = "cpu") -> EmbeddingService:
        """Load a BERT-family folder (None: the bundled all-MiniLM-L6-v2); blocking."""
        from engine.embeddings.model import EmbeddingModel

        return cls(EmbeddingModel.load(path, device=device), limits)

    @property
    def ready(self) -> bool:
        return self.batcher.ready

    def shutdown(self) -> None:
        self.batcher.shutdown()

    def card(self, created: int) -> dict[str, Any]:
        return {"id": self.name, "object": "model", "created": created, "owned_by": "batchgate"}


@dataclass(frozen=True)
class Prepared:
    """A request's inputs as the model takes them, and the tokens that costs."""

    inputs: tuple[tuple[int, ...], ...]
    num_tokens: int


def prepare(req: EmbeddingsRequest, service: EmbeddingService) -> Prepared:
    """Tokenize and check every input against OpenAI's limits, the vocabulary and the model's
    window (truncating where the request asks); APIError(400) names the input and the limit."""
    texts = [i for i in req.input if isinstance(i, str)]
    encoded = iter(service.model.tokenize(texts)) if texts else iter(())
    window = service.max_input_tokens
    cut = req.truncate_prompt_tokens
    if cut is not None and cut > window:
        raise invalid_request(
            f"'truncate_prompt_tokens' is {cut}, more than this model's {window}-token window.",
            param="truncate_prompt_tokens",
        )
    keep = window if cut == -1 else cut
    given: list[tuple[list[int], bool]] = []
    total = 0
    for i, raw in enumerate(req.input):  # OpenAI's limits first, on the inputs as sent
        is_text = isinstance(raw, str)
        ids: list[int] = list(next(encoded)) if isinstance(raw, str) else list(raw)
        where = _where(req, i)
        if not is_text:
            bad = next((t for t in ids if not 0 <= t < service.vocab_size), None)
            if bad is not None:
                raise invalid_request(
                    f"Token id {bad} in {where} is outside the vocabulary of {service.name} "
                    f"(0..{service.vocab_size - 1}). {LANGCHAIN_HINT}",
                    param="input",
                )
        if len(ids) > MAX_TOKENS_PER_INPUT:
            raise invalid_request(
                f"{where} has {len(ids)} tokens; at most {MAX_TOKENS_PER_INPUT} tokens are allowed per "
                "input.",
                param="input",
            )
        total += len(ids)
        if total > MAX_TOKENS_PER_REQUEST:
            raise invalid_request(
                f"'input' holds more than {MAX_TOKENS_PER_REQUEST} tokens; at most "
                f"{MAX_TOKENS_PER_REQUEST} tokens are allowed per request.",
                param="input",
            )
        given.append((ids, is_text))
    inputs: list[tuple[int, ...]] = []
    for i, (ids, is_text) in enumerate(given):  # then the model's window
        if len(ids) > window and keep is None:
            raise APIError(
                ErrorKind.CONTEXT_LENGTH_EXCEEDED,
                f"{_where(req, i)} has {len(ids)} tokens, more than the {window}-token window of "
                f"{service.name}. Shorten it, or set 'truncate_prompt_tokens' (-1 cuts it to the window).",
                param="input",
            )
        if keep is not None and len(ids) > keep:
            ids = service.model.truncate(ids, keep, text=is_text)
        inputs.append(tuple(ids))
    if req.dimensions is not None and req.dimensions != service.dimensions:
        raise invalid_request(
            f"'dimensions' is not supported by {service.name}: its embeddings have "
            f"{service.dimensions} dimensions and cannot be shortened; omit 'dimensions' "
            f"(or set it to {service.dimensions}).",
            param="dimensions",
        )
    return Prepared(tuple(inputs), sum(len(ids) for ids in inputs))


def _where(req: EmbeddingsRequest, i: int) -> str:
    return "'input'" if len(req.input) == 1 else f"'input[{i}]'"


def encode_vector(vector: list[float], encoding_format: str | None) -> list[float] | str:
    """`float`: the numbers; `base64`: their little-endian float32 bytes, as OpenAI sends."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


def response_body(
    model: str, vectors: tuple[list[float], ...], encoding_format: str | None, num_tokens: int
) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encode_vector(v, encoding_format)}
            for i, v in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }


def json_response(body: dict[str, Any], headers: dict[str, str]) -> Response:
    """A 200 with `body` encoded by orjson: the stdlib's json spends ~0.15-0.2 ms on the 384 float
    reprs of one vector, orjson ~0.01 ms (issue 13's 1-client latency). A non-finite number (a
    faulty model) is refused as Starlette's JSONResponse refuses it, not sent as null."""
    content = orjson.dumps(body)
    if b"null" in content and _non_finite(body):  # orjson writes NaN and inf as null
        raise ValueError("Out of range float values are not JSON compliant")
    return Response(content, media_type="application/json", headers=headers)


def _non_finite(body: dict[str, Any]) -> bool:
    return any(
        isinstance(d["embedding"], list) and not all(math.isfinite(x) for x in d["embedding"])
        for d in body["data"]
    )


def span(model: str, caller: admission.Caller, req: EmbeddingsRequest) -> telemetry.ChatSpan:
    """The `embeddings {model}` span with the GenAI attributes (no sampling parameters)."""
    s = telemetry.ChatSpan(
        "embeddings",
        model,
        max_tokens=None,
        temperature=None,
        top_p=None,
        tenant=caller.name,
        priority=caller.priority.name.lower(),
    )
    s.set("gen_ai.request.encoding_formats", [req.encoding_format or "float"])
    if req.dimensions is not None:
        s.set("gen_ai.embeddings.dimension.count", req.dimensions)
    return s


# -- the in-process endpoint -----------------------------------------------------------------


Authenticate = Callable[[Request, str | None], Awaitable[admission.Caller]]


class Embeddings:
    """The app's embedding model (loaded at start-up unless given) and its endpoint."""

    def __init__(
        self,
        settings: Any,
        metrics: Any,
        authenticate: Authenticate,
        tenancy: Any,
        service: EmbeddingService | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.authenticate = authenticate
        self.tenancy = tenancy
        self.owns_service = service is None
        self.service = service
        self.load_error: str | None = None
        if service is not None:
            service.observe_with(metrics.observe_embedding_batch)

    @property
    def wanted(self) -> bool:
        """Whether this server serves an embedding model at all."""
        return self.service is not None or self.settings.embedding_model != "none"

    async def load(self) -> None:
        """Load the configured model in a worker thread (errors are kept for /health and /ready)."""
        if self.service is not None or not self.wanted:
            return
        path = None if self.settings.embedding_model == "bundled" else self.settings.embedding_model
        device = self.settings.device
        if device == "auto":  # as the chat engine decides: CUDA when available
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            service = await anyio.to_thread.run_sync(
                EmbeddingService.load, path, self.settings.embedding_batch_limits(), device
            )
        except Exception as exc:  # noqa: BLE001 - reported by /health and /ready, and logged
            logger.exception("loading the embedding model failed")
            self.load_error = f"{type(exc).__name__}: {exc}"
            return
        service.observe_with(self.metrics.observe_embedding_batch)
        self.service = service
        logger.info("serving embeddings with %s (%d dimensions)", service.name, service.dimensions)

    async def shutdown(self) -> None:
        if self.owns_service and self.service is not None:
            await anyio.to_thread.run_sync(self.service.shutdown)

    def not_ready(self) -> str | None:
        """Why /ready should say no (None: ready, or no embedding model wanted)."""
        if not self.wanted:
            return None
        if self.load_error is not None:
            return f"the embedding model failed to load: {self.load_error}"
        if self.service is None:
            return "loading"
        if not self.service.ready:
            return "the embedding batcher stopped"
        return None

    @property
    def name(self) -> str | None:
        return self.service.name if self.service is not None else None

    async def handle(self, request: Request, chat_model: str | None) -> Response:
        req = parse_embeddings_request(await read_json(request, self.settings.max_body_bytes))
        caller = await self.authenticate(request, req.user)
        service = self._require(req.model, chat_model)
        size = sum(len(i) for i in req.input if isinstance(i, str))
        if size <= TOKENIZE_INLINE_MAX_CHARS:
            prepared = prepare(req, service)
        else:
            prepared = await anyio.to_thread.run_sync(prepare, req, service)
        request_id = responses.new_id("emb")
        s = span(req.model, caller, req)
        try:
            held = await admission.admit(
                None if caller.internal else self.tenancy,
                caller,
                num_prompt_tokens=prepared.num_tokens,
                max_num_tokens=0,
                request_id=request_id,
            )
        except APIError as exc:
            self.metrics.refused("rate_limit" if exc.kind is ErrorKind.RATE_LIMITED else "unavailable")
            s.event("gen_ai.admission", **{"batchgate.admitted": False})
            s.error(exc)
            s.end(response_id=request_id, input_tokens=prepared.num_tokens, output_tokens=0)
            raise
        s.event("gen_ai.admission", **{"batchgate.admitted": True})
        num_tokens = 0
        try:
            job = EmbeddingRequest(request_id, prepared.inputs, caller.priority, caller.queue_deadline_s)
            vectors = await unless_disconnected(request, service.batcher.embed(job))
            if vectors is None:
                logger.info("%s: client disconnected; its inputs were dropped", request_id)
                return Response(status_code=499)
            num_tokens = prepared.num_tokens
            held.record(num_prompt_tokens=num_tokens, num_completion_tokens=0)
            body = response_body(req.model, vectors, req.encoding_format, num_tokens)
            return json_response(body, headers={"X-Request-Id": request_id, **held.headers})
        except EngineError as exc:
            error = _engine_error(exc, request_id)
            error.headers.update({"X-Request-Id": request_id, **held.headers})
            if isinstance(exc, EngineOverloadedError):
                self.metrics.refused("deadline")
            s.error(error)
            raise error from None
        finally:
            self.metrics.count_tokens(caller.plan, num_tokens, 0)
            s.end(response_id=request_id, input_tokens=num_tokens, output_tokens=0)
            await held.close()

    def _require(self, model: str, chat_model: str | None) -> EmbeddingService:
        if self.service is not None and model == self.service.name:
            if not self.service.ready:
                raise APIError(
                    ErrorKind.UNAVAILABLE, "The embedding batcher is not running.", retry_after_s=5.0
                )
            return self.service
        if model == chat_model:
            raise invalid_request(
                f"`{model}` is a chat model; it does not make embeddings. "
                + (f"This server's embedding model is `{self.name}`." if self.name else ""),
                param="model",
            )
        if self.service is None and self.wanted and self.load_error is None:
            raise APIError(
                ErrorKind.UNAVAILABLE,
                "The embedding model is still loading; retry shortly.",
                retry_after_s=5.0,
            )
        served = (
            f" This server's embedding model is `{self.name}`."
            if self.name
            else (" This server serves no embedding model.")
        )
        raise APIError(
            ErrorKind.MODEL_NOT_FOUND,
            f"The model `{model}` does not exist or you do not have access to it.{served}",
            param="model",
        )


def _engine_error(exc: EngineError, request_id: str) -> APIError:
    if isinstance(exc, GenerationFailedError):
        # A bug or a fault of the model, not of this request: say nothing of it but where to look.
        return APIError(
            ErrorKind.GENERATION_FAILED,
            f"The server had an error while processing your request (request id {request_id}); "
            "retry the request.",
        )
    return from_engine_error(exc, param="input")


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None if the client disconnected first (`work` is then cancelled: the
    batcher drops the request's waiting inputs; a relayed call is closed)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    running = asyncio.ensure_future(work)
    watching = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({running, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not running.done():
            running.cancel()
        await asyncio.gather(running, watching, return_exceptions=True)
    if running.cancelled():
        return None
    return running.result()


# -- proxy mode --------------------------------------------------------------------------------


def count_proxied_tokens(req: EmbeddingsRequest, counter: Any) -> int:
    """Tokens to admit for a proxied request (the replica reports the exact count, settled after):
    token ids as given, texts with the gateway's counter, plus 2 each for [CLS] and [SEP]."""
    return sum(len(i) if isinstance(i, tuple) else counter.count(i) + 2 for i in req.input)
