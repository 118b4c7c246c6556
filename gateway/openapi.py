"""The OpenAPI 3.1 document served at /openapi.json.

Every schema is generated, none is written out here: requests from the pydantic models that
validate them (gateway/protocol.py, gateway/embeddings.py), responses from the typed dicts the
response builders return (gateway/schemas.py), so neither can drift from what the handlers do.
Tests validate real responses and stream chunks against the document. The served model name is an
enum, so a schema-driven fuzzer reaches the engine instead of stopping at 404.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter
from pydantic.json_schema import JsonSchemaMode

from gateway import schemas as response_schemas
from gateway.batch_input import BatchCreateRequest
from gateway.conversations import (
    ConversationCreateRequest,
    ConversationItemsRequest,
    ConversationUpdateRequest,
)
from gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingsRequest,
    input_schema,
    prompt_schema,
)
from gateway.responses_request import DERIVED_FIELDS, InputTokensRequest, ResponsesRequest

if TYPE_CHECKING:
    from gateway.embeddings import EmbeddingService

REF = "#/components/schemas/{model}"

# Both keys are bearer tokens: a tenant's key (checked against the tenants file's and the admin
# API's hashes; no key needed without --tenants) and the admin key (--admin-key-hash); neither
# opens the other's routes.
SECURITY_SCHEMES = {
    "tenantKey": {
        "type": "http",
        "scheme": "bearer",
        "description": "A tenant's API key; without --tenants no key is needed",
    },
    "adminKey": {
        "type": "http",
        "scheme": "bearer",
        "description": "The admin key (its hash: --admin-key-hash or BATCHGATE_ADMIN_KEY_HASH); "
        "a tenant's key is a 401 here",
    },
}
_TENANT_AUTH: list[dict[str, list[str]]] = [{"tenantKey": []}, {}]
_ADMIN_AUTH: list[dict[str, list[str]]] = [{"adminKey": []}]

REQUEST_TYPES: tuple[type, ...] = (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingsRequest,
    ResponsesRequest,
    InputTokensRequest,
    ConversationCreateRequest,
    ConversationUpdateRequest,
    ConversationItemsRequest,
    BatchCreateRequest,
)


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(model=name)}


@functools.cache
def component_schemas() -> dict[str, Any]:
    """Every named schema: the request models (as validated) and the response typed dicts (as
    sent), with the classes they nest; each class's name is its component's name. Generated once
    (pydantic takes milliseconds); callers get copies to edit."""
    inputs: list[tuple[str, JsonSchemaMode, TypeAdapter[Any]]] = [
        (t.__name__, "validation", TypeAdapter(t)) for t in REQUEST_TYPES
    ]
    inputs += [(t.__name__, "serialization", TypeAdapter(t)) for t in response_schemas.RESPONSE_TYPES]
    refs, defs = TypeAdapter.json_schemas(inputs, ref_template=REF)
    for (name, _), ref in refs.items():
        # pydantic names a def after its class, unless two classes share a name (it then
        # qualifies both): the names are the API's, so a clash is a bug to fix, not to rename
        if ref != _ref(name):
            raise RuntimeError(f"two schema classes are named {name!r}: {ref}")
    components: dict[str, Any] = defs["$defs"]
    for name in ("ResponsesRequest", "InputTokensRequest"):
        for field in DERIVED_FIELDS:  # set by parsing, refused from clients
            components[name]["properties"].pop(field)
    return components


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref("Error")}}}


_COMMON_ERRORS = {
    "401": _error("Missing or invalid API key (when tenants are configured)"),
    "404": _error("Unknown model (`model_not_found`)"),
    "405": _error("Method not allowed"),
    "500": _error("Internal error (a bug) or a failed generation"),
    "503": _error("Overloaded, loading, or the engine is unavailable; see Retry-After"),
}
_POST_ERRORS = {
    "400": _error("Invalid request; `param` names the field"),
    "413": _error("Request body too large"),
    "415": _error("Content-Type is not application/json"),
    "429": _error("Rate limited; see Retry-After and x-ratelimit-* headers"),
    **_COMMON_ERRORS,
}


_STORED_ERRORS = {
    "400": _error("Invalid query parameter; `param` names it"),
    "401": _error("Missing or invalid API key (when tenants are configured)"),
    "404": _error("No such response for this tenant (`not_found`)"),
    "405": _error("Method not allowed"),
    "500": _error("Internal error (a bug)"),
    "503": _error("The response store is unavailable; see Retry-After"),
}
_RESPONSE_ID = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}


_CONVERSATION_ID = {"name": "conversation_id", "in": "path", "required": True, "schema": {"type": "string"}}
_ITEM_ID = {"name": "item_id", "in": "path", "required": True, "schema": {"type": "string"}}
_PAGE = [
    {"name": "after", "in": "query", "required": False, "schema": {"type": "string"}},
    {
        "name": "limit",
        "in": "query",
        "required": False,
        "schema": {"type": "integer", "minimum": 1, "maximum": 100},
    },
    {
        "name": "order",
        "in": "query",
        "required": False,
        "schema": {"type": "string", "enum": ["asc", "desc"]},
    },
]


def _stored_op(summary: str, parameters: list[dict[str, Any]], schema: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "parameters": parameters,
        "responses": {"200": _json("OK", schema), **_STORED_ERRORS},
    }


def _body_op(
    summary: str, request: str, response: str, errors: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": _json("OK", response),
            **(errors or {**_STORED_ERRORS, "413": _POST_ERRORS["413"], "415": _POST_ERRORS["415"]}),
        },
    }


def _json(description: str, schema: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(schema)}}}


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
    return {"get": {"summary": summary, "security": [], "responses": {"200": ok, "503": bad}}}


def build_openapi(
    model_name: str | Sequence[str] | None,
    vocab_size: int | None = None,
    version: str = "0.1.0",
    *,
    embedding: EmbeddingService | None = None,
    generate: bool = False,
) -> dict[str, Any]:
    """The document for a server serving the chat model(s) `model_name` (None while loading),
    whose tokenizer has `vocab_size` tokens (bounds the token ids a prompt may hold), and
    `embedding` (a gateway.embeddings.EmbeddingService, or None) at /v1/embeddings. `generate`:
    the server also answers POST /v1/generate, an alias of /v1/completions (same request and
    response)."""
    schemas = copy.deepcopy(component_schemas())
    names = [model_name] if isinstance(model_name, str) else list(model_name or ())
    if names:
        for name in ("ChatCompletionRequest", "CompletionRequest", "ResponsesRequest", "InputTokensRequest"):
            schemas[name]["properties"]["model"] = {"type": "string", "enum": names}
    if vocab_size is not None:
        schemas["CompletionRequest"]["properties"]["prompt"] = prompt_schema(vocab_size)
    if embedding is not None:
        schemas["EmbeddingsRequest"]["properties"]["model"] = {"type": "string", "enum": [embedding.name]}
        schemas["EmbeddingsRequest"]["properties"]["input"] = input_schema(embedding.vocab_size)
    paths = _paths()
    if generate:
        paths["/v1/generate"] = {
            "post": _generation_op(
                "Create a text completion (alias of /v1/completions)",
                "CompletionRequest",
                "Completion",
                "text_completion",
                "Completion",
            )
        }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "batchgate",
            "version": version,
            "description": "OpenAI-compatible text generation over an in-process continuous-batching engine.",
        },
        "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": SECURITY_SCHEMES},
        "security": _TENANT_AUTH,
    }


def _paths() -> dict[str, Any]:
    return {
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
        **_usage_paths(),
        **_batch_paths(),
        **_admin_paths(),
        "/v1/responses": {
            "post": _generation_op(
                "Create a response (the Responses API)",
                "ResponsesRequest",
                "Response",
                "typed response events, each as `event: <type>` and `data: <event>`,",
                "ResponseStreamEvent",
            )
        },
        "/v1/responses/input_tokens": {
            "post": {
                "summary": "Count a response request's input tokens (its prompt, as the model reads it)",
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": _ref("InputTokensRequest")}},
                },
                "responses": {"200": _json("The count", "InputTokenCount"), **_POST_ERRORS},
            }
        },
        "/v1/responses/{response_id}": {
            "get": {
                "summary": "Retrieve a stored response (the caller's tenant's own)",
                "parameters": [_RESPONSE_ID],
                "responses": {"200": _json("The response", "Response"), **_STORED_ERRORS},
            },
            "delete": {
                "summary": "Delete a stored response",
                "parameters": [_RESPONSE_ID],
                "responses": {"200": _json("Deleted", "ResponseDeleted"), **_STORED_ERRORS},
            },
        },
        "/v1/responses/{response_id}/cancel": {
            "post": {
                "summary": "Cancel a background response (on any gateway of the pool)",
                "parameters": [_RESPONSE_ID],
                "responses": {"200": _json("The response, cancelled", "Response"), **_STORED_ERRORS},
            }
        },
        "/v1/responses/{response_id}/input_items": {
            "get": {
                "summary": "List a stored response's input items",
                "parameters": [_RESPONSE_ID, *_PAGE],
                "responses": {"200": _json("A page of items", "ResponseItemList"), **_STORED_ERRORS},
            }
        },
        "/v1/conversations": {
            "post": _body_op(
                "Create a conversation", "ConversationCreateRequest", "Conversation", _POST_ERRORS
            )
        },
        "/v1/conversations/{conversation_id}": {
            "get": _stored_op("Retrieve a conversation", [_CONVERSATION_ID], "Conversation"),
            "post": {
                **_body_op("Update a conversation's metadata", "ConversationUpdateRequest", "Conversation"),
                "parameters": [_CONVERSATION_ID],
            },
            "delete": _stored_op("Delete a conversation", [_CONVERSATION_ID], "ConversationDeleted"),
        },
        "/v1/conversations/{conversation_id}/items": {
            "get": _stored_op("List a conversation's items", [_CONVERSATION_ID, *_PAGE], "ResponseItemList"),
            "post": {
                **_body_op("Add items to a conversation", "ConversationItemsRequest", "ResponseItemList"),
                "parameters": [_CONVERSATION_ID],
            },
        },
        "/v1/conversations/{conversation_id}/items/{item_id}": {
            "get": {
                "summary": "Retrieve a conversation's item",
                "parameters": [_CONVERSATION_ID, _ITEM_ID],
                "responses": {
                    "200": {
                        "description": "The item (OpenAI's item shape)",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    },
                    **_STORED_ERRORS,
                },
            },
            "delete": _stored_op(
                "Delete a conversation's item", [_CONVERSATION_ID, _ITEM_ID], "Conversation"
            ),
        },
        "/health": _status_op("Liveness: the process answers", "The engine failed or died"),
        "/ready": _status_op("Readiness: model loaded and engine running", "Not ready (yet)"),
    }


_USAGE_RESULT = {
    "type": "object",
    "description": "One group's use in one bucket (cost_micros: micro-dollars at the configured prices)",
    "properties": {
        "object": {"type": "string"},
        "input_tokens": {"type": "integer"},
        "output_tokens": {"type": "integer"},
        "input_cached_tokens": {"type": "integer"},
        "num_model_requests": {"type": "integer"},
        "cost_micros": {"type": "integer"},
        "project_id": {"type": ["string", "null"], "description": "The tenant (group_by=project_id)"},
        "user_id": {"type": "null"},
        "api_key_id": {"type": ["string", "null"]},
        "model": {"type": ["string", "null"]},
        "batch": {"type": ["boolean", "null"]},
    },
}
_USAGE_PAGE = {
    "type": "object",
    "properties": {
        "object": {"const": "page"},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "object": {"const": "bucket"},
                    "start_time": {"type": "integer"},
                    "end_time": {"type": "integer"},
                    "results": {"type": "array", "items": _USAGE_RESULT},
                },
            },
        },
        "has_more": {"type": "boolean"},
        "next_page": {"type": "null"},
        "budgets": {"type": "array", "items": _ref("BudgetState"), "description": "GET /v1/usage only"},
    },
}


def _query(name: str, description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "description": description, "schema": schema}


_USAGE_PARAMS = [
    _query("start_time", "Unix seconds, inclusive (default: 24 hours ago)", {"type": "integer"}),
    _query("end_time", "Unix seconds, exclusive (default: now)", {"type": "integer"}),
    _query("bucket_width", "Bucket width (UTC-aligned)", {"type": "string", "enum": ["1h", "1d"]}),
    _query("group_by", "Repeated or comma-separated", {"type": "array", "items": {"type": "string"}}),
    _query("models", "Only these models", {"type": "array", "items": {"type": "string"}}),
    _query("api_key_ids", "Only these keys (key_<16 hex>)", {"type": "array", "items": {"type": "string"}}),
]


def _usage_paths() -> dict[str, Any]:
    page = {"description": "OK", "content": {"application/json": {"schema": _USAGE_PAGE}}}
    errors = {
        "400": _error("Invalid query; `param` names it"),
        "401": _error("Missing or invalid key (the admin key for the organization routes)"),
        "404": _error("No usage ledger: tenancy is off (no --tenants)"),
        "503": _error("The ledger's store (Redis) is unavailable"),
    }
    return {
        "/v1/usage": {
            "get": {
                "summary": "The calling tenant's usage buckets and its budgets' state",
                "parameters": _USAGE_PARAMS,
                "responses": {"200": page, **errors},
            }
        },
        "/v1/organization/usage/completions": {
            "get": {
                "summary": "Every tenant's usage, in OpenAI's organization Usage API shape (admin key)",
                "security": _ADMIN_AUTH,
                "parameters": [
                    *_USAGE_PARAMS,
                    _query(
                        "project_ids", "Only these tenants", {"type": "array", "items": {"type": "string"}}
                    ),
                ],
                "responses": {"200": page, **errors},
            }
        },
        "/admin/usage.csv": {
            "get": {
                "summary": "The organization usage buckets as CSV, one row per bucket and group (admin key)",
                "security": _ADMIN_AUTH,
                "parameters": _USAGE_PARAMS,
                "responses": {
                    "200": {"description": "CSV", "content": {"text/csv": {"schema": {"type": "string"}}}},
                    **errors,
                },
            }
        },
    }


_FILE_ID = {"name": "file_id", "in": "path", "required": True, "schema": {"type": "string"}}
_BATCH_ID = {"name": "batch_id", "in": "path", "required": True, "schema": {"type": "string"}}
_UPLOAD = {
    "type": "object",
    "required": ["file", "purpose"],
    "additionalProperties": False,
    "properties": {
        "file": {"type": "string", "format": "binary"},
        "purpose": {"type": "string", "enum": ["batch", "user_data"]},
        "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
        "expires_after[seconds]": {"type": "integer", "minimum": 3600, "maximum": 2592000},
    },
}


def _batch_paths() -> dict[str, Any]:
    """The Files and Batches APIs (gateway/files.py, gateway/batches.py)."""
    upload_errors = {
        **_STORED_ERRORS,
        "400": _error("Invalid upload: purpose, expiry, too many lines, or over the storage quota"),
        "413": _error("The file is larger than --max-file-bytes"),
        "415": _error("Content-Type is not multipart/form-data"),
    }
    content = {"description": "The file's bytes", "content": {"application/octet-stream": {"schema": {}}}}
    return {
        "/v1/files": {
            "post": {
                "summary": "Upload a file (a batch's JSONL input, or user data)",
                "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": _UPLOAD}}},
                "responses": {"200": _json("The file", "FileObject"), **upload_errors},
            },
            "get": _stored_op(
                "List the tenant's files",
                [*_PAGE, _query("purpose", "Only files of this purpose", {"type": "string"})],
                "FileList",
            ),
        },
        "/v1/files/{file_id}": {
            "get": _stored_op("Retrieve a file", [_FILE_ID], "FileObject"),
            "delete": _stored_op("Delete a file", [_FILE_ID], "FileDeleted"),
        },
        "/v1/files/{file_id}/content": {
            "get": {
                "summary": "A file's content",
                "parameters": [_FILE_ID],
                "responses": {"200": content, **_STORED_ERRORS},
            }
        },
        "/v1/batches": {
            "post": _body_op("Create a batch", "BatchCreateRequest", "Batch"),
            "get": _stored_op("List the tenant's batches, newest first", _PAGE[:2], "BatchList"),
        },
        "/v1/batches/{batch_id}": {"get": _stored_op("Retrieve a batch", [_BATCH_ID], "Batch")},
        "/v1/batches/{batch_id}/cancel": {
            "post": _stored_op(
                "Cancel a batch (its unstarted lines end as batch_cancelled)", [_BATCH_ID], "Batch"
            )
        },
    }


_NAME = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
_MODEL_NAME = {
    "name": "name",
    "in": "path",
    "required": True,
    "description": "The model's name (it may hold '/')",
    "schema": {"type": "string"},
}
_KEY_HASH = {
    "name": "key_hash",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": "^sha256:[0-9a-f]{64}$"},
}
_ADMIN_ERRORS = {
    "400": _error("The change breaks the tenants file's rules (the message names the field), or bad JSON"),
    "401": _error(
        "Missing or incorrect admin key (a tenant's key is no admin key; none configured: every call)"
    ),
    "404": _error(
        "No such plan, tenant, price or key; or the admin API is off (it needs --tenants and --redis-url)"
    ),
    "405": _error("Method not allowed"),
    "500": _error("Internal error (a bug)"),
    "503": _error("Redis, where the changes live, is unavailable; see Retry-After"),
}


def _admin_op(
    summary: str,
    response: str,
    parameters: Sequence[dict[str, Any]] = (),
    request: str | None = None,
    *,
    status: str = "200",
    optional_body: bool = False,
    errors: dict[str, Any] | None = None,
) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "security": _ADMIN_AUTH}
    if parameters:
        op["parameters"] = list(parameters)
    if request is not None:
        content = {"application/json": {"schema": _ref(request)}}
        op["requestBody"] = {"required": not optional_body, "content": content}
    op["responses"] = {
        status: _json("OK" if status == "200" else "Created", response),
        **(errors or _ADMIN_ERRORS),
    }
    return op


def _admin_paths() -> dict[str, Any]:
    """The admin API (gateway/admin.py, gateway/loras.py): run-time plans, tenants, prices, keys
    and budgets, the audit log, and LoRA adapters; every route needs the admin key."""
    paths: dict[str, Any] = {}
    for noun, plural, param, what in (
        ("Plan", "plans", _NAME, "a plan (each of its tenants' default limits and budgets)"),
        ("Tenant", "tenants", _NAME, "a tenant (its plan and budget overrides)"),
        ("Price", "prices", _MODEL_NAME, "a model's price (the next request of it pays the new one)"),
    ):
        table = f"{noun}Table"
        paths[f"/admin/{plural}"] = {"get": _admin_op(f"List every {noun.lower()}", f"Admin{noun}List")}
        paths[f"/admin/{plural}/{{name}}"] = {
            "get": _admin_op(f"Retrieve {what}", f"Admin{noun}", [param]),
            "put": _admin_op(f"Create or replace {what}", f"Admin{noun}", [param], table),
            "delete": _admin_op(f"Delete {what}", "AdminDeleted", [param]),
        }
    paths["/admin/tenants/{name}/keys"] = {
        "get": _admin_op("List a tenant's keys (hashes and metadata only)", "ApiKeyList", [_NAME]),
        "post": _admin_op(
            "Issue a key for a tenant (the raw key is in this answer only)",
            "IssuedKey",
            [_NAME],
            "KeyCreateRequest",
            status="201",
            optional_body=True,
        ),
    }
    paths["/admin/keys/{key_hash}/rotate"] = {
        "post": _admin_op(
            "Rotate a key: a new one (same tenant, name, budgets), the old one revoked",
            "IssuedKey",
            [_KEY_HASH],
            "KeyRotateRequest",
            status="201",
            optional_body=True,
        )
    }
    paths["/admin/keys/{key_hash}/budgets"] = {
        "put": _admin_op("Set a key's own budgets ({} removes them)", "ApiKey", [_KEY_HASH], "BudgetFields")
    }
    paths["/admin/keys/{key_hash}"] = {
        "delete": _admin_op("Revoke a key (a 401 at once on every gateway)", "KeyRevoked", [_KEY_HASH])
    }
    paths["/admin/audit"] = {
        "get": _admin_op(
            "The audit log: who changed what, when",
            "AuditLog",
            [
                _query(
                    "limit",
                    "How many entries, newest first",
                    {"type": "integer", "minimum": 1, "maximum": 1000},
                )
            ],
        )
    }
    lora_errors = {
        **_ADMIN_ERRORS,
        "404": _error("No such adapter, or no in-process chat model to attach adapters to"),
        "409": _error("The adapter is in use and ?wait=false: nothing changed (`adapter_in_use`)"),
        "503": _error("The engine is unavailable; see Retry-After"),
    }
    paths["/admin/loras"] = {
        "get": _admin_op("List the LoRA adapters and the adapter bytes each model holds", "LoraList")
    }
    paths["/admin/loras/{name}"] = {
        "put": _admin_op(
            "Load or replace a LoRA adapter (requests that started keep their version)",
            "LoraAdapter",
            [_NAME],
            "LoraLoadRequest",
            errors=lora_errors,
        ),
        "delete": _admin_op(
            "Unload a LoRA adapter (taken from new requests at once)",
            "LoraDeleted",
            [
                _NAME,
                _query(
                    "wait",
                    "Wait for the requests using it (false: a 409 while any does)",
                    {"type": "boolean"},
                ),
                _query(
                    "timeout_s", "How long to wait, seconds (default 30)", {"type": "number", "minimum": 0}
                ),
            ],
            errors=lora_errors,
        ),
    }
    return paths
