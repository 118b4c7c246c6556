"""The routes other processes call on this server: a gateway in front of it (its internal token),
and the operator for the stats (the admin key).

    GET  /v1/internal/stats                the engine's load, what each model does, adapters held
    GET  /v1/internal/upstreams            this gateway's replicas, as it sees them
    GET  /v1/internal/usage/{request_id}   the usage kept for a gateway's request (gateway/reports.py)
    POST /v1/internal/count                the exact prompt tokens of a chat or completions body

With tenants configured and no `--internal-token` they are closed to everyone (gateway/admission.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import admission, endpoints, loras
from gateway.errors import APIError, ErrorKind
from gateway.local.engine_backend import EngineBackend
from gateway.pipeline import Pipeline
from gateway.pool.relay import ReplicaBackend
from gateway.registry import ModelRegistry
from gateway.settings import Settings

if TYPE_CHECKING:
    from tenancy.service import Tenancy


class InternalRoutes:
    """The internal routes over the app's registry, in-process chat backends, pipeline and pool
    (None: no pool)."""

    def __init__(
        self,
        settings: Settings,
        tenancy: Tenancy | None,
        registry: ModelRegistry,
        engines: Sequence[EngineBackend],
        pipeline: Pipeline,
        replicas: ReplicaBackend | None,
    ) -> None:
        self.settings = settings
        self.tenancy = tenancy
        self.registry = registry
        self.engines = engines
        self.pipeline = pipeline
        self.replicas = replicas

    def routes(self) -> list[Route]:
        return [
            Route("/v1/internal/stats", self.stats, methods=["GET"]),
            Route("/v1/internal/upstreams", self.upstreams, methods=["GET"]),
            Route("/v1/internal/usage/{request_id}", self.usage, methods=["GET"]),
            Route("/v1/internal/count", self.count, methods=["POST"]),
        ]

    def _check(self, request: Request) -> None:
        """The internal token; with tenants and no token, closed to all."""
        closed = admission.has_tenants(self.tenancy)
        admission.check_internal(self.settings.internal_token, request.headers, closed=closed)

    def _trusted(self, request: Request) -> bool:
        """Whether the caller may read tenants' names: a gateway in front (its internal token) or
        the admin key."""
        if admission.internal_caller(self.settings.internal_token, request.headers, None) is not None:
            return True
        try:
            admission.check_admin(self.settings.admin_key_hash, request.headers)
        except APIError:
            return False
        return True

    async def stats(self, request: Request) -> Response:
        """engine.stats() as JSON, for gateways routing by outstanding work, with what each
        served model does (`tasks`), so a gateway refuses a model sent to the wrong endpoint
        before admission, as this server would, and the LoRA adapters held (`loras`, by name:
        owner, model, resident, version, content hash) for a gateway's adapter routing. Tenants'
        names (the adapters they own) only to a gateway in front (its token) or the admin (its
        key): with tenants nobody else gets an answer, and without (a replica without
        --internal-token) anyone else sees the public adapters only."""
        trusted = self._trusted(request)
        if not trusted:
            self._check(request)
        everything = admission.Caller(name="", internal=True)
        cards = self.registry.cards(everything)
        tasks = {c.id: c.task.value for c in cards if c.task is not None and (trusted or c.owner is None)}
        if not self.engines:  # an embedding-only replica: the pool routes by its own in-flight count
            return JSONResponse({"num_waiting_tokens": 0, "num_running_tokens": 0, "tasks": tasks})
        report = loras.held_report(self.engines)
        if not trusted:
            report = {name: held for name, held in report.items() if held["owner"] is None}
        held = {"loras": report, "chat_model": self.engines[0].name}
        return JSONResponse({**self.engines[0].stats(), "tasks": tasks, **held})

    async def usage(self, request: Request) -> Response:
        """The usage this replica kept for a gateway's request (gateway/reports.py); 404 when none
        came within the wait."""
        self._check(request)
        report = await self.pipeline.reports.take(request.path_params["request_id"])
        if report is None:
            raise APIError(ErrorKind.NOT_FOUND, "No usage report for this request id.")
        return JSONResponse(report.body())

    async def count(self, request: Request) -> Response:
        """`{"prompt_tokens": n}`: the exact prompt of the chat or completions request in the body
        (the endpoint's path in `x-batchgate-path`), for a gateway's budget hold (gateway/pool/relay.py);
        the pipeline checks the internal token."""
        path = request.headers.get(admission.PATH_HEADER, "")
        endpoint = next((e for e in endpoints.ENDPOINTS if e.countable and e.path == path), None)
        if endpoint is None:
            raise APIError(ErrorKind.NOT_FOUND, f"No countable endpoint {path[:100]!r}.")
        return JSONResponse({"prompt_tokens": await self.pipeline.count(endpoint, request)})

    async def upstreams(self, request: Request) -> Response:
        self._check(request)
        if self.replicas is None:
            return JSONResponse([])
        return JSONResponse(self.replicas.replicas.snapshot())
