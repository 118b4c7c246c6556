"""Structured output and tool calling at the edge: grammars, prompts, parsing and stream deltas.

What a chat request asks for becomes an `OutputPlan`: the grammar its output must match (engine/
grammar.py), the specs to compile first (each names the field a compile error points at, so a bad
schema is a 400 naming it), and whether tool calls are parsed out of the text.

- `response_format`: `json_object` -> any JSON object; `json_schema` -> the schema (`strict:
  false`: keywords the grammar engine does not implement are ignored rather than refused).
- `tools` with `tool_choice` `auto` (the default): the model writes text or calls; once the output
  starts with `<tool_call>` it is constrained to calls. With a JSON `response_format` beside them,
  the text is that JSON (an answer in the format, or calls). `required`: one or more calls (one with
  `parallel_tool_calls: false`, at most `MAX_PARALLEL_TOOL_CALLS`). A named function: calls of that
  function. `none`: the tools are not shown to the model and nothing is parsed.

The tool-call format is Hermes's (also Qwen2.5's), one call per block:

    <tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>

The tools reach the prompt through the model's chat template where the template renders `tools`;
otherwise (SmolLM2's template does not) through the default format below: a system message that
lists the functions' JSON schemas and this calling convention; earlier calls are rendered as such
blocks in the assistant's turn and tool results as `<tool_response>` blocks in a user turn.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.json_schema import bound_schema
from engine.types import GrammarError, GrammarSpec
from gateway.errors import invalid_request
from gateway.openai.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, Tool
from gateway.openai.schemas import ChatCompletionDelta, MessageToolCall, ToolCallDelta

if TYPE_CHECKING:
    from engine.client import EngineClient

# Calls in one turn, at most: a small model, once it has called, may go on repeating the call until
# max_tokens (SmolLM2-135M does, greedy); the grammar ends the turn after this many instead.
MAX_PARALLEL_TOOL_CALLS = 4
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# JSON compiled compact: no whitespace between tokens (the runaway-whitespace guard, engine/grammar/).
_COMPACT = {"whitespace_flexible": False}
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

DEFAULT_TOOLS_PROMPT = (
    "You can call functions. To call one, reply with\n"
    '<tool_call>{{"name": <function name>, "arguments": <arguments as a JSON object>}}</tool_call>\n'
    "(one block per call) and nothing else. The functions, as JSON schemas:\n<tools>\n{tools}\n</tools>"
)


@dataclass(frozen=True)
class OutputPlan:
    """How a chat request's output is constrained and read back."""

    grammar: GrammarSpec | None = None
    # Specs to compile before admission, each with the request field its error names.
    checks: tuple[tuple[GrammarSpec, str], ...] = ()
    tools: tuple[Tool, ...] = ()  # shown to the model
    parse_tool_calls: bool = False
    # The call syntax the grammar writes (gateway/openai/formats.py): "hermes" (this module's
    # `<tool_call>` blocks), "mistral", "llama3_json" or "harmony".
    syntax: str = "hermes"


def plan_output(req: ChatCompletionRequest, closed_arguments: bool = True) -> OutputPlan:
    """The plan for `req` (already validated by gateway/openai/protocol.py). `closed_arguments`: a call's
    arguments hold no keys beyond its function's declared properties where its schema does not
    say (`closed_schema`; the `--tool-arguments declared` setting), else JSON Schema's default."""
    fmt = req.response_format
    tools = tuple(req.tools or ())
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    if tools and choice != "none":
        checks = tuple((parameters_spec(t), f"tools[{i}].function.parameters") for i, t in enumerate(tools))
        answer = answer_schema(fmt) if choice == "auto" else None
        grammar = GrammarSpec.lark(
            tool_call_grammar(tools, choice, req.parallel_tool_calls is not False, answer, closed_arguments),
            json_only=choice != "auto" or answer is not None,
        )
        return OutputPlan(grammar, (*checks, (grammar, "tools")), tools, parse_tool_calls=True)
    if fmt is None or fmt.type == "text":
        return OutputPlan()
    if fmt.type == "json_object":
        spec = GrammarSpec.json_object()
        return OutputPlan(spec, ((spec, "response_format"),))
    if fmt.json_schema.schema_ is None:
        spec = GrammarSpec.json_object()
    else:
        spec = GrammarSpec.json_schema(fmt.json_schema.schema_, strict=fmt.json_schema.strict is not False)
    return OutputPlan(spec, ((spec, "response_format.json_schema.schema"),))


