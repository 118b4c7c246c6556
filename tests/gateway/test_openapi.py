"""The OpenAPI document: well-formed, loadable by schemathesis, and in agreement with the parser."""

from __future__ import annotations

import re
from typing import Any

import jsonschema
import pytest
import schemathesis
from typing_extensions import is_typeddict

from gateway import errors
from gateway.anthropic import schemas as anthropic_schemas
from gateway.errors import APIError, ErrorKind
from gateway.openai import bodies, schemas
from gateway.openai.protocol import parse_chat_request, parse_completion_request
from gateway.openai.tools import ToolCallParser, parse_message
from gateway.openapi.document import REQUEST_TYPES, build_openapi

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
        "GET /v1/usage",
        "GET /v1/organization/usage/completions",
        "GET /admin/usage.csv",
        "POST /v1/responses",
        "POST /v1/responses/input_tokens",
        "POST /v1/responses/compact",
        "GET /v1/responses/{response_id}",
        "DELETE /v1/responses/{response_id}",
        "POST /v1/responses/{response_id}/cancel",
        "GET /v1/responses/{response_id}/input_items",
        "POST /v1/conversations",
        "GET /v1/conversations/{conversation_id}",
        "POST /v1/conversations/{conversation_id}",
        "DELETE /v1/conversations/{conversation_id}",
        "GET /v1/conversations/{conversation_id}/items",
        "POST /v1/conversations/{conversation_id}/items",
        "GET /v1/conversations/{conversation_id}/items/{item_id}",
        "DELETE /v1/conversations/{conversation_id}/items/{item_id}",
        "POST /v1/files",
        "GET /v1/files",
        "GET /v1/files/{file_id}",
        "DELETE /v1/files/{file_id}",
        "GET /v1/files/{file_id}/content",
        "POST /v1/batches",
        "GET /v1/batches",
        "GET /v1/batches/{batch_id}",
        "POST /v1/batches/{batch_id}/cancel",
        "POST /v1/messages",
        "POST /v1/messages/count_tokens",
        *ADMIN_OPERATIONS,
    }


ADMIN_OPERATIONS = {
    *(f"{m} /admin/{n}" for m in ("GET",) for n in ("plans", "tenants", "prices", "audit", "loras")),
    *(f"{m} /admin/{n}/{{name}}" for m in ("GET", "PUT", "DELETE") for n in ("plans", "tenants", "prices")),
    "GET /admin/tenants/{name}/keys",
    "POST /admin/tenants/{name}/keys",
    "POST /admin/keys/{key_hash}/rotate",
    "PUT /admin/keys/{key_hash}/budgets",
    "DELETE /admin/keys/{key_hash}",
    "PUT /admin/loras/{name}",
    "DELETE /admin/loras/{name}",
    # issue 44: every tenant's batches, and the serving state
    "GET /admin/batches",
    "GET /admin/batches/{batch_id}",
    "POST /admin/batches/{batch_id}/cancel",
    "GET /admin/engines",
    "GET /admin/replicas",
}
# Served but not documented: the document itself, Prometheus, and the gateway-to-gateway routes.
UNDOCUMENTED = {"/openapi.json", "/metrics", "/v1/generate"}


def test_the_document_covers_every_route_the_app_serves() -> None:
    from gateway.app import create_app
    from gateway.settings import Settings
    from tests.gateway.fakes import FakeEngine

    app = create_app(Settings(embedding_model="none"), engine=FakeEngine())
    paths = build_openapi(MODEL)["paths"]
    documented = {(path, method.upper()) for path, ops in paths.items() for method in ops}
    served = {
        (re.sub(r":\w+}", "}", route.path), method)
        for route in app.routes
        for method in set(getattr(route, "methods", None) or ()) - {"HEAD"}  # a WebSocket route has none
        if route.path not in UNDOCUMENTED and not route.path.startswith("/v1/internal/")
    }
    assert served == documented


