"""One batch line's records: its ids, its journal entry when it could not run, its usage, and
when a refused line runs again."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import orjson

from gateway.backend import Endpoint
from gateway.batches.input import Line
from gateway.batches.store import (
    LineResult,
)
from gateway.errors import APIError, ErrorKind

if TYPE_CHECKING:
    from tenancy.tokens import TokenCounter


RETRIED = frozenset({ErrorKind.RATE_LIMITED, ErrorKind.OVERLOADED, ErrorKind.UNAVAILABLE})
MAX_RETRY_WAIT_S = 30.0
# What the lines that cannot run are told, by why.
STOP_MESSAGES = {
    "batch_cancelled": "This request was not executed because the batch was cancelled.",
    "batch_expired": "This request could not be executed before the completion window expired.",
    "insufficient_quota": "This request was not executed: a hard budget of your account was reached.",
}


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


def answer_usage(payload: Any) -> tuple[int, int, int]:
    """(input, cached, output) tokens of an answer body (chat, completions, embeddings, responses)."""
    usage = payload.get("usage") if isinstance(payload, dict) else None
    if not isinstance(usage, dict):
        return 0, 0, 0
    num_in = int(usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0)
    num_out = int(usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0)
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    return num_in, int(details.get("cached_tokens", 0) or 0), num_out


def retry_wait(exc: APIError) -> float | None:
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


def count_into(
    body: dict[str, Any], num_done: int, num_failed: int, num_in: int, num_cached: int, num_out: int
) -> None:
    """Set the batch's request_counts and usage from its journal's tally."""
    body["request_counts"].update(completed=num_done - num_failed, failed=num_failed)
    body["usage"] = usage_object(num_in, num_cached, num_out)


def usage_object(num_in: int, num_cached: int, num_out: int) -> dict[str, Any]:
    return {
        "input_tokens": num_in,
        "input_tokens_details": {"cached_tokens": num_cached},
        "output_tokens": num_out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": num_in + num_out,
    }


def stopped(endpoint: Endpoint, batch_id: str, line: Line, code: str) -> LineResult:
    line_id, _ = line_ids(endpoint, batch_id, line.custom_id)
    error = {"code": code, "message": STOP_MESSAGES[code]}
    text = orjson.dumps({"id": line_id, "custom_id": line.custom_id, "response": None, "error": error})
    return LineResult(line.custom_id, line.number, True, text)


def batch_error(code: str, message: str, param: str | None = None) -> dict[str, Any]:
    return {"code": code, "line": None, "message": message, "param": param}
