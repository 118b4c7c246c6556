"""A replica's answer as it passes through the gateway: its SSE frames read whole, and what they
say of the request's usage (tokens, response id, finish reasons) for settlement and the span."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import httpx

from gateway.anthropic import output as messages_output
from gateway.backend import Usage
from gateway.responses.output import TEXT_EVENTS
from gateway.telemetry import ChatSpan


async def stop_read(task: asyncio.Task[bytes]) -> None:
    """Cancel `task` (a read of the replica's stream) once and wait until it has ended. Its
    cancellation makes httpcore close the connection, shielded; a second cancel would cut that
    close short and leave the connection open, the replica generating for nobody."""
    if not task.done():
        if not task.cancelling():
            task.cancel()
        await asyncio.wait({task})


class UpstreamEnded(Exception):
    """The replica's stream ended before its last frame (`[DONE]`, Anthropic's `message_stop`)."""


async def read_frames(response: httpx.Response) -> AsyncGenerator[bytes, None]:
    """Complete SSE frames (`data: ...\\n\\n`) from a replica's stream; comments are dropped."""
    lines: list[str] = []
    async for line in response.aiter_lines():
        if line == "":
            if lines:
                yield ("\n".join(lines) + "\n\n").encode()
                lines = []
            continue
        if line.startswith(":"):
            continue  # keep-alive; ours are sent by our own EventStreamResponse
        lines.append(line)
    raise UpstreamEnded("the stream ended without [DONE]")


async def no_frames() -> AsyncGenerator[bytes, None]:
    """No frames: what a whole (non-streamed) answer is read as."""
    return
    yield b""


class Observer:
    """Reads tokens, response id and finish reasons from what the replica sends back into the
    call's `Usage`."""

    def __init__(self, usage: Usage, span: ChatSpan) -> None:
        self.usage = usage
        self.span = span
        usage.final = False  # until the replica's usage comes: the counts are exact then
        self.usage_only = False  # the last frame observed carried usage and no choices

    @property
    def reported(self) -> bool:
        """The replica's usage came: the counts are exact."""
        return self.usage.final

    def observe_body(self, payload: bytes) -> None:
        self.usage.served = True
        try:
            body = json.loads(payload)
            self.usage.response_id = str(body.get("id")) if body.get("id") else None
            for choice in body.get("choices") or ():
                self.span.finish_reason(int(choice.get("index", 0)), choice.get("finish_reason"))
            u = body["usage"]
            if body.get("object") == "response":
                self._response_usage(u)
                return
            if body.get("type") == "message":
                self._message_usage(u)
                self.span.finish_reason(0, str(body.get("stop_reason")))
                return
            self.usage.num_prompt_tokens = int(u["prompt_tokens"])
            self.usage.num_completion_tokens = int(u.get("completion_tokens", 0))  # embeddings have none
            details = u.get("prompt_tokens_details")
            if isinstance(details, dict) and details.get("cached_tokens") is not None:
                self.usage.num_cached_tokens = int(details["cached_tokens"])
        except (ValueError, KeyError, TypeError, AttributeError):
            pass

    def observe(self, frame: bytes) -> bool:
        """Account one data frame; True if it carried generated text."""
        if frame.startswith(b"event: "):
            return self._observe_event(frame)
        try:
            event = json.loads(frame[len(b"data: ") :])
        except ValueError:
            return False
        if not isinstance(event, dict):
            return False
        if self.usage.response_id is None and event.get("id"):
            self.usage.response_id = str(event["id"])
        u = event.get("usage")
        self.usage_only = isinstance(u, dict) and not event.get("choices")
        if isinstance(u, dict):
            self.usage.num_prompt_tokens = int(u.get("prompt_tokens", self.usage.num_prompt_tokens))
            self.usage.num_completion_tokens = int(
                u.get("completion_tokens", self.usage.num_completion_tokens)
            )
            self.usage.final = True
            details = u.get("prompt_tokens_details")
            if isinstance(details, dict) and details.get("cached_tokens") is not None:
                self.usage.num_cached_tokens = int(details["cached_tokens"])
        carried = False
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if choice.get("finish_reason"):
                self.span.finish_reason(int(choice.get("index", 0)), str(choice["finish_reason"]))
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("tool_calls") or choice.get("text"):  # tool calls count too
                carried = True
                if not self.reported:
                    self.usage.num_completion_tokens += 1  # one per chunk: an estimate, corrected by usage
        return carried

    def _response_usage(self, u: dict[str, Any]) -> None:
        """A Responses API `usage` object (input, output and cached tokens)."""
        self.usage.num_prompt_tokens = int(u["input_tokens"])
        self.usage.num_completion_tokens = int(u["output_tokens"])
        details = u.get("input_tokens_details")
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            self.usage.num_cached_tokens = int(details["cached_tokens"])

    def _message_usage(self, u: dict[str, Any]) -> None:
        """Anthropic's `usage`: the prompt is its input, cache-read and cache-write tokens."""
        cached = int(u.get("cache_read_input_tokens") or 0)
        written = int(u.get("cache_creation_input_tokens") or 0)
        self.usage.num_prompt_tokens = int(u["input_tokens"]) + cached + written
        self.usage.num_cached_tokens = cached
        self.usage.num_completion_tokens = int(u["output_tokens"])

    def _observe_event(self, frame: bytes) -> bool:
        """A typed event: a Responses stream's (text and argument deltas, and the terminal event's
        response: its id and usage) or a Messages stream's (block deltas; the message's id at its
        start, its usage at its end)."""
        kind = frame[len(b"event: ") : frame.find(b"\n")]
        if kind in TEXT_EVENTS or kind in messages_output.TEXT_EVENTS:
            if not self.reported:
                self.usage.num_completion_tokens += 1  # an estimate, corrected by the final usage
            return True
        if kind in (b"message_start", b"message_delta"):
            self._message_event(frame)
            return False
        if not kind.startswith(b"response."):
            return False
        try:
            response = json.loads(frame.split(b"\ndata: ", 1)[1])["response"]
            self.usage.response_id = str(response["id"])
            u = response.get("usage")
            if isinstance(u, dict):
                self._response_usage(u)
                self.usage.final = True
        except (ValueError, KeyError, TypeError, IndexError):
            pass
        return False

    def _message_event(self, frame: bytes) -> None:
        """`message_start` names the message; `message_delta` has its final usage."""
        try:
            payload = json.loads(frame.split(b"\ndata: ", 1)[1])
            if payload["type"] == "message_start":
                self.usage.response_id = str(payload["message"]["id"])
                return
            self._message_usage(payload["usage"])
            self.usage.final = True
            self.span.finish_reason(0, str(payload["delta"]["stop_reason"]))
        except (ValueError, KeyError, TypeError, IndexError):
            pass
