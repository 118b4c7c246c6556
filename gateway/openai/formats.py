"""A model family's chat conventions beyond its template: the syntax its tool calls take, its
reasoning, the grammars that constrain both and the parsers that read them back.

A model's `ChatFormat` is read once from its tokenizer's chat template (and its config's
`model_type`), as llama.cpp's server picks a chat format by what the template writes:

- `harmony`, templates that write `<|channel|>` (gpt-oss): a call is a commentary message,
  `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{arguments}`;
- `mistral`, templates that write `[TOOL_CALLS]` (Mistral, Mixtral):
  `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
- `llama3_json`, templates that write `<|python_tag|>` (Llama 3.1 to 3.3):
  `{"name": ..., "parameters": {...}}`, one a turn;
- `hermes`, templates that write `<tool_call>` (Qwen2.5, Qwen3; newlines inside the tags), and
  every template that does not render tools (SmolLM2, Gemma 3, Phi-4), the tools then listed in a
  system message (gateway/openai/tools.py): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Reasoning: gpt-oss's analysis channel, and `<think>...</think>` before the answer where the
template writes `<think>` (Qwen3): `reasoning(template_kwargs)` says whether this prompt's output
may start with it ("optional"), starts inside it ("open": the template opened it), or has none
(`enable_thinking: false` closed it). Grammars let the reasoning come first, free, then constrain
the calls or the JSON answer, as vLLM's reasoning parsers do.

A marker that is a special token of the model (Mistral's `[TOOL_CALLS]`, gpt-oss's `<|channel|>`)
is the token in the grammar (`<[id]>`, which text cannot spell) and the output is detokenized
with its special tokens (`keep_special_tokens`), so the parser sees them; one that is plain text
(Qwen's `<tool_call>` and `<think>`) is its text.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal

from engine.types import GrammarSpec
from gateway.openai import tools
from gateway.openai.parsers import (
    DeltaParser,
    HarmonyParser,
    JsonCallsParser,
    TextParser,
    ThinkSplitter,
)
from gateway.openai.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, Tool

Syntax = Literal["hermes", "mistral", "llama3_json", "harmony"]
# How an output starts, for a model that reasons in <think>: maybe with it, or inside it.
Reasoning = Literal["optional", "open"] | None

MARKERS: dict[str, tuple[str, ...]] = {
    "hermes": (tools.TOOL_CALL_OPEN, tools.TOOL_CALL_CLOSE),
    "mistral": ("[TOOL_CALLS]",),
    "llama3_json": ("<|python_tag|>",),
    "harmony": (
        "<|start|>",
        "<|end|>",
        "<|message|>",
        "<|channel|>",
        "<|constrain|>",
        "<|call|>",
        "<|return|>",
    ),
}
THINK = ("<think>", "</think>")
_MAX_CACHED_PROMPT_STARTS = 64


def syntax_of(template: str, model_type: str, native_tools: bool) -> Syntax:
    """The call syntax a template's model writes (the table in the module docstring)."""
    if "<|channel|>" in template or model_type == "gpt_oss":
        return "harmony"
    if not native_tools:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template:
        return "llama3_json"
    return "hermes"


def mistral_call_id() -> str:
    """A call id as Mistral's templates take them: 9 letters and digits."""
    return uuid.uuid4().hex[:9]


def as_mistral_id(call_id: str) -> str:
    """`call_id` as Mistral's templates take it (another client's id becomes 9 hex digits of its
    hash, the same for the call and its result)."""
    if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _regex_text(text: str) -> str:
    """`text` as literal text inside a Lark `/.../` regex (Rust's regex syntax)."""
    return "".join("\\n" if c == "\n" else ("\\" + c if c in r".^$*+?()[]{}|\/-" else c) for c in text)


