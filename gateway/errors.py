"""The gateway's one error family and the one table that maps every error to HTTP.

Every error a client can see, from a malformed body to an engine failure, leaves through
`APIError` and comes back in OpenAI's shape::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "n", "code": null}}

`ERROR_TABLE` decides status, `type` and `code` per `ErrorKind`; engine errors map onto kinds by
their stable `code` (`ENGINE_ERROR_KINDS`), Starlette's own HTTP errors (unknown route, wrong
method) by status. Only a bug of ours is a 500 (`ErrorKind.INTERNAL`).

Another protocol says the same errors in its own words: a `Dialect` (OpenAI's is `OPENAI`;
Anthropic's, gateway/anthropic/errors.py) renders an `APIError` as a whole response and as an
event of a started stream, and says how its streams end. `Dialects` picks one per request, by
the route (and, on the routes every protocol shares, by the protocol's own header), for what the
core writes itself: the exception handlers, the drain's refusals, a relay's failure mid-stream.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from typing_extensions import TypedDict

from engine.types import EngineError, EngineOverloadedError, InvalidRequestError
from gateway.sse import DONE, encode_event

logger = logging.getLogger(__name__)

# The Retry-After of a 503 whose cause has no estimate of its own (an engine or batcher not
# running, a model still loading).
UNAVAILABLE_RETRY_AFTER_S = 5.0


class ErrorKind(enum.Enum):
    INVALID_REQUEST = "invalid_request"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    INVALID_API_KEY = "invalid_api_key"
    NOT_FOUND = "not_found"
    PREVIOUS_RESPONSE_NOT_FOUND = "previous_response_not_found"
    MODEL_NOT_FOUND = "model_not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    CONFLICT = "conflict"
    REQUEST_TOO_LARGE = "request_too_large"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    RATE_LIMITED = "rate_limited"
    INSUFFICIENT_QUOTA = "insufficient_quota"
    OVERLOADED = "overloaded"
    UNAVAILABLE = "unavailable"
    GENERATION_FAILED = "generation_failed"
    INTERNAL = "internal"


class Refusal(enum.Enum):
    """Why a request was refused before it ran; the value is the `reason` label of
    `batchgate_refusals` (gateway/metrics.py)."""

    RATE_LIMIT = "rate_limit"  # the tenant's limits (429)
    BUDGET = "budget"  # a hard budget cannot hold the request (429 insufficient_quota)
    DEADLINE = "deadline"  # it could not start before its queue deadline (503)
    OVERLOAD = "overload"  # a replica answered 502/503/504 (relayed)
    UNAVAILABLE = "unavailable"  # no engine, replica or rate limiter to take it (503)


@dataclass(frozen=True)
class ErrorSpec:
    status: int
    type: str
    code: str | None
    refusal: Refusal | None = None  # counted as a refusal with this reason


ERROR_TABLE: dict[ErrorKind, ErrorSpec] = {
    ErrorKind.INVALID_REQUEST: ErrorSpec(400, "invalid_request_error", None),
    ErrorKind.CONTEXT_LENGTH_EXCEEDED: ErrorSpec(400, "invalid_request_error", "context_length_exceeded"),
    ErrorKind.INVALID_API_KEY: ErrorSpec(401, "authentication_error", "invalid_api_key"),
    ErrorKind.NOT_FOUND: ErrorSpec(404, "invalid_request_error", "not_found"),
    # OpenAI's answer for a `previous_response_id` it does not have (or not for this key): a 400.
    ErrorKind.PREVIOUS_RESPONSE_NOT_FOUND: ErrorSpec(
        400, "invalid_request_error", "previous_response_not_found"
    ),
    ErrorKind.MODEL_NOT_FOUND: ErrorSpec(404, "invalid_request_error", "model_not_found"),
    ErrorKind.METHOD_NOT_ALLOWED: ErrorSpec(405, "invalid_request_error", "method_not_allowed"),
    ErrorKind.CONFLICT: ErrorSpec(409, "invalid_request_error", "conflict"),
    ErrorKind.REQUEST_TOO_LARGE: ErrorSpec(413, "invalid_request_error", "request_too_large"),
    ErrorKind.UNSUPPORTED_MEDIA_TYPE: ErrorSpec(415, "invalid_request_error", "unsupported_media_type"),
    ErrorKind.RATE_LIMITED: ErrorSpec(429, "rate_limit_error", "rate_limit_exceeded", Refusal.RATE_LIMIT),
    # OpenAI's answer for an exhausted quota: waiting does not help (x-should-retry: false).
    ErrorKind.INSUFFICIENT_QUOTA: ErrorSpec(429, "insufficient_quota", "insufficient_quota", Refusal.BUDGET),
    ErrorKind.OVERLOADED: ErrorSpec(503, "server_error", "server_overloaded", Refusal.DEADLINE),
    ErrorKind.UNAVAILABLE: ErrorSpec(503, "server_error", "engine_unavailable", Refusal.UNAVAILABLE),
    ErrorKind.GENERATION_FAILED: ErrorSpec(500, "server_error", "generation_failed"),
    ErrorKind.INTERNAL: ErrorSpec(500, "server_error", "internal_error"),
}

# Engine error `code` -> kind. An engine code missing here is a bug of ours (INTERNAL), on purpose:
# a new engine error must be given a status deliberately.
ENGINE_ERROR_KINDS: dict[str, ErrorKind] = {
    "context_length_exceeded": ErrorKind.CONTEXT_LENGTH_EXCEEDED,
    "server_overloaded": ErrorKind.OVERLOADED,
    "engine_unavailable": ErrorKind.UNAVAILABLE,
    "generation_failed": ErrorKind.GENERATION_FAILED,
    "invalid_grammar": ErrorKind.INVALID_REQUEST,
    "invalid_request": ErrorKind.INVALID_REQUEST,
    "invalid_adapter": ErrorKind.INVALID_REQUEST,
    "adapter_not_found": ErrorKind.MODEL_NOT_FOUND,
    "adapter_in_use": ErrorKind.CONFLICT,
}

# Starlette raises HTTPException for routing and protocol problems; these are the ones it raises.
_HTTP_STATUS_KINDS: dict[int, ErrorKind] = {
    400: ErrorKind.INVALID_REQUEST,
    404: ErrorKind.NOT_FOUND,
    405: ErrorKind.METHOD_NOT_ALLOWED,
    413: ErrorKind.REQUEST_TOO_LARGE,
    415: ErrorKind.UNSUPPORTED_MEDIA_TYPE,
}


class ErrorDetail(TypedDict):
    message: str
    type: str
    param: str | None
    code: str | None


class Error(TypedDict):
    """OpenAI's error object; also the payload of an SSE error event after a failure mid-stream."""

    error: ErrorDetail


