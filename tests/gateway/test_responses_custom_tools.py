"""Custom tools through the official SDK against a real server (the real engine, the tiny random
model): a grammar tool's input always parses in its grammar (Codex's own apply_patch Lark grammar,
a regex), free-text tools, tool_choice naming one, allowed_tools, the streamed events, and a call's
output going back as a custom_tool_call_output item."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import llguidance
import llguidance.hf
import openai
import pytest
from openai.types.responses import Response
from transformers import AutoTokenizer

from tests.gateway.conftest import TinyServer
from tests.lark_check import APPLY_PATCH_GRAMMAR, lark_parser

# Codex CLI's apply_patch tool as Codex sends it.
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Use the `apply_patch` tool to edit files. This is a FREEFORM tool.",
    "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_GRAMMAR},
}
EMAIL = {
    "type": "custom",
    "name": "send_to",
    "description": "An address to send to.",
    "format": {"type": "grammar", "syntax": "regex", "definition": r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"},
}
NOTE = {"type": "custom", "name": "note", "description": "Write a note.", "format": {"type": "text"}}


@pytest.fixture
def client(tiny_server: TinyServer) -> openai.OpenAI:
    return tiny_server.openai()


def _parses(tiny_model_dir: Path, grammar: str, text: str) -> tuple[bool, bool]:
    """Whether `text` is in `grammar`'s language as far as it goes, and whether it is complete
    there, by a fresh matcher (not the one that generated it)."""
    hf = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(hf), grammar, log_level=0)
    ok = all(matcher.consume_token(t) for t in hf.encode(text, add_special_tokens=False))
    return ok, ok and matcher.is_accepting()


def _calls(resp: Response) -> list[Any]:
    return [item for item in resp.output if item.type == "custom_tool_call"]


def test_codex_apply_patch_forced_through_the_api_parses_in_its_grammar(
    client: openai.OpenAI, tiny_server: TinyServer, tiny_model_dir: Path
) -> None:
    resp = client.responses.create(
        model=tiny_server.model,
        input="Create hello.txt saying hi.",
        tools=[APPLY_PATCH],  # type: ignore[list-item]
        tool_choice={"type": "custom", "name": "apply_patch"},
        max_output_tokens=120,
        temperature=0,
    )
    (call,) = _calls(resp)
    assert call.name == "apply_patch" and call.call_id.startswith("call_")
    assert call.input.startswith("*** Begin Patch\n")
    # Random weights end no line of their own: near max_output_tokens the grammar's shortest
    # completion closes the patch, so the call is whole, and parses (by Lark itself and by a fresh
    # matcher, not the one that generated it).
    assert resp.status == "completed", call.input
    lark_parser(APPLY_PATCH_GRAMMAR).parse(call.input)
    assert _parses(tiny_model_dir, APPLY_PATCH_GRAMMAR, call.input) == (True, True)
    assert resp.tools[0].type == "custom"  # echoed as sent
    tiny_server.wait_idle()


def test_a_regex_tool_streams_its_input_and_the_output_goes_back(
    client: openai.OpenAI, tiny_server: TinyServer
) -> None:
    fields: dict[str, Any] = {
        "model": tiny_server.model,
        "input": "Who gets it?",
        "tools": [EMAIL, NOTE],
        "tool_choice": {
            "type": "allowed_tools",
            "mode": "required",
            "tools": [{"type": "custom", "name": "send_to"}],
        },
        "max_output_tokens": 60,
        "temperature": 0,
    }
    whole = client.responses.create(**fields)
    (call,) = _calls(whole)
    assert whole.status == "completed"
    assert call.name == "send_to" and re.fullmatch(EMAIL["format"]["definition"], call.input)
    with client.responses.stream(**fields) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert "response.custom_tool_call_input.delta" in kinds
    done = next(e for e in events if e.type == "response.custom_tool_call_input.done")
    streamed = next(i for i in events[-1].response.output if i.type == "custom_tool_call")  # type: ignore[union-attr]
    assert done.input == streamed.input == call.input  # the stream assembles what create answers
    follow = client.responses.create(
        model=tiny_server.model,
        previous_response_id=whole.id,
        input=[{"type": "custom_tool_call_output", "call_id": call.call_id, "output": "sent"}],
        max_output_tokens=4,
    )
    items = client.responses.input_items.list(follow.id).data
    assert items[0].type == "custom_tool_call_output"
    tiny_server.wait_idle()


def test_bad_custom_tools_are_400s_naming_the_field(tiny_server: TinyServer) -> None:
    def post(**fields: Any) -> httpx.Response:
        return httpx.post(
            tiny_server.base_url + "/v1/responses", json={"model": tiny_server.model, "input": "x", **fields}
        )

    bad_grammar = {**APPLY_PATCH, "format": {"type": "grammar", "syntax": "lark", "definition": "start: ("}}
    r = post(tools=[NOTE, bad_grammar])
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[1].format.definition", r.text
    r = post(tools=[NOTE], tool_choice={"type": "custom", "name": "nope"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    r = post(tools=[{**NOTE, "format": {"type": "grammar", "syntax": "ebnf", "definition": "x"}}])
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("tools[0].format"), r.text
    bad_schema = {"type": "function", "name": "f", "parameters": {"properties": {"a": {"type": "nope"}}}}
    r = post(tools=[NOTE, bad_schema])
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[1].parameters", r.text
    r = post(input=[{"type": "custom_tool_call_output", "call_id": "call_x", "output": "x"}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].call_id", r.text
    assert json.loads(post(tools=[NOTE], max_output_tokens=2).text)["tools"][0]["name"] == "note"
