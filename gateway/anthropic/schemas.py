"""The Messages API's response shapes, written once: typed dicts the builders return and the
OpenAPI document's source (as gateway/openai/schemas.py is OpenAI's). Names follow Anthropic's
SDK where they do not clash with OpenAI's components (its `Usage` is `MessageUsage` here)."""

from __future__ import annotations

from typing import Annotated, Literal, NotRequired

from pydantic import Field
from typing_extensions import TypedDict

NonNegativeInt = Annotated[int, Field(ge=0)]

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
ErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
    "api_error",
    "overloaded_error",
]


class TextBlock(TypedDict):
    type: Literal["text"]
    text: str


class ToolUseBlock(TypedDict):
    """A call of a tool: its `input` is valid against the tool's `input_schema` (the grammar)."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, object]


ContentBlock = TextBlock | ToolUseBlock


class MessageUsage(TypedDict):
    """`input_tokens`: the prompt tokens not read from the prefix cache; `cache_read_input_tokens`:
    those read from it (the prompt is their sum); `cache_creation_input_tokens`: always 0 (the
    cache is written without being asked)."""

    input_tokens: NonNegativeInt
    cache_creation_input_tokens: NonNegativeInt
    cache_read_input_tokens: NonNegativeInt
    output_tokens: NonNegativeInt


class Message(TypedDict):
    """A message (`POST /v1/messages`); in a stream's `message_start`, before any content."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    content: list[ContentBlock]
    model: str
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage


class ContentBlockDelta(TypedDict):
    """A block's next piece: `text` (text_delta) or `partial_json` of a call's input
    (input_json_delta)."""

    type: Literal["text_delta", "input_json_delta"]
    text: NotRequired[str]
    partial_json: NotRequired[str]


class MessageDelta(TypedDict):
    stop_reason: StopReason
    stop_sequence: str | None


class ErrorObject(TypedDict):
    type: ErrorType
    message: str


class ErrorResponse(TypedDict):
    """Every error of the Messages API; also an `error` event's data, the last of its stream."""

    type: Literal["error"]
    error: ErrorObject


class MessageStreamEvent(TypedDict):
    """One event of a message's stream (`event: <type>` and this as its data): `message` on
    message_start, `index` and `content_block` on content_block_start, `index` and a block's
    `delta` on content_block_delta, `index` on content_block_stop, the message's `delta` and
    `usage` on message_delta, nothing more on message_stop and ping, `error` on error."""

    type: Literal[
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
        "ping",
        "error",
    ]
    message: NotRequired[Message]
    index: NotRequired[NonNegativeInt]
    content_block: NotRequired[ContentBlock]
    delta: NotRequired[ContentBlockDelta | MessageDelta]
    usage: NotRequired[MessageUsage]
    error: NotRequired[ErrorObject]


class MessageTokensCount(TypedDict):
    """`POST /v1/messages/count_tokens`: the prompt's tokens, as a message request holds them."""

    input_tokens: NonNegativeInt


class ModelInfo(TypedDict):
    type: Literal["model"]
    id: str
    display_name: str
    created_at: str


class ModelInfoPage(TypedDict):
    """`GET /v1/models` for a request that carries `anthropic-version`."""

    data: list[ModelInfo]
    has_more: bool
    first_id: str | None
    last_id: str | None


RESPONSE_TYPES: tuple[type, ...] = (
    Message,
    MessageStreamEvent,
    MessageTokensCount,
    ErrorResponse,
    ModelInfo,
    ModelInfoPage,
)
