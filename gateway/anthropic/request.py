"""Anthropic's Messages API requests (`POST /v1/messages`, `POST /v1/messages/count_tokens`),
validated at the edge; their chat form is gateway/anthropic/chat_form.py.

Parsing raises an `APIError` 400 whose message names the field as Anthropic's API does
(`max_tokens: Field required`, `messages.0.content.1: ...`). What is taken:

- `system` (a string or text blocks), `messages` (roles user and assistant, and system: Claude
  Code sends its per-turn context so), content as a string or blocks: `text`, `tool_use`,
  `tool_result` (a string or text blocks, `is_error`), `thinking` and `redacted_thinking` (an
  assistant's, accepted in the history and not shown to the model); `image`, `document` and the
  server tools' blocks are a 400 (the models served read text, and run no server tools);
- `tools` (custom tools with an `input_schema`; `defer_loading` ones are not shown to the model),
  `tool_choice` (`auto`, `any`, `tool`, `none`, `disable_parallel_tool_use`); a server tool
  (`web_search_...`, `bash_...`) is a 400;
- `max_tokens`, `stop_sequences`, `temperature`, `top_p`, `top_k`, `stream`, `metadata.user_id`,
  `output_config.format` (or its older name `output_format`: a JSON schema the answer is
  constrained to);
- accepted and ignored, each named in `ignored` (the `x-batchgate-ignored` response header):
  `thinking` (no reasoning format here: the request runs without it), `context_management`
  (the history is rendered as sent), `output_config.effort`, `speed`, `service_tier`,
  `inference_geo`, `diagnostics`. `cache_control` markers are accepted anywhere Anthropic takes
  them (on blocks, tools, the request): the prefix cache is automatic.

Anything else is a 400 (`<field>: Extra inputs are not permitted`, Anthropic's own words).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from gateway.errors import APIError, invalid_request

TOOL_NAME = r"^[a-zA-Z0-9_-]{1,128}$"
TOOL_ID = r"^[a-zA-Z0-9_-]+$"
# Blocks we cannot take, and why (the models served read text; no tools run on our side).
_MEDIA_BLOCKS = ("image", "document", "search_result", "container_upload")
_SERVER_BLOCKS = (
    "server_tool_use",
    "web_search_tool_result",
    "web_fetch_tool_result",
    "code_execution_tool_result",
    "bash_code_execution_tool_result",
    "text_editor_code_execution_tool_result",
    "tool_search_tool_result",
    "mcp_tool_use",
    "mcp_tool_result",
    "tool_reference",
)


class WireModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)


class CacheControlEphemeralParam(WireModel):
    """A prompt-caching breakpoint: accepted, and changes nothing (the prefix cache is automatic)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlockParam(WireModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControlEphemeralParam | None = None
    citations: list[dict[str, Any]] | None = None


class ToolUseBlockParam(WireModel):
    type: Literal["tool_use"]
    id: Annotated[str, Field(pattern=TOOL_ID)]
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    input: dict[str, Any]
    cache_control: CacheControlEphemeralParam | None = None


def _tool_result_content(value: Any) -> Any:
    if isinstance(value, list):
        _check_blocks(value, allowed=("text",))
    return value


class ToolResultBlockParam(WireModel):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(pattern=TOOL_ID)]
    content: Annotated[str | list[TextBlockParam], BeforeValidator(_tool_result_content)] = ""
    is_error: bool | None = None
    cache_control: CacheControlEphemeralParam | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content)


class ThinkingBlockParam(WireModel):
    """An assistant's reasoning, sent back in the history; its `signature` (empty or not) is not
    checked: this server signs nothing."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""
    cache_control: CacheControlEphemeralParam | None = None


class RedactedThinkingBlockParam(WireModel):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[
    TextBlockParam
    | ToolUseBlockParam
    | ToolResultBlockParam
    | ThinkingBlockParam
    | RedactedThinkingBlockParam,
    Field(discriminator="type"),
]
_BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


def _check_blocks(blocks: list[Any], allowed: tuple[str, ...]) -> None:
    """A clear refusal of a block we cannot take, before the schema's own checks."""
    for i, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str) or kind in allowed:
            continue
        if kind in _MEDIA_BLOCKS:
            raise ValueError(
                f"block {i} is an `{kind}` block: this server's models read text only; send the text instead"
            )
        if kind in _SERVER_BLOCKS:
            raise ValueError(f"block {i} is a `{kind}` block: this server runs no server tools")
        if kind in _BLOCK_TYPES:
            raise ValueError(f"block {i}: a `{kind}` block is not allowed here")
        raise ValueError(f"block {i} has an unknown type `{kind}`")


