"""`/v1/files`, as OpenAI's API: upload (multipart), list, retrieve, content, delete, per tenant.

    POST   /v1/files                 multipart `file` + `purpose` (batch | user_data) -> FileObject
    GET    /v1/files                 ?purpose, after, limit (1-10,000), order -> a list page
    GET    /v1/files/{id}            -> FileObject (another tenant's id: 404)
    GET    /v1/files/{id}/content    -> the bytes
    DELETE /v1/files/{id}            -> {id, object: "file", deleted: true}

Limits: `--max-file-bytes` (413, counted as the upload streams: gateway/batches/upload.py),
`--batch-max-lines` for a `batch` file (400), and the tenant's `max_files` and
`storage_quota_bytes` over all its files, batch outputs included (400; gateway/bounds.py).
Metadata is in gateway/batches/store.py, bytes in gateway/batches/blobs.py. Batch outputs are
`batch_output` files the runner writes (gateway/batches/api.py) through `Files.write`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.admission import Caller
from gateway.batches.blobs import Blobs
from gateway.batches.input import ExpiresAfter
from gateway.batches.store import BatchStore
from gateway.batches.upload import read_upload
from gateway.bounds import Bounds, exceeded
from gateway.errors import APIError, ErrorKind, invalid_request
from gateway.openai import bodies
from gateway.openai.listing import list_page, list_params
from gateway.responses.conversations import parse_body

UPLOAD_PURPOSES = ("batch", "user_data")
FORM_FIELDS = {"file", "purpose", "expires_after[anchor]", "expires_after[seconds]"}
MAX_FILE_LIST_LIMIT = 10_000


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


def not_found(file_id: str, param: str | None = None) -> APIError:
    return APIError(ErrorKind.NOT_FOUND, f"No such File object: {file_id}", param=param)


def expires_at(seconds: int | None, anchor_time: int) -> int | None:
    """When a file created at `anchor_time` expires (`expires_after.seconds` after it), or None."""
    return None if seconds is None else anchor_time + seconds


class Files:
    """The file routes and what the batch runner reads and writes through them."""

    def __init__(
        self,
        store: BatchStore,
        blobs: Blobs,
        *,
        max_file_bytes: int,
        max_lines: int,
        bounds: Callable[[Caller], Bounds],
    ) -> None:
        self.store = store
        self.blobs = blobs
        self.max_file_bytes = max_file_bytes
        self.max_lines = max_lines
        self.bounds = bounds  # the caller's tenant's max_files and storage_quota_bytes

    async def check_room(
        self, caller: Caller, size: int, param: str = "file", what: str = "This file"
    ) -> None:
        """APIError 400 naming the bound when `size` more bytes in one more file would take the
        caller's tenant past its `max_files` or `storage_quota_bytes`."""
        bounds = self.bounds(caller)
        num_files, num_bytes = await self.store.file_usage(caller.name)
        if num_files + 1 > bounds.max_files:
            message = f"{what} would be your file number {num_files + 1:,}; delete files you no longer need"
            raise exceeded("max_files", bounds.max_files, message, param)
        if num_bytes + size > bounds.storage_quota_bytes:
            message = (
                f"{what} ({size:,} bytes) would take your files to {num_bytes + size:,} bytes; delete "
                "files you no longer need"
            )
            raise exceeded("storage_quota_bytes", bounds.storage_quota_bytes, message, param)

    async def write(
        self,
        caller: Caller,
        data: bytes,
        *,
        filename: str,
        purpose: str,
        expires_at: int | None = None,
        check_quota: bool = True,
        file_id: str | None = None,
    ) -> dict[str, Any]:
        """Store `data` as a file of the caller's tenant; its FileObject. `check_quota` False:
        a batch's output, which counts toward the quota but is never refused (it is the result
        of work done and billed). `file_id`: that id (written again, it is replaced), else a new one."""
        if check_quota:
            await self.check_room(caller, len(data))
        body: dict[str, Any] = {
            "id": file_id or new_file_id(),
            "object": "file",
            "bytes": len(data),
            "created_at": bodies.now(),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "expires_at": expires_at,
            "status_details": None,
        }
        await self.blobs.put(body["id"], data)
        await self.store.put_file(caller.name, body)
        return body

    async def find(self, caller: Caller, file_id: str, param: str | None = None) -> dict[str, Any]:
        body = await self.store.get_file(caller.name, file_id)
        if body is None or (body["expires_at"] is not None and body["expires_at"] <= bodies.now()):
            raise not_found(file_id, param)
        return body

    async def read(self, caller: Caller, file_id: str, param: str | None = None) -> bytes:
        await self.find(caller, file_id, param)
        data = await self.blobs.get(file_id)
        if data is None:
            raise not_found(file_id, param)
        return data

    # -- routes ----------------------------------------------------------------------------------

    async def create(self, caller: Caller, request: Request) -> Response:
        form = await read_upload(request, self.max_file_bytes)
        names = set(form.fields) | ({form.file_field} if form.file_field else set())
        unknown = sorted(names - FORM_FIELDS)
        if unknown:
            raise invalid_request(f"Unrecognized form field: {unknown[0]!r}.", param=unknown[0])
        data = form.file
        purpose = form.fields.get("purpose")
        if data is None or form.file_field != "file":
            raise invalid_request("'file' is required: the file to upload.", param="file")
        if purpose not in UPLOAD_PURPOSES:
            raise invalid_request(
                f"'purpose' must be one of {', '.join(UPLOAD_PURPOSES)}, got {purpose!r}.",
                param="purpose",
            )
        filename = form.filename or "upload"
        anchor = form.fields.get("expires_after[anchor]")
        seconds = form.fields.get("expires_after[seconds]")
        if purpose == "batch":
            self._check_batch_file(data)
        after = None
        if anchor is not None or seconds is not None:
            raw = {"anchor": anchor, "seconds": int(str(seconds)) if str(seconds).isdigit() else seconds}
            try:
                after = parse_body(ExpiresAfter, raw).seconds
            except APIError as exc:
                exc.param = f"expires_after.{exc.param}" if exc.param else "expires_after"
                raise
        expiry = expires_at(after, bodies.now())
        return JSONResponse(
            await self.write(caller, data, filename=filename, purpose=purpose, expires_at=expiry)
        )

    def _check_batch_file(self, data: bytes) -> None:
        if not data.strip():
            raise invalid_request(
                "The file is empty; a batch file has one JSON request per line.", param="file"
            )
        num_lines = sum(1 for line in data.splitlines() if line.strip())
        if num_lines > self.max_lines:
            raise invalid_request(
                f"A batch file has at most {self.max_lines} requests; this one has {num_lines}.", param="file"
            )

    async def list_all(self, caller: Caller, request: Request) -> Response:
        query = request.query_params
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise invalid_request("'order' must be 'asc' or 'desc'.", param="order")
        after, limit = list_params(query, MAX_FILE_LIST_LIMIT, MAX_FILE_LIST_LIMIT)
        rows = await self.store.list_files(
            caller.name, purpose=query.get("purpose"), after=after, limit=limit + 1, ascending=order == "asc"
        )
        now = bodies.now()
        rows = [r for r in rows if r["expires_at"] is None or r["expires_at"] > now]
        return JSONResponse(list_page(rows, limit))

    async def retrieve(self, caller: Caller, request: Request) -> Response:
        return JSONResponse(await self.find(caller, request.path_params["file_id"]))

    async def content(self, caller: Caller, request: Request) -> Response:
        data = await self.read(caller, request.path_params["file_id"])
        return Response(data, media_type="application/octet-stream")

    async def delete(self, caller: Caller, request: Request) -> Response:
        file_id = request.path_params["file_id"]
        await self.find(caller, file_id)
        await self.store.delete_file(caller.name, file_id)
        await self.blobs.delete(file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})
