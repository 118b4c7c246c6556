"""LoRA adapters across a pool of replicas (gateway-only mode): who owns each, which replica holds
it, and loading it where a request goes when none there does.

The gateway holds the ownership: the adapters its models file's `[[loras]]` and `--lora` declare
without an in-process chat model to attach to (their `path` is read by the replicas: a folder
they share), and those its admin API loads into the pool (recorded in `--storage-dir`, as in local
mode); an adapter only a replica declares has the owner that replica reports. `/v1/models`
through the gateway lists an owned adapter to its owner alone, and anyone else gets the 404 of
a name nobody serves (gateway/registry.py), exactly as a replica does in local mode.

Each replica reports its adapters in /v1/internal/stats (gateway/pool/replicas.py's `HeldAdapter`:
owner, base model, version, resident in an engine slot or only loaded). A request for an adapter
goes, among the replicas within `--route-affinity-tokens` of the least loaded, to one that has it
resident, else one that holds it, else one that serves its base model, where it is loaded first
(gateway/pool/routing.py): the replica's `PUT /admin/loras/{name}` with the internal token (requests
arriving meanwhile share that load; a gateway's loads are not recorded on the replica, which
would otherwise restore a version the gateway has since replaced). A replica that refuses the
load is left out and the next one tried; when none can load it the request gets a 503
`adapter_load_failed` naming why.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

import httpx

from gateway.errors import APIError, ErrorKind
from gateway.loras import AdapterRecord
from gateway.pool.replicas import HeldAdapter, ReplicaSet, Upstream
from gateway.pool.routing import AdapterRoute
from gateway.settings import LoraSpec

logger = logging.getLogger("batchgate.pool")

# A cold load from local disk takes well under a second; a replica busy with a step answers later.
LOAD_TIMEOUT_S = 60.0
# A replica's answer to an admin call -> the kind the gateway's own answer has.
_ADMIN_STATUS_KINDS = {
    400: ErrorKind.INVALID_REQUEST,
    404: ErrorKind.NOT_FOUND,
    409: ErrorKind.CONFLICT,
}


class AdapterLoadError(Exception):
    """A replica answered a load with an error (`status`, its `message`)."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"{url} answered {status}: {message}")
        self.url, self.status, self.message = url, status, message

    def for_request(self, name: str) -> APIError:
        """The error a request for the adapter gets when no replica could load it."""
        retry = {} if self.status >= 500 else {"x-should-retry": "false"}  # the files are bad
        return APIError(
            ErrorKind.UNAVAILABLE,
            f"The LoRA adapter `{name}` could not be loaded on a replica: {self.message}",
            code="adapter_load_failed",
            headers=retry,
            retry_after_s=None if retry else 5.0,
        )

    def for_admin(self) -> APIError:
        kind = _ADMIN_STATUS_KINDS.get(self.status, ErrorKind.UNAVAILABLE)
        return APIError(kind, f"Replica {self.url}: {self.message}")


