"""Multipart uploads read as they stream (gateway/batches/upload.py): counted as they arrive,
refused at the file limit plus the multipart overhead, and never spooled to a temporary file."""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.batches.upload import MULTIPART_OVERHEAD, read_upload
from gateway.errors import EXCEPTION_HANDLERS

LIMIT = 1 << 20
BOUNDARY = "----batchgate-test"


class Counted:
    """An ASGI app wrapper counting the request body bytes the app received."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.received = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def counting() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                self.received += len(message.get("body", b""))
            return message

        await self.app(scope, counting, send)


async def upload(request: Request) -> Response:
    form = await read_upload(request, LIMIT)
    size = None if form.file is None else len(form.file)
    return JSONResponse({"fields": form.fields, "filename": form.filename, "size": size})


@pytest.fixture
def app() -> Counted:
    return Counted(
        Starlette(routes=[Route("/upload", upload, methods=["POST"])], exception_handlers=EXCEPTION_HANDLERS)
    )


def head(name: str, filename: str | None = None) -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    return f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n\r\n".encode()


def body(file: bytes, **fields: str) -> bytes:
    parts = b"".join(head(k) + v.encode() + b"\r\n" for k, v in fields.items())
    return parts + head("file", "data.jsonl") + file + f"\r\n--{BOUNDARY}--\r\n".encode()


HEADERS = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}


async def post(app: Counted, content: Any, headers: dict[str, str] = HEADERS) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post("/upload", content=content, headers=headers)


async def test_a_form_within_the_limit_is_read_whole(app: Counted) -> None:
    r = await post(app, body(b"x" * LIMIT, purpose="batch"))
    assert r.status_code == 200, r.text
    assert r.json() == {"fields": {"purpose": "batch"}, "filename": "data.jsonl", "size": LIMIT}


async def test_a_chunked_24_mib_upload_is_refused_before_2_mib_and_nothing_is_spooled(
    app: Counted, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spool = tmp_path / "tmp"
    spool.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spool))  # where a spooled file part would go
    sent = 0

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: sent chunked
        nonlocal sent
        yield head("purpose") + b"batch\r\n" + head("file", "big.jsonl")
        for _ in range(24 * 16):
            sent += 64 * 1024
            yield b"y" * (64 * 1024)
        yield f"\r\n--{BOUNDARY}--\r\n".encode()

    r = await post(app, chunks())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert app.received < 2 * LIMIT and app.received <= LIMIT + MULTIPART_OVERHEAD + 64 * 1024
    assert list(spool.iterdir()) == []


async def test_a_declared_length_over_the_limit_is_refused_before_reading(app: Counted) -> None:
    r = await post(app, body(b"z" * (2 * LIMIT)))
    assert r.status_code == 413 and app.received == 0


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"--not-the-boundary\r\n" + body(b"a"), "not valid multipart"),
        (body(b"a", **{f"f{i}": "v" for i in range(9)}), "Too many form fields"),
        (body(b"a", purpose="p" * 2000), "longer than"),
        (head("file", "a") + b"x\r\n" + head("other", "b") + f"y\r\n--{BOUNDARY}--\r\n".encode(), "one file"),
    ],
)
async def test_malformed_forms_are_a_400(app: Counted, content: bytes, problem: str) -> None:
    r = await post(app, content)
    assert r.status_code == 400 and problem in r.json()["error"]["message"], r.text


async def test_not_multipart_is_a_415(app: Counted) -> None:
    r = await post(app, b"{}", {"content-type": "application/json"})
    assert r.status_code == 415
