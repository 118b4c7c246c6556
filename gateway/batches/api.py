"""`/v1/batches`, as OpenAI's API, and the runner that works through each batch's lines.

    POST /v1/batches               {input_file_id, endpoint, completion_window: "24h", metadata,
                                    output_expires_after} -> Batch (status `validating`)
    GET  /v1/batches               ?after, limit (1-100, default 20) -> a list page, newest first
    GET  /v1/batches/{id}          -> Batch (another tenant's id: 404)
    POST /v1/batches/{id}/cancel   -> Batch (`cancelling`, then `cancelled`)

The batches run in gateway/batches/batch_runner.py; its docstring says how (life, limits, leases).
A create is refused (400, naming the bound: gateway/bounds.py) when the tenant would have more than
its `batch_max_open` batches not yet final or `batch_max_queued_lines` lines in them, or when it
is at its `max_files` or `storage_quota_bytes` (no room for the batch's output).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.admission import Caller
from gateway.batches.batch_runner import PRIVATE, BatchRunner
from gateway.batches.blobs import Blobs, DirectoryBlobs, S3Blobs
from gateway.batches.files import Files
from gateway.batches.input import BatchCreateRequest
from gateway.batches.lines import count_into, usage_object
from gateway.batches.store import (
    FINAL_STATUSES,
    SQLITE_FILE,
    BatchStore,
    SQLiteBatchStore,
    StoredBatch,
)
from gateway.body import read_json
from gateway.bounds import bounds_of, exceeded
from gateway.errors import APIError, ErrorKind, invalid_request
from gateway.metrics import Metrics
from gateway.openai.listing import list_page, list_params
from gateway.pipeline import Pipeline
from gateway.responses.conversations import parse_body
from gateway.settings import Settings

if TYPE_CHECKING:
    from tenancy.service import Tenancy


COMPLETION_WINDOWS = {"24h": 24 * 3600}
MAX_BATCH_LIST_LIMIT, DEFAULT_BATCH_LIST_LIMIT = 100, 20
_LINES = "_num_lines"  # a batch's requests, counted at create (kept with it, not shown)


def num_lines(body: dict[str, Any]) -> int:
    """A batch's requests (counted at create; a batch created before: as validated)."""
    return int(body.get(_LINES) or body["request_counts"]["total"])


def public(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if not k.startswith("_")}


class Batches:
    """The batch routes (see the module docstring) over the store and the runner."""

    def __init__(self, runner: BatchRunner, max_body_bytes: int) -> None:
        self.runner = runner
        self.store = runner.store
        self.files = runner.files
        self.max_body_bytes = max_body_bytes
        # Per tenant: its bounds checked and its batch recorded as one (on this gateway).
        self._create_locks: dict[str, asyncio.Lock] = {}

    @property
    def clock(self) -> Callable[[], int]:
        """Epoch seconds: timestamps and the completion window (the runner's; tests move it)."""
        return self.runner.clock

    @clock.setter
    def clock(self, clock: Callable[[], int]) -> None:
        self.runner.clock = clock

    async def resume(self) -> None:
        """Start the runners (once the models are served); see `BatchRunner.resume`."""
        await self.runner.resume()

    async def aclose(self) -> None:
        await self.runner.aclose()

    # -- routes ----------------------------------------------------------------------------------

    async def create(self, caller: Caller, request: Request) -> Response:
        req = parse_body(BatchCreateRequest, await read_json(request, self.max_body_bytes))
        file = await self.files.find(caller, req.input_file_id, param="input_file_id")
        if file["purpose"] != "batch":
            raise invalid_request(
                f"The file {req.input_file_id} has purpose '{file['purpose']}'; "
                "a batch needs purpose 'batch'.",
                param="input_file_id",
            )
        lock = self._create_locks.setdefault(caller.name, asyncio.Lock())
        async with lock:
            num_lines = await self._check_bounds(caller, req.input_file_id)
            return await self._create(caller, req, num_lines)

    async def _check_bounds(self, caller: Caller, input_file_id: str) -> int:
        """The batch's requests (lines); APIError 400 naming the bound the batch would pass."""
        bounds = self.runner.bounds(caller)
        mine = [b.body for b in await self.store.unfinished() if b.tenant == caller.name]
        if len(mine) + 1 > bounds.batch_max_open:
            what = f"This would be your open batch number {len(mine) + 1:,}"
            raise exceeded("batch_max_open", bounds.batch_max_open, what, "input_file_id")
        data = await self.files.read(caller, input_file_id, "input_file_id")
        num_requests = sum(1 for line in data.splitlines() if line.strip())
        queued = sum(num_lines(b) for b in mine)
        if queued + num_requests > bounds.batch_max_queued_lines:
            total = queued + num_requests
            what = f"This batch's {num_requests:,} requests would take your open batches to {total:,}"
            raise exceeded("batch_max_queued_lines", bounds.batch_max_queued_lines, what, "input_file_id")
        await self.files.check_room(caller, 0, "input_file_id", "This batch's output file")
        return num_requests

    async def _create(self, caller: Caller, req: BatchCreateRequest, num_lines: int) -> Response:
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
            "usage": usage_object(0, 0, 0),
            "metadata": None if req.metadata is None else dict(req.metadata),
            PRIVATE: None if req.output_expires_after is None else req.output_expires_after.seconds,
            _LINES: num_lines,
        }
        stored = StoredBatch(caller.name, caller.key_id, batch)
        await self.store.put_batch(stored)
        self.runner.start(stored)
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
            count_into(body, *await self.store.tally(stored.tenant, body["id"]))
        return public(body)

    async def retrieve(self, caller: Caller, request: Request) -> Response:
        return JSONResponse(await self._live(await self._find(caller, request.path_params["batch_id"])))

    async def list_all(self, caller: Caller, request: Request) -> Response:
        after, limit = list_params(request.query_params, DEFAULT_BATCH_LIST_LIMIT, MAX_BATCH_LIST_LIMIT)
        rows = await self.store.list_batches(caller.name, after=after, limit=limit + 1)
        return JSONResponse(list_page([public(r) for r in rows], limit))

    async def cancel(self, caller: Caller, request: Request) -> Response:
        stored = await self._find(caller, request.path_params["batch_id"])
        stored = self.runner.running.get(stored.body["id"], stored)  # its runner's copy, which it writes
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
        self.runner.cancelled.add(body["id"])
        return JSONResponse(await self._live(stored))


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
        from gateway.batches.redis_store import RedisBatchStore

        store = RedisBatchStore(settings.redis_url)
    else:
        store = SQLiteBatchStore(None if storage is None else storage / SQLITE_FILE)
    if storage is None:
        weakref.finalize(store, shutil.rmtree, root, True)  # the temporary files go with the store

    bounds = functools.partial(bounds_of, settings)
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
        bounds=bounds,
    )
    runner = BatchRunner(
        store,
        files,
        pipeline,
        tenancy,
        metrics,
        max_lines=settings.batch_max_lines,
        max_concurrent_lines=settings.batch_max_concurrent_lines,
        max_in_flight=settings.batch_max_in_flight,
        max_running=settings.batch_max_running,
        bounds=bounds,
        lease_s=settings.batch_lease_s,
    )
    batches = Batches(runner, settings.max_body_bytes)
    return files, batches
