"""A Responses request as the chat request it renders, shortened for `truncation: auto`
(`drop_oldest`), and the echoes of its tools and text config a response carries.

`to_chat()` renders a request (with the conversation before it, from `previous_response_id`) as the
chat request the engine backend already serves: instructions as the system message, then the
history's items, then this turn's, so a continuation's prompt starts with its previous turn's.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from gateway.errors import invalid_request
from gateway.openai.protocol import ChatCompletionRequest, validation_error
from gateway.responses.request import (
    CustomTool,
    FunctionToolChoice,
    GrammarFormat,
    Item,
    JsonSchemaText,
    ResponsesRequest,
    ToolChoiceAllowed,
    offered_tools,
)


def drop_oldest(req: ResponsesRequest) -> ResponsesRequest | None:
    """`req` without the oldest item of its conversation (history, then input), and without the
    outputs of calls no longer in it; None when one item is all that is left (`truncation: auto`)."""
    items = [*req.history, *req.input]
    if len(items) <= 1:
        return None
    rest = [(i, fields(i)) for i in items[1:]]
    calls = {f["call_id"] for _, f in rest if f["type"] in _CALL_TYPES}
    kept = [i for i, f in rest if f["type"] not in _OUTPUT_TYPES or f["call_id"] in calls]
    if not kept:
        return None
    in_history = {id(i) for i in req.history}
    history = tuple(i for i in kept if id(i) in in_history)
    return req.model_copy(update={"history": history, "input": [i for i in kept if id(i) not in in_history]})


def fields(item: Item | dict[str, Any]) -> dict[str, Any]:
    """An item's (or a part's) fields by name: a stored one is its dict, a parsed one's are its
    attributes (so stored history is rendered without being parsed again)."""
    return item if isinstance(item, dict) else vars(item)


def text_of(value: str | list[Any]) -> str:
    """A message's content or a tool output as text: a string, or its parts' texts in order."""
    if isinstance(value, str):
        return value
    return "".join(f["refusal"] if f["type"] == "refusal" else f["text"] for f in map(fields, value))


_CALL_TYPES = ("function_call", "custom_tool_call")
_OUTPUT_TYPES = ("function_call_output", "custom_tool_call_output")


# -- as a chat request ------------------------------------------------------------------------


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that renders `req`: instructions, then its history, then its input."""
    messages: list[dict[str, Any]] = []
    _, customs = offered_tools(req)
    system = "\n\n".join(t for t in (req.instructions, custom_tools_prompt(customs)) if t)
    if system:
        messages.append({"role": "system", "content": system})
    calls: set[str] = set()
    for where, item in [("history", i) for i in req.history] + [
        (f"input[{n}]", i) for n, i in enumerate(req.input)
    ]:
        f = fields(item)
        kind = f["type"]
        if kind == "message":
            messages.append({"role": f["role"], "content": text_of(f["content"])})
        elif kind == "function_call":
            call = {
                "id": f["call_id"],
                "type": "function",
                "function": {"name": f["name"], "arguments": f["arguments"]},
            }
            calls.add(f["call_id"])
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if f["call_id"] not in calls:
                raise invalid_request(
                    f"No function_call found for the function_call_output with call_id {f['call_id']!r}.",
                    param=f"{where}.call_id",
                )
            messages.append({"role": "tool", "tool_call_id": f["call_id"], "content": text_of(f["output"])})
        elif kind == "custom_tool_call":
            calls.add(f["call_id"])
            block = custom_call_block(f["name"], f["input"])
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" not in last:
                last["content"] = f"{last['content']}\n{block}" if last["content"] else block
            else:
                messages.append({"role": "assistant", "content": block})
        elif kind == "custom_tool_call_output":
            if f["call_id"] not in calls:
                raise invalid_request(
                    "No custom_tool_call found for the custom_tool_call_output with call_id "
                    f"{f['call_id']!r}.",
                    param=f"{where}.call_id",
                )
            content = f"<tool_response>\n{text_of(f['output'])}\n</tool_response>"
            messages.append({"role": "user", "content": content})
    if not messages:
        raise invalid_request("'input' must hold at least one message or item.", param="input")
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    for name in ("temperature", "top_p", "parallel_tool_calls", "user"):
        value = getattr(req, name)
        if value is not None:
            body[name] = value
    if req.logprobs:
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, JsonSchemaText):
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {
                "name": fmt.name,
                "schema": fmt.schema_,
                **({"strict": fmt.strict} if fmt.strict is not None else {}),
                **({"description": fmt.description} if fmt.description is not None else {}),
            },
        }
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    _chat_tools(req, body)
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        # Our own rendering of a validated request: a field the chat model refuses is a bug to see.
        raise invalid_request(f"The request cannot be rendered: {validation_error(exc).message}") from None


