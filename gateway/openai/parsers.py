"""Reading an output in its model family's own format: reasoning and tool calls, whole and streamed.

Every parser here reads one choice's text as it is generated, with the interface of the Hermes
parser (`tools.ToolCallParser`): `feed(text, final)` returns OpenAI chat deltas, `{"content": ...}`,
`{"reasoning_content": ...}` and `{"tool_calls": [...]}` as OpenAI streams calls (index, id, type
and name first, then argument fragments), and `num_calls` counts the calls begun. A whole output
is read by the same parser (`read_whole`), so a stream assembles to exactly the whole answer.

- `ThinkSplitter`: reasoning in `<think>...</think>` before the answer (Qwen3; `open`: the prompt
  already opened it), the answer read by an inner parser.
- `JsonCallsParser`: calls as JSON objects after a marker, each `{"name": ..., "arguments": {...}}`
  (or `"parameters"`): Mistral's `[TOOL_CALLS][{...}, {...}]`, Llama 3.1's `{...}` (an output that
  starts with `{`, or after `<|python_tag|>`; several separated by `;`).
- `HarmonyParser`: gpt-oss's messages, `<|channel|>analysis<|message|>...<|end|><|start|>assistant
  <|channel|>final<|message|>...`: analysis is reasoning, final (and commentary without a
  recipient) is content, a commentary message `to=functions.NAME` is a call of NAME whose
  message is its arguments.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gateway.openai.schemas import ChatCompletionDelta, MessageToolCall
from gateway.openai.tools import new_call_id, partial_suffix


class DeltaParser(Protocol):
    """One choice's text, fed as it comes, as OpenAI chat deltas (see the module docstring)."""

    @property
    def num_calls(self) -> int: ...

    def feed(self, text: str, final: bool = False) -> list[ChatCompletionDelta]: ...


def _content(text: str) -> list[ChatCompletionDelta]:
    return [{"content": text}] if text else []


@dataclass
class TextParser:
    """Text as content: the inner parser of a reasoning format when no tools are parsed."""

    num_calls: int = 0

    def feed(self, text: str, final: bool = False) -> list[ChatCompletionDelta]:
        return _content(text)


@dataclass
class ThinkSplitter:
    """`<think>reasoning</think>` at the start of the output (or, `open`: the prompt opened it,
    reasoning up to `</think>`) as `reasoning_content`, without the whitespace around it; the rest
    goes to `inner`."""

    inner: DeltaParser
    open: bool = False
    start: str = "<think>"
    end: str = "</think>"
    _buffer: str = ""
    _state: str = ""  # "" (not known yet), "reasoning", "answer" (before its first character), "rest"
    _said: bool = False  # some reasoning was sent

    def __post_init__(self) -> None:
        self._state = "reasoning" if self.open else ""

    @property
    def num_calls(self) -> int:
        return self.inner.num_calls

    def feed(self, text: str, final: bool = False) -> list[ChatCompletionDelta]:
        self._buffer += text
        deltas: list[ChatCompletionDelta] = []
        if self._state == "":
            head = self._buffer.lstrip()
            if head.startswith(self.start):
                self._state, self._buffer = "reasoning", head[len(self.start) :]
            elif self.start.startswith(head) and not final:
                return deltas  # may still become the opening tag
            else:
                self._state = "rest"
        if self._state == "reasoning":
            if not self._said:
                self._buffer = self._buffer.lstrip()
            end = self._buffer.find(self.end)
            if end < 0:
                keep = 0 if final else partial_suffix(self._buffer, self.end)
                keep += 0 if final else _trailing_space(self._buffer[: len(self._buffer) - keep])
                reasoning, self._buffer = (
                    self._buffer[: len(self._buffer) - keep],
                    self._buffer[len(self._buffer) - keep :],
                )
                return self._reasoning(reasoning.rstrip() if final else reasoning)
            deltas += self._reasoning(self._buffer[:end].rstrip())
            self._state, self._buffer = "answer", self._buffer[end + len(self.end) :]
        if self._state == "answer":
            self._buffer = self._buffer.lstrip()
            if not self._buffer and not final:
                return deltas
            self._state = "rest"
        text, self._buffer = self._buffer, ""
        return deltas + self.inner.feed(text, final=final)

    def _reasoning(self, text: str) -> list[ChatCompletionDelta]:
        if not text:
            return []
        self._said = True
        return [{"reasoning_content": text}]