class APIError(Exception):
    """An error to show the client: a kind from `ERROR_TABLE`, a message, and the offending field.

    `retry_after_s` becomes a `Retry-After` header (whole seconds, rounded up); `headers` are
    extra response headers (e.g. `x-ratelimit-*` from admission, `Allow` on a 405).
    """

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        param: str | None = None,
        retry_after_s: float | None = None,
        headers: dict[str, str] | None = None,
        code: str | None = None,
        type_: str | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        self.headers = dict(headers or {})
        self._code = code
        self._type = type_
        # Counted once by the pipeline; None where another count already has it (the engine
        # counts its own deadline refusals).
        self.refusal: Refusal | None = ERROR_TABLE[kind].refusal
        self.budget: tuple[str, str] | None = None  # a budget refusal's (metric, scope kind)

    @property
    def spec(self) -> ErrorSpec:
        return ERROR_TABLE[self.kind]

    @property
    def status(self) -> int:
        return self.spec.status

    def body(self) -> Error:
        """The OpenAI error object, also used as the payload of an SSE error event."""
        spec = self.spec
        return {
            "error": {
                "message": self.message,
                "type": self._type or spec.type,
                "param": self.param,
                "code": self._code if self._code is not None else spec.code,
            }
        }

    def response_headers(self) -> dict[str, str]:
        headers = dict(self.headers)
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return headers

    def to_response(self) -> Response:
        return JSONResponse(self.body(), status_code=self.status, headers=self.response_headers())


def invalid_request(message: str, param: str | None = None) -> APIError:
    return APIError(ErrorKind.INVALID_REQUEST, message, param=param)


def model_not_found(model: str, hint: str = "") -> APIError:
    """The 404 for a model name nobody serves (OpenAI's wording); `hint`: what is served instead."""
    return APIError(
        ErrorKind.MODEL_NOT_FOUND,
        f"The model `{model}` does not exist or you do not have access to it." + hint,
        param="model",
    )


def from_engine_error(exc: EngineError, *, param: str | None = None) -> APIError:
    """Map an engine error to its APIError by the error's stable `code`."""
    kind = ENGINE_ERROR_KINDS.get(exc.code)
    if kind is None:
        logger.error("engine error with unmapped code %r: %s", exc.code, exc)
        return APIError(ErrorKind.INTERNAL, "The server had an error while processing your request.")
    retry_after = exc.retry_after_s if isinstance(exc, EngineOverloadedError) else None
    if kind is ErrorKind.UNAVAILABLE and retry_after is None:
        retry_after = UNAVAILABLE_RETRY_AFTER_S
    if isinstance(exc, InvalidRequestError):
        # The engine's own check of the request (e.g. a token id outside the vocabulary): the
        # field it names, else the caller's (the prompt's field).
        param = exc.param or param
    elif kind is not ErrorKind.CONTEXT_LENGTH_EXCEEDED:
        param = None
    return APIError(kind, str(exc) or kind.value, param=param, retry_after_s=retry_after)


