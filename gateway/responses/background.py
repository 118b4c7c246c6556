"""Background responses (`background: true`): they run on after the client has its answer, with
their state in the response store, so any gateway of a pool polls or cancels them.

    POST (background) -> stored `queued` with a lease (`lease_until`) -> 200 with that at once
      the run: `in_progress`, its lease renewed every third of --responses-background-lease while
      it runs; its answer (completed, incomplete or failed) replaces the record at the end
    POST /v1/responses/{id}/cancel, on any gateway -> a cancel mark in the store; the gateway that
      runs it cancels at once when it is this one, else at its next renewal; the pipeline's
      lifetime then closes (engine sequence, KV blocks, slot, tenant lease, budget hold released)
      and the record reads `cancelled`
    a read of a `queued`/`in_progress` record whose lease lapsed (its gateway died) is `failed`
      with the reason; a drain deadline or a shutdown fails the runs it cuts short the same way
    GET /v1/responses/{id}?stream=true, on any gateway -> the run's events, derived from the stored
      record (gateway/responses/output.py `stored_events`), followed until it ends (`changed`)

Cancelling a foreground response is a 400; cancelling a finished background one returns it as is
(both as OpenAI's API).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import orjson

from gateway.backend import Body, Reply
from gateway.drain import Drain
from gateway.errors import APIError, ErrorKind, invalid_request
from gateway.responses.conversations import guarded
from gateway.responses.store import ResponseStore, StoredResponse, save_response

logger = logging.getLogger("batchgate.gateway")

ACTIVE = ("queued", "in_progress")
# At most this long between a stream replay's reads of a run another gateway runs (a run on this
# gateway wakes its replays when it ends).
REPLAY_POLL_S = 1.0
LAPSED = "The gateway running this background response stopped before it finished; create it again."
DRAINED = "The gateway running this background response shut down before it finished; create it again."


def _cancel_key(response_id: str) -> str:
    return f"{response_id}:cancel"


def _with_status(record: StoredResponse, status: str, error: str | None = None) -> StoredResponse:
    response = {**record.response, "status": status}
    if error is not None:
        response["error"] = {"code": "server_error", "message": error}
    return replace(record, response=response, lease_until=None)


@dataclass(frozen=True)
class Job:
    """What a background run does: `execute` the request, `finish` (store) its answer, `close`
    (release everything, whatever the end; idempotent: a run that answers closes before it
    stores the answer, and again at its end)."""

    execute: Callable[[], Awaitable[Reply]]
    finish: Callable[[dict[str, Any]], Awaitable[None]]
    close: Callable[[], Awaitable[None]]


@dataclass
class _Run:
    task: asyncio.Task[None]
    outcome: str | None = None  # "cancelled" or a failure's reason, once decided


def _failure(reply: Reply) -> str:
    """The message of a backend's error body (a replica's 400, say), or a generic one."""
    if isinstance(reply, Body) and isinstance(reply.payload, bytes):
        with contextlib.suppress(ValueError, KeyError, TypeError):
            return str(orjson.loads(reply.payload)["error"]["message"])
    if isinstance(reply, Body) and isinstance(reply.payload, dict):
        with contextlib.suppress(KeyError, TypeError):
            return str(reply.payload["error"]["message"])
    return "The model backend failed."


async def _ended(task: asyncio.Task[None], stop: asyncio.Event) -> None:
    """Stop the renewal `task` between its store writes, and wait until it has: a Redis call
    cancelled mid-command can leave its connection waiting for a reply that never comes (a
    background run whose replica failed at once stayed `in_progress` so)."""
    stop.set()
    await asyncio.wait({task})


class BackgroundRuns:
    """This gateway's background runs over the shared store (see the module docstring)."""

    def __init__(self, store: ResponseStore, lease_s: float, drain: Drain, store_format: int = 1) -> None:
        if lease_s <= 0:
            raise ValueError(f"the background lease must be positive, got {lease_s}")
        self.store = store
        self.store_format = store_format  # the format records are written in (gateway/responses/store.py)
        self.lease_s = lease_s
        self.drain = drain
        self._runs: dict[tuple[str, str], _Run] = {}

    async def _put(self, tenant: str, record: StoredResponse) -> None:
        await guarded(save_response(self.store, tenant, record, self.store_format))

    def _leased(self, record: StoredResponse, status: str) -> StoredResponse:
        response = {**record.response, "status": status}
        return replace(record, response=response, lease_until=time.time() + self.lease_s)

    async def start(self, tenant: str, record: StoredResponse, job: Job) -> dict[str, Any]:
        """Store `record` queued, run `job` in the background and return the queued response."""
        queued = self._leased(record, "queued")
        try:
            await self._put(tenant, queued)
        except BaseException:
            await job.close()
            raise
        key = (tenant, record.response_id)
        run = _Run(asyncio.get_running_loop().create_task(self._run(tenant, queued, job)))
        self._runs[key] = run
        run.task.add_done_callback(lambda _: self._runs.pop(key, None))
        return queued.response

    async def _run(self, tenant: str, record: StoredResponse, job: Job) -> None:
        run = self._runs.get((tenant, record.response_id))
        self.drain.enter()
        stop = asyncio.Event()
        renewing = asyncio.get_running_loop().create_task(self._renew(tenant, record, stop))
        try:
            with self.drain.on_stop(lambda: self._stop(tenant, record.response_id, DRAINED)):
                reply = await job.execute()
            await _ended(renewing, stop)
            # Settled (sent) before the answer is stored: whoever reads it done on this gateway
            # and then its usage sees the settlement (docs/OPERATIONS.md).
            await asyncio.shield(job.close())
            if isinstance(reply, Body) and reply.status == 200:
                payload = reply.payload
                response = orjson.loads(payload) if isinstance(payload, bytes) else dict(payload)
                if await self._cancel_marked(tenant, record.response_id):
                    response = {**response, "status": "cancelled"}
                await job.finish({**response, "background": True})
            else:
                await self._put(tenant, _with_status(record, "failed", _failure(reply)))
        except asyncio.CancelledError:
            await _ended(renewing, stop)
            outcome = (run.outcome if run is not None else None) or DRAINED
            status, error = ("cancelled", None) if outcome == "cancelled" else ("failed", outcome)
            with contextlib.suppress(APIError):
                await self._put(tenant, _with_status(record, status, error))
        except Exception as exc:  # noqa: BLE001 - the client is gone: the record carries the error
            await _ended(renewing, stop)
            failure = exc if isinstance(exc, APIError) else APIError(ErrorKind.INTERNAL, "It failed.")
            logger.warning("%s: background response failed: %s", record.response_id, failure.message)
            with contextlib.suppress(APIError):
                await self._put(tenant, _with_status(record, "failed", failure.message))
        finally:
            renewing.cancel()
            await asyncio.shield(job.close())
            self.drain.exit()

    async def _renew(self, tenant: str, record: StoredResponse, stop: asyncio.Event) -> None:
        """Renew the lease until `stop`; a cancel mark from another gateway stops the run."""
        while not stop.is_set():
            if await self._cancel_marked(tenant, record.response_id):
                self._stop(tenant, record.response_id, "cancelled")
                return
            await self._put(tenant, self._leased(record, "in_progress"))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.lease_s / 3)

    async def _cancel_marked(self, tenant: str, response_id: str) -> bool:
        return await guarded(self.store.get(tenant, _cancel_key(response_id))) is not None

    def _stop(self, tenant: str, response_id: str, outcome: str) -> None:
        run = self._runs.get((tenant, response_id))
        if run is not None and run.outcome is None:
            run.outcome = outcome
            run.task.cancel()

    async def changed(self, tenant: str, response_id: str) -> None:
        """Wait until the run of `response_id` may have moved on: its end when this gateway runs
        it, else the poll interval (a third of the lease, at most REPLAY_POLL_S)."""
        run = self._runs.get((tenant, response_id))
        timeout = min(self.lease_s / 3, REPLAY_POLL_S)
        if run is not None:
            await asyncio.wait({run.task}, timeout=timeout)
        else:
            await asyncio.sleep(timeout)

    async def view(self, tenant: str, record: StoredResponse) -> StoredResponse:
        """The record as a reader sees it: a run cancelled is cancelled (before its gateway stored
        that), a run whose lease lapsed failed."""
        if record.response.get("status") not in ACTIVE:
            return record
        if await self._cancel_marked(tenant, record.response_id):
            return _with_status(record, "cancelled")
        if (record.lease_until or 0) < time.time():
            return _with_status(record, "failed", LAPSED)
        return record

    async def cancel(self, tenant: str, record: StoredResponse) -> dict[str, Any]:
        """POST /cancel of `record` (this tenant's): the cancelled response (see the docstring)."""
        if not record.response.get("background"):
            raise invalid_request(
                "Only responses created with 'background': true can be cancelled.", param="response_id"
            )
        record = await self.view(tenant, record)
        if record.response.get("status") not in ACTIVE:
            return record.response
        response_id = record.response_id
        await guarded(self.store.put(tenant, _cancel_key(response_id), b"1"))
        cancelled = _with_status(record, "cancelled")
        run = self._runs.get((tenant, response_id))
        if run is not None:
            self._stop(tenant, response_id, "cancelled")
            await asyncio.wait({run.task})  # released and stored before the answer
        else:
            await self._put(tenant, cancelled)
        return cancelled.response

    async def aclose(self) -> None:
        """Shutdown: the runs still going fail with the reason (and release everything)."""
        runs = list(self._runs.items())
        for (tenant, response_id), _ in runs:
            self._stop(tenant, response_id, DRAINED)
        if runs:
            await asyncio.wait({run.task for _, run in runs})
