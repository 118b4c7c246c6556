"""`/v1/batches`, as OpenAI's API, and the runner that works through each batch's lines.

    POST /v1/batches               {input_file_id, endpoint, completion_window: "24h", metadata,
                                    output_expires_after} -> Batch (status `validating`)
    GET  /v1/batches               ?after, limit (1-100, default 20) -> a list page, newest first
    GET  /v1/batches/{id}          -> Batch (another tenant's id: 404)
    POST /v1/batches/{id}/cancel   -> Batch (`cancelling`, then `cancelled`)

A batch's life: `validating` (every line checked, gateway/batch_input.py; any error: `failed`
with `errors.data` naming the lines) -> `in_progress` -> `finalizing` (output and error files
written from the journal) -> `completed`, `cancelled` or `expired`. Each line runs through the
same pipeline as an interactive request (`Pipeline.answer`), as the tenant who created the batch,
in the engine's `batch` class (below `free`: only the capacity interactive traffic leaves), and
settles at the batch price, idempotently on its request id (derived from the batch id and the
custom_id), so a line run again after a crash is billed once. Each result is journaled at once
(gateway/batch_store.py); a gateway started again resumes every unfinished batch, running only
the lines without a result. Every custom_id ends in exactly one output or error line: a line that
cannot run gets an error line (`batch_cancelled`, `batch_expired`, `insufficient_quota` once a
hard budget refused one of the batch's lines).

Limits. A batch's lines are admitted in the tenant's batch lane (tenancy.limiter), not against
its interactive requests, tokens a minute or concurrency: the plan's `batch_tokens_per_minute` and
`batch_max_concurrent_lines` bound them, over every gateway with Redis; budgets and the ledger are
shared with interactive traffic. Per model, the prompt tokens of a tenant's unfinished batches stay
within the plan's `batch_enqueued_tokens` (OpenAI's batch queue limit): a batch that would go over
fails validation with `token_limit_exceeded`. On each gateway: at most `--batch-max-running`
batches run at once (the others wait, `validating`, or go to a gateway with room), at most
`--batch-max-in-flight` lines of all of them, and at most `--batch-max-concurrent-lines` of one
tenant's (or its plan's `batch_max_concurrent_lines`). Refusals that pass (rate limits, overload, a
loading model) are retried after their Retry-After; the line keeps its place. A refusal that
waiting cannot cure (a line larger than the batch tokens a minute) is that line's error.

One runner per batch: it holds the batch's lease in the store (renewed every third of
`--batch-lease`; a gateway that cannot renew it stops running the batch). With the SQLite store one
gateway runs the batches of its storage directory (a single pod with a volume); with Redis
(gateway/batch_redis.py) and the files in a shared bucket, every gateway of a pool watches the
unfinished batches and takes over one whose lease lapsed (its gateway died), as soon as it lapses.
The journal, not the lease, keeps each custom_id to one line: a line two runners both ran is
journaled once and settled once.

Tracing: each run of a batch is a `batch {id}` span (a root), and each line's request span starts
a trace of its own with a link to it (OpenTelemetry span links, as for messages processed in a batch).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
import shutil
import socket
import tempfile
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.types import Priority
from gateway import responses, telemetry
from gateway.admission import Caller, tenant_caller
from gateway.backend import Endpoint
from gateway.batch_input import BATCH_ENDPOINTS, BatchCreateRequest, Line, parse_lines, unserved
from gateway.batch_store import (
    FINAL_STATUSES,
    SQLITE_FILE,
    BatchStore,
    LineResult,
    SQLiteBatchStore,
    StoredBatch,
)
from gateway.blobs import Blobs, DirectoryBlobs, S3Blobs
from gateway.body import read_json
from gateway.conversations import parse_body
from gateway.errors import APIError, ErrorKind, invalid_request
from gateway.files import Files, expires_at
from gateway.listing import list_page, list_params
from gateway.metrics import Metrics
from gateway.pipeline import Pipeline
from gateway.settings import Settings

if TYPE_CHECKING:
    from tenancy.service import Tenancy
    from tenancy.tokens import TokenCounter

logger = logging.getLogger("batchgate.gateway")

COMPLETION_WINDOWS = {"24h": 24 * 3600}
MAX_BATCH_LIST_LIMIT, DEFAULT_BATCH_LIST_LIMIT = 100, 20
# Refusals that pass: the line waits (Retry-After, at most this long) and runs again.
RETRIED = frozenset({ErrorKind.RATE_LIMITED, ErrorKind.OVERLOADED, ErrorKind.UNAVAILABLE})
MAX_RETRY_WAIT_S = 30.0
# What the lines that cannot run are told, by why.
STOP_MESSAGES = {
    "batch_cancelled": "This request was not executed because the batch was cancelled.",
    "batch_expired": "This request could not be executed before the completion window expired.",
    "insufficient_quota": "This request was not executed: a hard budget of your account was reached.",
}
_PRIVATE = "_output_expires_after"  # kept with the batch, not shown
_ENQUEUED = "_enqueued_tokens"  # {model: prompt tokens} of a validated batch, for the queue limit


def line_ids(endpoint: Endpoint, batch_id: str, custom_id: str) -> tuple[str, str]:
    """The output line's id (`batch_req_...`) and the line's request id (its endpoint's prefix),
    both derived from (batch id, custom_id): settlement is idempotent on the request id."""
    digest = hashlib.sha256(f"{batch_id}\0{custom_id}".encode()).hexdigest()[:32]
    sep = "" if endpoint.id_prefix.endswith("_") else "-"
    return f"batch_req_{digest}", f"{endpoint.id_prefix}{sep}{digest}"


def derived_file_id(batch_id: str, kind: str) -> str:
    """The id of a batch's output or error file (`kind`), the same on every run of it."""
    digest = hashlib.sha256(f"{batch_id}\0{kind}".encode()).hexdigest()
    return f"file-{digest[:24]}"


def public(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if not k.startswith("_")}


def _usage(payload: Any) -> tuple[int, int, int]:
    """(input, cached, output) tokens of an answer body (chat, completions, embeddings, responses)."""
    usage = payload.get("usage") if isinstance(payload, dict) else None
    if not isinstance(usage, dict):
        return 0, 0, 0
    num_in = int(usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0)
    num_out = int(usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0)
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    return num_in, int(details.get("cached_tokens", 0) or 0), num_out


class Batches:
    """The batch routes and runner (see the module docstring)."""

    def __init__(
        self,
        store: BatchStore,
        files: Files,
        pipeline: Pipeline,
        tenancy: Tenancy | None,
        metrics: Metrics,
        *,
        max_lines: int,
        max_concurrent_lines: int,
        max_in_flight: int,
        max_running: int,
        lease_s: float = 30.0,
        clock: Callable[[], int] = responses.now,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if lease_s <= 0:
            raise ValueError(f"the batch lease must be positive, got {lease_s}")
        self.store = store
        self.files = files
        self.pipeline = pipeline
        self.tenancy = tenancy
        self.metrics = metrics
        self.max_lines = max_lines
        self.max_concurrent_lines = max_concurrent_lines
        self.lease_s = lease_s
        self.clock = clock  # epoch seconds: timestamps and the completion window (tests move it)
        self._sleep = sleep
        # Who holds a batch's lease: this process, unique across restarts and hosts.
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._watcher: asyncio.Task[None] | None = None
        self._runners: dict[str, asyncio.Task[None]] = {}
        self._running: dict[str, StoredBatch] = {}  # the records the runners update
        self._cancelled: set[str] = set()
        self._quota_stopped: set[str] = set()
        self._lanes: dict[str, asyncio.Semaphore] = {}  # per tenant: its lines in flight here
        self._in_flight = asyncio.Semaphore(max_in_flight)  # every batch's lines in flight here
        self._run_slots = asyncio.Semaphore(max_running)  # batches this gateway runs at once
        self._enqueue_lock = asyncio.Lock()  # the queue limit's check and the batch's record
        self._started = asyncio.Event()  # set by `resume`: the models are loaded

    # -- routes ----------------------------------------------------------------------------------

    async def create(self, caller: Caller, request: Request) -> Response:
        req = parse_body(BatchCreateRequest, await read_json(request, self.pipeline.settings.max_body_bytes))
        file = await self.files.find(caller, req.input_file_id, param="input_file_id")
        if file["purpose"] != "batch":
            raise invalid_request(
                f"The file {req.input_file_id} has purpose '{file['purpose']}'; "
                "a batch needs purpose 'batch'.",
                param="input_file_id",
            )
        now = self.clock()
        batch: dict[str, Any] = {
            "id": f"batch_{hashlib.sha256(f'{caller.name}{time.time_ns()}'.encode()).hexdigest()[:32]}",
            "object": "batch",
            "endpoint": req.endpoint,
            "model": None,
            "errors": None,
            "input_file_id": req.input_file_id,
            "completion_window": req.completion_window,
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + COMPLETION_WINDOWS[req.completion_window],
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "usage": _usage_object(0, 0, 0),
            "metadata": None if req.metadata is None else dict(req.metadata),
            _PRIVATE: None if req.output_expires_after is None else req.output_expires_after.seconds,
        }
        stored = StoredBatch(caller.name, caller.key_id, batch)
        await self.store.put_batch(stored)
        self._start(stored)
        return JSONResponse(public(batch))

    async def _find(self, caller: Caller, batch_id: str) -> StoredBatch:
        stored = await self.store.get_batch(caller.name, batch_id)
        if stored is None:
            raise APIError(ErrorKind.NOT_FOUND, f"No batch found with id '{batch_id}'.")
        return stored

    async def _live(self, stored: StoredBatch) -> dict[str, Any]:
        """The batch as answered: its counts and usage read from the journal while it runs."""
        body = stored.body
        if body["status"] in ("in_progress", "cancelling", "finalizing"):
            _count(body, *await self.store.tally(stored.tenant, body["id"]))
        return public(body)

    async def retrieve(self, caller: Caller, request: Request) -> Response:
        return JSONResponse(await self._live(await self._find(caller, request.path_params["batch_id"])))

    async def list_all(self, caller: Caller, request: Request) -> Response:
        after, limit = list_params(request.query_params, DEFAULT_BATCH_LIST_LIMIT, MAX_BATCH_LIST_LIMIT)
        rows = await self.store.list_batches(caller.name, after=after, limit=limit + 1)
        return JSONResponse(list_page([public(r) for r in rows], limit))

    async def cancel(self, caller: Caller, request: Request) -> Response:
        stored = await self._find(caller, request.path_params["batch_id"])
        stored = self._running.get(stored.body["id"], stored)  # its runner's copy, which it writes
        body = stored.body
        if body["status"] in FINAL_STATUSES:
            raise APIError(
                ErrorKind.INVALID_REQUEST,
                f"Cannot cancel a batch with status '{body['status']}'.",
                code="batch_not_cancellable",
            )
        if body["status"] != "cancelling":
            body["status"], body["cancelling_at"] = "cancelling", self.clock()
            await self.store.put_batch(stored)
        await self.store.mark_cancel(stored.tenant, body["id"])  # for the runner, on any gateway
        self._cancelled.add(body["id"])
        return JSONResponse(await self._live(stored))

    # -- the runner ------------------------------------------------------------------------------

    async def resume(self) -> None:
        """Start a runner for every unfinished batch in the store, and let runners start (the
        app calls this once its models have loaded); with a shared store, keep watching for
        batches whose runner's lease lapses."""
        self._started.set()
        await self._scan()
        if self.store.shared:
            self._watcher = asyncio.create_task(self._watch(), name="batch-watch")

    async def _scan(self) -> float:
        """Start a runner for each unfinished batch that none holds; how long until the next
        held lease lapses (at most a third of the lease)."""
        wait = self.lease_s / 3
        for stored in await self.store.unfinished():
            if stored.body["id"] in self._runners:
                continue
            left = await self.store.lease_left(stored.tenant, stored.body["id"])
            if left <= 0:
                self._start(stored)
            else:
                wait = min(wait, left)
        return wait

    async def _watch(self) -> None:
        while True:
            try:
                wait = await self._scan()
            except Exception as exc:  # noqa: BLE001 - a store outage: look again later
                logger.warning("batches: cannot read the unfinished batches (%r)", exc)
                wait = self.lease_s / 3
            await self._sleep(wait + 0.01)

    async def aclose(self) -> None:
        """Stop every runner (and the watch); lines in flight are cancelled (refunded) and run
        again on resume, or by another gateway once the leases, released here, are free."""
        runners = [*self._runners.values(), *([self._watcher] if self._watcher else [])]
        for task in runners:
            task.cancel()
        await asyncio.gather(*runners, return_exceptions=True)

    def _start(self, stored: StoredBatch) -> None:
        batch_id = stored.body["id"]
        if batch_id not in self._runners:
            task = asyncio.create_task(self._run(stored), name=f"batch-{batch_id}")
            self._runners[batch_id], self._running[batch_id] = task, stored

            def done(_: object) -> None:
                self._runners.pop(batch_id, None)
                self._running.pop(batch_id, None)

            task.add_done_callback(done)

    def _caller(self, stored: StoredBatch) -> Caller | None:
        """The batch's lines' caller: its tenant (as configured now), in the batch class, with no
        queue deadline; None when the tenant no longer exists."""
        if self.tenancy is None:
            return Caller(name=stored.tenant, priority=Priority.BATCH)
        tenant = self.tenancy.config.tenant(stored.tenant)
        if tenant is None:
            return None
        return dataclasses.replace(
            tenant_caller(tenant, stored.key_id), priority=Priority.BATCH, queue_deadline_s=None
        )

    def _lane(self, caller: Caller) -> asyncio.Semaphore:
        """The tenant's slots for lines in flight on this gateway."""
        lane = self._lanes.get(caller.name)
        if lane is None:
            plan = caller.tenant.plan if caller.tenant is not None else None
            slots = (plan.batch_max_concurrent_lines if plan else None) or self.max_concurrent_lines
            lane = self._lanes[caller.name] = asyncio.Semaphore(slots)
        return lane

    def _stop_code(self, body: dict[str, Any]) -> str | None:
        """Why the batch's remaining lines may not start, or None."""
        if body["id"] in self._cancelled:
            return "batch_cancelled"
        if self.clock() >= body["expires_at"]:
            return "batch_expired"
        if body["id"] in self._quota_stopped:
            return "insufficient_quota"
        return None

    async def _run(self, stored: StoredBatch) -> None:
        await self._started.wait()
        async with self._run_slots:
            await self._run_held(stored)

    async def _run_held(self, stored: StoredBatch) -> None:
        tenant, batch_id = stored.tenant, stored.body["id"]
        if not await self.store.claim(tenant, batch_id, self.owner, self.lease_s):
            return  # another gateway runs it
        keeper = asyncio.create_task(self._keep(stored, asyncio.current_task()), name=f"lease-{batch_id}")
        try:
            fresh = await self.store.get_batch(tenant, batch_id)  # as its last runner left it
            if fresh is None or fresh.body["status"] in FINAL_STATUSES:
                return
            stored.body.clear()
            stored.body.update(fresh.body)
            if stored.body["status"] == "cancelling" or await self.store.cancel_marked(tenant, batch_id):
                self._cancelled.add(batch_id)
            with telemetry.batch_span(batch_id, tenant, stored.body["endpoint"]):
                await self._run_claimed(stored)
        finally:
            keeper.cancel()
            try:
                await self.store.release(tenant, batch_id, self.owner)
            except Exception as exc:  # noqa: BLE001 - the lease then lapses by itself
                logger.warning("batch %s: the lease was not released (%r)", batch_id, exc)

    async def _keep(self, stored: StoredBatch, runner: asyncio.Task[Any] | None) -> None:
        """Renew the runner's lease, and pick up a cancel asked on another gateway; a lease that
        cannot be renewed (taken over, or the store away) stops the runner."""
        tenant, body = stored.tenant, stored.body
        while True:
            await self._sleep(self.lease_s / 3)
            try:
                held = await self.store.claim(tenant, body["id"], self.owner, self.lease_s)
                marked = held and await self.store.cancel_marked(tenant, body["id"])
                if marked and body["id"] not in self._cancelled:
                    self._cancelled.add(body["id"])
                    if body["status"] == "in_progress":
                        body.update(status="cancelling", cancelling_at=self.clock())
            except Exception as exc:  # noqa: BLE001 - any store failure: the lease cannot be trusted
                logger.warning("batch %s: the lease could not be renewed (%r)", body["id"], exc)
                held = False
            if not held:
                logger.warning("batch %s: lease lost; this gateway stops running it", body["id"])
                if runner is not None:
                    runner.cancel()
                return

    async def _run_claimed(self, stored: StoredBatch) -> None:
        body = stored.body
        try:
            caller = self._caller(stored)
            if caller is None:
                await self._fail(
                    stored, [_batch_error("invalid_request", "The batch's tenant no longer exists.")]
                )
                return
            lines = await self._validate(stored, caller)
            if lines is None:
                return
            if body["in_progress_at"] is None and not await self._enqueue(stored, caller, lines):
                return
            await self._execute(stored, caller, lines)
            await self._finalize(stored, caller)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a runner's fault must end its batch, not vanish
            logger.exception("batch %s: the runner failed", body["id"])
            await self._fail(
                stored, [_batch_error("internal_error", "The batch runner failed; see the server log.")]
            )

    async def _validate(self, stored: StoredBatch, caller: Caller) -> list[Line] | None:
        """The batch's lines, or None after failing it with the errors found."""
        body = stored.body
        endpoint = BATCH_ENDPOINTS[body["endpoint"]]
        try:
            data = await self.files.read(caller, body["input_file_id"], "input_file_id")
        except APIError as exc:
            await self._fail(stored, [_batch_error("invalid_request", exc.message, "input_file_id")])
            return None
        lines, errors = parse_lines(data, endpoint)
        if len(lines) > self.max_lines:
            errors.insert(
                0, _batch_error("too_many_requests", f"A batch has at most {self.max_lines} requests.")
            )
        while not errors:
            try:
                errors = await unserved(lines, endpoint, self.pipeline.registry, caller)
                break
            except APIError as exc:  # models still loading: validate when they are served
                await asyncio.sleep(min(exc.retry_after_s or 1.0, MAX_RETRY_WAIT_S))
        if errors:
            await self._fail(stored, errors)
            return None
        return lines

    async def _enqueue(self, stored: StoredBatch, caller: Caller, lines: list[Line]) -> bool:
        """Take the validated batch into the queue, `in_progress`; False after failing it with
        `token_limit_exceeded` when its prompt tokens would take the tenant's unfinished batches
        of a model over the plan's `batch_enqueued_tokens` (as OpenAI's batch queue limit)."""
        body = stored.body
        plan = caller.tenant.plan if caller.tenant is not None else None
        limit = plan.batch_enqueued_tokens if plan is not None else None
        async with self._enqueue_lock:  # the check and the record as one, on this gateway
            if limit is not None and self.tenancy is not None:
                body[_ENQUEUED] = await anyio.to_thread.run_sync(prompt_tokens, self.tenancy.tokens, lines)
                queued: dict[str, int] = {}
                for other in await self.store.unfinished():
                    if other.tenant == stored.tenant and other.body["id"] != body["id"]:
                        for model, num in (other.body.get(_ENQUEUED) or {}).items():
                            queued[model] = queued.get(model, 0) + num
                for model, num in body[_ENQUEUED].items():
                    if queued.get(model, 0) + num > limit:
                        message = (
                            f"Enqueued token limit reached for {model} of tenant {stored.tenant}. Limit: "
                            f"{limit:,} enqueued tokens; this batch has {num:,}, the tenant's unfinished "
                            f"batches {queued.get(model, 0):,}. Please try again once some in_progress "
                            "batches have been completed."
                        )
                        await self._fail(stored, [_batch_error("token_limit_exceeded", message)])
                        return False
            body.update(in_progress_at=self.clock(), model=lines[0].model)
            body["request_counts"]["total"] = len(lines)
            if body["status"] == "validating":  # (not when cancelled while validating)
                body["status"] = "in_progress"
            await self.store.put_batch(stored)
        return True

    async def _execute(self, stored: StoredBatch, caller: Caller, lines: list[Line]) -> None:
        body = stored.body
        endpoint = BATCH_ENDPOINTS[body["endpoint"]]
        done = {r.custom_id for r in await self.store.results(stored.tenant, body["id"])}
        todo = [line for line in lines if line.custom_id not in done]
        lane = self._lane(caller)
        self.metrics.batch_queued.inc(len(todo))
        started = 0
        try:
            async with asyncio.TaskGroup() as group:
                for line in todo:
                    await lane.acquire()
                    stop = self._stop_code(body)
                    if stop is None:
                        await self._in_flight.acquire()
                        stop = self._stop_code(body)  # (it may have waited long)
                        if stop is not None:
                            self._in_flight.release()
                    started += 1
                    self.metrics.batch_queued.dec()
                    if stop is None:
                        group.create_task(self._line(stored, endpoint, caller, line, lane))
                    else:
                        lane.release()
                        await self._record(stored, _stopped(endpoint, body["id"], line, stop), stop)
        finally:
            self.metrics.batch_queued.dec(len(todo) - started)  # those a stop left unstarted

    async def _line(
        self, stored: StoredBatch, endpoint: Endpoint, caller: Caller, line: Line, lane: asyncio.Semaphore
    ) -> None:
        self.metrics.batch_in_flight.inc()
        try:
            result, status = await self._answer(stored.body, endpoint, caller, line)
            await self._record(stored, result, status)
        finally:
            self.metrics.batch_in_flight.dec()
            self._in_flight.release()
            lane.release()

    async def _answer(
        self, body: dict[str, Any], endpoint: Endpoint, caller: Caller, line: Line
    ) -> tuple[LineResult, str]:
        """Run one line through the pipeline: its journal entry and its metrics status."""
        line_id, request_id = line_ids(endpoint, body["id"], line.custom_id)

        def answered(status: int, payload: Any, usage: tuple[int, int, int] = (0, 0, 0)) -> LineResult:
            response = {"status_code": status, "request_id": request_id, "body": payload}
            text = orjson.dumps(
                {"id": line_id, "custom_id": line.custom_id, "response": response, "error": None}
            )
            return LineResult(line.custom_id, line.number, status != 200, text, *usage)

        while True:
            try:
                reply = await self.pipeline.answer(endpoint, line.body, caller, request_id)
                break
            except APIError as exc:
                stop = self._stop_code(body)
                wait_s = _retry_wait(exc)
                if wait_s is not None:
                    if stop is not None:
                        return _stopped(endpoint, body["id"], line, stop), stop
                    await asyncio.sleep(wait_s)
                    continue
                if exc.kind is ErrorKind.INSUFFICIENT_QUOTA:
                    self._quota_stopped.add(body["id"])
                    return answered(exc.status, exc.body()), "insufficient_quota"
                return answered(exc.status, exc.body()), "failed"
            except Exception:  # noqa: BLE001 - a bug in one line must not take the batch down
                logger.exception("batch %s: line %s failed", body["id"], line.custom_id)
                internal = APIError(ErrorKind.INTERNAL, "The server failed to process this request.")
                return answered(internal.status, internal.body()), "failed"
        payload = orjson.loads(reply.payload) if isinstance(reply.payload, bytes) else reply.payload
        result = answered(reply.status, payload, _usage(payload))
        return result, "failed" if result.failed else "completed"

    async def _record(self, stored: StoredBatch, result: LineResult, status: str) -> None:
        if await self.store.record(stored.tenant, stored.body["id"], result):
            self.metrics.batch_lines.labels(status).inc()

    async def _finalize(self, stored: StoredBatch, caller: Caller) -> None:
        body = stored.body
        if await self.store.cancel_marked(stored.tenant, body["id"]):  # asked on another gateway
            self._cancelled.add(body["id"])
        stop = self._stop_code(body)
        body.update(status="finalizing", finalizing_at=self.clock())
        await self.store.put_batch(stored)
        _count(body, *await self.store.tally(stored.tenant, body["id"]))
        results = await self.store.results(stored.tenant, body["id"])
        expiry = expires_at(body.get(_PRIVATE), self.clock())
        for key, failed in (("output_file_id", False), ("error_file_id", True)):
            text = b"".join(r.text + b"\n" for r in results if r.failed == failed)
            if text and body[key] is None:
                kind = "error" if failed else "output"
                # Its id derives from the batch's: a runner stopped between writing the file and
                # saving its id writes the same file again, never an orphan.
                file = await self.files.write(
                    caller,
                    text,
                    file_id=derived_file_id(body["id"], kind),
                    filename=f"{body['id']}_{kind}.jsonl",
                    purpose="batch_output",
                    expires_at=expiry,
                    check_quota=False,
                )
                body[key] = file["id"]
                await self.store.put_batch(stored)
        final = {"batch_cancelled": "cancelled", "batch_expired": "expired"}.get(stop or "", "completed")
        body.update(status=final, **{f"{final}_at": self.clock()})
        await self.store.put_batch(stored)
        self._cancelled.discard(body["id"])
        self._quota_stopped.discard(body["id"])
        logger.info("batch %s: %s (%s)", body["id"], final, body["request_counts"])

    async def _fail(self, stored: StoredBatch, errors: list[dict[str, Any]]) -> None:
        body = stored.body
        body.update(status="failed", failed_at=self.clock(), errors={"object": "list", "data": errors})
        await self.store.put_batch(stored)


def _retry_wait(exc: APIError) -> float | None:
    """How long a refused line waits before it runs again (its Retry-After, capped); None: the
    refusal is the line's answer (a rate limit without Retry-After never admits it)."""
    if exc.kind not in RETRIED:
        return None
    wait_ms = exc.headers.get("retry-after-ms")
    if exc.retry_after_s is None and wait_ms is None:
        return None if exc.kind is ErrorKind.RATE_LIMITED else 1.0
    wait_s = exc.retry_after_s if exc.retry_after_s is not None else int(wait_ms or 0) / 1000
    return min(wait_s, MAX_RETRY_WAIT_S)


def prompt_tokens(counter: TokenCounter, lines: list[Line]) -> dict[str, int]:
    """The prompt tokens of `lines` per model, as admission estimates them: chat `messages`, or
    the `prompt` (completions) or `input` (embeddings, responses: text or message items)."""
    out: dict[str, int] = {}
    for line in lines:
        body = line.body
        value = body.get("messages", body.get("prompt", body.get("input")))
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            num = counter.count_messages(value)
        else:
            num = counter.count_prompt(value)
        out[line.model] = out.get(line.model, 0) + num
    return out


def _count(
    body: dict[str, Any], num_done: int, num_failed: int, num_in: int, num_cached: int, num_out: int
) -> None:
    """Set the batch's request_counts and usage from its journal's tally."""
    body["request_counts"].update(completed=num_done - num_failed, failed=num_failed)
    body["usage"] = _usage_object(num_in, num_cached, num_out)


def _usage_object(num_in: int, num_cached: int, num_out: int) -> dict[str, Any]:
    return {
        "input_tokens": num_in,
        "input_tokens_details": {"cached_tokens": num_cached},
        "output_tokens": num_out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": num_in + num_out,
    }


def _stopped(endpoint: Endpoint, batch_id: str, line: Line, code: str) -> LineResult:
    line_id, _ = line_ids(endpoint, batch_id, line.custom_id)
    error = {"code": code, "message": STOP_MESSAGES[code]}
    text = orjson.dumps({"id": line_id, "custom_id": line.custom_id, "response": None, "error": error})
    return LineResult(line.custom_id, line.number, True, text)


def _batch_error(code: str, message: str, param: str | None = None) -> dict[str, Any]:
    return {"code": code, "line": None, "message": message, "param": param}


def build_batches(
    settings: Settings, pipeline: Pipeline, tenancy: Tenancy | None, metrics: Metrics
) -> tuple[Files, Batches]:
    """The Files and Batches APIs: with `--redis-url` and `--files-bucket`, records in Redis and
    bytes in the bucket, shared by a pool of gateways; else this gateway's own, the records in
    `--storage-dir`'s batches.sqlite3 and the bytes in the bucket or the storage directory's files/
    (records in Redis beside bytes only one gateway holds would be 404s on the others). Without a
    storage directory: an in-memory database and a temporary directory (lost at exit, as the
    other embedded stores are without one)."""
    storage = Path(settings.storage_dir) if settings.storage_dir else None
    root = storage or Path(tempfile.mkdtemp(prefix="batchgate-files-"))
    store: BatchStore
    if settings.redis_url and settings.files_bucket:
        from gateway.batch_redis import RedisBatchStore

        store = RedisBatchStore(settings.redis_url)
    else:
        store = SQLiteBatchStore(None if storage is None else storage / SQLITE_FILE)
    if storage is None:
        weakref.finalize(store, shutil.rmtree, root, True)  # the temporary files go with the store

    def quota(caller: Caller) -> int | None:
        return caller.tenant.plan.storage_quota_bytes if caller.tenant is not None else None

    blobs: Blobs
    if settings.files_bucket:
        blobs = S3Blobs(settings.files_bucket, settings.s3_endpoint_url)
    else:
        blobs = DirectoryBlobs(root / "files")
    files = Files(
        store,
        blobs,
        max_file_bytes=settings.max_file_bytes,
        max_lines=settings.batch_max_lines,
        quota=quota,
    )
    batches = Batches(
        store,
        files,
        pipeline,
        tenancy,
        metrics,
        max_lines=settings.batch_max_lines,
        max_concurrent_lines=settings.batch_max_concurrent_lines,
        max_in_flight=settings.batch_max_in_flight,
        max_running=settings.batch_max_running,
        lease_s=settings.batch_lease_s,
    )
    return files, batches
