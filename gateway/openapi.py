"""The OpenAPI 3.1 document served at /openapi.json.

Request schemas are generated from the pydantic models in gateway/protocol.py (the same models
that validate requests, so the two cannot drift); response schemas are written out here and
pinned by tests that validate real responses and stream chunks against them. The served model
name is an enum, so a schema-driven fuzzer reaches the engine instead of stopping at 404.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic.json_schema import models_json_schema

from gateway.embeddings import EmbeddingsRequest, input_schema
from gateway.protocol import ChatCompletionRequest, CompletionRequest, prompt_schema

REF = "#/components/schemas/{model}"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


_INT0 = {"type": "integer", "minimum": 0}

RESPONSE_SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    },
    "Usage": {
        "type": "object",
        "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
        "properties": {
            "prompt_tokens": _INT0,
            "completion_tokens": _INT0,
            "total_tokens": _INT0,
            "prompt_tokens_details": {
                "type": "object",
                "required": ["cached_tokens"],
                "properties": {"cached_tokens": _INT0},
            },
        },
    },
    "TopLogprob": {
        "type": "object",
        "required": ["token", "logprob", "bytes"],
        "properties": {
            "token": {"type": "string"},
            "logprob": {"type": "number"},
            "bytes": _nullable({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}}),
        },
    },
    "TokenLogprob": {
        "type": "object",
        "required": ["token", "logprob", "bytes", "top_logprobs"],
        "properties": {
            "token": {"type": "string"},
            "logprob": {"type": "number"},
            "bytes": _nullable({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}}),
            "top_logprobs": {"type": "array", "items": _ref("TopLogprob")},
        },
    },
    "ChatLogprobs": {
        "type": "object",
        "required": ["content"],
        "properties": {
            "content": _nullable({"type": "array", "items": _ref("TokenLogprob")}),
            "refusal": _nullable({"type": "array", "items": _ref("TokenLogprob")}),
        },
    },
    "ChatCompletion": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "chat.completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "system_fingerprint": {"type": ["string", "null"]},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", "message", "logprobs", "finish_reason"],
                    "properties": {
                        "index": _INT0,
                        "message": {
                            "type": "object",
                            "required": ["role", "content"],
                            "properties": {
                                "role": {"const": "assistant"},
                                "content": {"type": ["string", "null"]},
                                "refusal": {"type": ["string", "null"]},
                                "tool_calls": {"type": "array", "items": _ref("MessageToolCall")},
                            },
                        },
                        "logprobs": _nullable(_ref("ChatLogprobs")),
                        "finish_reason": {"enum": ["stop", "length", "tool_calls"]},
                    },
                },
            },
            "usage": _ref("Usage"),
        },
    },
    "MessageToolCall": {
        "type": "object",
        "required": ["id", "type", "function"],
        "properties": {
            "id": {"type": "string"},
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "required": ["name", "arguments"],
                "properties": {
                    "name": {"type": "string"},
                    "arguments": {"type": "string", "description": "the arguments as JSON text"},
                },
            },
        },
    },
    "ToolCallDelta": {
        "type": "object",
        "description": "a streamed call: index, id, type and name first, then argument fragments",
        "required": ["index"],
        "properties": {
            "index": _INT0,
            "id": {"type": "string"},
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
            },
        },
        "additionalProperties": False,
    },
    "ChatCompletionChunk": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "chat.completion.chunk"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "system_fingerprint": {"type": ["string", "null"]},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", "delta", "finish_reason"],
                    "properties": {
                        "index": _INT0,
                        "delta": {
                            "type": "object",
                            "properties": {
                                "role": {"const": "assistant"},
                                "content": {"type": ["string", "null"]},
                                "refusal": {"type": ["string", "null"]},
                                "tool_calls": {"type": "array", "items": _ref("ToolCallDelta")},
                            },
                            "additionalProperties": False,
                        },
                        "logprobs": _nullable(_ref("ChatLogprobs")),
                        "finish_reason": {"enum": ["stop", "length", "tool_calls", None]},
                    },
                },
            },
            "usage": _nullable(_ref("Usage")),
        },
    },
    "CompletionLogprobs": {
        "type": "object",
        "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
        "properties": {
            "tokens": {"type": "array", "items": {"type": "string"}},
            "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
            "top_logprobs": _nullable(
                {
                    "type": "array",
                    "items": _nullable({"type": "object", "additionalProperties": {"type": "number"}}),
                }
            ),
            "text_offset": {"type": "array", "items": _INT0},
        },
    },
    "Completion": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "text_completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "system_fingerprint": {"type": ["string", "null"]},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", "text", "logprobs", "finish_reason"],
                    "properties": {
                        "index": _INT0,
                        "text": {"type": "string"},
                        "logprobs": _nullable(_ref("CompletionLogprobs")),
                        "finish_reason": {"enum": ["stop", "length", None]},
                    },
                },
            },
            "usage": _nullable(_ref("Usage")),
        },
    },
    "Model": {
        "type": "object",
        "required": ["id", "object", "created", "owned_by"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "model"},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
        },
    },
    "ModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}},
    },
    "Embedding": {
        "type": "object",
        "required": ["object", "index", "embedding"],
        "properties": {
            "object": {"const": "embedding"},
            "index": _INT0,
            "embedding": {
                "description": "float: the numbers; base64: their little-endian float32 bytes",
                "anyOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}],
            },
        },
    },
    "CreateEmbeddingResponse": {
        "type": "object",
        "required": ["object", "data", "model", "usage"],
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": _ref("Embedding")},
            "model": {"type": "string"},
            "usage": {
                "type": "object",
                "required": ["prompt_tokens", "total_tokens"],
                "properties": {"prompt_tokens": _INT0, "total_tokens": _INT0},
            },
        },
    },
    "Status": {
        "type": "object",
        "required": ["status"],
        "properties": {
            "status": {"type": "string"},
            "model": {"type": "string"},
            "detail": {"type": "string"},
        },
    },
}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref("Error")}}}


_COMMON_ERRORS = {
    "404": _error("Unknown model (`model_not_found`)"),
    "405": _error("Method not allowed"),
    "500": _error("Internal error (a bug) or a failed generation"),
    "503": _error("Overloaded, loading, or the engine is unavailable; see Retry-After"),
}
_POST_ERRORS = {
    "400": _error("Invalid request; `param` names the field"),
    "401": _error("Missing or invalid API key (when tenants are configured)"),
    "413": _error("Request body too large"),
    "415": _error("Content-Type is not application/json"),
    "429": _error("Rate limited; see Retry-After and x-ratelimit-* headers"),
    **_COMMON_ERRORS,
}


def _sse_event(chunk_schema: str) -> dict[str, Any]:
    """One server-sent event (OpenAPI < 3.2: `schema` of text/event-stream describes each event):
    its `data` is `[DONE]` or a JSON chunk (or, after a failure mid-stream, an error object)."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "type": "string",
                "if": {"const": "[DONE]"},
                "then": True,
                "else": {
                    "contentMediaType": "application/json",
                    "contentSchema": {"anyOf": [_ref(chunk_schema), _ref("Error")]},
                },
            }
        },
    }


