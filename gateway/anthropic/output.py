"""From engine outputs to Anthropic's message object and its event stream.

A message has one choice. Its text is split by the reader chat uses for the model's family
(gateway/openai/formats.py: its tool-call syntax, its reasoning, which is left out) into content
blocks, in the order the model wrote them: `text`, and `tool_use` (its `input` the call's
arguments). The stream is Anthropic's:

    message_start (usage so far), ping,
      per block: content_block_start, content_block_delta... (text_delta | input_json_delta),
                 content_block_stop
    message_delta (stop_reason, stop_sequence, usage), message_stop

An error after the first byte is an `error` event, the stream's last. The whole message is the
stream's blocks assembled (one writer builds both), so a streamed message and a whole one read
the same.

`usage` is Anthropic's: `input_tokens` are the prompt tokens not read from the prefix cache,
`cache_read_input_tokens` those read from it (their sum is the prompt, which count_tokens
counts), `cache_creation_input_tokens` 0 (the cache is written without being asked).
`stop_reason`: `end_turn`, `max_tokens` (max_tokens, or the window's room it was cut to),
`tool_use`, or `stop_sequence` with the one that matched.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from gateway.anthropic.errors import ANTHROPIC, MESSAGE_STOP, event
from gateway.anthropic.request import MessagesRequest
from gateway.anthropic.schemas import (
    ContentBlock,
    ContentBlockDelta,
    Message,
    MessageDelta,
    MessageUsage,
    StopReason,
    ToolUseBlock,
)
from gateway.openai import bodies, generation
from gateway.openai.generation import Job, Outputs
from gateway.openai.parsers import DeltaParser
from gateway.openai.tokenizer import Tokenizer

# A relay's estimate of the tokens streamed so far counts these (gateway/pool/frames.py).
TEXT_EVENTS = (b"content_block_delta",)


def usage(num_prompt_tokens: int, num_cached_tokens: int, num_output_tokens: int) -> MessageUsage:
    return {
        "input_tokens": num_prompt_tokens - num_cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": num_cached_tokens,
        "output_tokens": num_output_tokens,
    }


def tool_use_id(call_id: str) -> str:
    """Anthropic's id of a call chat's parser named `call_<hex>`."""
    return "toolu_" + call_id.removeprefix("call_")


def matched_stop(tokenizer: Tokenizer, token_ids: Sequence[int], stops: Sequence[str]) -> str | None:
    """The stop sequence that ended an output, if one did: the engine cuts a matched stop string
    from the text, not from the tokens, and no stop string is in the text before it (the output
    would have ended there), so the first one in the tokens' text is the one."""
    if not stops:
        return None
    text = tokenizer.decode(token_ids)
    found = [(text.find(s), s) for s in stops if s in text]
    return min(found)[1] if found else None