def _content(value: Any) -> Any:
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of content blocks")
    _check_blocks(value, allowed=_BLOCK_TYPES)
    return value


class MessageParam(WireModel):
    role: Literal["user", "assistant", "system"]
    content: Annotated[list[Block], BeforeValidator(_content)]


def _system(value: Any) -> Any:
    if isinstance(value, str):
        return [{"type": "text", "text": value}] if value else []
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of text blocks")
    _check_blocks(value, allowed=("text",))
    return value


def _tools(value: Any) -> Any:
    if not isinstance(value, list):
        return value
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(
                f"tool {i} is Anthropic's server tool `{kind}`: this server runs no server tools; "
                "declare a custom tool (name, description, input_schema) instead"
            )
    return value


class ToolParam(WireModel):
    """A custom tool: the model calls it with an `input` valid against `input_schema`."""

    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControlEphemeralParam | None = None
    defer_loading: bool | None = None  # not shown to the model (no tool search here)
    strict: bool | None = None
    input_examples: list[dict[str, Any]] | None = None
    eager_input_streaming: bool | None = None


class ToolChoiceAutoParam(WireModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAnyParam(WireModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceToolParam(WireModel):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNoneParam(WireModel):
    type: Literal["none"]


ToolChoice = Annotated[
    ToolChoiceAutoParam | ToolChoiceAnyParam | ToolChoiceToolParam | ToolChoiceNoneParam,
    Field(discriminator="type"),
]


class ThinkingConfigParam(WireModel):
    """Extended thinking: accepted; the request runs without it (no reasoning format here). Its
    kind must be one of Anthropic's; its settings are not read, so new ones are taken too."""

    model_config = ConfigDict(extra="allow")

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=1)] | None = None
    display: str | None = None


class MetadataParam(WireModel):
    user_id: Annotated[str, Field(max_length=512)] | None = None


class JSONOutputFormatParam(WireModel):
    type: Literal["json_schema"]
    schema_: Annotated[dict[str, Any], Field(alias="schema")]


class OutputConfigParam(WireModel):
    effort: str | None = None  # not read: any of Anthropic's levels, present or to come
    format: JSONOutputFormatParam | None = None


class _Prompt(WireModel):
    """What a message request and a count request share: the prompt and what shapes it."""

    model: Annotated[str, Field(min_length=1)]
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: Annotated[list[TextBlockParam], BeforeValidator(_system)] = []
    tools: Annotated[list[ToolParam] | None, BeforeValidator(_tools)] = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfigParam | None = None
    context_management: dict[str, Any] | None = None
    output_config: OutputConfigParam | None = None
    output_format: JSONOutputFormatParam | None = None  # the older name of output_config.format
    # A breakpoint on the last cacheable block: changes nothing here (the cache is automatic).
    cache_control: CacheControlEphemeralParam | None = None
    speed: Literal["standard", "fast"] | None = None

    @property
    def user(self) -> str | None:
        return None

    @property
    def output_format_given(self) -> JSONOutputFormatParam | None:
        """The JSON schema the answer is constrained to, if any."""
        if self.output_config is not None and self.output_config.format is not None:
            return self.output_config.format
        return self.output_format

    @property
    def ignored(self) -> list[str]:
        """The fields accepted and ignored (the `x-batchgate-ignored` header names them)."""
        names = []
        if self.thinking is not None and self.thinking.type != "disabled":
            names.append("thinking")
        if self.context_management is not None:
            names.append("context_management")
        if self.output_config is not None and self.output_config.effort is not None:
            names.append("output_config.effort")
        if self.speed is not None:
            names.append("speed")
        return names