def _chat_tools(req: ResponsesRequest, body: dict[str, Any]) -> None:
    """The function tools as chat's `tools` and `tool_choice`. With custom tools offered, the
    output plan is gateway/responses/custom_tools.py's, which reads the choice from `req` itself."""
    functions, customs = offered_tools(req)
    choice = req.tool_choice
    if not functions:
        return
    if customs:  # the choice is read from `req` by gateway/responses/custom_tools.py
        choice = None
    if isinstance(choice, ToolChoiceAllowed):
        body["tool_choice"] = choice.mode
    elif isinstance(choice, FunctionToolChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        body["tool_choice"] = choice
    body["tools"] = [
        {
            "type": "function",
            "function": f.model_dump(exclude_none=True, exclude={"type", "defer_loading"}),
        }
        for f in functions
    ]


def tools_echo(req: ResponsesRequest) -> list[dict[str, Any]]:
    """`tools` as a response echoes them: the function tools, strict as applied, then the custom
    tools."""
    functions: list[dict[str, Any]] = [
        {
            "type": "function",
            "name": f.name,
            "description": f.description,
            "parameters": f.parameters if f.parameters is not None else {"type": "object", "properties": {}},
            "strict": f.strict is not False,
        }
        for f in req.functions
    ]
    return functions + [c.model_dump(mode="json", exclude_none=True) for c in req.customs]


def tool_choice_echo(req: ResponsesRequest) -> Any:
    choice = req.tool_choice
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        return choice
    return choice.model_dump(mode="json")


def text_echo(req: ResponsesRequest) -> dict[str, Any]:
    fmt = req.text.format if req.text is not None else None
    if fmt is None:
        return {"format": {"type": "text"}}
    return {"format": fmt.model_dump(mode="json", by_alias=True, exclude_none=True)}


# How a custom tool call reads in the model's output (and in the prompt of a later turn): its
# input as written, between these tags (gateway/responses/custom_tools.py's grammar and parser).
CUSTOM_CALL_OPEN = '<custom_tool_call name="{name}">'
CUSTOM_CALL_CLOSE = "</custom_tool_call>"
CUSTOM_TOOLS_PROMPT = (
    "You can also call tools that take text input. To call one, reply with\n"
    + CUSTOM_CALL_OPEN.format(name="<tool name>")
    + "<input>"
    + CUSTOM_CALL_CLOSE
    + "\nThe tools:\n{tools}"
)


def custom_call_block(name: str, text: str) -> str:
    return CUSTOM_CALL_OPEN.format(name=name) + text + CUSTOM_CALL_CLOSE


def custom_tools_prompt(customs: tuple[CustomTool, ...]) -> str:
    """The system prompt's list of the custom tools offered ("" for none)."""
    if not customs:
        return ""
    lines = []
    for c in customs:
        line = f"- {c.name}: {c.description or ''}".rstrip()
        if isinstance(c.format, GrammarFormat):
            line += f"\n  Its input follows this {c.format.syntax} grammar:\n{c.format.definition}"
        lines.append(line)
    return CUSTOM_TOOLS_PROMPT.format(tools="\n".join(lines))


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
