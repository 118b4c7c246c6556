"""The serving state, for the operator (the admin key): this process's engines and the pool's replicas.

    GET /admin/engines    each in-process chat model: ready or why not, and its engine's counts now
                          (requests running and waiting per priority class, KV-cache blocks, the
                          last step's batch, output tokens/s, preemptions, adapters resident)
    GET /admin/replicas   each `--upstream` replica as this gateway sees it: healthy or not, its
                          models and adapters, the tokens it reports, what this gateway has open
                          there, its last error (the same as /v1/internal/upstreams, which takes
                          the internal token); none without a pool

Neither needs Redis: they read this process's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import admission
from gateway.local.engine_backend import EngineBackend
from gateway.metrics import PRIORITIES
from gateway.pool.relay import ReplicaBackend


class StateRoutes:
    """The state routes over the app's in-process chat backends and its pool (None: no pool)."""

    def __init__(
        self, admin_key_hash: str | None, engines: Sequence[EngineBackend], replicas: ReplicaBackend | None
    ) -> None:
        self.admin_key_hash = admin_key_hash
        self.engines = engines
        self.replicas = replicas

    def routes(self) -> list[Route]:
        return [
            Route("/admin/engines", self.list_engines, methods=["GET"]),
            Route("/admin/replicas", self.list_replicas, methods=["GET"]),
        ]

    async def list_engines(self, request: Request) -> Response:
        admission.check_admin(self.admin_key_hash, request.headers)
        data = [await _engine_body(backend) for backend in self.engines]
        return JSONResponse({"object": "list", "data": data})

    async def list_replicas(self, request: Request) -> Response:
        admission.check_admin(self.admin_key_hash, request.headers)
        data = [] if self.replicas is None else self.replicas.replicas.snapshot()
        return JSONResponse({"object": "list", "data": data})


async def _engine_body(backend: EngineBackend) -> dict[str, Any]:
    not_ready = await backend.not_ready()
    body: dict[str, Any] = {
        "object": "engine",
        "model": backend.name,
        "status": "ready" if not_ready is None else not_ready.status,
        "detail": None if not_ready is None else not_ready.detail,
        "stats": None,
    }
    engine = backend.engine
    if engine is None:
        return body
    stats = engine.stats()
    body["stats"] = {
        "running": {p: stats.running_by_priority.get(p, 0) for p in PRIORITIES},
        "waiting": {p: stats.waiting_by_priority.get(p, 0) for p in PRIORITIES},
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "num_total_blocks": stats.num_total_blocks,
        "num_free_blocks": stats.num_free_blocks,
        "kv_cache_usage": (stats.num_total_blocks - stats.num_free_blocks) / (stats.num_total_blocks or 1),
        "last_batch_size": stats.last_batch_size,
        "output_tokens_per_s": stats.output_tokens_per_s,
        "num_preemptions": stats.num_preemptions,
        "total_steps": stats.total_steps,
        "loras_resident": list(stats.loras_resident),
    }
    return body