def answer_schema(fmt: Any) -> dict[str, Any] | None:
    """The JSON schema a text answer must match beside tool calls (response_format), or None."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object" or fmt.json_schema.schema_ is None:
        return {"type": "object"}
    schema: dict[str, Any] = bound_schema(fmt.json_schema.schema_)
    return schema


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else _EMPTY_PARAMETERS


def parameters_spec(tool: Tool) -> GrammarSpec:
    return GrammarSpec.json_schema(_parameters(tool), strict=tool.function.strict is not False)


def closed_schema(schema: Any) -> Any:
    """`schema` with `"additionalProperties": false` on every object subschema that declares
    `properties` and says nothing of further keys (a copy), as xgrammar's strict mode generates:
    a model then cannot invent keys (LangChain's tools got `{"city": ..., "properties": {...}}`)."""
    if isinstance(schema, list):
        return [closed_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: closed_schema(value) for key, value in schema.items()}
    if isinstance(schema.get("properties"), dict) and not {
        "additionalProperties",
        "patternProperties",
        "unevaluatedProperties",
    } & set(schema):
        out["additionalProperties"] = False
    return out


def call_schema(
    tools: Sequence[Tool], choice: Any, closed_arguments: bool = True, arguments_key: str = "arguments"
) -> dict[str, Any]:
    """The JSON schema of one call of the tools `choice` allows, `{"name": ..., "arguments": ...}`
    (Llama 3.1 names them "parameters"), compact, with llguidance's options; its `anyOf` is empty
    when no function is allowed."""
    close = closed_schema if closed_arguments else (lambda schema: schema)
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function.name]
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                arguments_key: bound_schema(close(_parameters(t))),
            },
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    lenient = any(t.function.strict is False for t in tools)
    return {"anyOf": options, "x-guidance": {**_COMPACT, **({"lenient": True} if lenient else {})}}


def arguments_schema(tool: Tool, closed_arguments: bool = True) -> dict[str, Any]:
    """The JSON schema of one function's arguments as its calls are generated (bounded, and
    closed where `closed_arguments`), compact, with llguidance's options."""
    schema = _parameters(tool)
    schema = bound_schema(closed_schema(schema) if closed_arguments else schema)
    lenient = {"lenient": True} if tool.function.strict is False else {}
    return {**schema, "x-guidance": {**_COMPACT, **lenient}}


def answer_rule(answer: dict[str, Any], lenient: bool = False) -> str:
    """The Lark rule `answer`: a JSON text of the `answer` schema, compact (`lenient`: keywords
    the grammar engine does not implement are ignored)."""
    options = {**_COMPACT, **({"lenient": True} if lenient else {})}
    return f"answer: %json {json.dumps({**answer, 'x-guidance': options})}"


def tool_call_grammar(
    tools: Sequence[Tool],
    choice: Any,
    parallel: bool,
    answer: dict[str, Any] | None = None,
    closed_arguments: bool = True,
    other_calls: Sequence[tuple[str, str]] = (),
    *,
    wrap: tuple[str, str] = (json.dumps(TOOL_CALL_OPEN), json.dumps(TOOL_CALL_CLOSE)),
    prefix: tuple[str, Sequence[str]] | None = None,
) -> str:
    """A Lark grammar (llguidance's dialect) for the calls `choice` allows, or (auto) free text, or
    with `answer` (a JSON schema: response_format beside tools) a JSON answer instead.
    `other_calls`: further kinds of call, each a rule's name and its Lark lines (custom tools).
    `wrap`: the Lark of what opens and closes each call (Qwen's templates write newlines inside);
    `prefix`: what the output starts with first (a Lark expression, and the lines of its rules:
    a model's reasoning, gateway/openai/formats.py)."""
    schema = call_schema(tools, choice, closed_arguments)
    kinds = [name for name, _ in other_calls]
    lines = [line for _, rule in other_calls for line in rule.splitlines()]
    if schema["anyOf"]:
        kinds.insert(0, "function_call")
        lines.append(f"function_call: {wrap[0]} %json {json.dumps(schema)} {wrap[1]}")
    lines += [
        f"call: {' | '.join(kinds)}",
        f'calls: call ("\\n" call)~0..{MAX_PARALLEL_TOOL_CALLS - 1}' if parallel else "calls: call",
    ]
    if prefix is not None:
        lines += prefix[1]

    def start(body: str) -> str:
        return f"start: {prefix[0]} ({body})" if prefix is not None else f"start: {body}"

    if choice == "auto" and answer is not None:
        lines = [start("calls | answer"), answer_rule(answer), *lines]
    elif choice == "auto":
        # Text that does not start like a call; once the output starts with "<", a call it is.
        lines = [start("calls | TEXT"), r"TEXT: /[^<](.|\n)*/", *lines]
    else:
        lines = [start("calls"), *lines]
    return "\n".join(lines) + "\n"


