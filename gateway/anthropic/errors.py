"""Anthropic's dialect: the one error map of the protocol, its event framing, and its API key.

Every `APIError` keeps its kind; only its words change. A whole error is Anthropic's shape with
the status of `ERROR_MAP`::

    {"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}

and inside a stream already started it is an `error` event, the stream's last (no
`message_stop` follows). Refusals that waiting cures keep their `retry-after` (a shed request is
a 529 `overloaded_error`, as Anthropic's own); a budget refusal keeps `x-should-retry: false`,
which Anthropic's SDKs honour as OpenAI's do. No error of ours is a 403 `permission_error`: a
tenant's model it may not use is a 404, as for OpenAI's protocol.

Events are framed as Anthropic frames them: `event: <type>` then `data: <json>`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from starlette.responses import JSONResponse, Response

from gateway.anthropic.schemas import ErrorResponse, ErrorType, MessageStreamEvent
from gateway.errors import APIError, ErrorKind

# ErrorKind -> (HTTP status, Anthropic's error type). Anthropic uses invalid_request_error for the
# 4xx it has no type of its own for (405, 409, 415).
ERROR_MAP: dict[ErrorKind, tuple[int, ErrorType]] = {
    ErrorKind.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorKind.CONTEXT_LENGTH_EXCEEDED: (400, "invalid_request_error"),
    ErrorKind.INVALID_API_KEY: (401, "authentication_error"),
    ErrorKind.NOT_FOUND: (404, "not_found_error"),
    ErrorKind.PREVIOUS_RESPONSE_NOT_FOUND: (400, "invalid_request_error"),
    ErrorKind.MODEL_NOT_FOUND: (404, "not_found_error"),
    ErrorKind.METHOD_NOT_ALLOWED: (405, "invalid_request_error"),
    ErrorKind.CONFLICT: (409, "invalid_request_error"),
    ErrorKind.REQUEST_TOO_LARGE: (413, "request_too_large"),
    ErrorKind.UNSUPPORTED_MEDIA_TYPE: (415, "invalid_request_error"),
    ErrorKind.RATE_LIMITED: (429, "rate_limit_error"),
    ErrorKind.INSUFFICIENT_QUOTA: (429, "rate_limit_error"),
    ErrorKind.OVERLOADED: (529, "overloaded_error"),
    ErrorKind.UNAVAILABLE: (529, "overloaded_error"),
    ErrorKind.GENERATION_FAILED: (500, "api_error"),
    ErrorKind.INTERNAL: (500, "api_error"),
}
# A gateway in front of replicas answers it as they do: retried on another replica (pool/relay.py).
OVERLOADED_STATUS = 529


def error_body(error: APIError) -> ErrorResponse:
    """Anthropic's error object (also an `error` event's data)."""
    return {"type": "error", "error": {"type": ERROR_MAP[error.kind][1], "message": error.message}}


def event(payload: MessageStreamEvent) -> bytes:
    """One server-sent event as Anthropic frames it (its type named twice, as Anthropic does)."""
    data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"event: {payload['type']}\ndata: {data}\n\n".encode()


MESSAGE_STOP = event({"type": "message_stop"})
_ERROR_EVENT = b"event: error\n"


class AnthropicDialect:
    """The Messages API's dialect (gateway/errors.py's `Dialect`): Anthropic's error shape and
    statuses, `message_stop` last, and the key in `x-api-key` (or `Authorization: Bearer`, which
    Claude Code sends with ANTHROPIC_AUTH_TOKEN)."""

    end_frame = MESSAGE_STOP
    end_after_error = False
    marker = "anthropic-version"  # every Anthropic SDK request carries it

    def is_last(self, frame: bytes) -> bool:
        return frame == MESSAGE_STOP or frame.startswith(_ERROR_EVENT)

    def error_response(self, error: APIError) -> Response:
        return JSONResponse(error_body(error), ERROR_MAP[error.kind][0], headers=error.response_headers())

    def error_event(self, error: APIError) -> bytes:
        return event({"type": "error", "error": error_body(error)["error"]})

    def authorization(self, headers: Mapping[str, str]) -> str | None:
        given = headers.get("authorization")
        if given is not None:
            return given
        key = headers.get("x-api-key")
        return None if key is None else f"Bearer {key.strip()}"


ANTHROPIC = AnthropicDialect()
