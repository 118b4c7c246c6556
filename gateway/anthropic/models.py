"""`GET /v1/models` and `GET /v1/models/{model}` as Anthropic's SDKs read them (the requests that
carry `anthropic-version`): `ModelInfo` objects in a page with `has_more`, `first_id`, `last_id`."""

from __future__ import annotations

import datetime
from collections.abc import Sequence

from gateway.anthropic.schemas import ModelInfo, ModelInfoPage


def model_info(model: str, created: int) -> ModelInfo:
    """One served model (or alias) as Anthropic's `ModelInfo`."""
    when = datetime.datetime.fromtimestamp(created, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"type": "model", "id": model, "display_name": model, "created_at": when}


def model_list(infos: Sequence[ModelInfo]) -> ModelInfoPage:
    """Every model in one page (the served models are few: `limit` and the page ids are not read)."""
    return {
        "data": list(infos),
        "has_more": False,
        "first_id": infos[0]["id"] if infos else None,
        "last_id": infos[-1]["id"] if infos else None,
    }
