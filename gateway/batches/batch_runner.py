"""The runner that works through each batch's lines (the routes: gateway/batches/api.py).

A batch's life: `validating` (every line checked, gateway/batches/input.py; any error: `failed`
with `errors.data` naming the lines) -> `in_progress` -> `finalizing` (output and error files
written from the journal) -> `completed`, `cancelled` or `expired`. Each line runs through the
same pipeline as an interactive request (`Pipeline.answer`), as the tenant who created the batch,
in the engine's `batch` class (below `free`: only the capacity interactive traffic leaves), and
settles at the batch price, idempotently on its request id (derived from the batch id and the
custom_id), so a line run again after a crash is billed once. Each result is journaled at once
(gateway/batches/store.py); a gateway started again resumes every unfinished batch, running only
the lines without a result. Every custom_id ends in exactly one output or error line: a line that
cannot run gets an error line (`batch_cancelled`, `batch_expired`, `insufficient_quota` once a
hard budget refused one of the batch's lines).

Limits. A batch's lines are admitted in the tenant's batch lane (tenancy.limiter), not against
its interactive requests, tokens a minute or concurrency: the plan's `batch_tokens_per_minute` and
`batch_max_concurrent_lines` bound them, over every gateway with Redis; budgets and the ledger are
shared with interactive traffic. Per model, the prompt tokens of a tenant's unfinished batches stay
within the plan's `batch_enqueued_tokens` (OpenAI's batch queue limit): a batch that would go over
fails validation with `token_limit_exceeded`. On each gateway: at most `--batch-max-running`
batches run at once, shared among tenants in turns, at most the tenant's
`batch_max_running_per_tenant` of one tenant's (gateway/batches/slots.py; the others wait,
`validating`, or go to a gateway with room), at most `--batch-max-in-flight` lines of all of them,
and at most `--batch-max-concurrent-lines` of one tenant's (or its plan's
`batch_max_concurrent_lines`). Refusals that pass (rate limits, overload, a
loading model) are retried after their Retry-After; the line keeps its place. A refusal that
waiting cannot cure (a line larger than the batch tokens a minute) is that line's error.

One runner per batch: it holds the batch's lease in the store (renewed every third of
`--batch-lease`; a gateway that cannot renew it stops running the batch). With the SQLite store one
gateway runs the batches of its storage directory (a single pod with a volume); with Redis
(gateway/batches/redis_store.py) and the files in a shared bucket, every gateway of a pool watches the
unfinished batches and takes over one whose lease lapsed (its gateway died), as soon as it lapses.
The journal, not the lease, keeps each custom_id to one line: a line two runners both ran is
journaled once and settled once.

Tracing: each run of a batch is a `batch {id}` span (a root), and each line's request span starts
a trace of its own with a link to it (OpenTelemetry span links, as for messages processed in a batch).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
import orjson

from engine.types import Priority
from gateway import telemetry
from gateway.admission import Caller, tenant_caller
from gateway.backend import Endpoint
from gateway.batches.files import Files, expires_at
from gateway.batches.input import BATCH_ENDPOINTS, Line, parse_lines, unserved
from gateway.batches.lines import (
    MAX_RETRY_WAIT_S,
    answer_usage,
    batch_error,
    count_into,
    derived_file_id,
    line_ids,
    prompt_tokens,
    retry_wait,
    stopped,
)
from gateway.batches.slots import RunSlots
from gateway.batches.store import (
    FINAL_STATUSES,
    BatchStore,
    LineResult,
    StoredBatch,
)
from gateway.bounds import Bounds
from gateway.errors import APIError, ErrorKind
from gateway.metrics import Metrics
from gateway.openai import bodies
from gateway.pipeline import Pipeline

if TYPE_CHECKING:
    from tenancy.service import Tenancy

logger = logging.getLogger("batchgate.gateway")

PRIVATE = "_output_expires_after"  # kept with the batch, not shown
_ENQUEUED = "_enqueued_tokens"  # {model: prompt tokens} of a validated batch, for the queue limit


class BatchRunner:
    """Runs each batch's lines through the pipeline (see the module docstring)."""

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
        bounds: Callable[[Caller | None], Bounds],
        lease_s: float = 30.0,
        clock: Callable[[], int] = bodies.now,
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
        self.running: dict[str, StoredBatch] = {}  # the records the runners update
        self.cancelled: set[str] = set()  # batches whose remaining lines may not start
        self._quota_stopped: set[str] = set()
        self._lanes: dict[str, asyncio.Semaphore] = {}  # per tenant: its lines in flight here
        self._in_flight = asyncio.Semaphore(max_in_flight)  # every batch's lines in flight here
        self.bounds = bounds  # a tenant's bounds (its batches running at once)
        self.slots = RunSlots(max_running)  # batches this gateway runs at once, tenants in turns
        self._enqueue_lock = asyncio.Lock()  # the queue limit's check and the batch's record
        self._started = asyncio.Event()  # set by `resume`: the models are loaded

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
                self.start(stored)
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

    def start(self, stored: StoredBatch) -> None:
        """Run `stored` (once its models are served: `resume`), unless this gateway already does."""
        batch_id = stored.body["id"]
        if batch_id not in self._runners:
            task = asyncio.create_task(self._run(stored), name=f"batch-{batch_id}")
            self._runners[batch_id], self.running[batch_id] = task, stored

            def done(_: object) -> None:
                self._runners.pop(batch_id, None)
                self.running.pop(batch_id, None)

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
        if body["id"] in self.cancelled:
            return "batch_cancelled"
        if self.clock() >= body["expires_at"]:
            return "batch_expired"
        if body["id"] in self._quota_stopped:
            return "insufficient_quota"
        return None

    async def _run(self, stored: StoredBatch) -> None:
        await self._started.wait()
        cap = self.bounds(self._caller(stored)).batch_max_running_per_tenant
        async with self.slots.slot(stored.tenant, cap):
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
                self.cancelled.add(batch_id)
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
                if marked and body["id"] not in self.cancelled:
                    self.cancelled.add(body["id"])
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
                    stored, [batch_error("invalid_request", "The batch's tenant no longer exists.")]
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
                stored, [batch_error("internal_error", "The batch runner failed; see the server log.")]
            )

    async def _validate(self, stored: StoredBatch, caller: Caller) -> list[Line] | None:
        """The batch's lines, or None after failing it with the errors found."""
        body = stored.body
        endpoint = BATCH_ENDPOINTS[body["endpoint"]]
        try:
            data = await self.files.read(caller, body["input_file_id"], "input_file_id")
        except APIError as exc:
            await self._fail(stored, [batch_error("invalid_request", exc.message, "input_file_id")])
            return None
        lines, errors = parse_lines(data, endpoint)
        if len(lines) > self.max_lines:
            errors.insert(
                0, batch_error("too_many_requests", f"A batch has at most {self.max_lines} requests.")
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
                        await self._fail(stored, [batch_error("token_limit_exceeded", message)])
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
                        await self._record(stored, stopped(endpoint, body["id"], line, stop), stop)
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
                wait_s = retry_wait(exc)
                if wait_s is not None:
                    if stop is not None:
                        return stopped(endpoint, body["id"], line, stop), stop
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
        result = answered(reply.status, payload, answer_usage(payload))
        return result, "failed" if result.failed else "completed"

    async def _record(self, stored: StoredBatch, result: LineResult, status: str) -> None:
        if await self.store.record(stored.tenant, stored.body["id"], result):
            self.metrics.batch_lines.labels(status).inc()

    async def _finalize(self, stored: StoredBatch, caller: Caller) -> None:
        body = stored.body
        if await self.store.cancel_marked(stored.tenant, body["id"]):  # asked on another gateway
            self.cancelled.add(body["id"])
        stop = self._stop_code(body)
        body.update(status="finalizing", finalizing_at=self.clock())
        await self.store.put_batch(stored)
        count_into(body, *await self.store.tally(stored.tenant, body["id"]))
        results = await self.store.results(stored.tenant, body["id"])
        expiry = expires_at(body.get(PRIVATE), self.clock())
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
        self.cancelled.discard(body["id"])
        self._quota_stopped.discard(body["id"])
        logger.info("batch %s: %s (%s)", body["id"], final, body["request_counts"])

    async def _fail(self, stored: StoredBatch, errors: list[dict[str, Any]]) -> None:
        body = stored.body
        body.update(status="failed", failed_at=self.clock(), errors={"object": "list", "data": errors})
        await self.store.put_batch(stored)
