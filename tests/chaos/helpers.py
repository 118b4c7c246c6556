"""What the chaos tests share: SSE requests run in threads, each recording how it ended."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class StreamResult:
    """One streaming request as its client saw it: status, data events, and how it ended."""

    status: int | None = None
    events: list[str] = field(default_factory=list)
    error: str | None = None  # a transport failure (cut connection), if any
    first_event: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def ended_with_done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    @property
    def error_events(self) -> list[dict[str, Any]]:
        return [p for p in self.payloads if "error" in p]

    @property
    def payloads(self) -> list[dict[str, Any]]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]

    @property
    def finish_reasons(self) -> list[str]:
        return [
            c["finish_reason"] for p in self.payloads for c in p.get("choices", ()) if c.get("finish_reason")
        ]


def stream_chat(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None, timeout_s: float = 120.0
) -> StreamResult:
    """Start a streaming chat request in a daemon thread; the result fills in as it runs."""
    result = StreamResult()

    def run() -> None:
        try:
            with (
                httpx.Client(timeout=timeout_s) as http,
                http.stream(
                    "POST", url + "/v1/chat/completions", json={**body, "stream": True}, headers=headers
                ) as r,
            ):
                result.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        result.events.append(line.removeprefix("data: "))
                        result.first_event.set()
        except httpx.HTTPError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        finally:
            result.first_event.set()
            result.done.set()

    threading.Thread(target=run, daemon=True).start()
    return result


def chat_body(model: str, content: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }
