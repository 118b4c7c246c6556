"""A batch's input file, validated line by line before anything runs (as OpenAI does): each line
`{"custom_id", "method": "POST", "url", "body"}`, decoded as an interactive request's body is
(gateway/body.py's `decode_json`: nesting deeper than its limit or half a surrogate pair is that
line's `invalid_json_line`, never the batch's internal error), its url the batch's endpoint, its
body what that endpoint accepts (the endpoint's own parser, so a line is refused here exactly as
the same request would be interactively), its custom_id unique, no `stream`, and its model served
(`unserved`).

    parse_lines(data, endpoint) -> (lines, errors)   errors: OpenAI's `errors.data` items
    unserved(lines, endpoint, registry) -> errors
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field

from gateway import endpoints
from gateway.admission import Caller
from gateway.backend import Endpoint
from gateway.body import decode_json
from gateway.errors import APIError
from gateway.openai.protocol import StrictModel
from gateway.registry import ModelRegistry
from gateway.responses.conversations import Metadata

# The endpoints a batch may name (OpenAI's, less those this server does not serve).
BATCH_ENDPOINTS: dict[str, Endpoint] = {
    e.path: e for e in (endpoints.CHAT, endpoints.COMPLETIONS, endpoints.EMBEDDINGS, endpoints.RESPONSES)
}
# At most this many line errors are reported (OpenAI reports the first ones too).
MAX_REPORTED_ERRORS = 100
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 30 * 24 * 3600  # OpenAI's bounds on expires_after.seconds


class ExpiresAfter(StrictModel):
    """When a file expires: `seconds` after its creation."""

    anchor: Literal["created_at"]
    seconds: Annotated[int, Field(ge=MIN_EXPIRY_S, le=MAX_EXPIRY_S)]


class BatchCreateRequest(StrictModel):
    """POST /v1/batches."""

    input_file_id: Annotated[str, Field(min_length=1)]
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]
    completion_window: Literal["24h"]
    metadata: Metadata | None = None
    output_expires_after: ExpiresAfter | None = None


@dataclass(frozen=True)
class Line:
    number: int  # 1-based, as OpenAI numbers them
    custom_id: str
    body: dict[str, Any]
    model: str


def _error(code: str, line: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"code": code, "line": line, "message": message, "param": param}


def _line(number: int, raw: bytes, endpoint: Endpoint) -> Line | dict[str, Any]:
    try:
        item = decode_json(raw, "this line")
    except APIError as exc:
        return _error("invalid_json_line", number, exc.message)
    if not isinstance(item, dict):
        return _error("invalid_json_line", number, "Each line must be a JSON object.")
    for field in ("custom_id", "method", "url", "body"):
        if field not in item:
            return _error(
                "missing_required_parameter", number, f"Missing required parameter: '{field}'.", field
            )
    unknown = sorted(set(item) - {"custom_id", "method", "url", "body"})
    if unknown:
        return _error("invalid_request", number, f"Unrecognized parameter: '{unknown[0]}'.", unknown[0])
    custom_id, body = item["custom_id"], item["body"]
    if not isinstance(custom_id, str) or not custom_id:
        return _error("invalid_request", number, "'custom_id' must be a non-empty string.", "custom_id")
    if item["method"] != "POST":
        return _error("invalid_request", number, "'method' must be 'POST'.", "method")
    if item["url"] != endpoint.path:
        return _error(
            "mismatched_endpoint",
            number,
            f"The url '{item['url']}' does not match the batch's endpoint '{endpoint.path}'.",
            "url",
        )
    if not isinstance(body, dict):
        return _error("invalid_request", number, "'body' must be a JSON object.", "body")
    if body.get("stream"):
        return _error(
            "invalid_request", number, "Batch requests cannot stream: remove 'stream'.", "body.stream"
        )
    try:
        req = endpoint.parse(body)
    except APIError as exc:
        param = f"body.{exc.param}" if exc.param else "body"
        return _error(exc.body()["error"]["code"] or "invalid_request", number, exc.message, param)
    return Line(number, custom_id, body, req.model)


def parse_lines(data: bytes, endpoint: Endpoint) -> tuple[list[Line], list[dict[str, Any]]]:
    """Every line of `data` (blank ones skipped, numbered as in the file), and the errors found."""
    lines: list[Line] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    for number, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        parsed = _line(number, raw, endpoint)
        if isinstance(parsed, Line) and parsed.custom_id in seen:
            parsed = _error(
                "duplicate_custom_id",
                number,
                f"The custom_id '{parsed.custom_id}' is used twice.",
                "custom_id",
            )
        if isinstance(parsed, Line):
            seen.add(parsed.custom_id)
            lines.append(parsed)
        elif len(errors) < MAX_REPORTED_ERRORS:
            errors.append(parsed)
    if not lines and not errors:
        errors.append(_error("empty_file", 0, "The input file has no requests."))
    return lines, errors


async def unserved(
    lines: list[Line], endpoint: Endpoint, registry: ModelRegistry, caller: Caller
) -> list[dict[str, Any]]:
    """An error for each line whose model is not served for `endpoint` (each model resolved once;
    a 503 while models load is raised, so validation is retried rather than failed)."""
    refused: dict[str, APIError | None] = {}
    errors: list[dict[str, Any]] = []
    for line in lines:
        if line.model not in refused:
            try:
                await registry.resolve(line.model, endpoint, caller)
                refused[line.model] = None
            except APIError as exc:
                if exc.status >= 500:
                    raise
                refused[line.model] = exc
        refusal = refused[line.model]
        if refusal is not None and len(errors) < MAX_REPORTED_ERRORS:
            code = refusal.body()["error"]["code"] or "invalid_request"
            errors.append(_error(code, line.number, refusal.message, "body.model"))
    return errors
