"""The Responses API's request (`POST /v1/responses`), validated at the edge (its chat form:
gateway/responses/chat_form.py).

A `ResponsesRequest` is parsed once, with a 400 naming the field for anything we do not take:

- `input` is a string or items: `message`s (roles user, system, developer, assistant; parts
  `input_text` / `output_text` / `refusal`), `function_call`, `function_call_output`; `reasoning`
  items are accepted and skipped; `input_image` / `input_file` / `input_audio` parts are a 400
  (the models served are text only). Items are normalized to OpenAI's item shape (a string input
  becomes one user message), which is what the store keeps and `input_items` lists.
- Fields clients send routinely that cannot apply to an open model are accepted and ignored, each
  named in `ignored` (the pipeline sends them in the `x-batchgate-ignored` header and logs them):
  `reasoning`, `include` values other than `message.output_text.logprobs`, `client_metadata`,
  `service_tier`, `prompt_cache_retention`, `max_tool_calls`, `stream_options`, `text.verbosity`,
  and hosted tools (`web_search`, `file_search`, `code_interpreter`, ...), which are not offered to
  the model. Everything else we do not support is a 400 that names it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationError, WithJsonSchema

from gateway.errors import APIError, invalid_request
from gateway.openai.protocol import (
    MAX_TOP_LOGPROBS,
    NAME_PATTERN,
    StrictModel,
    _integral,
    validation_error,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# OpenAI's ResponseIncludable values (openai 3.57): only the logprobs apply here, the rest concern
# hosted tools, images and reasoning, and are ignored.
INCLUDABLE = frozenset(
    {
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
        "reasoning.encrypted_content",
        LOGPROBS_INCLUDE,
    }
)
# Hosted tools that run on OpenAI's side: not offered to the model, named as ignored.
HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_2025_08_26",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "computer",
        "computer_use_preview",
        "image_generation",
        "mcp",
        "local_shell",
        "shell",
        "tool_search",
        "apply_patch",
        "programmatic_tool_calling",
    }
)
# Accepted and ignored (named in the warning header) whatever their value.
IGNORED_FIELDS = (
    "reasoning",
    "client_metadata",
    "service_tier",
    "prompt_cache_retention",
    "max_tool_calls",
    "stream_options",
)
# OpenAI fields we do not implement: accepted only with these values ("not asked for").
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "prompt": (None,),
}
_MEDIA_PARTS = {"input_image", "input_file", "input_audio"}
MAX_METADATA_KEYS = 16
# Fields of ResponsesRequest that parsing derives (never sent by a client; not in the document).
DERIVED_FIELDS = ("functions", "customs", "namespaces", "ignored", "history", "history_parent")
_INPUT_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]}


def _input(value: Any) -> Any:
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise ValueError("must be a string or an array of input items")
    # An "easy" message ({role, content}) is a message item without its type.
    return [{"type": "message", **v} if isinstance(v, dict) and "type" not in v else v for v in value]


def _tool_choice(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    kind = value.get("type")
    if kind == "function":
        return FunctionToolChoice.model_validate(value)
    if kind == "custom":
        return CustomToolChoice.model_validate(value)
    if kind == "allowed_tools":
        return ToolChoiceAllowed.model_validate(value)
    raise ValueError(
        "must be 'none', 'auto', 'required', {'type': 'function', 'name': ...}, "
        "{'type': 'custom', 'name': ...} or {'type': 'allowed_tools', 'mode': ..., 'tools': [...]}"
    )


@dataclass(frozen=True)
class Parent:
    """The stored response a turn continues: its conversation is the turn's history's first
    `num_items` items; `response` is its response object where known (format 2 stores only the
    fields that differ from it), None where not (a WebSocket's cache)."""

    response_id: str
    num_items: int
    response: dict[str, Any] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class InConversation:
    """The conversation (`/v1/conversations`) a turn's history is: its items through `through`,
    the id of the last one before the turn (None: it had none). Format 2 stored this instead of
    the items in 52b05c6; records written so are still read (gateway/responses/store.py)."""

    conversation_id: str
    through: str | None


class InputText(StrictModel):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: Any = None


class OutputText(StrictModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class RefusalPart(StrictModel):
    type: Literal["refusal"]
    refusal: str


Part = Annotated[InputText | OutputText | RefusalPart, Field(discriminator="type")]


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Part]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    namespace: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class CustomToolCallItem(StrictModel):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str
    id: str | None = None
    namespace: str | None = None
    caller: Any = None
    async_: Annotated[bool | None, Field(alias="async")] = None


class CustomToolCallOutputItem(StrictModel):
    type: Literal["custom_tool_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    caller: Any = None


class ReasoningItem(StrictModel):
    """Accepted and skipped: an open model's own reasoning is not carried between turns."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] | None = None
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


class CompactionItem(StrictModel):
    """A compacted history (gateway/responses/compaction.py): expanded before the turn renders."""

    type: Literal["compaction"]
    encrypted_content: str
    id: str | None = None
    created_by: str | None = None


Item = Annotated[
    MessageItem
    | FunctionCallItem
    | FunctionCallOutputItem
    | CustomToolCallItem
    | CustomToolCallOutputItem
    | ReasoningItem
    | CompactionItem,
    Field(discriminator="type"),
]
_ITEM_TYPES = (
    "message",
    "function_call",
    "function_call_output",
    "custom_tool_call",
    "custom_tool_call_output",
    "reasoning",
    "compaction",
)


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class NamespaceTool(StrictModel):
    """A named group of function tools (Codex sends these); its functions are offered by name."""

    type: Literal["namespace"]
    name: str
    description: str | None = None
    tools: list[FunctionTool]


class FreeTextFormat(StrictModel):
    type: Literal["text"]


class GrammarFormat(StrictModel):
    type: Literal["grammar"]
    syntax: Literal["lark", "regex"]
    definition: Annotated[str, Field(min_length=1)]


class CustomTool(StrictModel):
    """A tool whose input is free text, or text in a Lark or regex grammar (engine/grammar/
    enforces it, so the input always parses)."""

    type: Literal["custom"]
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    description: str | None = None
    format: Annotated[FreeTextFormat | GrammarFormat, Field(discriminator="type")] | None = None
    defer_loading: bool | None = None


class JsonSchemaText(StrictModel):
    type: Literal["json_schema"]
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    schema_: Annotated[dict[str, Any], Field(alias="schema")]
    description: str | None = None
    strict: bool | None = None


class PlainText(StrictModel):
    type: Literal["text"]


class JsonObjectText(StrictModel):
    type: Literal["json_object"]


TextFormat = Annotated[PlainText | JsonObjectText | JsonSchemaText, Field(discriminator="type")]


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class FunctionToolChoice(StrictModel):
    type: Literal["function"]
    name: str


class CustomToolChoice(StrictModel):
    type: Literal["custom"]
    name: str


class AllowedTool(StrictModel):
    type: Literal["function", "custom"]
    name: str


class ToolChoiceAllowed(StrictModel):
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[AllowedTool]


ToolChoice = Annotated[
    Literal["none", "auto", "required"] | FunctionToolChoice | CustomToolChoice | ToolChoiceAllowed,
    BeforeValidator(_tool_choice),
]
MaxTokens = Annotated[int, Field(ge=1), BeforeValidator(_integral)] | None


class ConversationRef(StrictModel):
    id: str


class CompactionSetting(StrictModel):
    """`context_management`'s one kind: compact the history once the prompt passes the threshold."""

    type: Literal["compaction"]
    compact_threshold: Annotated[int, Field(ge=1), BeforeValidator(_integral)] | None = None


class ResponsesRequest(StrictModel):
    """OpenAI's create-response body (the subset of the module docstring)."""

    model: str
    input: Annotated[list[Item], BeforeValidator(_input), WithJsonSchema(_INPUT_SCHEMA)]
    instructions: str | None = None
    max_output_tokens: MaxTokens = None
    temperature: Annotated[float | None, Field(ge=0.0, le=2.0)] = None
    top_p: Annotated[float | None, Field(gt=0.0, le=1.0)] = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), BeforeValidator(_integral)] | None = None
    include: list[Literal[tuple(sorted(INCLUDABLE))]] | None = None  # type: ignore[valid-type]
    tools: list[Any] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | ConversationRef | None = None
    metadata: dict[str, str] | None = None
    stream: bool | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    context_management: list[CompactionSetting] | None = None
    # Accepted and ignored, whatever their value (IGNORED_FIELDS; parsing takes them out first).
    reasoning: Annotated[Any, Field(description="ignored (named in x-batchgate-ignored)")] = None
    client_metadata: Annotated[Any, Field(description="ignored (named in x-batchgate-ignored)")] = None
    service_tier: Annotated[Any, Field(description="ignored (named in x-batchgate-ignored)")] = None
    prompt_cache_retention: Annotated[Any, Field(description="ignored (named in x-batchgate-ignored)")] = None
    max_tool_calls: Annotated[Any, Field(description="ignored (named in x-batchgate-ignored)")] = None
    stream_options: Annotated[Any, Field(description="ignored (named in x-batchgate-ignored)")] = None
    # Filled by parse_responses_request, not by the client:
    functions: Annotated[tuple[FunctionTool, ...], Field(exclude=True)] = ()
    customs: Annotated[tuple[CustomTool, ...], Field(exclude=True)] = ()
    namespaces: Annotated[dict[str, str], Field(exclude=True)] = {}  # function name -> its namespace
    ignored: Annotated[tuple[str, ...], Field(exclude=True)] = ()
    # The conversation before this turn (from previous_response_id or conversation), as stored:
    # items in OpenAI's shape, validated and normalized when they came in, so read as they are.
    history: Annotated[tuple[dict[str, Any], ...], Field(exclude=True)] = ()
    # The stored response `history` continues (how format 2 stores it: gateway/responses/store.py).
    history_parent: Annotated[Parent | None, Field(exclude=True)] = None

    @property
    def conversation_id(self) -> str | None:
        return self.conversation.id if isinstance(self.conversation, ConversationRef) else self.conversation

    @property
    def stores(self) -> bool:
        return self.store is not False

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_output_tokens

    @property
    def compact_threshold(self) -> int | None:
        """Past how many prompt tokens the history is compacted first (`context_management`)."""
        return next((c.compact_threshold for c in self.context_management or () if c.compact_threshold), None)

    @property
    def include_usage(self) -> bool:
        return False

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())