def _trailing_space(text: str) -> int:
    return len(text) - len(text.rstrip())


# -- calls as JSON objects ------------------------------------------------------------------------

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class _JsonObject:
    """One JSON object read a character at a time as it is generated: its `name` once that string
    is whole, where the value of `arguments` (or `parameters`) starts and, once known, ends, and
    where the object ends. Keys and values at the top level only; what is nested is skipped."""

    text: str = ""
    name: str | None = None
    args_start: int = -1
    args_end: int = -1
    end: int = -1
    _i: int = 0
    _depth: int = 0
    _in_string: bool = False
    _escape: bool = False
    _string_start: int = -1
    _key: str | None = None  # the last key read at the top level
    _value_key: str | None = None  # the key whose value is being read (None: a key is next)
    _value_start: int = -1

    def feed(self, text: str) -> None:
        self.text += text
        while self._i < len(self.text) and self.end < 0:
            i, c = self._i, self.text[self._i]
            self._i += 1
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
                    if self._depth == 1:
                        self._string_done(i + 1)
                continue
            if c.isspace():
                continue
            if self._depth == 1 and self._value_key is not None and self._value_start < 0:
                self._value_start = i
                if self._value_key in ARGUMENT_KEYS and self.args_start < 0:
                    self.args_start = i
            if c == '"':
                self._in_string, self._string_start = True, i
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 1:  # a nested value closed: the value at the top level
                    self._value_done(i + 1)
                elif self._depth == 0:
                    if self._value_key is not None and self._value_start >= 0:
                        self._value_done(i)  # a number, true, false or null
                    self.end = i + 1
            elif self._depth == 1 and c == ":":
                self._value_key, self._value_start = self._key or "", -1
            elif self._depth == 1 and c == "," and self._value_key is not None:
                self._value_done(i)

    def _string_done(self, end: int) -> None:
        literal = self.text[self._string_start : end]
        if self._value_key is None:
            self._key = json.loads(literal)
            return
        if self._value_key == "name":
            value = json.loads(literal)
            self.name = value if isinstance(value, str) else None
        self._value_done(end)

    def _value_done(self, end: int) -> None:
        if self._value_key in ARGUMENT_KEYS and self.args_end < 0 and self.args_start >= 0:
            self.args_end = len(self.text[:end].rstrip())
        self._value_key, self._value_start = None, -1

    @property
    def arguments_so_far(self) -> str:
        """The argument value's text as far as it is known (all of it once `args_end` is set)."""
        if self.args_start < 0:
            return ""
        return self.text[self.args_start : self.args_end if self.args_end >= 0 else self._i]