@dataclass
class Blocks:
    """The content blocks of one message as its text comes (see the module docstring): `feed`
    returns the events each piece adds, `close` those that end the last block; `content` holds
    the blocks, the open one last. Whitespace before any block is held, and dropped if a call
    comes next (chat's parser drops it after calls)."""

    parser: DeltaParser | None  # the model family's reader of calls and reasoning; None: plain text
    content: list[ContentBlock] = field(default_factory=list)
    num_calls: int = 0
    _open: bool = False
    _held: str = ""
    _args: list[str] = field(default_factory=list)

    def feed(self, text: str, final: bool = False) -> list[bytes]:
        if self.parser is None:
            return self._text(text) if text else []
        frames: list[bytes] = []
        for delta in self.parser.feed(text, final=final):
            if "reasoning_content" in delta:
                continue  # not shown: `thinking` is accepted and ignored (docs/MESSAGES.md)
            if "content" in delta:
                frames += self._text(delta["content"] or "")
                continue
            for part in delta["tool_calls"]:
                function = part.get("function", {})
                if "id" in part:
                    frames += self._start_call(part["id"], function.get("name", ""))
                fragment = function.get("arguments", "")
                if fragment and self._open and self.content[-1]["type"] == "tool_use":
                    self._args.append(fragment)
                    frames.append(self._delta({"type": "input_json_delta", "partial_json": fragment}))
        return frames

    def close(self) -> list[bytes]:
        frames: list[bytes] = []
        if self._held and not self.num_calls:
            frames += self._start({"type": "text", "text": ""})
            frames += self._append_text(self._held)
        self._held = ""
        return frames + self._stop()

    def _text(self, text: str) -> list[bytes]:
        if self._open and self.content[-1]["type"] == "text":
            return self._append_text(text)
        if not (self._held + text).strip():
            self._held += text
            return []
        text, self._held = self._held + text, ""
        return self._start({"type": "text", "text": ""}) + self._append_text(text)

    def _append_text(self, text: str) -> list[bytes]:
        block = self.content[-1]
        assert block["type"] == "text"  # an open text block
        block["text"] += text
        return [self._delta({"type": "text_delta", "text": text})]

    def _start_call(self, call_id: str, name: str) -> list[bytes]:
        self._held = ""
        self.num_calls += 1
        block: ToolUseBlock = {"type": "tool_use", "id": tool_use_id(call_id), "name": name, "input": {}}
        frames = self._start(block)  # the open call's input is read as it closes
        self._args = []
        return frames

    def _start(self, block: ContentBlock) -> list[bytes]:
        frames = self._stop()
        self.content.append(block)
        self._open = True
        copy: ContentBlock = {**block}  # type: ignore[assignment]  # its state as it started
        start = event({"type": "content_block_start", "index": len(self.content) - 1, "content_block": copy})
        return [*frames, start]

    def _delta(self, delta: ContentBlockDelta) -> bytes:
        return event({"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta})

    def _stop(self) -> list[bytes]:
        if not self._open:
            return []
        block = self.content[-1]
        if block["type"] == "tool_use":
            block["input"] = _input_of("".join(self._args))
        self._open = False
        return [event({"type": "content_block_stop", "index": len(self.content) - 1})]


def _input_of(arguments: str) -> dict[str, object]:
    """A call's input: its arguments, or {} where they were cut short (max_tokens)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_of(
    reason: str | None, num_calls: int, job: Job, token_ids: Sequence[int], stops: Sequence[str]
) -> tuple[StopReason, str | None]:
    """(stop_reason, stop_sequence) of a finished choice."""
    if reason == "length":
        return "max_tokens", None
    if num_calls:
        return "tool_use", None
    matched = matched_stop(job.tokenizer, token_ids, stops)
    return ("stop_sequence", matched) if matched is not None else ("end_turn", None)


def skeleton(job: Job) -> Message:
    """The message before any output."""
    return {
        "id": job.request_id,
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": job.model,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage(job.num_prompt_tokens, job.num_cached_tokens, 0),
    }


def message_body(req: MessagesRequest, job: Job, choice: bodies.Choice) -> Message:
    """The whole message of a gathered choice."""
    blocks = Blocks(job.parser() if job.parser is not None else None)
    blocks.feed(choice.text, final=True)
    blocks.close()
    reason, sequence = stop_of(
        choice.final_reason, blocks.num_calls, job, choice.token_ids, req.stop_sequences or ()
    )
    body = skeleton(job)
    body["content"] = blocks.content
    body["stop_reason"] = reason
    body["stop_sequence"] = sequence
    body["usage"] = usage(job.num_prompt_tokens, job.num_cached_tokens, choice.num_output_tokens)
    return body


async def message_events(req: MessagesRequest, outputs: Outputs, job: Job) -> AsyncIterator[bytes]:
    """The event stream of one message (see the module docstring)."""
    blocks = Blocks(job.parser() if job.parser is not None else None)
    token_ids: list[int] = []
    num_output, reason, started = 0, None, False
    try:
        async for index, out in outputs:
            error = generation.item_error((index, out))
            if error is not None:
                raise error
            num_output = max(num_output, out.num_output_tokens)
            token_ids.extend(out.new_token_ids)
            job.observe(out)  # the prompt tokens read from the cache are known from the first output
            job.on_usage(num_output)
            if not started:
                started = True
                yield event({"type": "message_start", "message": skeleton(job)})
                yield event({"type": "ping"})
            for frame in blocks.feed(out.new_text, final=out.finished):
                yield frame
            if out.finished:
                reason = bodies.finish_reason_of(out)
        if not started:
            yield event({"type": "message_start", "message": skeleton(job)})
        for frame in blocks.close():
            yield frame
        stop_reason, sequence = stop_of(reason, blocks.num_calls, job, token_ids, req.stop_sequences or ())
        u = usage(job.num_prompt_tokens, job.num_cached_tokens, num_output)
        delta: MessageDelta = {"stop_reason": stop_reason, "stop_sequence": sequence}
        yield event({"type": "message_delta", "delta": delta, "usage": u})
        yield MESSAGE_STOP
    except Exception as exc:  # noqa: BLE001 - after the first byte, errors travel as events
        yield ANTHROPIC.error_event(generation.error_of(exc))