def _pop_ignored(body: dict[str, Any]) -> list[str]:
    ignored = []
    for name in IGNORED_FIELDS:
        if name in body:
            if body.pop(name) is not None:
                ignored.append(name)
    include = body.get("include")
    if isinstance(include, list):
        for i, value in enumerate(include):
            if value not in INCLUDABLE:
                raise invalid_request(
                    f"Invalid value for 'include[{i}]': must be one of {', '.join(sorted(INCLUDABLE))}.",
                    param=f"include[{i}]",
                )
        ignored += [f"include={v}" for v in include if v != LOGPROBS_INCLUDE]
    return ignored


def _check_unsupported(body: dict[str, Any]) -> None:
    for name, allowed in UNSUPPORTED_FIELDS.items():
        if name in body:
            if body[name] not in allowed:
                raise invalid_request(
                    f"'{name}' is not supported by this server; remove it from the request.", param=name
                )
            del body[name]


def _check_media(items: Any) -> None:
    """A clear 400 for image, file and audio parts, before the item models see them."""
    if not isinstance(items, list):
        return
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        if item.get("type") not in (*_ITEM_TYPES, None):
            raise invalid_request(
                f"Input items of type {item.get('type')!r} are not supported; this server takes "
                "message, function_call, function_call_output and reasoning items.",
                param=f"input[{i}].type",
            )
        content = item.get("content") if item.get("type", "message") == "message" else item.get("output")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _MEDIA_PARTS:
                where = "content" if item.get("type", "message") == "message" else "output"
                raise invalid_request(
                    f"'{kind}' is not supported: the models this server serves take text only.",
                    param=f"input[{i}].{where}[{j}]",
                )


