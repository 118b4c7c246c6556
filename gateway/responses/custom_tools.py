"""Custom tools of the Responses API: their grammar beside the function tools, and reading their
calls back out of the model's text.

A custom tool takes text, not JSON: free text (`format: {type: text}`, the default) or text in a
grammar (`{type: grammar, syntax: lark | regex, definition}`). The model calls one by writing

    <custom_tool_call name="apply_patch">*** Begin Patch ... *** End Patch
    </custom_tool_call>

(gateway/responses/request.py renders earlier calls the same way, and lists the tools in the system
prompt). The output grammar is gateway/openai/tools.py's calls grammar with one more kind of call per
custom tool, whose input is the tool's own grammar as a named sub-grammar (`@custom_0`), so the
input always parses in it; a free-text input runs to the first closing tag.

`CallSplitter` wraps the function-call parser: text outside a custom call goes through it, a
custom call comes out as `CustomStart`, `CustomInput` fragments and `CustomEnd`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace

from engine.types import GrammarSpec, regex_as_lark
from gateway.openai import tools
from gateway.openai.formats import ChatFormat
from gateway.openai.parsers import DeltaParser
from gateway.openai.protocol import ChatCompletionRequest
from gateway.openai.schemas import ChatCompletionDelta
from gateway.responses.chat_form import CUSTOM_CALL_CLOSE, CUSTOM_CALL_OPEN
from gateway.responses.request import (
    CustomTool,
    GrammarFormat,
    ResponsesRequest,
    ToolChoiceAllowed,
    offered_tools,
    tool_param,
)

_HEAD = '<custom_tool_call name="'


def _input_grammar(tool: CustomTool) -> str | None:
    """The tool's input grammar as Lark text; None for free text."""
    fmt = tool.format
    if not isinstance(fmt, GrammarFormat):
        return None
    return fmt.definition if fmt.syntax == "lark" else regex_as_lark(fmt.definition)


def plan_output(
    req: ResponsesRequest,
    chat: ChatCompletionRequest,
    closed_arguments: bool = True,
    chat_format: ChatFormat | None = None,
) -> tools.OutputPlan:
    """The output plan of `req` rendered as `chat`: the model family's (`chat_format`,
    gateway/openai/formats.py; None: gateway/openai/tools.py's), with the custom tools that
    `tool_choice` offers as further kinds of call (in the `<tool_call>` syntax, whatever the
    family's); its errors name the Responses request's fields."""
    functions, customs = offered_tools(req)
    if not customs:
        if chat_format is not None:
            plan = chat_format.plan_output(chat, closed_arguments)
        else:
            plan = tools.plan_output(chat, closed_arguments)
        return replace(plan, checks=tuple((spec, _responses_param(req, chat, p)) for spec, p in plan.checks))
    choice = req.tool_choice
    mode = choice.mode if isinstance(choice, ToolChoiceAllowed) else choice
    calls: list[tuple[str, str]] = []
    subgrammars: list[tuple[str, str]] = []
    checks: list[tuple[GrammarSpec, str]] = []
    chat_tools = tuple(chat.tools or ()) if functions else ()
    for t in chat_tools:
        checks.append((tools.parameters_spec(t), f"{tool_param(req, t.function.name)}.parameters"))
    for i, tool in enumerate(customs):
        rule, head = f"custom_{i}", json.dumps(CUSTOM_CALL_OPEN.format(name=tool.name))
        grammar = _input_grammar(tool)
        if grammar is None:  # free text, up to the first closing tag
            end = CUSTOM_CALL_CLOSE.replace("/", "\\/")
            calls.append((rule, f"{rule}: {head} {rule}_text\n{rule}_text[lazy]: /(.|\\n)*{end}/"))
            continue
        calls.append((rule, f"{rule}: {head} @input_{i} {json.dumps(CUSTOM_CALL_CLOSE)}"))
        subgrammars.append((f"input_{i}", grammar))
        checks.append((GrammarSpec.lark(grammar), f"{tool_param(req, tool.name)}.format.definition"))
    text = tools.tool_call_grammar(
        chat_tools,
        "auto" if mode in (None, "auto") else "required",
        req.parallel_tool_calls is not False,
        closed_arguments=closed_arguments,
        other_calls=calls,
    )
    spec = GrammarSpec.lark(text, subgrammars=tuple(subgrammars))
    return tools.OutputPlan(spec, (*checks, (spec, "tools")), chat_tools, parse_tool_calls=True)


def _responses_param(req: ResponsesRequest, chat: ChatCompletionRequest, param: str) -> str:
    """A chat request's field (as gateway/openai/tools.py names it) as the Responses request's."""
    if param.startswith("response_format"):
        return "text.format.schema" if param.endswith(".schema") else "text.format"
    found = re.fullmatch(r"tools\[(\d+)\]\.function\.parameters", param)
    if found is not None and chat.tools is not None:
        return f"{tool_param(req, chat.tools[int(found.group(1))].function.name)}.parameters"
    return param


@dataclass(frozen=True)
class CustomStart:
    call_id: str
    name: str


@dataclass(frozen=True)
class CustomInput:
    text: str


@dataclass(frozen=True)
class CustomEnd:
    pass


Event = ChatCompletionDelta | CustomStart | CustomInput | CustomEnd


@dataclass
class CallSplitter:
    """Splits one choice's text, fed as it is generated, into function-call parser deltas (chat
    delta dicts) and custom calls (see the module docstring)."""

    inner: DeltaParser = field(default_factory=tools.ToolCallParser)
    _buffer: str = ""
    _state: str = "text"  # text | head (the name being read) | input

    def feed(self, text: str, final: bool = False) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while True:
            if self._state == "text":
                start = self._buffer.find(_HEAD)
                if start < 0:
                    keep = 0 if final else tools.partial_suffix(self._buffer, _HEAD)
                    cut = len(self._buffer) - keep
                    events += self.inner.feed(self._buffer[:cut], final=final)
                    self._buffer = self._buffer[cut:]
                    return events
                events += self.inner.feed(self._buffer[:start], final=True)
                self._buffer, self._state = self._buffer[start + len(_HEAD) :], "head"
            elif self._state == "head":
                end = self._buffer.find('">')
                if end < 0:
                    if final:  # cut off inside the tag: what there was is text
                        events += self.inner.feed(_HEAD + self._buffer, final=True)
                        self._buffer, self._state = "", "text"
                    return events
                events.append(CustomStart(tools.new_call_id(), self._buffer[:end]))
                self._buffer, self._state = self._buffer[end + 2 :], "input"
            else:
                end = self._buffer.find(CUSTOM_CALL_CLOSE)
                if end < 0:
                    keep = 0 if final else tools.partial_suffix(self._buffer, CUSTOM_CALL_CLOSE)
                    cut = len(self._buffer) - keep
                    if cut:
                        events.append(CustomInput(self._buffer[:cut]))
                    self._buffer = self._buffer[cut:]
                    if final:
                        events.append(CustomEnd())
                        self._state = "text"
                    return events
                if end:
                    events.append(CustomInput(self._buffer[:end]))
                events.append(CustomEnd())
                self._buffer = self._buffer[end + len(CUSTOM_CALL_CLOSE) :].lstrip("\n")
                self._state = "text"
