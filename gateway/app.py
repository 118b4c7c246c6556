"""The Starlette app: OpenAI's endpoints over one in-process engine.

Each generation handler is the same short pipeline (see gateway/admission.py for the tenancy
part):

    read body -> parse (400) -> model check (404) -> authenticate (401) -> tokenize (400)
      -> sampling params (400) -> admit (429) -> submit (400/503) -> stream or gather -> settle

The event loop never runs the model: the engine computes in its own thread and hands outputs
back through its stream; large prompts are tokenized in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.types import EngineError, GenerationRequest, SamplingParams
from gateway import admission, embeddings, generation, protocol, responses, telemetry, tools
from gateway.body import read_json, unless_disconnected
from gateway.drain import Drain, DrainMiddleware, deadline_frame
from gateway.errors import EXCEPTION_HANDLERS, APIError, ErrorKind, from_engine_error, invalid_request
from gateway.metrics import Metrics, MetricsMiddleware, TimedStream
from gateway.openapi import build_openapi
from gateway.settings import Settings
from gateway.sse import EventStreamResponse
from gateway.tokens import Tokenizer

logger = logging.getLogger("batchgate.gateway")

# Prompts longer than this (characters) are tokenized in a worker thread, not on the event loop.
TOKENIZE_INLINE_MAX_CHARS = 4096

EngineFactory = Callable[[Settings], Any]


def _default_engine_factory(settings: Settings) -> Any:
    from engine.async_engine import AsyncEngine

    return AsyncEngine.from_config(settings.engine_config())


class Gateway:
    """The app's state and handlers. Create it through `create_app`."""

    def __init__(
        self,
        settings: Settings,
        engine: Any | None,
        tenancy: Any | None,
        engine_factory: EngineFactory,
        owns_tenancy: bool,
        embedder: embeddings.EmbeddingService | None = None,
    ) -> None:
        self.settings = settings
        self.tenancy = tenancy
        self.owns_tenancy = owns_tenancy
        self.engine_factory = engine_factory
        self.owns_engine = engine is None
        # `--model none`: no chat model (an embedding-only replica); the chat endpoints are 404s.
        self.serves_chat = engine is not None or settings.model != "none"
        self.engine: Any | None = None
        self.tokenizer: Tokenizer | None = None
        self.load_error: str | None = None
        self.created = int(time.time())
        self.metrics = Metrics(lambda: self.engine)
        self.embeddings = embeddings.Embeddings(settings, self.metrics, self._authenticate, tenancy, embedder)
        self.drain = Drain()
        self.metrics.state.draining = lambda: self.drain.draining
        self.metrics.state.redis_up = lambda: getattr(self.tenancy, "redis_up", None)
        if engine is not None:
            self._attach(engine)

    # -- lifecycle ---------------------------------------------------------------------------

    def _attach(self, engine: Any) -> None:
        self.tokenizer = Tokenizer(engine.tokenizer)
        self.engine = engine

    async def load_engine(self) -> None:
        try:
            engine = await anyio.to_thread.run_sync(self.engine_factory, self.settings)
            tokenizer = await anyio.to_thread.run_sync(Tokenizer, engine.tokenizer)
        except Exception as exc:  # noqa: BLE001 - reported by /health and /ready, and logged
            logger.exception("loading the model failed")
            self.load_error = f"{type(exc).__name__}: {exc}"
            return
        self.tokenizer = tokenizer
        self.engine = engine
        freeze_startup_heap()
        logger.info("serving %s (max_model_len %d)", engine.model_name, engine.max_model_len)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        loader = (
            asyncio.ensure_future(self.load_engine()) if self.engine is None and self.serves_chat else None
        )
        embedding_loader = asyncio.ensure_future(self.embeddings.load())
        if loader is None:
            freeze_startup_heap()
        try:
            async with admission.watching(self.tenancy):
                yield
        finally:
            if loader is not None:
                await loader  # a load in progress cannot be interrupted; wait, then shut it down
            await embedding_loader
            await self.embeddings.shutdown()
            if self.owns_engine and self.engine is not None:
                await anyio.to_thread.run_sync(self.engine.shutdown)
            if self.owns_tenancy and self.tenancy is not None:
                await self.tenancy.aclose()

    @property
    def model_name(self) -> str | None:
        if self.engine is None:
            return None
        return self.settings.served_model_name or str(self.engine.model_name)

    def _require_engine(self) -> tuple[Any, Tokenizer]:
        if not self.serves_chat:
            served = f" Its embedding model is `{self.embeddings.name}`." if self.embeddings.name else ""
            raise APIError(
                ErrorKind.MODEL_NOT_FOUND, f"This server serves no chat model.{served}", param="model"
            )
        if self.engine is None or self.tokenizer is None:
            if self.load_error is not None:
                raise APIError(ErrorKind.UNAVAILABLE, f"The model failed to load: {self.load_error}")
            raise APIError(
                ErrorKind.UNAVAILABLE, "The model is still loading; retry shortly.", retry_after_s=5.0
            )
        if not self.engine.ready:
            raise APIError(ErrorKind.UNAVAILABLE, "The engine is not running.", retry_after_s=5.0)
        return self.engine, self.tokenizer

    # -- probes and metadata -----------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        """Liveness: 503 once the model failed to load, the engine loop died or stopped, or the
        engine went `--engine-stall-timeout` seconds without a step while work waited; the
        orchestrator then restarts the process."""
        if self.load_error is not None:
            return JSONResponse(
                {"status": "error", "detail": f"model failed to load: {self.load_error}"}, 503
            )
        if self.embeddings.load_error is not None:
            return JSONResponse({"status": "error", "detail": self.embeddings.not_ready()}, 503)
        if self.engine is not None:
            problem = self.engine.health().problem(self.settings.engine_stall_timeout_s)
            if problem is not None:
                return JSONResponse({"status": "error", "detail": problem}, 503)
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        if self.drain.draining:
            return JSONResponse({"status": "unavailable", "detail": "draining"}, 503)
        if self.engine is None and self.serves_chat:
            status = "error" if self.load_error is not None else "loading"
            return JSONResponse({"status": status}, 503)
        if self.engine is not None:
            # A stalled engine is unready at once, so gateways route around it while the
            # orchestrator's liveness probe (/health) takes its time to restart the process.
            problem = self.engine.health().problem(self.settings.engine_stall_timeout_s)
            if problem is not None:
                return JSONResponse({"status": "unavailable", "detail": problem}, 503)
        embeddings_not_ready = self.embeddings.not_ready()
        if embeddings_not_ready is not None:
            status = "loading" if embeddings_not_ready == "loading" else "unavailable"
            return JSONResponse({"status": status, "detail": embeddings_not_ready}, 503)
        check = getattr(self.tenancy, "ready", None)
        if check is not None and not await check():
            return JSONResponse({"status": "unavailable", "detail": "the rate limiter is unreachable"}, 503)
        return JSONResponse({"status": "ready", "model": self.model_name or self.embeddings.name})

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "batchgate"}

    async def list_models(self, request: Request) -> Response:
        cards = []
        if self.serves_chat:
            self._require_engine()
            cards.append(self._model_card())
        if self.embeddings.service is not None:
            cards.append(self.embeddings.service.card(self.created))
        return JSONResponse({"object": "list", "data": cards})

    async def get_model(self, request: Request) -> Response:
        service = self.embeddings.service
        if service is not None and request.path_params["model"] == service.name:
            return JSONResponse(service.card(self.created))
        self._require_engine()
        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    async def openapi(self, request: Request) -> Response:
        vocab_size = self.tokenizer.vocab_size if self.tokenizer is not None else None
        return JSONResponse(build_openapi(self.model_name, vocab_size, embedding=self.embeddings.service))

    async def create_embeddings(self, request: Request) -> Response:
        return await self.embeddings.handle(request, self.model_name)

    def _check_model(self, model: str) -> None:
        if model == self.embeddings.name:
            raise invalid_request(
                f"`{model}` is an embedding model; send it to /v1/embeddings. "
                f"This server's chat model is `{self.model_name}`.",
                param="model",
            )
        if model != self.model_name:
            raise APIError(
                ErrorKind.MODEL_NOT_FOUND,
                f"The model `{model}` does not exist or you do not have access to it. "
                f"This server serves `{self.model_name}`.",
                param="model",
            )

    # -- generation --------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        engine, tokenizer = self._require_engine()
        req = protocol.parse_chat_request(await read_json(request, self.settings.max_body_bytes))
        # Authenticate before the model check: an unauthenticated caller learns nothing of the server.
        caller = await self._authenticate(request, req.user)
        self._check_model(req.model)
        plan = tools.plan_output(req)  # response_format and tools (gateway/tools.py)
        size = sum(len(m.text) for m in req.messages)
        prompt = await self._tokenize(lambda ms: tokenizer.encode_chat(ms, plan.tools), req.messages, size)
        params = protocol.sampling_params(
            req,
            num_prompt_tokens=len(prompt),
            max_model_len=engine.max_model_len,
            vocab_size=tokenizer.vocab_size,
        )
        if plan.grammar is not None:
            await tools.compile_checks(engine, plan)  # a schema it cannot compile: 400 before admission
            params = dataclasses.replace(params, grammar=plan.grammar)
        job = generation.Job(
            request_id=responses.new_id("chatcmpl"),
            created=responses.now(),
            model=req.model,
            num_choices=params.n,
            num_prompt_tokens=len(prompt),
            tokenizer=tokenizer,
            logprobs=params.logprobs,
            include_usage=req.include_usage,
            parse_tool_calls=plan.parse_tool_calls,
        )
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        span = _chat_span("chat", req, params, caller, messages=messages)
        return await self._generate(
            request, job, caller, [prompt], params, bool(req.stream), chat=True, span=span
        )

    async def completions(self, request: Request) -> Response:
        engine, tokenizer = self._require_engine()
        req = protocol.parse_completion_request(await read_json(request, self.settings.max_body_bytes))
        # Authenticate before the model check: an unauthenticated caller learns nothing of the server.
        caller = await self._authenticate(request, req.user)
        self._check_model(req.model)
        size = sum(len(p) for p in req.prompt)
        prompts = await self._tokenize(lambda ps: [tokenizer.encode_prompt(p) for p in ps], req.prompt, size)
        longest = max(prompts, key=len)
        params = protocol.sampling_params(
            req,
            num_prompt_tokens=len(longest),
            max_model_len=engine.max_model_len,
            vocab_size=tokenizer.vocab_size,
        )
        echo: list[str] = []
        if req.echo:
            texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in req.prompt]
            echo = [text for text in texts for _ in range(params.n)]
        job = generation.Job(
            request_id=responses.new_id("cmpl"),
            created=responses.now(),
            model=req.model,
            num_choices=params.n * len(prompts),
            num_prompt_tokens=sum(len(p) for p in prompts),
            tokenizer=tokenizer,
            logprobs=params.logprobs,
            include_usage=req.include_usage,
            echo_prefixes=echo,
        )
        span = _chat_span("text_completion", req, params, caller, messages=list(req.prompt))
        return await self._generate(
            request, job, caller, prompts, params, bool(req.stream), chat=False, span=span
        )

    async def _authenticate(self, request: Request, user: str | None) -> admission.Caller:
        internal = admission.internal_caller(self.settings.internal_token, request.headers, user)
        if internal is not None:  # a gateway already authenticated and admitted this request
            return internal
        return await admission.authenticate(self.tenancy, request.headers.get("authorization"), user)

    async def internal_stats(self, request: Request) -> Response:
        """engine.stats() as JSON, for gateways routing by outstanding work."""
        admission.check_internal(self.settings.internal_token, request.headers)
        if not self.serves_chat:  # an embedding-only replica: the pool routes by its own in-flight count
            return JSONResponse({"num_waiting_tokens": 0, "num_running_tokens": 0})
        engine, _ = self._require_engine()
        return JSONResponse(dataclasses.asdict(engine.stats()))

    async def _tokenize(self, fn: Callable[[Any], Any], arg: Any, size: int) -> Any:
        if size <= TOKENIZE_INLINE_MAX_CHARS:
            return fn(arg)
        return await anyio.to_thread.run_sync(fn, arg)

    async def _generate(
        self,
        request: Request,
        job: generation.Job,
        caller: admission.Caller,
        prompts: list[list[int]],
        params: SamplingParams,
        stream: bool,
        *,
        chat: bool,
        span: telemetry.ChatSpan | None = None,
    ) -> Response:
        if span is None:
            operation = "chat" if chat else "text_completion"
            span = _chat_span(operation, None, params, caller, model=job.model)
        try:
            held = await admission.admit(
                None if caller.internal else self.tenancy,
                caller,
                num_prompt_tokens=job.num_prompt_tokens,
                max_num_tokens=params.max_tokens * job.num_choices,
                request_id=job.request_id,
            )
        except APIError as exc:
            self.metrics.refused("rate_limit" if exc.kind is ErrorKind.RATE_LIMITED else "unavailable")
            span.event("gen_ai.admission", **{"batchgate.admitted": False})
            span.error(exc)
            span.end(response_id=job.request_id, input_tokens=job.num_prompt_tokens, output_tokens=0)
            raise
        span.event("gen_ai.admission", **{"batchgate.admitted": True})
        held = _Counted(held, self.metrics, caller.plan, job.num_prompt_tokens, span, job.request_id)
        job.on_usage = held.on_usage
        headers = {"X-Request-Id": job.request_id, **held.headers}
        outputs: generation.Outputs | None = None
        handed_over = False  # once the stream response owns outputs and admission, it closes them
        try:
            outputs = await self._submit(
                job.request_id, prompts, params, caller, param="messages" if chat else "prompt", span=span
            )
            if stream:
                # Watch the connection while the request waits for its first output: a client that
                # leaves now gives its queue place and lease back at once (the finally aborts).
                ready = await unless_disconnected(request, outputs.wait_ready(self.settings.keep_alive_s))
                if ready is None:
                    logger.info("%s: client disconnected before the first output; aborted", job.request_id)
                    return Response(status_code=499)
                error = outputs.first_error()
                if error is not None:
                    raise error
                events = (
                    generation.chat_events(outputs, job)
                    if chat
                    else generation.completion_events(outputs, job)
                )
                closing = outputs

                async def on_close() -> None:
                    await closing.aclose()
                    await held.close()

                response = EventStreamResponse(
                    events,
                    keep_alive_s=self.settings.keep_alive_s,
                    headers=headers,
                    on_close=on_close,
                    keep_alive_first=not ready,
                    stop=self.drain,
                    stop_frame=deadline_frame(),
                )
                handed_over = True
                return response
            choices = await _gather_unless_disconnected(request, outputs, job)
            if choices is None:
                logger.info("%s: client disconnected; aborted", job.request_id)
                return Response(status_code=499)
            body = generation.chat_body(job, choices) if chat else generation.completion_body(job, choices)
            return JSONResponse(body, headers=headers)
        except APIError as exc:
            span.error(exc)
            raise
        finally:
            if not handed_over:
                if outputs is not None:
                    await outputs.aclose()
                await held.close()

    async def _submit(
        self,
        request_id: str,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        caller: admission.Caller,
        *,
        param: str,
        span: telemetry.ChatSpan | None = None,
    ) -> generation.Outputs:
        assert self.engine is not None
        streams: list[tuple[int, Any]] = []
        try:
            for i, prompt in enumerate(prompts):
                engine_request = GenerationRequest(
                    request_id=request_id if len(prompts) == 1 else f"{request_id}-{i}",
                    prompt_token_ids=prompt,
                    sampling=params,
                    priority=caller.priority,
                    queue_deadline_s=caller.queue_deadline_s,
                    fairness_key=caller.name,
                    cache_salt=caller.cache_salt if self.settings.prefix_caching == "tenant" else "",
                )
                timed = TimedStream(self.engine.submit(engine_request), self.metrics, span)
                streams.append((i * params.n, timed))
        except (EngineError, ValueError) as exc:
            for _, submitted in streams:
                await submitted.aclose()
            if isinstance(exc, EngineError):
                if exc.code == "engine_unavailable":
                    self.metrics.refused("unavailable")
                raise from_engine_error(exc, param=param) from None
            # The engine's own validation (e.g. a token id outside the model's vocabulary).
            raise invalid_request(str(exc), param=param) from None
        return generation.Outputs(streams)


class _Counted:
    """An admission hold that also counts the request's tokens (by plan) when it is settled."""

    def __init__(
        self,
        held: admission.Admission,
        metrics: Metrics,
        plan: str,
        num_prompt_tokens: int,
        span: telemetry.ChatSpan,
        request_id: str,
    ) -> None:
        self._held = held
        self._span = span
        self._request_id = request_id
        self._metrics = metrics
        self._plan = plan
        self._num_prompt_tokens = num_prompt_tokens
        self._num_completion_tokens = 0
        self._closed = False
        self.headers = held.headers

    def on_usage(self, num_completion_tokens: int) -> None:
        self._num_completion_tokens = num_completion_tokens
        self._held.record(
            num_prompt_tokens=self._num_prompt_tokens, num_completion_tokens=num_completion_tokens
        )

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._metrics.count_tokens(self._plan, self._num_prompt_tokens, self._num_completion_tokens)
            self._span.end(
                response_id=self._request_id,
                input_tokens=self._num_prompt_tokens,
                output_tokens=self._num_completion_tokens,
            )
        await self._held.close()