# -- the prompt -----------------------------------------------------------------------------------


_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "probe_function", "parameters": {"type": "object", "properties": {}}},
}


def template_renders_tools(hf_tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template writes the `tools` it is given into the prompt: tried,
    not guessed from its text (Phi-4-mini's names `tools` but reads them only from a system
    message's field)."""
    template = getattr(hf_tokenizer, "chat_template", None)
    if not isinstance(template, str) or "tools" not in template:
        return False
    try:
        probe = [{"role": "user", "content": "hi"}]
        rendered = hf_tokenizer.apply_chat_template(
            probe, tools=[_PROBE_TOOL], add_generation_prompt=True, tokenize=False
        )
    except Exception:  # noqa: BLE001 - a template that needs more than the probe: trust its text
        return True
    return isinstance(rendered, str) and "probe_function" in rendered


def _call_block(name: str, arguments: str) -> str:
    return f'{TOOL_CALL_OPEN}{{"name":{json.dumps(name)},"arguments":{arguments or "{}"}}}{TOOL_CALL_CLOSE}'


def conversation(
    messages: Sequence[ChatMessage],
    tools: Sequence[Tool],
    native: bool,
    *,
    reasoning_key: str | None = None,
    call_id: Callable[[str], str] = lambda call_id: call_id,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages (and tools) for `apply_chat_template`, in the form transformers documents: the
    template's own tool rendering when `native` (a call's arguments as an object), else the default
    format of the module docstring (tools argument None). `reasoning_key`: where the template reads
    an assistant message's reasoning (Qwen3: `reasoning_content`, gpt-oss: `thinking`; None: it is
    dropped); `call_id`: a call's id as the template takes it (Mistral's: 9 letters and digits)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        message: dict[str, Any] = {"role": role, "content": m.text}
        if m.name is not None:
            message["name"] = m.name
        if native:
            if m.reasoning_content and reasoning_key is not None:
                message[reasoning_key] = m.reasoning_content
            if m.tool_calls:
                message["tool_calls"] = [
                    {
                        "id": call_id(c.id),
                        "type": "function",
                        "function": {
                            "name": c.function.name,
                            "arguments": _loads_or_text(c.function.arguments),
                        },
                    }
                    for c in m.tool_calls
                ]
            if m.tool_call_id is not None:
                message["tool_call_id"] = call_id(m.tool_call_id)
        else:
            if m.tool_calls:
                blocks = "\n".join(_call_block(c.function.name, c.function.arguments) for c in m.tool_calls)
                message["content"] = f"{m.text}\n{blocks}" if m.text else blocks
            if m.role == "tool":
                message = {"role": "user", "content": f"<tool_response>\n{m.text}\n</tool_response>"}
        out.append(message)
    if not tools:
        return out, None
    if native:
        return out, [t.model_dump(exclude_none=True) for t in tools]
    listed = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
    prompt = DEFAULT_TOOLS_PROMPT.format(tools=listed)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _loads_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


# -- reading calls back -----------------------------------------------------------------------------