@dataclass
class JsonCallsParser:
    """Calls as JSON objects (see the module docstring): after one of `markers`, or, with
    `bare_start`, when the output itself starts with `{`; `array`: the calls are a JSON array
    (Mistral), else objects separated by `;` (Llama 3.1). Text before the calls is content; an
    object that turns out not to be a call (no `name`) is content too."""

    markers: tuple[str, ...]
    array: bool = False
    bare_start: bool = False
    num_calls: int = 0
    _buffer: str = ""
    _state: str = "start"  # start, text, between (calls), object, done
    _object: _JsonObject | None = None
    _sent: int = 0  # argument characters sent of the open call
    _said: bool = False  # the open object's call head was sent
    _ids: list[str] = field(default_factory=list)
    new_id: Callable[[], str] = new_call_id

    def feed(self, text: str, final: bool = False) -> list[ChatCompletionDelta]:
        self._buffer += text
        deltas: list[ChatCompletionDelta] = []
        while True:
            step = getattr(self, f"_{self._state}_step")(final)
            if step is None:
                return deltas
            deltas += step

    def _start_step(self, final: bool) -> list[ChatCompletionDelta] | None:
        head = self._buffer.lstrip()
        if not head and not final:
            return None
        if self.bare_start and head.startswith("{"):
            self._buffer, self._state = head, "between"
        else:
            self._state = "text"
        return []

    def _text_step(self, final: bool) -> list[ChatCompletionDelta] | None:
        found = [(i, m) for m in self.markers if (i := self._buffer.find(m)) >= 0]
        if found:
            start, marker = min(found)
            before, self._buffer = self._buffer[:start], self._buffer[start + len(marker) :]
            self._state = "between"
            return _content(before if before.strip() or not self.num_calls else "")
        keep = 0 if final else max((partial_suffix(self._buffer, m) for m in self.markers), default=0)
        emit, self._buffer = (
            self._buffer[: len(self._buffer) - keep],
            self._buffer[len(self._buffer) - keep :],
        )
        if self.num_calls and not emit.strip():
            return None
        return _content(emit) or None

    def _between_step(self, final: bool) -> list[ChatCompletionDelta] | None:
        """Between calls: whitespace, the array's brackets and the separators, then an object."""
        stripped = self._buffer.lstrip(" \t\r\n,;[" if self.array else " \t\r\n;")
        if stripped.startswith("{"):
            self._buffer, self._state, self._object = "", "object", _JsonObject()
            self._sent, self._said = 0, False
            self._object.feed(stripped)
            return []
        if self.array and stripped.startswith("]"):
            self._buffer, self._state = stripped[1:], "text"
            return []
        if not stripped and not final:
            self._buffer = ""
            return None
        self._buffer, self._state = stripped, "text"  # not a call after all: the rest is text
        return [] if stripped or final else None

    def _object_step(self, final: bool) -> list[ChatCompletionDelta] | None:
        obj = self._object
        assert obj is not None  # set with the state
        if self._buffer:
            obj.feed(self._buffer)
            self._buffer = ""
        deltas: list[ChatCompletionDelta] = []
        if not self._said and obj.name is not None:
            self._said = True
            call_id = self.new_id()
            self._ids.append(call_id)
            deltas.append(
                {
                    "tool_calls": [
                        {
                            "index": self.num_calls,
                            "id": call_id,
                            "type": "function",
                            "function": {"name": obj.name, "arguments": ""},
                        }
                    ]
                }
            )
        if self._said:
            arguments = obj.arguments_so_far
            if obj.args_end < 0 and arguments.startswith('"'):
                arguments = ""  # arguments written as a JSON string: sent decoded, once whole
            elif obj.args_end >= 0 and arguments.startswith('"'):
                decoded = json.loads(arguments)
                arguments = decoded if isinstance(decoded, str) else arguments
            if len(arguments) > self._sent:
                deltas.append(self._args(arguments[self._sent :]))
                self._sent = len(arguments)
        if obj.end >= 0 or final:
            rest = obj.text[obj.end :] if obj.end >= 0 else ""
            if not self._said:  # no name: it was text that looked like a call
                self._state, self._buffer = "text", obj.text[: obj.end if obj.end >= 0 else None] + rest
                return deltas
            self.num_calls += 1
            self._state, self._buffer, self._object = "between", rest, None
            return deltas
        return deltas or None

    def _args(self, fragment: str) -> ChatCompletionDelta:
        return {"tool_calls": [{"index": self.num_calls, "function": {"arguments": fragment}}]}


# -- gpt-oss's harmony ------------------------------------------------------------------------------

HARMONY_STOPS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")


