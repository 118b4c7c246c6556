"""The Starlette app: OpenAI's endpoints, and Anthropic's Messages API, over the model registry's
backends.

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
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute

from gateway import admission, endpoints, loras, telemetry
from gateway.admin import api as admin
from gateway.admin import usage_routes as usage
from gateway.admin.batches import AdminBatches
from gateway.admin.internal import InternalRoutes
from gateway.admin.state import StateRoutes
from gateway.admin.webhooks import BudgetAlerts, BudgetWebhook
from gateway.anthropic import models as anthropic_models
from gateway.anthropic.errors import ANTHROPIC
from gateway.backend import Backend, Endpoint, Task, new_id
from gateway.batches.api import build_batches, num_lines
from gateway.bounds import bounds_of, take_request
from gateway.console.routes import Console
from gateway.drain import Drain, DrainMiddleware
from gateway.endpoints import LOCAL_ROUTES
from gateway.errors import OPENAI, APIError, Dialects, exception_handlers, model_not_found
from gateway.local.embedding_backend import EmbeddingBackend, EmbeddingService
from gateway.local.engine_backend import (
    EngineBackend,
    EngineFactory,
    default_engine_factory,
    freeze_startup_heap,
)
from gateway.metrics import Metrics, MetricsMiddleware
from gateway.openai import bodies
from gateway.openapi.document import build_openapi
from gateway.pipeline import Pipeline
from gateway.pool.relay import ReplicaBackend
from gateway.registry import ModelRegistry
from gateway.responses.background import BackgroundRuns
from gateway.responses.compaction import Compactor, Sealer, load_key
from gateway.responses.conversations import Conversations
from gateway.responses.state import ResponsesState, build_store
from gateway.responses.websocket import ResponsesSockets
from gateway.settings import Settings
from gateway.turns import SocketTurns, summarize

if TYPE_CHECKING:
    from engine.client import EngineClient
    from tenancy.service import Tenancy


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
        on_load_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.on_load_failure = on_load_failure
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
        self.registry = ModelRegistry(self.backends, settings.model_aliases())
        # Each protocol's errors in its own words (gateway/errors.py): by the endpoint's dialect.
        self.dialects = Dialects.of_routes(
            {e.path: e.dialect for e in endpoints.ENDPOINTS if e.dialect is not OPENAI}
        )
        self.drain = Drain()
        self.bounds = functools.partial(bounds_of, settings)  # a caller's tenant's (gateway/bounds.py)
        store = build_store(settings, self.metrics, self._stored_bound)
        store_format = int(settings.responses_store_format)
        self.conversations = Conversations(store, settings.max_body_bytes, self.bounds, store_format)
        background = BackgroundRuns(store, settings.responses_background_lease_s, self.drain, store_format)
        compactor = Compactor(Sealer(load_key(settings.compaction_key, settings.storage_dir)))
        self.responses = ResponsesState(
            store,
            self.conversations,
            background,
            settings.keep_alive_s,
            compactor,
            settings.max_body_bytes,
            self.metrics.state_lookup.observe,
            self.metrics.compactions.inc,
            store_format,
        )
        self.pipeline = Pipeline(settings, self.registry, tenancy, self.metrics, self.drain, self.responses)
        compactor.summarize = functools.partial(summarize, self.pipeline)
        self.sockets = ResponsesSockets(
            SocketTurns(self.pipeline),
            self.drain,
            lambda caller: self.bounds(caller).websocket_max_open,
            settings.websocket_cache_size,
            settings.websocket_send_buffer_bytes,
            self.metrics,
            settings.max_body_bytes,
        )
        self.files, self.batches = build_batches(settings, self.pipeline, tenancy, self.metrics)
        records = loras.AdapterRecords.in_storage(settings.storage_dir)
        audit = None if tenancy is None or tenancy.admin is None else tenancy.admin.record
        pool = self.replicas.adapters if self.replicas is not None else None
        self.loras = loras.LoraRoutes(
            self.engines,
            settings.admin_key_hash,
            records,
            audit,
            settings.internal_token,
            pool,
            roots=settings.lora_roots,
            tenant_exists=self._tenant_exists if admission.has_tenants(tenancy) else None,
        )
        self.metrics.state.draining = lambda: self.drain.draining
        self.metrics.state.redis_up = lambda: None if self.tenancy is None else self.tenancy.redis_up
        self.webhook = None
        if settings.budget_webhook_url:
            self.webhook = BudgetWebhook(settings.budget_webhook_url, settings.budget_webhook_secret)
        if tenancy is not None:
            alerts = BudgetAlerts(tenancy, self.metrics, self.webhook)
            tenancy.on_soft_limit(alerts.crossed)
            self.metrics.state.read_budget_use = alerts.read_use

    def batch_tenants(self) -> list[str]:
        """Whose batches the admin lists: every configured tenant (open mode: the open caller, "")."""
        names = self.tenancy.tenant_names() if self.tenancy is not None else []
        return names or [""]

    def _tenant_exists(self, name: str) -> bool:
        return self.tenancy is not None and self.tenancy.config.tenant(name) is not None

    def _stored_bound(self, tenant_name: str) -> int:
        """A tenant's most stored responses and conversations (its plan's, else the setting)."""
        tenant = self.tenancy.config.tenant(tenant_name) if self.tenancy is not None else None
        own = tenant.plan.responses_max_stored if tenant is not None else None
        return own or self.settings.responses_max_stored

    async def limits_report(self, caller: admission.Caller) -> dict[str, dict[str, int | None]]:
        """The caller's tenant's bounds (gateway/bounds.py) and its use of each now: /v1/usage's
        `limits`."""
        bounds = self.bounds(caller)
        num_files, num_bytes = await self.files.store.file_usage(caller.name)
        open_batches = [b.body for b in await self.batches.store.unfinished() if b.tenant == caller.name]
        used: dict[str, int | None] = {
            "responses_max_stored": await self.responses.store.num_stored(caller.name),
            "conversation_max_items": None,  # per conversation
            "conversation_max_bytes": None,
            "max_files": num_files,
            "storage_quota_bytes": num_bytes,
            "batch_max_open": len(open_batches),
            "batch_max_queued_lines": sum(num_lines(b) for b in open_batches),
            "batch_max_running_per_tenant": self.batches.runner.slots.running(caller.name),
            "websocket_max_open": self.sockets.open.num_open(caller.name),
        }
        return {name: {"limit": getattr(bounds, name), "used": used[name]} for name in used}

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
        loaded: list[EngineBackend | EmbeddingBackend] = [*self.engines, *self.embedders]
        failed = [b.problem() for b in loaded if b.load_error is not None]
        if failed and self.on_load_failure is not None:
            self.on_load_failure("; ".join(p for p in failed if p))  # `batchgate serve` exits
            return
        await self.loras.restore()
        await self.batches.resume()

    # -- the model endpoints -----------------------------------------------------------------

    def route(self, endpoint: Endpoint) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            return await self.pipeline.handle(endpoint, request)

        return handle

    def stored(
        self, handle: Callable[[admission.Caller, Request], Awaitable[Response]], charged: bool = False
    ) -> Callable[[Request], Awaitable[Response]]:
        """A route over the tenant's stored state: authenticated like the model endpoints; one that
        `charged` (it creates or grows state) costs a request of the tenant's request budget and
        holds a concurrency slot while it runs, as a chat request does (gateway/bounds.py)."""

        async def route(request: Request) -> Response:
            caller = await self.pipeline.authenticate(request.headers, None)
            if not charged:
                return await handle(caller, request)
            try:
                hold, headers = await take_request(self.tenancy, caller, new_id("req_"))
            except APIError as exc:
                if exc.refusal is not None:
                    self.metrics.refused(exc.refusal)
                raise
            try:
                response = await handle(caller, request)
            except APIError as exc:
                exc.headers = {**headers, **exc.headers}
                raise
            finally:
                await hold.release()
            response.headers.update(headers)
            return response

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
        dialect = self.dialects.of(request.url.path, request.headers)
        return await self.pipeline.authenticate(request.headers, None, dialect)

    def _anthropic(self, request: Request) -> bool:
        """An Anthropic SDK's request (its `anthropic-version`): answered in Anthropic's shape."""
        return self.dialects.of(request.url.path, request.headers) is ANTHROPIC

    async def list_models(self, request: Request) -> Response:
        """Every model the caller may use now; a 503 while none is, because they load or failed.
        An Anthropic client also gets the aliases that name one model id (not a pattern)."""
        caller = await self._caller(request)
        cards = self.registry.cards(caller)
        if not cards:
            await self._raise_unless_ready()
        if self._anthropic(request):
            served = {c.id: c.created for c in cards}
            infos = [anthropic_models.model_info(c.id, c.created) for c in cards]
            for alias in self.registry.aliases:
                exact = not any(ch in alias.name for ch in "*?[")
                if exact and alias.model in served and alias.name not in served:
                    infos.append(anthropic_models.model_info(alias.name, served[alias.model]))
            return JSONResponse(anthropic_models.model_list(infos))
        return JSONResponse(bodies.model_list([bodies.model_card(c.id, c.created) for c in cards]))

    async def _raise_unless_ready(self) -> None:
        for backend in self.backends:
            not_ready = await backend.not_ready()
            if not_ready is not None:
                raise not_ready.error()

    async def get_model(self, request: Request) -> Response:
        """One model's card (no task check: any served model; an alias, as the model it names)."""
        model = request.path_params["model"]
        caller = await self._caller(request)
        target = self.registry.alias_of(model, caller) or model
        if self.replicas is not None:
            await self.replicas.find(target)  # probes replicas marked down when none serves it
        for card in self.registry.cards(caller):
            if card.id == target:
                if self._anthropic(request):
                    return JSONResponse(anthropic_models.model_info(model, card.created))
                return JSONResponse(bodies.model_card(model, card.created))
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