# The arguments start at their first character (not a space a model writes after the colon).
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallParser:
    """Splits one choice's text, fed as it is generated, into OpenAI deltas: `{"content": ...}` for
    text and `{"tool_calls": [...]}` as OpenAI streams calls (index, id, type and name first, then
    argument fragments). Text that may be the start of `<tool_call>` is held back until it is
    known; argument text is sent up to its last `}` (the call's own closing brace comes last).
    Whitespace between and after calls is not content.
    """

    num_calls: int = 0
    _buffer: str = ""
    _in_call: bool = False
    _args_start: int = -1  # offset of the arguments in _buffer once the name is known
    _args_sent: int = 0
    _ids: list[str] = field(default_factory=list)

    def feed(self, text: str, final: bool = False) -> list[ChatCompletionDelta]:
        self._buffer += text
        deltas: list[ChatCompletionDelta] = []
        while True:
            step = self._call_step(final) if self._in_call else self._text_step(final)
            if step is None:
                return deltas
            deltas.extend(step)

    def _text_step(self, final: bool) -> list[ChatCompletionDelta] | None:
        start = self._buffer.find(TOOL_CALL_OPEN)
        if start >= 0:
            before, self._buffer = self._buffer[:start], self._buffer[start + len(TOOL_CALL_OPEN) :]
            self._in_call, self._args_start, self._args_sent = True, -1, 0
            return self._content(before)
        keep = 0 if final else partial_suffix(self._buffer, TOOL_CALL_OPEN)
        emit, self._buffer = (
            self._buffer[: len(self._buffer) - keep],
            self._buffer[len(self._buffer) - keep :],
        )
        deltas = self._content(emit)
        return None if not deltas else deltas + (self._text_step(final) or [])

    def _content(self, text: str) -> list[ChatCompletionDelta]:
        if not text or (self.num_calls and not text.strip()):
            return []
        return [{"content": text}]

    def _call_step(self, final: bool) -> list[ChatCompletionDelta] | None:
        deltas: list[ChatCompletionDelta] = []
        if self._args_start < 0:
            head = _CALL_HEAD.match(self._buffer)
            if head is None:
                if final:  # cut off before the name was complete: give back what there was as text
                    self._in_call = False
                    text, self._buffer = TOOL_CALL_OPEN + self._buffer, ""
                    return self._content(text) or None
                return None
            call_id = new_call_id()
            self._ids.append(call_id)
            name = json.loads(f'"{head.group(1)}"')
            head_delta: ToolCallDelta = {
                "index": self.num_calls,
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
            deltas.append({"tool_calls": [head_delta]})
            self._args_start = self._args_sent = head.end()
        end = self._buffer.find(TOOL_CALL_CLOSE, self._args_start)
        if end >= 0 or final:
            body = self._buffer[self._args_start : end if end >= 0 else len(self._buffer)].rstrip()
            if end >= 0 and body.endswith("}"):
                body = body[:-1].rstrip()  # the call object's own closing brace
            if len(body) > self._args_sent - self._args_start:
                deltas.append(self._args_delta(body[self._args_sent - self._args_start :]))
            self.num_calls += 1
            self._in_call = False
            self._buffer = self._buffer[end + len(TOOL_CALL_CLOSE) :] if end >= 0 else ""
            return deltas
        last_brace = self._buffer.rfind("}", self._args_sent)
        if last_brace > self._args_sent:
            deltas.append(self._args_delta(self._buffer[self._args_sent : last_brace]))
            self._args_sent = last_brace
        return deltas or None

    def _args_delta(self, fragment: str) -> ChatCompletionDelta:
        return {"tool_calls": [{"index": self.num_calls, "function": {"arguments": fragment}}]}


def partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `token`."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if text.endswith(token[:n]):
            return n
    return 0


def parse_message(text: str) -> tuple[str | None, list[MessageToolCall]]:
    """A whole output -> (content or None, OpenAI `tool_calls`); the same parser as the stream, so
    a streamed response assembles to exactly the non-streamed one."""
    parser = ToolCallParser()
    content: list[str] = []
    calls: list[MessageToolCall] = []
    for delta in parser.feed(text, final=True):
        if "content" in delta:
            content.append(delta["content"] or "")
            continue
        for part in delta["tool_calls"]:
            function = part["function"]
            if part["index"] == len(calls):
                calls.append(
                    {
                        "id": part["id"],
                        "type": "function",
                        "function": {"name": function["name"], "arguments": function["arguments"]},
                    }
                )
            else:
                calls[part["index"]]["function"]["arguments"] += function["arguments"]
    text_out = "".join(content)
    return (text_out if text_out.strip() or not calls else None), calls


async def compile_checks(engine: EngineClient, plan: OutputPlan) -> None:
    """Compile the plan's grammars through the engine's cache (off the event loop and the engine
    thread); APIError 400 naming the field whose schema the grammar engine refuses, and why."""
    for spec, param in plan.checks:
        try:
            # Shielded: a caller that goes away must not cancel a compile other requests share.
            await asyncio.shield(asyncio.wrap_future(engine.grammar(spec)))
        except GrammarError as exc:
            raise invalid_request(f"Invalid schema for '{param}': {exc}", param=param) from None