def from_http_exception(exc: HTTPException) -> APIError:
    kind = _HTTP_STATUS_KINDS.get(exc.status_code, ErrorKind.INVALID_REQUEST)
    if exc.status_code >= 500:
        kind = ErrorKind.INTERNAL
    headers = dict(exc.headers or {})
    return APIError(kind, str(exc.detail), headers=headers)


def json_error(kind: ErrorKind, message: str) -> Error:
    return APIError(kind, message).body()


def sse_error_event(error: APIError) -> bytes:
    return encode_event(error.body())


# -- dialects: the same errors in another protocol's words ----------------------------------------


class Dialect(Protocol):
    """How one API family writes what the core writes on its behalf: an error as a whole response
    and as an event of a stream already started, the end of its streams, and where its API key
    comes in."""

    @property
    def end_frame(self) -> bytes:
        """The frame a complete stream ends with; the request is settled before it goes out."""
        ...

    @property
    def end_after_error(self) -> bool:
        """Whether a stream ended by an error event still ends with `end_frame` (OpenAI's
        `[DONE]` does; Anthropic's `message_stop` does not)."""
        ...

    def is_last(self, frame: bytes) -> bool:
        """Whether `frame` ends a stream (a relay reads no further)."""
        ...

    def error_response(self, error: APIError) -> Response: ...

    def error_event(self, error: APIError) -> bytes: ...

    def authorization(self, headers: Mapping[str, str]) -> str | None:
        """The `Authorization` value the request's API key is read from (None: no key)."""
        ...

    @property
    def marker(self) -> str | None:
        """A header only this protocol's clients send: on the routes every protocol shares,
        a request that carries it is answered in this dialect."""
        ...


class OpenAIDialect:
    """OpenAI's: the error object above, `data: [DONE]` last (after an error event too), the key
    as `Authorization: Bearer <key>`."""

    end_frame = DONE
    end_after_error = True
    marker = None

    def is_last(self, frame: bytes) -> bool:
        return frame == DONE

    def error_response(self, error: APIError) -> Response:
        return error.to_response()

    def error_event(self, error: APIError) -> bytes:
        return sse_error_event(error)

    def authorization(self, headers: Mapping[str, str]) -> str | None:
        return headers.get("authorization")


OPENAI = OpenAIDialect()


@dataclass(frozen=True)
class Dialects:
    """The dialect of a request: a protocol's own routes (`routes`: a path and everything under
    it), and on the routes every protocol shares (`shared`: /v1/models) the protocol whose header
    the request carries (`markers`: the Anthropic SDK sends `anthropic-version` on every call);
    OpenAI's elsewhere."""

    routes: Mapping[str, Dialect]
    markers: Mapping[str, Dialect] = field(default_factory=dict)
    shared: tuple[str, ...] = ("/v1/models",)

    @classmethod
    def of_routes(cls, routes: Mapping[str, Dialect]) -> Dialects:
        """The dialects of these routes, each also where its marker header comes."""
        markers = {d.marker: d for d in routes.values() if d.marker is not None}
        return cls(routes, markers)

    def of(self, path: str, headers: Mapping[str, str]) -> Dialect:
        for route, dialect in self.routes.items():
            if path == route or path.startswith(route + "/"):
                return dialect
        if any(path == route or path.startswith(route + "/") for route in self.shared):
            for header, dialect in self.markers.items():
                if header in headers:
                    return dialect
        return OPENAI


# -- Starlette exception handlers ------------------------------------------------------------


def exception_handlers(dialects: Dialects) -> dict[Any, Any]:
    """Starlette's exception handlers: every error in the dialect of the request it answers."""

    def respond(request: Request, error: APIError) -> Response:
        return dialects.of(request.url.path, request.headers).error_response(error)

    async def handle_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return respond(request, exc)

    async def handle_http_exception(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        error = from_http_exception(exc)
        if error.kind is ErrorKind.NOT_FOUND:
            error.message = f"Unknown request URL: {request.method} {request.url.path}."
        elif error.kind is ErrorKind.METHOD_NOT_ALLOWED:
            error.message = f"Method {request.method} is not allowed for {request.url.path}."
        return respond(request, error)

    async def handle_unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        error = APIError(ErrorKind.INTERNAL, "The server had an error while processing your request.")
        return respond(request, error)

    handlers: dict[Any, Callable[[Request, Exception], Any]] = {
        APIError: handle_api_error,
        HTTPException: handle_http_exception,
        Exception: handle_unexpected,
    }
    return handlers


EXCEPTION_HANDLERS = exception_handlers(Dialects({}))