# The stored-state routes that create or grow state: each costs a request of the tenant's budget.
CHARGED = {
    ("POST", "/v1/conversations"),
    ("POST", "/v1/conversations/{conversation_id}"),
    ("POST", "/v1/conversations/{conversation_id}/items"),
    ("POST", "/v1/files"),
    ("POST", "/v1/batches"),
}


def stored_routes(gateway: Gateway) -> list[Route]:
    """The routes over a tenant's stored state: responses and conversations (gateway/responses/),
    files and batches (gateway/batches/); each is authenticated like the model endpoints, and
    each that creates or grows state (`CHARGED`) costs a request of the tenant's budget
    (`Gateway.stored`)."""
    r, c, files, batches = gateway.responses, gateway.conversations, gateway.files, gateway.batches
    table: list[tuple[str, str, Callable[[admission.Caller, Request], Awaitable[Response]]]] = [
        ("POST", "/v1/responses/compact", r.compact),
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
    return [
        Route(path, gateway.stored(handle, (method, path) in CHARGED), methods=[method])
        for method, path, handle in table
    ]


def usage_routes(gateway: Gateway) -> list[Route]:
    """The usage ledger's routes (gateway/admin/usage_routes.py)."""
    routes = usage.UsageRoutes(gateway.tenancy, gateway.settings.admin_key_hash, gateway.limits_report)
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
    on_load_failure: Callable[[str], None] | None = None,
) -> Starlette:
    """Build the app.

    `engine`: a started EngineClient (the caller owns it and shuts it down), or None to have the app
    build one with `engine_factory(settings)` in a worker thread at start-up (the app owns it; /ready
    is 503 until it is loaded; /health answers at once). `tenancy`: a `tenancy.Tenancy`, or None for
    open mode (no API keys, no limits); closed on shutdown only if `owns_tenancy`. `embedder`: a
    started embedding service (the caller owns it), or None to load `settings.embedding_model` at
    start-up beside the engine (none: no embedding model). With `settings.upstreams` and no
    `engine`, the app is a gateway in front of those replicas (gateway/pool/relay.py).
    `on_load_failure`: called (on the event loop) with what failed and why once a model it loads
    failed to load (`batchgate serve` then exits: gateway/cli.py); without it the app stays up,
    /health and /ready answering 503 with the reason.
    """
    gateway = Gateway(
        settings,
        tenancy,
        owns_tenancy=owns_tenancy,
        engine=engine,
        engine_factory=engine_factory,
        embedder=embedder,
        on_load_failure=on_load_failure,
    )
    routes: list[BaseRoute] = [
        *(Route(e.path, gateway.route(e), methods=["POST"]) for e in endpoints.ENDPOINTS),
        # The Responses API's WebSocket mode (gateway/responses/websocket.py), beside its POST.
        WebSocketRoute(endpoints.RESPONSES.path, gateway.sockets.serve),
        *stored_routes(gateway),
        Route("/v1/models", gateway.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", gateway.get_model, methods=["GET"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/ready", gateway.ready, methods=["GET"]),
        Route("/openapi.json", gateway.openapi, methods=["GET"]),
        Route("/metrics", gateway.metrics.endpoint, methods=["GET"]),
        *InternalRoutes(
            settings, gateway.tenancy, gateway.registry, gateway.engines, gateway.pipeline, gateway.replicas
        ).routes(),
        *usage_routes(gateway),
        *admin.AdminRoutes(gateway.tenancy, settings.admin_key_hash).routes(),
        *AdminBatches(gateway.batches, settings.admin_key_hash, gateway.batch_tenants).routes(),
        *StateRoutes(settings.admin_key_hash, gateway.engines, gateway.replicas).routes(),
        *gateway.loras.routes(),
    ]
    # The admin console (gateway/console/): only with an admin key; else /ui is a 404 as any unknown path.
    console = None
    if settings.admin_key_hash:
        console = Console(
            settings.admin_key_hash,
            idle_s=settings.console_session_idle_s,
            max_s=settings.console_session_max_s,
        )
        routes += console.routes()
    app = Starlette(
        routes=routes,
        exception_handlers=exception_handlers(gateway.dialects),
        lifespan=gateway.lifespan,
        middleware=[
            *telemetry.asgi_middleware(),
            Middleware(MetricsMiddleware, metrics=gateway.metrics),
            Middleware(DrainMiddleware, drain=gateway.drain, dialects=gateway.dialects),
        ],
    )
    app.state.gateway = gateway
    app.state.console = console
    return app
