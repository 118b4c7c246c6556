"""Responses turns that start outside a `POST /v1/responses`: a WebSocket's turns
(gateway/responses/websocket.py) and a compaction's summary (gateway/responses/compaction.py),
both through the pipeline as the POST runs them."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from gateway import admission, endpoints
from gateway.backend import Reply, new_id
from gateway.pipeline import Lifetime, Pipeline
from gateway.responses.compaction import SUMMARY_MAX_TOKENS, SUMMARY_PROMPT


class SocketTurns:
    """A Responses WebSocket's turns through the pipeline, as `POST /v1/responses` runs them."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    async def authenticate(self, headers: Mapping[str, str], user: str | None) -> admission.Caller:
        return await self.pipeline.authenticate(headers, user)

    async def start_turn(
        self, body: dict[str, Any], caller: admission.Caller, cached: Mapping[str, tuple[dict[str, Any], ...]]
    ) -> tuple[Lifetime, Reply]:
        return await self.pipeline.start_turn(endpoints.RESPONSES, body, caller, cached)


async def summarize(
    pipeline: Pipeline, caller: admission.Caller, model: str, conversation: Sequence[dict[str, Any]]
) -> tuple[str, dict[str, Any]]:
    """A compaction's summary (gateway/responses/compaction.py): a Responses turn through the
    pipeline continuing `conversation` (held as if a socket kept it), charged as any turn."""
    key = new_id("resp_")
    body = {
        "model": model,
        "input": SUMMARY_PROMPT,
        "previous_response_id": key,
        "store": False,
        "max_output_tokens": SUMMARY_MAX_TOKENS,
        "truncation": "auto",
        "temperature": 0,
    }
    cached = {key: tuple(conversation)}
    reply = await pipeline.answer(
        endpoints.RESPONSES, body, caller, new_id("resp_"), cached=cached, batch=False
    )
    payload = reply.payload
    answer: dict[str, Any] = json.loads(payload) if isinstance(payload, bytes) else dict(payload)
    texts = [
        part.get("text", "")
        for item in answer.get("output", ())
        if item.get("type") == "message"
        for part in item.get("content", ())
    ]
    return "".join(texts).strip(), dict(answer.get("usage") or {})