class ChatFormat:
    """One model's conventions (see the module docstring), read from its Hugging Face tokenizer."""

    def __init__(self, hf_tokenizer: Any, model_type: str = "llama") -> None:
        template = getattr(hf_tokenizer, "chat_template", None)
        self.hf = hf_tokenizer
        self.template = template if isinstance(template, str) else ""
        self.native_tools = tools.template_renders_tools(hf_tokenizer)
        self.syntax: Syntax = syntax_of(self.template, model_type, self.native_tools)
        self.think = self.syntax != "harmony" and all(tag in self.template for tag in THINK)
        # Qwen's templates write a call as "<tool_call>\n{...}\n</tool_call>".
        self.newline_calls = (
            self.syntax == "hermes" and self.native_tools and "<tool_call>\\n" in self.template
        )
        markers = MARKERS[self.syntax] + (THINK if self.think else ())
        self.marks = {marker: self._lark(marker) for marker in markers}
        self.keep_special_tokens = any(mark.startswith("<[") for mark in self.marks.values())
        self._starts: dict[str, Reasoning] = {}

    def _lark(self, marker: str) -> str:
        """`marker` in Lark: the special token it is (`<[id]>`), else its text."""
        token_id = (getattr(self.hf, "added_tokens_encoder", None) or {}).get(marker)
        added = (getattr(self.hf, "added_tokens_decoder", None) or {}).get(token_id)
        return (
            f"<[{token_id}]>"
            if added is not None and getattr(added, "special", False)
            else json.dumps(marker)
        )

    # -- the prompt ---------------------------------------------------------------------------

    def conversation(
        self, messages: Sequence[ChatMessage], shown: Sequence[Tool]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """Messages and tools for `apply_chat_template` (gateway/openai/tools.py's `conversation`),
        with reasoning where this template reads it and call ids as it takes them."""
        key = "thinking" if self.syntax == "harmony" else ("reasoning_content" if self.think else None)
        call_id = as_mistral_id if self.syntax == "mistral" else (lambda call_id: call_id)
        return tools.conversation(messages, shown, self.native_tools, reasoning_key=key, call_id=call_id)

    def reasoning(self, template_kwargs: dict[str, Any] | None) -> Reasoning:
        """How this prompt's output starts (see `Reasoning`): read from the template's own
        generation prompt with these variables (`enable_thinking: false` closes the block)."""
        if not self.think:
            return None
        key = json.dumps(template_kwargs or {}, sort_keys=True)
        if key not in self._starts:
            if len(self._starts) >= _MAX_CACHED_PROMPT_STARTS:
                self._starts.clear()
            self._starts[key] = self._probe(template_kwargs or {})
        return self._starts[key]

    def _probe(self, template_kwargs: dict[str, Any]) -> Reasoning:
        try:
            rendered = self.hf.apply_chat_template(
                [{"role": "user", "content": "hi"}],
                add_generation_prompt=True,
                tokenize=False,
                **template_kwargs,
            )
        except Exception:  # noqa: BLE001 - the request's own render says what is wrong
            return "optional"
        tail = str(rendered).rstrip()
        if tail.endswith(THINK[0]):
            return "open"
        return None if tail.endswith(THINK[1]) else "optional"

    # -- the output plan ------------------------------------------------------------------------

    def plan_output(self, req: ChatCompletionRequest, closed_arguments: bool = True) -> tools.OutputPlan:
        """`tools.plan_output`'s plan in this family's syntax, the reasoning allowed first."""
        reasoning = self.reasoning(req.chat_template_kwargs)
        plan = tools.plan_output(req, closed_arguments)
        if self.syntax == "hermes" and reasoning is None and not self.newline_calls:
            return plan  # the default format (the bundled SmolLM2's): as it always was
        plan = dataclasses.replace(plan, syntax=self.syntax)
        fmt = req.response_format
        lenient = fmt is not None and fmt.type == "json_schema" and fmt.json_schema.strict is False
        free_first = self.syntax == "harmony" or reasoning is not None  # text the grammar lets be
        if not plan.tools:  # no calls: free text, or a JSON answer (after the reasoning)
            answer = tools.answer_schema(fmt)
            if answer is None or not free_first:
                return plan
            lines = self._grammar((), "none", False, answer, lenient, closed_arguments, reasoning)
            grammar = GrammarSpec.lark("\n".join(lines) + "\n")
            return dataclasses.replace(
                plan, grammar=grammar, checks=(*plan.checks, (grammar, "response_format"))
            )
        choice = req.tool_choice if req.tool_choice is not None else "auto"
        answer = tools.answer_schema(fmt) if choice == "auto" else None
        parallel = req.parallel_tool_calls is not False
        lines = self._grammar(plan.tools, choice, parallel, answer, lenient, closed_arguments, reasoning)
        json_only = (choice != "auto" or answer is not None) and not free_first
        grammar = GrammarSpec.lark("\n".join(lines) + "\n", json_only=json_only)
        checks = tuple(check for check in plan.checks if check[1] != "tools")
        return dataclasses.replace(plan, grammar=grammar, checks=(*checks, (grammar, "tools")))

    def _grammar(
        self,
        shown: Sequence[Tool],
        choice: Any,
        parallel: bool,
        answer: dict[str, Any] | None,
        lenient: bool,
        closed: bool,
        reasoning: Reasoning,
    ) -> list[str]:
        """The grammar's lines: the reasoning (if any), then calls of the tools `choice` allows,
        or (auto) free text that does not start like a call, or the JSON `answer`."""
        if isinstance(choice, NamedToolChoice):
            shown = [t for t in shown if t.function.name == choice.function.name]
        if self.syntax == "harmony":
            return self._harmony(shown, choice, answer, lenient, closed)
        prefix = self._think(reasoning)
        if self.syntax == "hermes" and shown:
            wrap = (self.marks[tools.TOOL_CALL_OPEN], self.marks[tools.TOOL_CALL_CLOSE])
            if self.newline_calls:
                wrap = (f'{wrap[0]} "\\n"', f'"\\n" {wrap[1]}')
            text = tools.tool_call_grammar(shown, choice, parallel, answer, closed, wrap=wrap, prefix=prefix)
            return text.splitlines()
        lines: list[str] = []
        bodies: list[str] = []
        opener = ""  # what a call starts with, as text (nothing: a special token)
        if shown and self.syntax == "mistral":
            schema = tools.call_schema(shown, choice, closed)
            array = {"type": "array", "items": {"anyOf": schema.pop("anyOf")}, "minItems": 1, **schema}
            array["maxItems"] = tools.MAX_PARALLEL_TOOL_CALLS if parallel else 1
            mark = self.marks["[TOOL_CALLS]"]
            lines.append(f"calls: {mark} %json {json.dumps(array)}")
            opener = "" if mark.startswith("<[") else "["
        elif shown:  # llama3_json: one call a turn, as its template renders them
            schema = tools.call_schema(shown, choice, closed, arguments_key="parameters")
            tag = self.marks["<|python_tag|>"]
            lines.append(f"calls: {tag + '? ' if tag.startswith('<[') else ''}%json {json.dumps(schema)}")
            opener = "{"
        if shown:
            bodies.append("calls")
        if answer is not None:
            bodies.append("answer")
            lines.append(tools.answer_rule(answer, lenient))
        elif choice == "auto":
            bodies.append("TEXT")
            lines.append(f"TEXT: /[^{_regex_text(opener)}](.|\\n)*/" if opener else r"TEXT: /(.|\n)+/")
        first = f"{prefix[0]} " if prefix is not None else ""
        lines += prefix[1] if prefix is not None else []
        return [f"start: {first}({' | '.join(bodies)})", *lines]

    def _until(self, rule: str, marker: str, after: str = "") -> list[str]:
        """Lark lines for `rule`: any text, then `marker` (and the fixed text `after`)."""
        mark = self.marks[marker]
        tail = f" {json.dumps(after)}" if after else ""
        if mark.startswith("<["):  # a special token, which no text spells: text, then it
            return [f"{rule}: {rule.upper()}_TEXT {mark}{tail}", f"{rule.upper()}_TEXT: /(.|\\n)*/"]
        return [f"{rule}[lazy]: /(.|\\n)*{_regex_text(marker + after)}/"]

    def _think(self, reasoning: Reasoning) -> tuple[str, list[str]] | None:
        """The reasoning before the body, as `tools.tool_call_grammar` takes a prefix."""
        if reasoning is None:
            return None
        thought = self._until("thought", THINK[1], "\n\n")
        if reasoning == "open":
            return "thought", thought
        return "reasoning?", [f"reasoning: {self.marks[THINK[0]]} thought", *thought]

    def _harmony(
        self, shown: Sequence[Tool], choice: Any, answer: dict[str, Any] | None, lenient: bool, closed: bool
    ) -> list[str]:
        """gpt-oss: analysis (and commentary) messages first, then a call, the final message, or
        a final message that is the JSON answer."""
        m = self.marks
        lines = [
            f"message: {m['<|channel|>']} CHANNEL {m['<|message|>']} message_text message_end",
            f'message_end: {m["<|start|>"]} "assistant"',
            'CHANNEL: "analysis" | "commentary"',
            *self._until("message_text", "<|end|>"),
        ]
        bodies = []
        if shown:
            bodies.append("call")
            calls = []
            for i, tool in enumerate(shown):
                head = (
                    f'{m["<|channel|>"]} "commentary to=functions.{tool.function.name} " {m["<|constrain|>"]}'
                )
                arguments = json.dumps(tools.arguments_schema(tool, closed))
                lines.append(f'call_{i}: {head} "json" {m["<|message|>"]} %json {arguments}')
                calls.append(f"call_{i}")
            lines.append(f"call: {' | '.join(calls)}")
        final = f'{m["<|channel|>"]} "final" {m["<|message|>"]}'
        if answer is not None:
            bodies.append("final")
            lines += [f"final: {final} answer", tools.answer_rule(answer, lenient)]
        elif choice == "auto":
            bodies.append("final")
            lines += [f"final: {final} FINAL_TEXT", r"FINAL_TEXT: /(.|\n)*/"]
        return [f"start: message* ({' | '.join(bodies)})", *lines]

    # -- reading the output ---------------------------------------------------------------------

    def parser(self, plan: tools.OutputPlan, reasoning: Reasoning) -> Callable[[], DeltaParser] | None:
        """How each choice of a request planned as `plan` is read: None for plain text."""
        if plan.syntax == "harmony":
            return HarmonyParser
        calls: Callable[[], DeltaParser] | None = None
        if plan.parse_tool_calls and plan.syntax == "mistral":
            calls = lambda: JsonCallsParser(("[TOOL_CALLS]",), array=True, new_id=mistral_call_id)  # noqa: E731
        elif plan.parse_tool_calls and plan.syntax == "llama3_json":
            calls = lambda: JsonCallsParser(("<|python_tag|>",), bare_start=True)  # noqa: E731
        elif plan.parse_tool_calls:
            calls = tools.ToolCallParser
        if reasoning is None:
            return calls
        inner = calls or TextParser
        return lambda: ThinkSplitter(inner(), open=reasoning == "open")