def _chat_span(
    operation: str,
    req: Any,
    params: SamplingParams,
    caller: admission.Caller,
    *,
    messages: Sequence[Any] | None = None,
    model: str | None = None,
) -> telemetry.ChatSpan:
    return telemetry.ChatSpan(
        operation,
        model or req.model,
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        tenant=caller.name,
        priority=caller.priority.name.lower(),
        messages=messages,
    )


async def _gather_unless_disconnected(
    request: Request, outputs: generation.Outputs, job: generation.Job
) -> list[responses.Choice] | None:
    """Gather every choice, or None if the client disconnected first (the engine then aborts)."""
    return await unless_disconnected(request, generation.gather(outputs, job))


def freeze_startup_heap() -> None:
    """Take what start-up allocated (modules, tokenizer, model wrappers) out of the cyclic GC's
    full collections, as vLLM's server does: those then scan only what came since. A full
    collection over a big heap stops the event loop (and every stream) for 0.2-0.3 s: measured in
    the test process, whose heap is large."""
    gc.collect()
    gc.freeze()


def create_app(
    settings: Settings,
    engine: Any | None = None,
    tenancy: Any | None = None,
    *,
    engine_factory: EngineFactory = _default_engine_factory,
    owns_tenancy: bool = False,
    embedder: embeddings.EmbeddingService | None = None,
) -> Starlette:
    """Build the app.

    `engine`: a started AsyncEngine (the caller owns it and shuts it down), or None to have the app
    build one with `engine_factory(settings)` in a worker thread at start-up (the app owns it; /ready
    is 503 until it is loaded; /health answers at once). `tenancy`: a `tenancy.Tenancy`, or None for
    open mode (no API keys, no limits); closed on shutdown only if `owns_tenancy`. `embedder`: a
    started embedding service (the caller owns it), or None to load `settings.embedding_model` at
    start-up beside the engine (none: no /v1/embeddings model).
    """
    if settings.upstreams and engine is None:
        from gateway.pool import create_proxy_app

        return create_proxy_app(settings, tenancy, owns_tenancy=owns_tenancy)
    gateway = Gateway(settings, engine, tenancy, engine_factory, owns_tenancy, embedder)
    return build_starlette(gateway, Route("/v1/internal/stats", gateway.internal_stats, methods=["GET"]))


def build_starlette(gateway: Any, internal: Route) -> Starlette:
    """The public routes every role serves, plus its one internal route, with errors and metrics.

    Shared by the in-process gateway and the proxy (gateway/pool.py): both expose the same API.
    """
    routes = [
        Route("/v1/chat/completions", gateway.chat_completions, methods=["POST"]),
        Route("/v1/completions", gateway.completions, methods=["POST"]),
        Route("/v1/embeddings", gateway.create_embeddings, methods=["POST"]),
        Route("/v1/models", gateway.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", gateway.get_model, methods=["GET"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/ready", gateway.ready, methods=["GET"]),
        Route("/openapi.json", gateway.openapi, methods=["GET"]),
        Route("/metrics", gateway.metrics.endpoint, methods=["GET"]),
        internal,
    ]
    app = Starlette(
        routes=routes,
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=gateway.lifespan,
        middleware=[
            *telemetry.asgi_middleware(),
            Middleware(MetricsMiddleware, metrics=gateway.metrics),
            Middleware(DrainMiddleware, drain=gateway.drain),
        ],
    )
    app.state.gateway = gateway
    return app