def test_admin_routes_need_the_admin_key_and_the_others_a_tenant_key_if_any() -> None:
    doc = build_openapi(MODEL)
    schemes = doc["components"]["securitySchemes"]
    assert {name: (s["type"], s.get("scheme") or s["name"]) for name, s in schemes.items()} == {
        "tenantKey": ("http", "bearer"),
        "adminKey": ("http", "bearer"),
        "anthropicKey": ("apiKey", "x-api-key"),  # the Messages API's header, or the bearer token
    }
    assert doc["security"] == [{"tenantKey": []}, {}]  # no key needed without --tenants
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            admin = path.startswith("/admin/") or path.startswith("/v1/organization/")
            messages = path.startswith("/v1/messages")
            expected = [{"anthropicKey": []}, *doc["security"]] if messages else doc["security"]
            if admin or path in ("/health", "/ready"):
                expected = [{"adminKey": []}] if admin else []
            assert op.get("security", doc["security"]) == expected, (method, path)
            if path not in ("/health", "/ready"):
                assert op["responses"]["401"]["content"]["application/json"]["schema"] == {
                    "$ref": "#/components/schemas/" + ("ErrorResponse" if messages else "Error")
                }, (method, path)


def test_generate_is_an_alias_of_completions() -> None:
    doc = build_openapi(MODEL, generate=True)
    assert (
        doc["paths"]["/v1/generate"]["post"]["requestBody"]
        == doc["paths"]["/v1/completions"]["post"]["requestBody"]
    )
    assert (
        doc["paths"]["/v1/generate"]["post"]["responses"]
        == doc["paths"]["/v1/completions"]["post"]["responses"]
    )
    labels = {result.ok().label for result in schemathesis.openapi.from_dict(doc).get_all_operations()}
    assert "POST /v1/generate" in labels
    assert "/v1/generate" not in build_openapi(MODEL)["paths"]


def _typed_dicts() -> set[str]:
    return {
        name
        for module in (schemas, anthropic_schemas)
        for name, value in vars(module).items()
        if is_typeddict(value) and value.__module__ in (module.__name__, errors.__name__)
    }


def test_every_schema_is_generated_from_a_class() -> None:
    """No hand-written shape: each component is a request model or a typed dict of gateway/openai/
    schemas.py, gateway/anthropic/schemas.py or gateway/errors.py (the ones the builders return),
    named after its class, and every response the document names is one of them."""
    components = build_openapi(MODEL)["components"]["schemas"]
    assert all(c["title"] == name for name, c in components.items())
    assert len(_typed_dicts()) >= 20
    assert _typed_dicts() <= set(components)
    request_side = set(components) - _typed_dicts()
    assert {t.__name__ for t in REQUEST_TYPES} <= request_side
    refs = {
        schema.get("$ref", "").rsplit("/", 1)[-1]
        for path in build_openapi(MODEL, generate=True)["paths"].values()
        for op in path.values()
        for response in op["responses"].values()
        for media in response["content"].values()
        for schema in [media["schema"], *media["schema"].get("anyOf", [])]
    }
    assert refs - {""} <= _typed_dicts()


