"""A Messages request as the chat request it renders (`to_chat`), and the window rule it runs
under (`Window`).

`to_chat()` renders the request as the chat request the engine backend already serves, so
tokenizing, tool grammars and tool-call parsing, sampling and the prefix cache are chat's:

- `system`: its text blocks joined by a blank line, as the first (system) message; a block that
  is Claude Code's per-request billing line (`x-anthropic-billing-header: cc_version=...;
  cch=...;`) is left out, so two turns of one session render the same prefix and the prefix
  cache serves the second (the line means nothing to the model);
- `messages`, in order: a user's text blocks joined by a blank line, its `tool_result` blocks as
  chat `tool` messages (before the text, where Anthropic puts them); an assistant's text, its
  `tool_use` blocks as `tool_calls` (`input` as JSON arguments), its thinking blocks left out; a
  system message (Claude Code's per-turn context) as a system message in its place;
- `tools` (but the `defer_loading` ones) as functions, `input_schema` their parameters;
  `tool_choice` `auto` / `any` / `tool` / `none` as chat's `auto` / `required` / the named
  function / `none`, `disable_parallel_tool_use` as `parallel_tool_calls: false`;
- `max_tokens`, `temperature`, `top_p`, `top_k`, `stop_sequences`, `metadata.user_id` (chat's
  `user`), `output_config.format` (a `json_schema` response format).

`Window` is the one rule that differs from chat's: a `max_tokens` above the room the prompt
leaves in the model's window is cut to that room (Claude Code asks for 32,000 or more whatever
the model) rather than refused; a prompt that leaves no room is Anthropic's `prompt is too long`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from gateway.anthropic.request import (
    CountTokensRequest,
    MessagesRequest,
    TextBlockParam,
    ToolChoiceToolParam,
    ToolResultBlockParam,
    ToolUseBlockParam,
)
from gateway.errors import APIError, ErrorKind, invalid_request
from gateway.openai.protocol import (
    ChatCompletionRequest,
    FunctionDefinition,
    Tool,
    validation_error,
)

BILLING_PREFIX = "x-anthropic-billing-header:"
# Blocks of one message are joined so (Anthropic keeps them apart; a chat message is one text).
BLOCK_SEPARATOR = "\n\n"
# The clamped max_tokens a request ran with, when lower than it asked for (the window's room).
CLAMPED_HEADER = "x-batchgate-clamped-max-tokens"


def is_billing_line(block: TextBlockParam) -> bool:
    """Claude Code's per-request attribution line (its `cch=` changes every request)."""
    return block.text.lstrip().startswith(BILLING_PREFIX)


def system_text(req: MessagesRequest | CountTokensRequest) -> str:
    """The system prompt as the model reads it: the blocks but the billing line."""
    return BLOCK_SEPARATOR.join(b.text for b in req.system if not is_billing_line(b))


def to_chat(req: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that renders `req` (see the module docstring)."""
    messages: list[dict[str, Any]] = []
    system = system_text(req)
    if system:
        messages.append({"role": "system", "content": system})
    calls: set[str] = set()
    for i, message in enumerate(req.messages):
        texts = [b.text for b in message.content if isinstance(b, TextBlockParam)]
        if message.role == "assistant":
            uses = [b for b in message.content if isinstance(b, ToolUseBlockParam)]
            out: dict[str, Any] = {"role": "assistant", "content": BLOCK_SEPARATOR.join(texts)}
            if uses:
                out["tool_calls"] = [
                    {
                        "id": b.id,
                        "type": "function",
                        "function": {"name": b.name, "arguments": _dumps(b.input)},
                    }
                    for b in uses
                ]
                calls.update(b.id for b in uses)
            messages.append(out)
            continue
        for j, block in enumerate(message.content):
            if isinstance(block, ToolResultBlockParam):
                if block.tool_use_id not in calls:
                    where = f"messages.{i}.content.{j}.tool_use_id"
                    raise invalid_request(
                        f"{where}: `{block.tool_use_id}` answers no `tool_use` block of an earlier "
                        "assistant message",
                        where,
                    )
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text})
        if texts or not any(isinstance(b, ToolResultBlockParam) for b in message.content):
            messages.append({"role": message.role, "content": BLOCK_SEPARATOR.join(texts)})
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if isinstance(req, MessagesRequest):
        body["max_tokens"] = req.max_tokens
        for name in ("temperature", "top_p", "top_k", "user"):
            value = getattr(req, name)
            if value is not None:
                body[name] = value
    fmt = req.output_format_given
    if fmt is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": fmt.schema_, "strict": True},
        }
    tools = _tools(req)
    if tools:
        choice = req.tool_choice
        if choice is None or choice.type == "auto":
            body["tool_choice"] = "auto"
        elif choice.type == "any":
            body["tool_choice"] = "required"
        elif choice.type == "none":
            body["tool_choice"] = "none"
        else:
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        if choice is not None and choice.type != "none" and choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    try:
        chat = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        # Our own rendering of a validated request: a field chat refuses is a bug to see.
        raise invalid_request(f"The request cannot be rendered: {validation_error(exc).message}") from None
    # Set past chat's validation, whose limits are OpenAI's (4 stop sequences, 64-character tool
    # names); Anthropic's are wider, and both fields are validated above by its own rules.
    update: dict[str, Any] = {"tools": tools or None}
    if isinstance(req, MessagesRequest) and req.stop_sequences:
        update["stop"] = tuple(req.stop_sequences)
    return chat.model_copy(update=update)


def _tools(req: MessagesRequest | CountTokensRequest) -> list[Tool]:
    """The tools shown to the model: all but the deferred ones (a tool search would load those;
    there is none here), unless `tool_choice` names one."""
    named = req.tool_choice.name if isinstance(req.tool_choice, ToolChoiceToolParam) else None
    return [
        Tool.model_construct(
            type="function",
            function=FunctionDefinition.model_construct(
                name=t.name, description=t.description, parameters=t.input_schema, strict=t.strict
            ),
        )
        for t in req.tools or ()
        if not t.defer_loading or t.name == named
    ]


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@dataclass
class Window:
    """The max_tokens rule of a Messages request: what it asked for, cut to the window's room;
    `clamped` holds the value it runs with when that is lower than asked."""

    requested: int
    clamped: int | None = None

    def fit(self, num_prompt_tokens: int, max_model_len: int) -> int:
        """The completion tokens the request runs with; APIError 400 (Anthropic's wording,
        which Claude Code reads) when the prompt leaves no room."""
        room = max_model_len - num_prompt_tokens
        if room < 1:
            raise prompt_too_long(num_prompt_tokens, max_model_len - 1)
        if self.requested > room:
            self.clamped = room
            return room
        return self.requested

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.clamped is None else {CLAMPED_HEADER: str(self.clamped)}


def prompt_too_long(num_prompt_tokens: int, maximum: int) -> APIError:
    """Anthropic's refusal of a prompt over the window, word for word (`maximum`: the longest
    prompt the window takes, one token short of it: an answer needs one)."""
    return APIError(
        ErrorKind.CONTEXT_LENGTH_EXCEEDED,
        f"prompt is too long: {num_prompt_tokens} tokens > {maximum} maximum",
        param="messages",
    )
