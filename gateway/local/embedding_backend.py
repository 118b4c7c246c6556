"""`POST /v1/embeddings` in process: OpenAI's embeddings endpoint over the dynamic batcher.

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
in-process backend (the served model and its batcher, the checks, the response); the request
model is gateway/openai/protocol.py's, the pipeline (gateway/pipeline.py) does the rest, as for
every endpoint, and a replica set (gateway/pool/relay.py) serves proxied embedding models.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import anyio
import orjson

from engine.embeddings.batcher import EmbeddingBatcher
from engine.embeddings.policy import BatchLimits, BatchRecord, EmbeddingRequest
from engine.types import EngineError, GenerationFailedError
from gateway.backend import Body, Call, ModelCard, NotReady, Plan, Reply, Task, Work
from gateway.errors import UNAVAILABLE_RETRY_AFTER_S, APIError, ErrorKind, from_engine_error, invalid_request
from gateway.openai import bodies, schemas
from gateway.openai.protocol import (
    MAX_TOKENS_PER_INPUT,
    MAX_TOKENS_PER_REQUEST,
    EmbeddingsRequest,
)
from gateway.openai.tokenizer import inline_or_thread

if TYPE_CHECKING:
    from gateway.metrics import Metrics
    from gateway.settings import Settings

logger = logging.getLogger("batchgate.embeddings")

LANGCHAIN_HINT = (
    "Clients that send OpenAI's own token ids instead of text (LangChain's OpenAIEmbeddings does by "
    "default) should send text: in LangChain, pass check_embedding_ctx_length=False."
)


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
        model: EmbeddingModelLike | None = None,
        limits: BatchLimits | None = None,
        *,
        name: str | None = None,
        build: Callable[[], EmbeddingModelLike] | None = None,
    ) -> None:
        """Serve `model`, or the model `build()` makes on the batcher's thread (see
        EmbeddingBatcher: a model runs faster on the thread that built it)."""
        built: list[EmbeddingModelLike] = [] if model is None else [model]

        def build_and_keep() -> EmbeddingModelLike:
            assert build is not None
            built.append(build())
            return built[0]

        self._on_batch: Callable[[BatchRecord], None] | None = None
        self.batcher = EmbeddingBatcher(
            model, limits, on_batch=self._observe, build=None if build is None else build_and_keep
        ).start()
        self.model = built[0]
        self.name: str = name or self.model.name
        self.dimensions: int = self.model.dimensions
        self.max_input_tokens: int = self.model.max_input_tokens
        self.vocab_size: int = self.model.vocab_size

    def _observe(self, record: BatchRecord) -> None:
        if self._on_batch is not None:
            self._on_batch(record)

    def observe_with(self, on_batch: Callable[[BatchRecord], None]) -> None:
        """Send batch records to `on_batch` (the app's metrics) from now on."""
        self._on_batch = on_batch

    @classmethod
    def load(
        cls, path: str | None, limits: BatchLimits, device: str = "cpu", name: str | None = None
    ) -> EmbeddingService:
        """Load a BERT-family folder (None: the bundled all-MiniLM-L6-v2), served as `name` (None:
        its own name); blocking."""
        from engine.embeddings.model import EmbeddingModel

        return cls(limits=limits, name=name, build=lambda: EmbeddingModel.load(path, device=device))

    @property
    def ready(self) -> bool:
        return self.batcher.ready

    def shutdown(self) -> None:
        self.batcher.shutdown()

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


# -- the in-process backend ------------------------------------------------------------------


class EmbeddingBackend:
    """The in-process embedding model (loaded at `start()` unless given) behind the pipeline."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        service: EmbeddingService | None = None,
        *,
        name: str | None = None,
    ) -> None:
        self.settings = settings
        self.served_name = name  # None: the model's own name
        self.metrics = metrics
        self.owns_service = service is None
        self.service = service
        self.load_error: str | None = None
        self.created = int(time.time())
        if service is not None:
            service.observe_with(metrics.observe_embedding_batch)

    async def start(self) -> None:
        """Load the configured model in a worker thread (errors are kept for /health and /ready)."""
        if self.service is not None:
            return
        path = None if self.settings.embedding_model == "bundled" else self.settings.embedding_model
        device = self.settings.device
        if device == "auto":  # as the chat engine decides: CUDA when available
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            service = await anyio.to_thread.run_sync(
                EmbeddingService.load, path, self.settings.embedding_batch_limits(), device, self.served_name
            )
        except Exception as exc:  # noqa: BLE001 - reported by /health and /ready, and logged
            logger.exception("loading the embedding model failed")
            self.load_error = f"{type(exc).__name__}: {exc}"
            return
        service.observe_with(self.metrics.observe_embedding_batch)
        self.service = service
        logger.info("serving embeddings with %s (%d dimensions)", service.name, service.dimensions)

    async def aclose(self) -> None:
        if self.owns_service and self.service is not None:
            await anyio.to_thread.run_sync(self.service.shutdown)

    @property
    def name(self) -> str | None:
        return self.service.name if self.service is not None else None

    def models(self) -> list[ModelCard]:
        if self.service is None:
            return []
        return [ModelCard(self.service.name, self.created, Task.EMBED)]

    async def find(self, model: str) -> bool:
        return False

    def problem(self) -> str | None:
        if self.load_error is not None:
            return f"the embedding model failed to load: {self.load_error}"
        return None

    async def not_ready(self) -> NotReady | None:
        if self.load_error is not None:
            detail = f"the embedding model failed to load: {self.load_error}"
            return NotReady("unavailable", detail, f"The embedding model failed to load: {self.load_error}")
        if self.service is None:
            return NotReady("loading", "loading", "The embedding model is still loading; retry shortly.")
        if not self.service.ready:
            return NotReady(
                "unavailable", "the embedding batcher stopped", "The embedding batcher is not running."
            )
        return None

    async def plan(self, work: Work) -> Plan:
        service = self.service
        if service is None or not service.ready:
            raise APIError(
                ErrorKind.UNAVAILABLE,
                "The embedding batcher is not running.",
                retry_after_s=UNAVAILABLE_RETRY_AFTER_S,
            )
        req = work.request
        assert isinstance(req, EmbeddingsRequest)
        size = sum(len(i) for i in req.input if isinstance(i, str))
        prepared = await inline_or_thread(lambda r: prepare(r, service), req, size)

        async def execute(call: Call) -> Reply:
            return await self._execute(call, service, req, prepared)

        return Plan(prepared.num_tokens, 0, execute)

    async def _execute(
        self, call: Call, service: EmbeddingService, req: EmbeddingsRequest, prepared: Prepared
    ) -> Reply:
        work = call.work
        job = EmbeddingRequest(
            work.request_id, prepared.inputs, work.caller.priority, work.caller.queue_deadline_s
        )
        try:
            # Cancelled when the client leaves: the batcher drops the request's waiting inputs.
            vectors = await service.batcher.embed(job)
        except EngineError as exc:
            raise _engine_error(exc, work.request_id) from None
        call.usage.served = True
        body = bodies.embedding_list(work.model, vectors, req.encoding_format, prepared.num_tokens)
        return Body(_encode(body))


def _encode(body: schemas.CreateEmbeddingResponse) -> bytes:
    """The response as JSON, by orjson: the float reprs of a vector are most of a one-client
    request's time with the stdlib's json (docs/BENCHMARKS.md). A non-finite number (a faulty
    model) is refused as Starlette's JSONResponse refuses it (a 500), not sent as null."""
    content = orjson.dumps(body)
    if b"null" in content and any(
        isinstance(d["embedding"], list) and not all(math.isfinite(x) for x in d["embedding"])
        for d in body["data"]
    ):
        raise ValueError("Out of range float values are not JSON compliant")
    return content


def _engine_error(exc: EngineError, request_id: str) -> APIError:
    if isinstance(exc, GenerationFailedError):
        # A bug or a fault of the model, not of this request: say nothing of it but where to look.
        return APIError(
            ErrorKind.GENERATION_FAILED,
            f"The server had an error while processing your request (request id {request_id}); "
            "retry the request.",
        )
    return from_engine_error(exc, param="input")
