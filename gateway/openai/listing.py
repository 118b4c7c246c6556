"""OpenAI's list objects (`object: "list"`, `first_id`, `last_id`, `has_more`) and their query's
`after` and `limit`: one shape for files, batches and conversation items."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.errors import invalid_request


def list_params(query: Mapping[str, str], default_limit: int, max_limit: int) -> tuple[str | None, int]:
    """`after` and `limit` of a list request (400 for a limit out of range)."""
    try:
        limit = int(query.get("limit", default_limit))
    except ValueError:
        limit = 0
    if not 1 <= limit <= max_limit:
        raise invalid_request(f"'limit' must be an integer from 1 to {max_limit}.", param="limit")
    return query.get("after") or None, limit


def list_page(rows: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """A list object from at least `limit + 1` rows, where there are more (the extra one says so)."""
    data = rows[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(rows) > limit,
    }
