"""The operator's paths: the usage ledger and the admin API."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.openapi.parts import ADMIN_AUTH, error, json_op, query, ref

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
        "budgets": {"type": "array", "items": ref("BudgetState"), "description": "GET /v1/usage only"},
        "limits": {
            "type": "object",
            "description": "GET /v1/usage only: the tenant's bounds on what it keeps, each with its use now "
            "(null: per conversation)",
            "additionalProperties": {
                "type": "object",
                "properties": {"limit": {"type": "integer"}, "used": {"type": ["integer", "null"]}},
            },
        },
    },
}


_USAGE_PARAMS = [
    query("start_time", "Unix seconds, inclusive (default: 24 hours ago)", {"type": "integer"}),
    query("end_time", "Unix seconds, exclusive (default: now)", {"type": "integer"}),
    query("bucket_width", "Bucket width (UTC-aligned)", {"type": "string", "enum": ["1h", "1d"]}),
    query("group_by", "Repeated or comma-separated", {"type": "array", "items": {"type": "string"}}),
    query("models", "Only these models", {"type": "array", "items": {"type": "string"}}),
    query("api_key_ids", "Only these keys (key_<16 hex>)", {"type": "array", "items": {"type": "string"}}),
]


def usage_paths() -> dict[str, Any]:
    page = {"description": "OK", "content": {"application/json": {"schema": _USAGE_PAGE}}}
    errors = {
        "400": error("Invalid query; `param` names it"),
        "401": error("Missing or invalid key (the admin key for the organization routes)"),
        "404": error("No usage ledger: tenancy is off (no --tenants)"),
        "503": error("The ledger's store (Redis) is unavailable"),
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
                "security": ADMIN_AUTH,
                "parameters": [
                    *_USAGE_PARAMS,
                    query(
                        "project_ids", "Only these tenants", {"type": "array", "items": {"type": "string"}}
                    ),
                ],
                "responses": {"200": page, **errors},
            }
        },
        "/admin/usage.csv": {
            "get": {
                "summary": "The organization usage buckets as CSV, one row per bucket and group (admin key)",
                "security": ADMIN_AUTH,
                "parameters": _USAGE_PARAMS,
                "responses": {
                    "200": {"description": "CSV", "content": {"text/csv": {"schema": {"type": "string"}}}},
                    **errors,
                },
            }
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
    "400": error("The change breaks the tenants file's rules (the message names the field), or bad JSON"),
    "401": error(
        "Missing or incorrect admin key (a tenant's key is no admin key; none configured: every call)"
    ),
    "404": error(
        "No such plan, tenant, price or key; or the admin API is off (it needs --tenants and --redis-url)"
    ),
    "405": error("Method not allowed"),
    "500": error("Internal error (a bug)"),
    "503": error("Redis, where the changes live, is unavailable; see Retry-After"),
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
    op: dict[str, Any] = {"summary": summary, "security": ADMIN_AUTH}
    if parameters:
        op["parameters"] = list(parameters)
    if request is not None:
        content = {"application/json": {"schema": ref(request)}}
        op["requestBody"] = {"required": not optional_body, "content": content}
    op["responses"] = {
        status: json_op("OK" if status == "200" else "Created", response),
        **(errors or _ADMIN_ERRORS),
    }
    return op


def admin_paths() -> dict[str, Any]:
    """The admin API (gateway/admin/api.py, gateway/loras.py): run-time plans, tenants, prices, keys
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
                query(
                    "limit",
                    "How many entries, newest first",
                    {"type": "integer", "minimum": 1, "maximum": 1000},
                )
            ],
        )
    }
    lora_errors = {
        **_ADMIN_ERRORS,
        "404": error("No such adapter, or no in-process chat model to attach adapters to"),
        "409": error("The adapter is in use and ?wait=false: nothing changed (`adapter_in_use`)"),
        "503": error("The engine is unavailable; see Retry-After"),
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
                query(
                    "wait",
                    "Wait for the requests using it (false: a 409 while any does)",
                    {"type": "boolean"},
                ),
                query(
                    "timeout_s", "How long to wait, seconds (default 30)", {"type": "number", "minimum": 0}
                ),
            ],
            errors=lora_errors,
        ),
    }
    paths.update(_batch_and_state_paths())
    return paths


def _batch_and_state_paths() -> dict[str, Any]:
    """Every tenant's batches (gateway/admin/batches.py) and the serving state (gateway/admin/state.py):
    the admin key, no Redis."""
    errors = {
        "401": _ADMIN_ERRORS["401"],
        "404": error("No such batch, or no such tenant (`tenant`)"),
        "405": _ADMIN_ERRORS["405"],
        "500": _ADMIN_ERRORS["500"],
    }
    tenant = query("tenant", "Only this tenant's (default: every tenant's)", {"type": "string"})
    batch_id = {"name": "batch_id", "in": "path", "required": True, "schema": {"type": "string"}}
    listing = [
        tenant,
        query("status", "Only batches with this status", {"type": "string"}),
        query("limit", "How many, newest first", {"type": "integer", "minimum": 1, "maximum": 100}),
    ]
    state_errors = {k: v for k, v in errors.items() if k != "404"}
    return {
        "/admin/batches": {
            "get": _admin_op(
                "List every tenant's batches, newest first",
                "AdminBatchList",
                listing,
                errors={"400": error("Invalid `limit`"), **errors},
            )
        },
        "/admin/batches/{batch_id}": {
            "get": _admin_op("Retrieve any tenant's batch", "AdminBatch", [batch_id, tenant], errors=errors)
        },
        "/admin/batches/{batch_id}/cancel": {
            "post": _admin_op(
                "Cancel any tenant's batch (as its tenant's own cancel does)",
                "AdminBatch",
                [batch_id, tenant],
                errors={"400": error("The batch is final already (`batch_not_cancellable`)"), **errors},
            )
        },
        "/admin/engines": {
            "get": _admin_op(
                "Each in-process chat model's engine now: requests per priority class, KV cache, throughput",
                "EngineStateList",
                errors=state_errors,
            )
        },
        "/admin/replicas": {
            "get": _admin_op(
                "Each pool replica as this gateway sees it: health, models, load, last error",
                "ReplicaList",
                errors=state_errors,
            )
        },
    }
