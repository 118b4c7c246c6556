"""The Starlette app: OpenAI's endpoints over the model registry's backends.

    create_app(settings) -> backends (in process: gateway/local/; replicas: gateway/pool/relay.py)
                         -> ModelRegistry (gateway/registry.py) -> Pipeline (gateway/pipeline.py)
                         -> routes: the model endpoints (gateway/endpoints.py), models, probes,
                            metrics, OpenAPI, the internal routes

Which backends: `--model` (default: the bundled chat model) and `--embedding-model` (default: the
bundled embedding model) in process, plus each model of `--models-file`; with `--upstream`, the
replicas' models, and no default local models (gateway-only mode) unless a models file names some.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import admission, endpoints, loras, telemetry
from gateway.admin import api as admin
from gateway.admin import usage_routes as usage
from gateway.admin.webhooks import BudgetWebhook
from gateway.backend import Backend, Endpoint, Task
from gateway.batches.api import build_batches
from gateway.drain import Drain, DrainMiddleware
from gateway.endpoints import LOCAL_ROUTES
from gateway.errors import EXCEPTION_HANDLERS, APIError, ErrorKind, model_not_found
from gateway.local.embedding_backend import EmbeddingBackend, EmbeddingService
from gateway.local.engine_backend import (
    EngineBackend,
    EngineFactory,
    default_engine_factory,
    freeze_startup_heap,
)
from gateway.metrics import BudgetUse, Metrics, MetricsMiddleware
from gateway.openai import bodies
from gateway.openapi.document import build_openapi
from gateway.pipeline import Pipeline
from gateway.pool.relay import ReplicaBackend
from gateway.registry import ModelRegistry
from gateway.responses.background import BackgroundRuns
from gateway.responses.conversations import Conversations
from gateway.responses.state import ResponsesState, build_store
from gateway.settings import Settings

if TYPE_CHECKING:
    from engine.client import EngineClient
    from tenancy.service import Tenancy

logger = logging.getLogger("batchgate.gateway")


class Gateway:
    """The app's state: its backends, registry, pipeline, metrics and drain. Build it through
    `create_app`."""

    def __init__(
        self,
        settings: Settings,
        tenancy: Tenancy | None,
        *,
        owns_tenancy: bool,
        engine: EngineClient | None = None,
        engine_factory: EngineFactory = default_engine_factory,
        embedder: EmbeddingService | None = None,
    ) -> None:
        self.settings = settings
        self.tenancy = tenancy
        self.owns_tenancy = owns_tenancy
        self.engines: list[EngineBackend] = []
        self.embedders: list[EmbeddingBackend] = []
        self.replicas: ReplicaBackend | None = None
        self.metrics = Metrics(lambda: self.engine)
        gateway_only = bool(settings.upstreams) and engine is None
        adapters = settings.served_loras()

        def adapters_of(model: str | None) -> list[Any]:
            return [a for a in adapters if a.model == model]

        if engine is not None or (not gateway_only and settings.model != "none"):
            main = EngineBackend(
                settings, self.metrics, engine, engine_factory, routes=LOCAL_ROUTES, loras=adapters_of(None)
            )
            self.engines.append(main)
        if embedder is not None or (not gateway_only and settings.embedding_model != "none"):
            self.embedders.append(EmbeddingBackend(settings, self.metrics, embedder))
        for spec in settings.served_models():
            own = settings.for_model(spec)
            if spec.task == "embed":
                self.embedders.append(EmbeddingBackend(own, self.metrics, name=spec.name))
            else:
                backend = EngineBackend(
                    own,
                    self.metrics,
                    engine_factory=engine_factory,
                    routes=LOCAL_ROUTES,
                    loras=adapters_of(spec.name),
                )
                self.engines.append(backend)
        chat_names = {None} | {s.name for s in settings.served_models() if s.task == "generate"}
        # Adapters of no in-process chat model are the pool's (gateway/pool/adapters.py).
        pooled = [a for a in adapters if a.model not in chat_names or (a.model is None and not self.engines)]
        if pooled and not settings.upstreams:
            names = ", ".join(sorted(a.name for a in pooled))
            raise ValueError(f"LoRA adapter(s) {names}: no in-process chat model to attach to")
        if settings.upstreams:
            self.replicas = ReplicaBackend(settings, self.metrics, tenancy, pooled)
            self.metrics.state.upstreams = self.replicas.replicas.counts
        self.backends: list[Backend] = [*self.engines, *self.embedders]
        if self.replicas is not None:
            self.backends.append(self.replicas)
        self.registry = ModelRegistry(self.backends)
        self.drain = Drain()
        store = build_store(settings, self.metrics)
        self.conversations = Conversations(store, settings.max_body_bytes)
        background = BackgroundRuns(store, settings.responses_background_lease_s, self.drain)
        self.responses = ResponsesState(
            store, self.conversations, background, settings.keep_alive_s, self.metrics.state_lookup.observe
        )
        self.pipeline = Pipeline(settings, self.registry, tenancy, self.metrics, self.drain, self.responses)
        self.files, self.batches = build_batches(settings, self.pipeline, tenancy, self.metrics)
        records = loras.AdapterRecords.in_storage(settings.storage_dir)
        audit = None if tenancy is None or tenancy.admin is None else tenancy.admin.record
        pool = self.replicas.adapters if self.replicas is not None else None
        self.loras = loras.LoraRoutes(
            self.engines, settings.admin_key_hash, records, audit, settings.internal_token, pool
        )
        self.metrics.state.draining = lambda: self.drain.draining
        self.metrics.state.redis_up = lambda: None if self.tenancy is None else self.tenancy.redis_up
        self.webhook = BudgetWebhook(settings.budget_webhook_url) if settings.budget_webhook_url else None
        if tenancy is not None:
            tenancy.on_soft_limit(self._soft_limit_crossed)
            self.metrics.state.read_budget_use = self._read_budget_use

    def _plan_label(self, tenant: Any) -> str:
        """A tenant's plan as a metrics label (bounded: paid, free, open)."""
        return "open" if tenant is None else ("free" if tenant.plan.priority == "free" else "paid")

    def _soft_limit_crossed(self, tenant_name: str, budget: Any) -> None:
        tenant = self.tenancy.config.tenant(tenant_name) if self.tenancy is not None else None
        plan = self._plan_label(tenant)
        self.metrics.soft_crossed(plan, budget.metric)
        logger.info("tenant %s crossed the soft threshold of its %s budget", tenant_name, budget.name)
        if self.webhook is not None:
            self.webhook.crossed(tenant_name, budget)

    async def _read_budget_use(self) -> dict[tuple[str, str], BudgetUse]:
        """Every tenant's budgets now, summed by plan and metric (the budget gauges)."""
        assert self.tenancy is not None
        out: dict[tuple[str, str], BudgetUse] = {}
        for tenant in list(self.tenancy.config.tenants.values()):
            if not self.tenancy.budgets_of(tenant):
                continue
            for state in await self.tenancy.budget_states(tenant):
                row = out.setdefault((self._plan_label(tenant), state.budget.metric), BudgetUse())
                row.used += state.used
                row.limit += state.budget.limit
                if state.budget.limit:
                    row.max_ratio = max(row.max_ratio, state.used / state.budget.limit)
        return out

    @property
    def engine(self) -> EngineClient | None:
        """The first in-process chat engine (metrics and /v1/internal/stats report it)."""
        return self.engines[0].engine if self.engines else None

    @property
    def load_error(self) -> str | None:
        return self.engines[0].load_error if self.engines else None

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        # Models load in the background: /health answers at once, /ready says 503 until loaded.
        loading = [asyncio.ensure_future(b.start()) for b in self.backends]
        if not self.engines:
            freeze_startup_heap()
        # Adapters loaded at run time come back, and batches (resumed or new) start, once the
        # models have loaded, not into 503s.
        resuming = asyncio.ensure_future(self._after_loading(loading))
        try:
            async with admission.watching(self.tenancy):
                yield
        finally:
            resuming.cancel()
            await self.batches.aclose()
            for task in loading:
                await task  # a load in progress cannot be interrupted; wait, then shut it down
            for backend in self.backends:
                await backend.aclose()
            await self.responses.aclose()
            await self.batches.store.aclose()
            self.loras.records.close()
            await self.files.blobs.aclose()
            if self.owns_tenancy and self.tenancy is not None:
                await self.tenancy.aclose()
            if self.pipeline.events is not None:
                self.pipeline.events.close()
            if self.webhook is not None:
                await self.webhook.aclose()

    async def _after_loading(self, loading: Sequence[asyncio.Future[None]]) -> None:
        await asyncio.gather(*loading, return_exceptions=True)
        await self.loras.restore()
        await self.batches.resume()

    # -- the model endpoints -----------------------------------------------------------------

    def route(self, endpoint: Endpoint) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            return await self.pipeline.handle(endpoint, request)

        return handle

    def stored(
        self, handle: Callable[[admission.Caller, Request], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        """A route over the tenant's stored responses: authenticated like the model endpoints."""

        async def route(request: Request) -> Response:
            caller = await self.pipeline.authenticate(request.headers, None)
            return await handle(caller, request)

        return route

    # -- probes and metadata -----------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        """Liveness: 503 once a model failed to load, an engine loop died or stopped, or an engine
        went `--engine-stall-timeout` seconds without a step while work waited; the orchestrator
        then restarts the process."""
        for backend in self.backends:
            problem = backend.problem()
            if problem is not None:
                return JSONResponse({"status": "error", "detail": problem}, 503)
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        if self.drain.draining:
            return JSONResponse({"status": "unavailable", "detail": "draining"}, 503)
        for backend in self.backends:
            not_ready = await backend.not_ready()
            if not_ready is not None:
                return JSONResponse({"status": not_ready.status, "detail": not_ready.detail}, 503)
        if self.engines and not self.loras.restored:
            return JSONResponse({"status": "loading", "detail": "restoring LoRA adapters"}, 503)
        if self.tenancy is not None and not await self.tenancy.ready():
            return JSONResponse({"status": "unavailable", "detail": "the rate limiter is unreachable"}, 503)
        names = [card.id for card in self.registry.cards()]
        body: dict[str, Any] = {"status": "ready", "model": names[0] if names else None, "models": names}
        if self.replicas is not None:
            body["upstreams"] = len(self.replicas.replicas.healthy())
        return JSONResponse(body)

    async def _caller(self, request: Request) -> admission.Caller:
        """Who lists the models: with tenants configured the key's tenant (a 401 without one, as
        OpenAI's /v1/models), so each tenant sees its own adapters; else the open caller."""
        return await self.pipeline.authenticate(request.headers, None)

    async def list_models(self, request: Request) -> Response:
        """Every model the caller may use now; a 503 while none is, because they load or failed."""
        cards = self.registry.cards(await self._caller(request))
        if not cards:
            await self._raise_unless_ready()
        return JSONResponse(bodies.model_list([bodies.model_card(c.id, c.created) for c in cards]))

    async def _raise_unless_ready(self) -> None:
        for backend in self.backends:
            not_ready = await backend.not_ready()
            if not_ready is not None:
                raise not_ready.error()

    async def get_model(self, request: Request) -> Response:
        """One model's card (no task check: any served model)."""
        model = request.path_params["model"]
        caller = await self._caller(request)
        if self.replicas is not None:
            await self.replicas.find(model)  # probes replicas marked down when none serves it
        for card in self.registry.cards(caller):
            if card.id == model:
                return JSONResponse(bodies.model_card(card.id, card.created))
        await self._raise_unless_ready()
        raise model_not_found(model)

    async def openapi(self, request: Request) -> Response:
        """The OpenAPI document: every served chat model's name, and the token bounds of the first
        in-process one (where there is one, every token id it takes is known)."""
        names = [c.id for c in self.registry.cards() if c.task in (Task.GENERATE, None)]
        chat = next((b for b in self.engines if b.tokenizer is not None), None)
        vocab_size = chat.tokenizer.vocab_size if chat is not None and chat.tokenizer else None
        if len(self.engines) > 1 or self.replicas is not None:
            vocab_size = None  # models with different vocabularies: leave token ids unbounded
        embedding = next((b.service for b in self.embedders if b.service is not None), None)
        return JSONResponse(build_openapi(names, vocab_size, embedding=embedding, generate=True))

    # -- internal routes (gateway <-> replica) ---------------------------------------------------

    async def internal_stats(self, request: Request) -> Response:
        """engine.stats() as JSON, for gateways routing by outstanding work, with what each
        served model does (`tasks`), so a gateway refuses a model sent to the wrong endpoint
        before admission, as this server would, and the LoRA adapters held (`loras`, by name:
        owner, model, resident, version, content hash) for a gateway's adapter routing."""
        admission.check_internal(self.settings.internal_token, request.headers)
        everything = admission.Caller(name="", internal=True)
        tasks = {c.id: c.task.value for c in self.registry.cards(everything) if c.task is not None}
        if not self.engines:  # an embedding-only replica: the pool routes by its own in-flight count
            return JSONResponse({"num_waiting_tokens": 0, "num_running_tokens": 0, "tasks": tasks})
        held = {"loras": loras.held_report(self.engines), "chat_model": self.engines[0].name}
        return JSONResponse({**self.engines[0].stats(), "tasks": tasks, **held})

    async def internal_usage(self, request: Request) -> Response:
        """The usage this replica kept for a gateway's request (gateway/reports.py); 404 when none
        came within the wait."""
        admission.check_internal(self.settings.internal_token, request.headers)
        report = await self.pipeline.reports.take(request.path_params["request_id"])
        if report is None:
            raise APIError(ErrorKind.NOT_FOUND, "No usage report for this request id.")
        return JSONResponse(report.body())

    async def internal_count(self, request: Request) -> Response:
        """`{"prompt_tokens": n}`: the exact prompt of the chat or completions request in the body
        (the endpoint's path in `x-batchgate-path`), for a gateway's budget hold (gateway/pool/relay.py)."""
        path = request.headers.get(admission.PATH_HEADER, "")
        endpoint = next((e for e in endpoints.ENDPOINTS if e.countable and e.path == path), None)
        if endpoint is None:
            raise APIError(ErrorKind.NOT_FOUND, f"No countable endpoint {path[:100]!r}.")
        return JSONResponse({"prompt_tokens": await self.pipeline.count(endpoint, request)})

    async def upstreams(self, request: Request) -> Response:
        admission.check_internal(self.settings.internal_token, request.headers)
        if self.replicas is None:
            return JSONResponse([])
        return JSONResponse(self.replicas.replicas.snapshot())


def stored_routes(gateway: Gateway) -> list[Route]:
    """The routes over a tenant's stored state: responses and conversations (gateway/responses/),
    files and batches (gateway/batches/); each is authenticated like the model endpoints
    (`Gateway.stored`)."""
    r, c, files, batches = gateway.responses, gateway.conversations, gateway.files, gateway.batches
    table: list[tuple[str, str, Callable[[admission.Caller, Request], Awaitable[Response]]]] = [
        ("GET", "/v1/responses/{response_id}", r.retrieve),
        ("DELETE", "/v1/responses/{response_id}", r.delete),
        ("POST", "/v1/responses/{response_id}/cancel", r.cancel),
        ("GET", "/v1/responses/{response_id}/input_items", r.input_items),
        ("POST", "/v1/conversations", c.create),
        ("GET", "/v1/conversations/{conversation_id}", c.retrieve),
        ("POST", "/v1/conversations/{conversation_id}", c.update),
        ("DELETE", "/v1/conversations/{conversation_id}", c.delete),
        ("GET", "/v1/conversations/{conversation_id}/items", c.list_items),
        ("POST", "/v1/conversations/{conversation_id}/items", c.add_items),
        ("GET", "/v1/conversations/{conversation_id}/items/{item_id}", c.get_item),
        ("DELETE", "/v1/conversations/{conversation_id}/items/{item_id}", c.delete_item),
        ("POST", "/v1/files", files.create),
        ("GET", "/v1/files", files.list_all),
        ("GET", "/v1/files/{file_id}", files.retrieve),
        ("DELETE", "/v1/files/{file_id}", files.delete),
        ("GET", "/v1/files/{file_id}/content", files.content),
        ("POST", "/v1/batches", batches.create),
        ("GET", "/v1/batches", batches.list_all),
        ("GET", "/v1/batches/{batch_id}", batches.retrieve),
        ("POST", "/v1/batches/{batch_id}/cancel", batches.cancel),
    ]
    return [Route(path, gateway.stored(handle), methods=[method]) for method, path, handle in table]


def usage_routes(gateway: Gateway) -> list[Route]:
    """The usage ledger's routes (gateway/admin/usage_routes.py)."""
    routes = usage.UsageRoutes(gateway.tenancy, gateway.settings.admin_key_hash)
    return [
        Route("/v1/usage", routes.own, methods=["GET"]),
        Route("/v1/organization/usage/completions", routes.organization, methods=["GET"]),
        Route("/admin/usage.csv", routes.csv_export, methods=["GET"]),
    ]


def create_app(
    settings: Settings,
    engine: EngineClient | None = None,
    tenancy: Tenancy | None = None,
    *,
    engine_factory: EngineFactory = default_engine_factory,
    owns_tenancy: bool = False,
    embedder: EmbeddingService | None = None,
) -> Starlette:
    """Build the app.

    `engine`: a started EngineClient (the caller owns it and shuts it down), or None to have the app
    build one with `engine_factory(settings)` in a worker thread at start-up (the app owns it; /ready
    is 503 until it is loaded; /health answers at once). `tenancy`: a `tenancy.Tenancy`, or None for
    open mode (no API keys, no limits); closed on shutdown only if `owns_tenancy`. `embedder`: a
    started embedding service (the caller owns it), or None to load `settings.embedding_model` at
    start-up beside the engine (none: no embedding model). With `settings.upstreams` and no
    `engine`, the app is a gateway in front of those replicas (gateway/pool/relay.py).
    """
    gateway = Gateway(
        settings,
        tenancy,
        owns_tenancy=owns_tenancy,
        engine=engine,
        engine_factory=engine_factory,
        embedder=embedder,
    )
    routes = [
        *(Route(e.path, gateway.route(e), methods=["POST"]) for e in endpoints.ENDPOINTS),
        *stored_routes(gateway),
        Route("/v1/models", gateway.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", gateway.get_model, methods=["GET"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/ready", gateway.ready, methods=["GET"]),
        Route("/openapi.json", gateway.openapi, methods=["GET"]),
        Route("/metrics", gateway.metrics.endpoint, methods=["GET"]),
        Route("/v1/internal/stats", gateway.internal_stats, methods=["GET"]),
        Route("/v1/internal/upstreams", gateway.upstreams, methods=["GET"]),
        Route("/v1/internal/usage/{request_id}", gateway.internal_usage, methods=["GET"]),
        Route("/v1/internal/count", gateway.internal_count, methods=["POST"]),
        *usage_routes(gateway),
        *admin.AdminRoutes(gateway.tenancy, settings.admin_key_hash).routes(),
        *gateway.loras.routes(),
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
