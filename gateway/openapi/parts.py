"""The OpenAPI document's building blocks: references, error responses, operations, security."""

from __future__ import annotations

from typing import Any

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
    "anthropicKey": {
        "type": "apiKey",
        "in": "header",
        "name": "x-api-key",
        "description": "A tenant's API key as Anthropic's SDKs send it (the Messages API only)",
    },
}
TENANT_AUTH: list[dict[str, list[str]]] = [{"tenantKey": []}, {}]
ANTHROPIC_AUTH: list[dict[str, list[str]]] = [{"anthropicKey": []}, {"tenantKey": []}, {}]
ADMIN_AUTH: list[dict[str, list[str]]] = [{"adminKey": []}]


def ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(model=name)}


def error(description: str, schema: str = "Error") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": ref(schema)}}}


# The Messages API's errors: Anthropic's shape and statuses (gateway/anthropic/errors.py).
MESSAGES_ERRORS = {
    "400": error("invalid_request_error (`prompt is too long: N tokens > M maximum` too)", "ErrorResponse"),
    "401": error("authentication_error: a missing or invalid API key", "ErrorResponse"),
    "404": error("not_found_error: an unknown model or route", "ErrorResponse"),
    "405": error("invalid_request_error: method not allowed", "ErrorResponse"),
    "413": error("request_too_large", "ErrorResponse"),
    "415": error("invalid_request_error: Content-Type is not application/json", "ErrorResponse"),
    "429": error(
        "rate_limit_error: a rate limit or a budget; see retry-after and x-should-retry", "ErrorResponse"
    ),
    "500": error("api_error: an internal error or a failed generation", "ErrorResponse"),
    "529": error("overloaded_error: shed, loading or draining; see retry-after", "ErrorResponse"),
}


COMMON_ERRORS = {
    "401": error("Missing or invalid API key (when tenants are configured)"),
    "404": error("Unknown model (`model_not_found`)"),
    "405": error("Method not allowed"),
    "500": error("Internal error (a bug) or a failed generation"),
    "503": error("Overloaded, loading, or the engine is unavailable; see Retry-After"),
}
POST_ERRORS = {
    "400": error("Invalid request; `param` names the field"),
    "413": error("Request body too large"),
    "415": error("Content-Type is not application/json"),
    "429": error("Rate limited; see Retry-After and x-ratelimit-* headers"),
    **COMMON_ERRORS,
}


STORED_ERRORS = {
    "400": error("Invalid query parameter; `param` names it"),
    "401": error("Missing or invalid API key (when tenants are configured)"),
    "404": error("No such response for this tenant (`not_found`)"),
    "405": error("Method not allowed"),
    "500": error("Internal error (a bug)"),
    "503": error("The response store is unavailable; see Retry-After"),
}
PAGE = [
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


def stored_op(summary: str, parameters: list[dict[str, Any]], schema: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "parameters": parameters,
        "responses": {"200": json_op("OK", schema), **STORED_ERRORS},
    }


def body_op(
    summary: str, request: str, response: str, errors: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": ref(request)}}},
        "responses": {
            "200": json_op("OK", response),
            **(errors or {**STORED_ERRORS, "413": POST_ERRORS["413"], "415": POST_ERRORS["415"]}),
        },
    }


def json_op(description: str, schema: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": ref(schema)}}}


def sse_event(chunk_schema: str) -> dict[str, Any]:
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
                    "contentSchema": {"anyOf": [ref(chunk_schema), ref("Error")]},
                },
            }
        },
    }


def generation_op(summary: str, request: str, response: str, chunk: str, chunk_schema: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": ref(request)}}},
        "responses": {
            "200": {
                "description": f"A {response} object, or (stream=true) server-sent {chunk} events ending "
                "with `data: [DONE]`",
                "content": {
                    "application/json": {"schema": ref(response)},
                    "text/event-stream": {"schema": sse_event(chunk_schema)},
                },
            },
            **POST_ERRORS,
        },
    }


def status_op(summary: str, not_ok: str) -> dict[str, Any]:
    ok = {"description": "OK", "content": {"application/json": {"schema": ref("Status")}}}
    bad = {"description": not_ok, "content": {"application/json": {"schema": ref("Status")}}}
    return {"get": {"summary": summary, "security": [], "responses": {"200": ok, "503": bad}}}


def query(name: str, description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "description": description, "schema": schema}