@dataclass(frozen=True)
class _Tools:
    functions: tuple[FunctionTool, ...]
    customs: tuple[CustomTool, ...]
    namespaces: dict[str, str]
    ignored: list[str]


def _tools(raw: list[Any] | None) -> _Tools:
    """The function tools offered to the model (namespaces flattened), which namespace each came
    from, the custom tools, and the hosted tools ignored."""
    functions: list[FunctionTool] = []
    customs: list[CustomTool] = []
    namespaces: dict[str, str] = {}
    ignored: list[str] = []
    for i, tool in enumerate(raw or ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        try:
            if kind == "function":
                functions.append(FunctionTool.model_validate(tool))
            elif kind == "namespace":
                group = NamespaceTool.model_validate(tool)
                functions += group.tools
                namespaces.update((f.name, group.name) for f in group.tools)
            elif kind in HOSTED_TOOLS:
                ignored.append(f"tools[{i}]={kind}")
            elif kind == "custom":
                customs.append(CustomTool.model_validate(tool))
            else:
                raise invalid_request(f"Unknown tool type {kind!r}.", param=f"tools[{i}].type")
        except ValidationError as exc:
            raise _nested_error(exc, f"tools[{i}]") from None
    names = [f.name for f in functions] + [c.name for c in customs]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise invalid_request(f"Duplicate tool name '{name}' in 'tools'.", param="tools")
    return _Tools(tuple(functions), tuple(customs), namespaces, ignored)


def _nested_error(exc: ValidationError, where: str) -> APIError:
    error = validation_error(exc)
    param = f"{where}.{error.param}" if error.param else where
    error.message = error.message.replace(f"'{error.param}'", f"'{param}'")
    error.param = param
    return error


def parse_responses_request(body: Any) -> ResponsesRequest:
    """Validate a decoded JSON body as a create-response request; APIError(400) names the field."""
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    for name in DERIVED_FIELDS:  # ours, not the client's
        if name in body:
            raise invalid_request(f"Unrecognized request argument supplied: {name}", param=name)
    body = dict(body)
    ignored = _pop_ignored(body)
    _check_unsupported(body)
    _check_media(body.get("input"))
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise invalid_request("Invalid value for 'tools': must be an array.", param="tools")
    offered = _tools(tools)
    try:
        req = ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    if req.metadata is not None and len(req.metadata) > MAX_METADATA_KEYS:
        raise invalid_request(f"'metadata' may hold at most {MAX_METADATA_KEYS} keys.", param="metadata")
    _check_tool_choice(req, offered)
    if req.conversation is not None and req.previous_response_id is not None:
        raise invalid_request(
            "'conversation' and 'previous_response_id' cannot be used together; give one of them.",
            param="conversation",
        )
    if req.background and req.stream:
        raise invalid_request(
            "'stream' with 'background' is not supported by this server: create the response with "
            "'background' alone and poll GET /v1/responses/{response_id}.",
            param="stream",
        )
    if req.background and not req.stores:
        raise invalid_request("'background' requires 'store': true.", param="background")
    if req.text is not None and req.text.verbosity is not None:
        ignored.append("text.verbosity")
    return req.model_copy(
        update={
            "functions": offered.functions,
            "customs": offered.customs,
            "namespaces": offered.namespaces,
            "ignored": (*ignored, *offered.ignored),
        }
    )


class InputTokensRequest(ResponsesRequest):
    """`POST /v1/responses/input_tokens`: a create body whose `input` may be left out (a
    continuation may add none)."""

    input: Annotated[list[Item], BeforeValidator(_input), WithJsonSchema(_INPUT_SCHEMA)] = []


def parse_input_tokens_request(body: Any) -> ResponsesRequest:
    """An InputTokensRequest body, parsed as the create request it counts (never stored)."""
    if isinstance(body, dict):
        body = {"input": [], **body}
    return parse_responses_request(body).model_copy(update={"store": False})


def _check_tool_choice(req: ResponsesRequest, offered: _Tools) -> None:
    choice = req.tool_choice
    kinds = {f.name: "function" for f in offered.functions} | {c.name: "custom" for c in offered.customs}
    if choice is None or choice in ("auto", "none"):
        return
    if not kinds:
        raise invalid_request(
            "'tool_choice' requires function or custom tools in 'tools'.", param="tool_choice"
        )
    wanted = (
        [(choice.type, choice.name)]
        if isinstance(choice, FunctionToolChoice | CustomToolChoice)
        else [(t.type, t.name) for t in choice.tools]
        if isinstance(choice, ToolChoiceAllowed)
        else []
    )
    for kind, name in wanted:
        if kinds.get(name) != kind:
            raise invalid_request(
                f"'tool_choice' names {kind} tool '{name}', which is not in 'tools'.", param="tool_choice"
            )


def tool_param(req: ResponsesRequest, name: str) -> str:
    """Where the tool `name` is in the request: `tools[i]`, or `tools[i].tools[j]` in a namespace."""
    for i, tool in enumerate(req.tools or ()):
        if not isinstance(tool, dict):
            continue
        if tool.get("name") == name and tool.get("type") in ("function", "custom"):
            return f"tools[{i}]"
        for j, inner in enumerate(tool.get("tools") or () if tool.get("type") == "namespace" else ()):
            if isinstance(inner, dict) and inner.get("name") == name:
                return f"tools[{i}].tools[{j}]"
    return "tools"


def offered_tools(req: ResponsesRequest) -> tuple[tuple[FunctionTool, ...], tuple[CustomTool, ...]]:
    """The function and custom tools `tool_choice` lets the model call."""
    choice = req.tool_choice
    if choice == "none":
        return (), ()
    if isinstance(choice, FunctionToolChoice | CustomToolChoice):
        allowed = {(choice.type, choice.name)}
    elif isinstance(choice, ToolChoiceAllowed):
        allowed = {(t.type, t.name) for t in choice.tools}
    else:
        return req.functions, req.customs
    return (
        tuple(f for f in req.functions if ("function", f.name) in allowed),
        tuple(c for c in req.customs if ("custom", c.name) in allowed),
    )


def items_of(req: ResponsesRequest) -> list[dict[str, Any]]:
    """This turn's input items in OpenAI's item shape (what the store keeps), without ids: a
    message's string content becomes one text part, as OpenAI lists input items."""
    out = []
    for item in req.input:
        raw = item.model_dump(mode="json", by_alias=True, exclude_none=True)
        if isinstance(item, MessageItem) and isinstance(item.content, str):
            kind = "output_text" if item.role == "assistant" else "input_text"
            part: dict[str, Any] = {"type": kind, "text": item.content}
            if kind == "output_text":
                part["annotations"] = []
            raw["content"] = [part]
            raw.setdefault("status", "completed")
        out.append(raw)
    return out