@dataclass
class HarmonyParser:
    """gpt-oss's harmony messages as chat deltas (see the module docstring). `phase` is the
    Responses API's phase of the message being read: "commentary" or "final_answer" (None
    before the first header)."""

    num_calls: int = 0
    phase: str | None = None
    # The phase of each content delta returned, in order (the Responses API's message items read
    # them: gateway/responses/output.py; None: text outside any message).
    content_phases: list[str | None] = field(default_factory=list)
    _buffer: str = ""
    _in_header: bool = True
    _route: str = "content"  # content, reasoning, call
    _call_text: str = ""
    _ids: list[str] = field(default_factory=list)

    def feed(self, text: str, final: bool = False) -> list[ChatCompletionDelta]:
        self._buffer += text
        deltas: list[ChatCompletionDelta] = []
        while True:
            if self._in_header:
                end = self._buffer.find("<|message|>")
                if end < 0:
                    if final and self._buffer.strip():  # never a message: what there is is text
                        deltas += _content(self._buffer)
                        self.content_phases.append(None)
                        self._buffer = ""
                    return deltas
                deltas += self._header(self._buffer[:end])
                self._buffer, self._in_header = self._buffer[end + len("<|message|>") :], False
                continue
            found = [(i, m) for m in HARMONY_STOPS if (i := self._buffer.find(m)) >= 0]
            if not found:
                keep = 0 if final else max(partial_suffix(self._buffer, m) for m in HARMONY_STOPS)
                body = self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(body) :]
                deltas += self._body(body)
                if final:
                    self._end_message()
                return deltas
            end, marker = min(found)
            deltas += self._body(self._buffer[:end])
            self._end_message()
            self._buffer, self._in_header = self._buffer[end + len(marker) :], True

    def _header(self, header: str) -> list[ChatCompletionDelta]:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        name = recipient.group(1) if recipient else None
        kind = channel.group(1) if channel else "final"
        if name is not None and name.startswith("functions."):
            self._route, self.phase = "call", "commentary"
            call_id = new_call_id()
            self._ids.append(call_id)
            head: ChatCompletionDelta = {
                "tool_calls": [
                    {
                        "index": self.num_calls,
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name.removeprefix("functions."), "arguments": ""},
                    }
                ]
            }
            return [head]
        self._route = "reasoning" if kind == "analysis" else "content"
        self.phase = "commentary" if kind == "commentary" else "final_answer"
        return []

    def _body(self, text: str) -> list[ChatCompletionDelta]:
        if not text:
            return []
        if self._route == "call":
            return [{"tool_calls": [{"index": self.num_calls, "function": {"arguments": text}}]}]
        if self._route == "reasoning":
            return [{"reasoning_content": text}]
        self.content_phases.append(self.phase)
        return [{"content": text}]

    def _end_message(self) -> None:
        if self._route == "call":
            self.num_calls += 1
        self._route = "content"


# -- a whole output ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    """A whole output read: its content (None when it only called), reasoning and calls."""

    content: str | None
    reasoning: str | None
    calls: list[MessageToolCall]


def gather(deltas: Sequence[ChatCompletionDelta]) -> Message:
    """Deltas as one message, as a client assembles a stream."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[MessageToolCall] = []
    for delta in deltas:
        content.append(delta.get("content") or "")
        reasoning.append(delta.get("reasoning_content") or "")
        for part in delta.get("tool_calls", []):
            function = part.get("function", {})
            if part["index"] == len(calls):
                name = function.get("name", "")
                calls.append(
                    {
                        "id": part.get("id", ""),
                        "type": "function",
                        "function": {"name": name, "arguments": ""},
                    }
                )
            calls[part["index"]]["function"]["arguments"] += function.get("arguments", "")
    text, thought = "".join(content), "".join(reasoning)
    return Message(text if text.strip() or not (calls or thought) else None, thought or None, calls)


def read_whole(parser: DeltaParser, text: str) -> Message:
    """A whole output, read by the parser that reads its stream."""
    return gather(parser.feed(text, final=True))
