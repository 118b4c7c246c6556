"""The OpenAPI 3.1 document served at /openapi.json.

Every schema is generated, none is written out here: requests from the pydantic models that
validate them (gateway/openai/protocol.py, gateway/responses/request.py, gateway/anthropic/
request.py, ...), responses from the typed dicts the response builders return (gateway/openai/
schemas.py, gateway/anthropic/schemas.py), so neither can drift from what the handlers do.
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

from gateway.anthropic import schemas as anthropic_schemas
from gateway.anthropic.request import CountTokensRequest, MessagesRequest
from gateway.batches.input import BatchCreateRequest
from gateway.openai import schemas as response_schemas
from gateway.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingsRequest,
    input_schema,
    prompt_schema,
)
from gateway.openapi import batch_paths, model_paths, operator_paths
from gateway.openapi.parts import REF, SECURITY_SCHEMES, TENANT_AUTH, generation_op, ref
from gateway.responses.conversations import (
    ConversationCreateRequest,
    ConversationItemsRequest,
    ConversationUpdateRequest,
)
from gateway.responses.request import DERIVED_FIELDS, InputTokensRequest, ResponsesRequest

if TYPE_CHECKING:
    from gateway.local.embedding_backend import EmbeddingService


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
    MessagesRequest,
    CountTokensRequest,
)


@functools.cache
def component_schemas() -> dict[str, Any]:
    """Every named schema: the request models (as validated) and the response typed dicts (as
    sent), with the classes they nest; each class's name is its component's name. Generated once
    (pydantic takes milliseconds); callers get copies to edit."""
    inputs: list[tuple[str, JsonSchemaMode, TypeAdapter[Any]]] = [
        (t.__name__, "validation", TypeAdapter(t)) for t in REQUEST_TYPES
    ]
    responses = (*response_schemas.RESPONSE_TYPES, *anthropic_schemas.RESPONSE_TYPES)
    inputs += [(t.__name__, "serialization", TypeAdapter(t)) for t in responses]
    refs, defs = TypeAdapter.json_schemas(inputs, ref_template=REF)
    for (name, _), given in refs.items():
        # pydantic names a def after its class, unless two classes share a name (it then
        # qualifies both): the names are the API's, so a clash is a bug to fix, not to rename
        if given != ref(name):
            raise RuntimeError(f"two schema classes are named {name!r}: {given}")
    components: dict[str, Any] = defs["$defs"]
    for name in ("ResponsesRequest", "InputTokensRequest"):
        for field in DERIVED_FIELDS:  # set by parsing, refused from clients
            components[name]["properties"].pop(field)
    return components


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
    `embedding` (a gateway.local.embedding_backend.EmbeddingService, or None) at /v1/embeddings. `generate`:
    the server also answers POST /v1/generate, an alias of /v1/completions (same request and
    response)."""
    schemas = copy.deepcopy(component_schemas())
    names = [model_name] if isinstance(model_name, str) else list(model_name or ())
    if names:
        for name in (
            "ChatCompletionRequest",
            "CompletionRequest",
            "ResponsesRequest",
            "InputTokensRequest",
            "MessagesRequest",
            "CountTokensRequest",
        ):
            schemas[name]["properties"]["model"] = {"type": "string", "enum": names}
    if vocab_size is not None:
        schemas["CompletionRequest"]["properties"]["prompt"] = prompt_schema(vocab_size)
    if embedding is not None:
        schemas["EmbeddingsRequest"]["properties"]["model"] = {"type": "string", "enum": [embedding.name]}
        schemas["EmbeddingsRequest"]["properties"]["input"] = input_schema(embedding.vocab_size)
    paths = {**model_paths.paths(), **operator_paths.usage_paths(), **batch_paths.paths()}
    paths.update(operator_paths.admin_paths())
    if generate:
        paths["/v1/generate"] = {
            "post": generation_op(
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
            "description": "OpenAI-compatible text generation over an in-process continuous-batching "
            "engine; Anthropic's Messages API too.",
        },
        "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": SECURITY_SCHEMES},
        "security": TENANT_AUTH,
    }