def _response_validator(name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(
        {"$ref": f"#/components/schemas/{name}", "components": build_openapi(MODEL)["components"]}
    )


def _tool_deltas() -> list[schemas.ChatCompletionDelta]:
    return ToolCallParser().feed('hi <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', final=True)


@pytest.mark.parametrize(
    ("name", "body"),
    [
        ("Model", bodies.model_card("m", 1)),
        ("ModelList", bodies.model_list([bodies.model_card("m", 1), bodies.model_card("e", 2)])),
        ("CreateEmbeddingResponse", bodies.embedding_list("e", [[0.5, -1.0], [2.0, 0.0]], "float", 3)),
        ("CreateEmbeddingResponse", bodies.embedding_list("e", [[0.5, -1.0]], "base64", 1)),
        ("Error", APIError(ErrorKind.INVALID_REQUEST, "bad n", param="n").body()),
        ("Error", APIError(ErrorKind.RATE_LIMITED, "slow down").body()),
        (
            "ChatCompletionChunk",
            bodies.chat_chunk(
                request_id="c",
                created=1,
                model="m",
                choices=[bodies.chat_delta(0, d) for d in _tool_deltas()],
                include_usage=True,
            ),
        ),
        (
            "ChatCompletionChunk",
            bodies.chat_chunk(
                request_id="c",
                created=1,
                model="m",
                choices=[],
                include_usage=True,
                usage_=bodies.usage(3, 4, 2),
            ),
        ),
        (
            "Completion",
            bodies.text_completion(
                request_id="c",
                created=1,
                model="m",
                choices=[bodies.completion_choice(0, "x", finish_reason="length", logprobs=None)],
                include_usage=False,
            ),
        ),
    ],
)
def test_builders_match_the_document(name: str, body: Any) -> None:
    _response_validator(name).validate(body)


def test_a_message_with_tool_calls_matches_the_document() -> None:
    content, calls = parse_message('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
    message = {"role": "assistant", "content": content, "refusal": None, "tool_calls": calls}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "tool_calls"}
    body = {"id": "c", "object": "chat.completion", "created": 1, "model": "m", "choices": [choice]}
    _response_validator("ChatCompletion").validate({**body, "usage": bodies.usage(1, 2)})


_CHOICE = {"index": 0, "delta": {"content": "x"}, "logprobs": None, "finish_reason": None}
_CHUNK = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [_CHOICE]}


@pytest.mark.parametrize(
    ("name", "body", "valid"),
    [
        ("Usage", {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}, True),
        ("Usage", {"prompt_tokens": -1, "completion_tokens": 0, "total_tokens": 0}, False),
        ("TopLogprob", {"token": "a", "logprob": -1.0, "bytes": [0, 255]}, True),
        ("TopLogprob", {"token": "a", "logprob": -1.0, "bytes": [256]}, False),
        ("TopLogprob", {"token": "a", "logprob": -1.0, "bytes": None}, True),
        ("ChatCompletionChunk", _CHUNK, True),
        ("ChatCompletionChunk", {**_CHUNK, "object": "chat.completion"}, False),
        ("ChatCompletionChunk", {**_CHUNK, "choices": [{**_CHOICE, "finish_reason": "abort"}]}, False),
        ("ChatCompletionChunk", {**_CHUNK, "choices": [{**_CHOICE, "delta": {"text": "x"}}]}, False),
        ("ToolCallDelta", {"index": 0, "function": {"arguments": "{"}}, True),
        ("ToolCallDelta", {"index": 0, "name": "f"}, False),
        (
            "CompletionChoice",
            {"index": 0, "text": "", "logprobs": None, "finish_reason": "tool_calls"},
            False,
        ),
        ("Embedding", {"object": "embedding", "index": 0, "embedding": "AAAA"}, True),
        ("Embedding", {"object": "embedding", "index": 0, "embedding": [1]}, True),
        ("Embedding", {"object": "embedding", "index": 0, "embedding": None}, False),
    ],
)
def test_response_constraints(name: str, body: Any, valid: bool) -> None:
    assert _response_validator(name).is_valid(body) == valid


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


def test_the_admin_tables_have_the_tenants_files_fields() -> None:
    from tenancy import config

    components = build_openapi(MODEL)["components"]["schemas"]

    def fields(name: str) -> set[str]:
        return set(components[name]["properties"])

    assert fields("PlanTable") == config._PLAN_FIELDS
    assert set(components["PlanTable"]["required"]) == config._PLAN_REQUIRED
    assert fields("TenantTable") == config._TENANT_FIELDS - {"keys"}  # issued with the keys routes
    assert fields("PriceTable") == config._PRICE_FIELDS
    assert fields("BudgetFields") == config._BUDGET_FIELDS
    assert all(
        components[n]["additionalProperties"] is False for n in ("PlanTable", "TenantTable", "PriceTable")
    )