class MessagesRequest(_Prompt):
    """`POST /v1/messages`."""

    max_tokens: Annotated[int, Field(ge=1)]
    metadata: MetadataParam | None = None
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    stream: bool | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None

    @property
    def user(self) -> str | None:
        """The end user (`metadata.user_id`): the fairness key in open mode, in the trace and the
        usage event."""
        return self.metadata.user_id if self.metadata is not None else None

    @property
    def ignored(self) -> list[str]:
        given = [n for n in ("service_tier", "inference_geo", "diagnostics") if getattr(self, n) is not None]
        return super().ignored + given


class CountTokensRequest(_Prompt):
    """`POST /v1/messages/count_tokens`: the prompt of a message request, counted."""

    @property
    def stream(self) -> bool:
        return False


# -- parsing ---------------------------------------------------------------------------------


def _loc(body: Any, loc: tuple[int | str, ...]) -> str:
    """An error's location as Anthropic writes it (`messages.0.content.1.text`), without the
    discriminator pydantic puts after a block's index."""
    parts: list[str] = []
    node = body
    skip_tag = False
    for part in loc:
        if skip_tag and isinstance(node, dict) and part == node.get("type"):
            skip_tag = False
            continue
        skip_tag = False
        parts.append(str(part))
        if isinstance(part, int) and isinstance(node, list) and 0 <= part < len(node):
            node = node[part]
            skip_tag = True
        elif isinstance(part, str) and isinstance(node, dict):
            node = node.get(part)
            if part == "content" and isinstance(node, str):
                node = [{"type": "text", "text": node}]
        else:
            node = None
    return ".".join(parts)


def _validation_error(body: Any, exc: ValidationError) -> APIError:
    err = exc.errors(include_url=False)[0]
    where = _loc(body, tuple(err["loc"]))
    message = err["msg"].removeprefix("Value error, ")
    return invalid_request(f"{where}: {message}" if where else message, param=where or None)


def _parse(model: type[_Prompt], body: Any) -> Any:
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    for name in ("container", "mcp_servers"):
        if body.get(name):
            raise invalid_request(f"{name}: not supported by this server (no tools run on our side)", name)
    body = {k: v for k, v in body.items() if not (k in ("container", "mcp_servers") and not v)}
    try:
        req = model.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(body, exc) from None
    _check_prompt(req)
    return req


def parse_messages_request(body: Any) -> MessagesRequest:
    """Validate a decoded JSON body as a Messages request; APIError(400) names the bad field."""
    req: MessagesRequest = _parse(MessagesRequest, body)
    if req.messages[-1].role == "assistant":
        raise invalid_request(
            "messages: the last message is the assistant's: a prefill is not supported by this "
            "server (its answer starts a new assistant turn); end with a user message",
            param="messages",
        )
    return req


def parse_count_tokens_request(body: Any) -> CountTokensRequest:
    """Validate a decoded JSON body as a count_tokens request."""
    req: CountTokensRequest = _parse(CountTokensRequest, body)
    return req


def _check_prompt(req: _Prompt) -> None:
    """What the schema cannot say: which role carries which block, the tools' names and choice."""
    for i, message in enumerate(req.messages):
        for j, block in enumerate(message.content):
            where = f"messages.{i}.content.{j}"
            assistant_only = block.type in ("tool_use", "thinking", "redacted_thinking")
            if assistant_only and message.role != "assistant":
                raise invalid_request(
                    f"{where}: a `{block.type}` block belongs to an assistant message", where
                )
            if block.type == "tool_result" and message.role != "user":
                raise invalid_request(f"{where}: a `tool_result` block belongs to a user message", where)
    names = [t.name for t in req.tools or ()]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise invalid_request(f"tools.{i}.name: tool names must be unique (`{name}` is given twice)")
    choice = req.tool_choice
    if choice is not None and choice.type != "none" and not names:
        raise invalid_request("tool_choice: may be given only with tools", "tool_choice")
    if isinstance(choice, ToolChoiceToolParam) and choice.name not in names:
        raise invalid_request(
            f"tool_choice.name: `{choice.name}` is not one of the tools", "tool_choice.name"
        )
