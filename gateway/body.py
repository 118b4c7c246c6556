"""Reading a request body: JSON only, size-limited, and decoded into values the server can use;
and, once it is read, watching the connection for the client leaving.

Every failure is an APIError in OpenAI's shape: 415 for a Content-Type that is not JSON, 413 for
a body over the limit, 400 for anything that does not decode (bad JSON, bad UTF-8, NaN, nesting
deeper than `MAX_JSON_DEPTH`, half a surrogate pair). `decode_json` is that decoding alone, also
what a Batch API line goes through (gateway/batches/input.py), so a line is refused exactly as the
same body would be.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect, Request

from gateway.errors import APIError, ErrorKind, invalid_request

# How much of an oversized body is read (and dropped) before answering 413, so that the client
# finishes sending and reads the answer instead of seeing a reset connection.
_DRAIN_MAX_BYTES = 16 * 1024 * 1024
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# Deeper JSON than this is refused (no request needs it; orjson, which writes stored state and
# batch outputs, stops at 255, and Python's parser at about 1,000).
MAX_JSON_DEPTH = 128

T = TypeVar("T")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request, max_body_bytes: int) -> Any:
    """The request's JSON body; APIError 415 (not JSON), 413 (too large) or 400 (malformed)."""
    content_type = request.headers.get("content-type")
    if content_type is not None:
        media_type = content_type.split(";", 1)[0].strip().lower()
        if media_type != "application/json" and not media_type.endswith("+json"):
            raise APIError(
                ErrorKind.UNSUPPORTED_MEDIA_TYPE,
                f"Content-Type must be application/json, got {media_type or 'nothing'!r}.",
            )
    chunks: list[bytes] = []
    size = 0
    too_large = False
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body_bytes:
        too_large = True
    try:
        if not too_large or int(declared) <= _DRAIN_MAX_BYTES:
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_body_bytes:
                    too_large = True
                if size > _DRAIN_MAX_BYTES:
                    break
                if not too_large:
                    chunks.append(chunk)
    except ClientDisconnect:
        # Nobody will read the answer; this keeps it from being logged as a server error.
        raise invalid_request("The client disconnected while sending the request body.") from None
    if too_large:
        raise APIError(
            ErrorKind.REQUEST_TOO_LARGE,
            f"The request body is larger than this server accepts ({max_body_bytes} bytes).",
        )
    body = b"".join(chunks)
    if not body.strip():
        raise invalid_request("The request body is empty; expected a JSON object.")
    return decode_json(body)


def decode_json(body: bytes, what: str = "the JSON body of your request") -> Any:
    """`body` decoded; APIError 400 (saying what failed in `what`) for bad JSON or UTF-8, NaN,
    nesting deeper than MAX_JSON_DEPTH, or half a surrogate pair."""
    try:
        value = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        # UnicodeDecodeError is a ValueError; RecursionError comes from absurdly deep nesting.
        if isinstance(exc, RecursionError):
            raise invalid_request(_too_deep(what)) from None
        raise invalid_request(
            f"We could not parse {what} ({type(exc).__name__}: {exc}). The OpenAI API expects a JSON payload."
        ) from None
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and _depth(value) > MAX_JSON_DEPTH:
        raise invalid_request(_too_deep(what))
    # JSON may escape half a surrogate pair ("\ud800"); Python accepts it into a str that no
    # tokenizer (nor UTF-8) can encode. Only a body with such an escape pays for the full check.
    if _ESCAPED_SURROGATE.search(body):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise invalid_request(
                f"{what[0].upper()}{what[1:]} contains invalid Unicode: an unpaired surrogate escape "
                "such as \\ud800."
            ) from None
    return value


def _too_deep(what: str) -> str:
    return f"We could not parse {what}: its arrays and objects nest deeper than {MAX_JSON_DEPTH} levels."


def _depth(value: Any) -> int:
    """How deep arrays and objects nest in `value` (a scalar: 0), without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((child, depth + 1) for child in item)
    return deepest


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None if the client disconnected first (``work`` is then cancelled,
    so its cleanup runs: the engine sequence is aborted, the upstream call closed).

    Call only after the body was read: this consumes the connection's next ASGI messages, and
    after the body the only one left to come is ``http.disconnect``. Waiting for a request's
    first output with this is what frees a queued request's place and lease as soon as its
    client leaves, instead of at its first token.
    """

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    working = asyncio.ensure_future(work)
    watching = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({working, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not working.done():
            working.cancel()
        await asyncio.gather(working, watching, return_exceptions=True)
    if working.cancelled():
        return None
    return working.result()
