"""The Files and Batch APIs' paths."""

from __future__ import annotations

from typing import Any

from gateway.openapi.parts import PAGE, STORED_ERRORS, body_op, error, json_op, query, stored_op

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


def paths() -> dict[str, Any]:
    """The Files and Batch APIs."""
    """The Files and Batches APIs (gateway/batches/files.py, gateway/batches/api.py)."""
    upload_errors = {
        **STORED_ERRORS,
        "400": error("Invalid upload: purpose, expiry, too many lines, or over the storage quota"),
        "413": error("The file is larger than --max-file-bytes"),
        "415": error("Content-Type is not multipart/form-data"),
    }
    content = {"description": "The file's bytes", "content": {"application/octet-stream": {"schema": {}}}}
    return {
        "/v1/files": {
            "post": {
                "summary": "Upload a file (a batch's JSONL input, or user data)",
                "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": _UPLOAD}}},
                "responses": {"200": json_op("The file", "FileObject"), **upload_errors},
            },
            "get": stored_op(
                "List the tenant's files",
                [*PAGE, query("purpose", "Only files of this purpose", {"type": "string"})],
                "FileList",
            ),
        },
        "/v1/files/{file_id}": {
            "get": stored_op("Retrieve a file", [_FILE_ID], "FileObject"),
            "delete": stored_op("Delete a file", [_FILE_ID], "FileDeleted"),
        },
        "/v1/files/{file_id}/content": {
            "get": {
                "summary": "A file's content",
                "parameters": [_FILE_ID],
                "responses": {"200": content, **STORED_ERRORS},
            }
        },
        "/v1/batches": {
            "post": body_op("Create a batch", "BatchCreateRequest", "Batch"),
            "get": stored_op("List the tenant's batches, newest first", PAGE[:2], "BatchList"),
        },
        "/v1/batches/{batch_id}": {"get": stored_op("Retrieve a batch", [_BATCH_ID], "Batch")},
        "/v1/batches/{batch_id}/cancel": {
            "post": stored_op(
                "Cancel a batch (its unstarted lines end as batch_cancelled)", [_BATCH_ID], "Batch"
            )
        },
    }
