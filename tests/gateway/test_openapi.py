"""The OpenAPI document: well-formed, loadable by schemathesis, and in agreement with the parser."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
import schemathesis

from gateway.errors import APIError
from gateway.openapi import build_openapi
from gateway.protocol import parse_chat_request, parse_completion_request

MODEL = "m"
MSG = [{"role": "user", "content": "hi"}]


def _keys(node: Any) -> set[str]:
    if isinstance(node, dict):
        return set(node) | {k for v in node.values() for k in _keys(v)}
    if isinstance(node, list):
        return {k for v in node for k in _keys(v)}
    return set()


def test_document_uses_json_schema_keywords_only() -> None:
    doc = build_openapi(MODEL, vocab_size=100)
    assert doc["openapi"] == "3.1.0"
    assert not _keys(doc) & {"ge", "le", "gt", "lt"}  # pydantic spellings that mean nothing to a validator
    props = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert props["model"] == {"type": "string", "enum": [MODEL]}
    assert props["n"]["anyOf"][0] == {"type": "integer", "minimum": 1, "maximum": 128}
    prompt = doc["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    assert prompt["anyOf"][2]["items"]["maximum"] == 99


def test_schemathesis_loads_every_operation() -> None:
    schema = schemathesis.openapi.from_dict(build_openapi(MODEL))
    labels = {result.ok().label for result in schema.get_all_operations()}
    assert labels == {
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "POST /v1/embeddings",
        "GET /v1/models",
        "GET /v1/models/{model}",
        "GET /health",
        "GET /ready",
    }


def _request_validator(name: str) -> jsonschema.Draft202012Validator:
    doc = build_openapi(MODEL, vocab_size=100)
    return jsonschema.Draft202012Validator(
        {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    )


@pytest.mark.parametrize(
    ("body", "valid"),
    [
        ({"model": MODEL, "messages": MSG}, True),
        (
            {
                "model": MODEL,
                "messages": MSG,
                "n": 2,
                "stop": ["a", "b"],
                "logit_bias": {"5": -100},
                "seed": -1,
            },
            True,
        ),
        ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}, True),
        ({"model": MODEL, "messages": MSG, "max_tokens": None, "tools": None}, True),
        (
            {
                "model": MODEL,
                "messages": [
                    *MSG,
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                        ],
                    },
                    {"role": "tool", "content": "42", "tool_call_id": "c1"},
                ],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
                "response_format": {"type": "text"},
            },
            True,
        ),
        (
            {
                "model": MODEL,
                "messages": MSG,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {}, "strict": True},
                },
            },
            True,
        ),
        ({"model": MODEL, "messages": MSG, "response_format": {"type": "json_schema"}}, False),
        ({"model": MODEL, "messages": MSG, "tool_choice": "sometimes"}, False),
        ({"model": MODEL, "messages": []}, False),
        ({"model": MODEL, "messages": MSG, "n": 0}, False),
        ({"model": MODEL, "messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, False),
        ({"model": MODEL, "messages": MSG, "temperature": 3}, False),
        ({"model": MODEL, "messages": MSG, "extra": 1}, False),
        ({"model": MODEL, "messages": [{"role": "function", "content": "x"}]}, False),
        ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, False),
    ],
)
def test_chat_schema_agrees_with_parser(body: dict[str, Any], valid: bool) -> None:
    schema_ok = _request_validator("ChatCompletionRequest").is_valid(body)
    assert schema_ok == valid
    if valid:
        parse_chat_request(body)
    else:
        with pytest.raises(APIError):
            parse_chat_request(body)


@pytest.mark.parametrize(
    ("body", "valid"),
    [
        ({"model": MODEL, "prompt": "x"}, True),
        ({"model": MODEL, "prompt": [[1, 2], [3]], "logprobs": 2, "echo": False}, True),
        ({"model": MODEL, "prompt": [100]}, False),  # outside the vocabulary
        ({"model": MODEL, "prompt": ""}, False),
        ({"model": MODEL, "prompt": []}, False),
        ({"model": MODEL, "prompt": "x", "logprobs": 6}, False),
    ],
)
def test_completion_schema_agrees_with_parser(body: dict[str, Any], valid: bool) -> None:
    assert _request_validator("CompletionRequest").is_valid(body) == valid
    if valid:
        parse_completion_request(body)