def _generation_op(
    summary: str, request: str, response: str, chunk: str, chunk_schema: str
) -> dict[str, Any]:
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {
                "description": f"A {response} object, or (stream=true) server-sent {chunk} events ending "
                "with `data: [DONE]`",
                "content": {
                    "application/json": {"schema": _ref(response)},
                    "text/event-stream": {"schema": _sse_event(chunk_schema)},
                },
            },
            **_POST_ERRORS,
        },
    }


def _status_op(summary: str, not_ok: str) -> dict[str, Any]:
    ok = {"description": "OK", "content": {"application/json": {"schema": _ref("Status")}}}
    bad = {"description": not_ok, "content": {"application/json": {"schema": _ref("Status")}}}
    return {"get": {"summary": summary, "responses": {"200": ok, "503": bad}}}


def build_openapi(
    model_name: str | None, vocab_size: int | None = None, version: str = "0.1.0", *, embedding: Any = None
) -> dict[str, Any]:
    """The document for a server serving `model_name` (None while the model is loading), whose
    tokenizer has `vocab_size` tokens (bounds the token ids a prompt may hold), and `embedding`
    (a gateway.embeddings.EmbeddingService, or None) at /v1/embeddings."""
    _, defs = models_json_schema(
        [
            (ChatCompletionRequest, "validation"),
            (CompletionRequest, "validation"),
            (EmbeddingsRequest, "validation"),
        ],
        ref_template=REF,
    )
    schemas: dict[str, Any] = copy.deepcopy(defs["$defs"])
    if model_name is not None:
        for name in ("ChatCompletionRequest", "CompletionRequest"):
            schemas[name]["properties"]["model"] = {"type": "string", "enum": [model_name]}
    if vocab_size is not None:
        schemas["CompletionRequest"]["properties"]["prompt"] = prompt_schema(vocab_size)
    if embedding is not None:
        schemas["EmbeddingsRequest"]["properties"]["model"] = {"type": "string", "enum": [embedding.name]}
        schemas["EmbeddingsRequest"]["properties"]["input"] = input_schema(embedding.vocab_size)
    schemas.update(copy.deepcopy(RESPONSE_SCHEMAS))
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "batchgate",
            "version": version,
            "description": "OpenAI-compatible text generation over an in-process continuous-batching engine.",
        },
        "paths": {
            "/v1/chat/completions": {
                "post": _generation_op(
                    "Create a chat completion",
                    "ChatCompletionRequest",
                    "ChatCompletion",
                    "chat.completion.chunk",
                    "ChatCompletionChunk",
                )
            },
            "/v1/completions": {
                "post": _generation_op(
                    "Create a text completion (legacy)",
                    "CompletionRequest",
                    "Completion",
                    "text_completion",
                    "Completion",
                )
            },
            "/v1/embeddings": {
                "post": {
                    "summary": "Create embeddings",
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": _ref("EmbeddingsRequest")}},
                    },
                    "responses": {
                        "200": {
                            "description": "A list of embeddings, one per input, in input order",
                            "content": {"application/json": {"schema": _ref("CreateEmbeddingResponse")}},
                        },
                        **_POST_ERRORS,
                    },
                }
            },
            "/v1/models": {
                "get": {
                    "summary": "List the served models",
                    "responses": {
                        "200": {
                            "description": "OK",
                            "content": {"application/json": {"schema": _ref("ModelList")}},
                        },
                        **_COMMON_ERRORS,
                    },
                }
            },
            "/v1/models/{model}": {
                "get": {
                    "summary": "Describe one served model",
                    "parameters": [
                        {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
                    ],
                    "responses": {
                        "200": {
                            "description": "OK",
                            "content": {"application/json": {"schema": _ref("Model")}},
                        },
                        **_COMMON_ERRORS,
                    },
                }
            },
            "/health": _status_op("Liveness: the process answers", "The engine failed or died"),
            "/ready": _status_op("Readiness: model loaded and engine running", "Not ready (yet)"),
        },
        "components": {"schemas": schemas},
    }