class PoolAdapters:
    """The adapters of a pool: declared here or reported by the replicas, and their loads."""

    def __init__(self, replicas: ReplicaSet, specs: Sequence[LoraSpec] = ()) -> None:
        self.replicas = replicas
        self.declared: dict[str, LoraSpec] = {s.name: s for s in specs}
        # Unloaded through this gateway: a replica that still reports one (it was down during the
        # unload) is not listed or routed to for it.
        self.unloaded: set[str] = set()
        self.created = int(time.time())
        self._loads: dict[tuple[str, str], asyncio.Future[dict[str, Any]]] = {}

    # -- ownership and holders -----------------------------------------------------------------

    def holders(self, name: str) -> list[tuple[Upstream, HeldAdapter]]:
        return [(u, u.loras[name]) for u in self.replicas.healthy() if name in u.loras]

    def is_adapter(self, name: str) -> bool:
        """Whether `name` is an adapter this gateway knows of (served, or unloaded here)."""
        return (
            name in self.declared
            or name in self.unloaded
            or any(name in u.loras for u in self.replicas.upstreams)
        )

    def hidden(self, name: str) -> bool:
        return name in self.unloaded and name not in self.declared

    def serves(self, name: str) -> bool:
        """Whether `name` is an adapter of the pool now (for the admin API)."""
        return self.is_adapter(name) and not self.hidden(name)

    def owner(self, name: str) -> str | None:
        """The tenant owning adapter `name` (None: public, or not an adapter): the declaration
        here, else what the replicas report (an owner any of them names wins over public)."""
        spec = self.declared.get(name)
        if spec is not None:
            return spec.tenant
        return next((held.owner for _, held in self.holders(name) if held.owner is not None), None)

    def loadable(self) -> list[str]:
        """Declared adapters no healthy replica holds but one could load (listed all the same)."""
        healthy = self.replicas.healthy()
        return [
            name
            for name, spec in sorted(self.declared.items())
            if not any(name in u.loras for u in healthy) and any(self._can_load(u, spec) for u in healthy)
        ]

    def _can_load(self, up: Upstream, spec: LoraSpec) -> bool:
        return spec.model in up.models if spec.model is not None else up.chat_model is not None

    def route(self, name: str) -> AdapterRoute[Upstream] | None:
        """How a request for adapter `name` is routed (None: `name` is no adapter)."""
        if not self.serves(name):
            return None
        spec = self.declared.get(name)

        def takes(up: Upstream) -> bool:
            return name in up.loras or (spec is not None and self._can_load(up, spec))

        def warmth(up: Upstream) -> int:
            held = up.loras.get(name)
            return 0 if held is None else 2 if held.resident else 1

        return AdapterRoute(takes, warmth)

    # -- loading on demand ---------------------------------------------------------------------

    async def ensure(self, up: Upstream, name: str) -> None:
        """Load declared adapter `name` on `up` unless it holds it; requests arriving meanwhile
        share the load. AdapterLoadError: the replica refused it; httpx.HTTPError: unreachable."""
        if name in up.loras:
            return
        key = (up.url, name)
        load = self._loads.get(key)
        if load is None:
            load = asyncio.ensure_future(self._put(up, self.declared[name]))
            self._loads[key] = load
            load.add_done_callback(lambda done: self._forget(key, done))
            logger.info("loading LoRA %s on %s for a request", name, up.url)
        await asyncio.shield(load)  # a request that leaves does not cut the load short

    def _forget(self, key: tuple[str, str], done: asyncio.Future[dict[str, Any]]) -> None:
        self._loads.pop(key, None)
        if not done.cancelled() and done.exception() is not None:  # retrieved: logged by its waiters
            logger.warning("loading LoRA %s on %s failed: %s", key[1], key[0], done.exception())

    async def _put(self, up: Upstream, spec: LoraSpec) -> dict[str, Any]:
        """The replica's `PUT /admin/loras/{name}`; `up` holds the adapter after it."""
        response = await self.replicas.client.put(
            f"{up.url}/admin/loras/{quote(spec.name, safe='')}",
            json={"path": spec.path, "tenant": spec.tenant, "model": spec.model},
            headers=self.replicas.internal_headers(),
            timeout=LOAD_TIMEOUT_S,
        )
        if response.status_code != 200:
            raise AdapterLoadError(up.url, response.status_code, _message(response))
        body: dict[str, Any] = response.json()
        up.loras[spec.name] = HeldAdapter(
            spec.tenant,
            body.get("model"),
            False,
            int(body.get("version", 0)),
            str(body.get("content_hash", "")),
        )
        if spec.name not in up.models:
            up.models = (*up.models, spec.name)
        return body

    # -- the admin API in pool mode (gateway/loras.py's LoraRoutes) ----------------------------

    def declare(self, record: AdapterRecord) -> None:
        """An adapter the admin API loaded before a restart: loaded again on demand."""
        self.declared[record.name] = LoraSpec(record.name, record.path, record.tenant, record.model)
        self.unloaded.discard(record.name)

    async def load(self, name: str, path: str, tenant: str | None, model: str | None) -> dict[str, Any]:
        """Load or replace `name`: on every healthy replica holding it (a replace: each serves
        new requests the new version), else on the least loaded that can take it, which checks
        the files; then declared here, for on-demand loads elsewhere. The first replica's body."""
        spec = LoraSpec(name, path, tenant, model)
        targets = [u for u, _ in self.holders(name)]
        if not targets:
            able = [u for u in self.replicas.healthy() if self._can_load(u, spec)]
            if not able:
                base = f"`{model}`" if model is not None else "a chat model"
                raise APIError(
                    ErrorKind.UNAVAILABLE, f"No healthy replica serves {base} to attach {name!r} to."
                )
            targets = [min(able, key=lambda u: u.load)]
        bodies = []
        for up in targets:
            try:
                bodies.append(await self._put(up, spec))
            except AdapterLoadError as exc:
                raise exc.for_admin() from None
            except httpx.HTTPError as exc:
                self.replicas.mark_down(up, f"{type(exc).__name__}: {exc}")
        if not bodies:
            raise APIError(ErrorKind.UNAVAILABLE, "No replica could be reached to load the adapter.")
        self.declare(AdapterRecord(name, path, tenant, model))
        return {**bodies[0], "owner": tenant, "replicas": [u.url for u in targets if name in u.loras]}

    async def unload(self, name: str, wait: bool, timeout_s: float) -> bool:
        """Take `name` from the pool: no longer declared here, and unloaded on every replica
        holding it; whether each released its memory within `timeout_s`. `wait=False` and a
        replica where requests still use it: a 409 (the declaration stays; where it was already
        unloaded it is loaded again on demand)."""
        spec = self.declared.pop(name, None)
        self.unloaded.add(name)
        holders = [u for u, _ in self.holders(name)]
        results = await asyncio.gather(*(self._delete(u, name, wait, timeout_s) for u in holders))
        busy = [u.url for u, released in zip(holders, results, strict=True) if released is None]
        if busy:
            if spec is not None:
                self.declared[name] = spec
            self.unloaded.discard(name)
            raise APIError(
                ErrorKind.CONFLICT,
                f"The adapter {name!r} is in use on {', '.join(busy)}; retry later, or unload with "
                "wait to let those requests finish first.",
            )
        return all(results)

    async def _delete(self, up: Upstream, name: str, wait: bool, timeout_s: float) -> bool | None:
        """Unload on one replica: whether released in time (None: in use, with `wait=False`)."""
        response = await self.replicas.client.delete(
            f"{up.url}/admin/loras/{quote(name, safe='')}",
            params={"wait": str(wait).lower(), "timeout_s": str(timeout_s)},
            headers=self.replicas.internal_headers(),
            timeout=timeout_s + LOAD_TIMEOUT_S,
        )
        if response.status_code == 409:
            return None
        up.loras.pop(name, None)
        up.models = tuple(m for m in up.models if m != name)
        if response.status_code == 404:
            return True  # gone already
        if response.status_code != 200:
            raise AdapterLoadError(up.url, response.status_code, _message(response)).for_admin()
        return bool(response.json().get("released"))

    def listing(self) -> list[dict[str, Any]]:
        """Every adapter of the pool, for `GET /admin/loras`: where declared, and who holds it."""
        names = set(self.declared) | {n for u in self.replicas.healthy() for n in u.loras}
        out = []
        for name in sorted(n for n in names if not self.hidden(n)):
            spec = self.declared.get(name)
            held = self.holders(name)
            out.append(
                {
                    "object": "lora",
                    "id": name,
                    "model": spec.model if spec is not None else held[0][1].model,
                    "owner": self.owner(name),
                    "path": spec.path if spec is not None else None,
                    "replicas": [
                        {
                            "url": u.url,
                            "resident": h.resident,
                            "version": h.version,
                            "content_hash": h.content_hash,
                        }
                        for u, h in held
                    ],
                }
            )
        return out


def _message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:300] or f"status {response.status_code}"
