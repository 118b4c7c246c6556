"""The model endpoints' paths, the stored responses and conversations, the probes."""

from __future__ import annotations

from typing import Any

from gateway.openapi.parts import (
    ANTHROPIC_AUTH,
    COMMON_ERRORS,
    MESSAGES_ERRORS,
    PAGE,
    POST_ERRORS,
    STORED_ERRORS,
    body_op,
    generation_op,
    json_op,
    ref,
    status_op,
    stored_op,
)

_RESPONSE_ID = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}


_CONVERSATION_ID = {"name": "conversation_id", "in": "path", "required": True, "schema": {"type": "string"}}
_ITEM_ID = {"name": "item_id", "in": "path", "required": True, "schema": {"type": "string"}}


def _anthropic_event() -> dict[str, Any]:
    """One event of a message's stream: its `event` line names the type its `data` carries."""
    return {
        "type": "object",
        "required": ["event", "data"],
        "properties": {
            "event": {"type": "string"},
            "data": {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": ref("MessageStreamEvent"),
            },
        },
    }


def paths() -> dict[str, Any]:
    """The model endpoints, the stored responses and conversations, the probes."""
    return {
        "/v1/chat/completions": {
            "post": generation_op(
                "Create a chat completion",
                "ChatCompletionRequest",
                "ChatCompletion",
                "chat.completion.chunk",
                "ChatCompletionChunk",
            )
        },
        "/v1/completions": {
            "post": generation_op(
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
                    "content": {"application/json": {"schema": ref("EmbeddingsRequest")}},
                },
                "responses": {
                    "200": {
                        "description": "A list of embeddings, one per input, in input order",
                        "content": {"application/json": {"schema": ref("CreateEmbeddingResponse")}},
                    },
                    **POST_ERRORS,
                },
            }
        },
        "/v1/models": {
            "get": {
                "summary": "List the served models",
                "responses": {
                    "200": {
                        "description": "OpenAI's list; Anthropic's page of ModelInfo (with the "
                        "aliases that name one model) for a request that carries anthropic-version",
                        "content": {
                            "application/json": {
                                "schema": {"anyOf": [ref("ModelList"), ref("ModelInfoPage")]}
                            }
                        },
                    },
                    **COMMON_ERRORS,
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
                        "content": {"application/json": {"schema": ref("Model")}},
                    },
                    **COMMON_ERRORS,
                },
            }
        },
        "/v1/responses": {
            "post": generation_op(
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
                    "content": {"application/json": {"schema": ref("InputTokensRequest")}},
                },
                "responses": {"200": json_op("The count", "InputTokenCount"), **POST_ERRORS},
            }
        },
        "/v1/messages": {
            "post": {
                "summary": "Create a message (Anthropic's Messages API)",
                "security": ANTHROPIC_AUTH,
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": ref("MessagesRequest")}},
                },
                "responses": {
                    "200": {
                        "description": "A Message, or (stream=true) its events, each as `event: <type>` "
                        "and `data: <event>`, message_stop last (an error event, last, after a failure); "
                        "x-batchgate-clamped-max-tokens: the max_tokens it ran with when the window "
                        "left less than asked; x-batchgate-ignored: the fields accepted and ignored",
                        "content": {
                            "application/json": {"schema": ref("Message")},
                            "text/event-stream": {"schema": _anthropic_event()},
                        },
                    },
                    **MESSAGES_ERRORS,
                },
            }
        },
        "/v1/messages/count_tokens": {
            "post": {
                "summary": "Count a message request's input tokens (its prompt, as the model reads it)",
                "security": ANTHROPIC_AUTH,
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": ref("CountTokensRequest")}},
                },
                "responses": {"200": json_op("The count", "MessageTokensCount"), **MESSAGES_ERRORS},
            }
        },
        "/v1/responses/compact": {
            "post": {
                "summary": "Compact a conversation into an opaque item to send back as input",
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "required": ["model"],
                                "properties": {
                                    "model": {"type": "string"},
                                    "input": {"anyOf": [{"type": "string"}, {"type": "array"}]},
                                    "previous_response_id": {"type": "string"},
                                    "instructions": {"type": "string"},
                                },
                            }
                        }
                    },
                },
                "responses": {"200": json_op("The compacted window", "ResponseCompaction"), **STORED_ERRORS},
            }
        },
        "/v1/responses/{response_id}": {
            "get": {
                "summary": "Retrieve a stored response (the caller's tenant's own)",
                "parameters": [_RESPONSE_ID],
                "responses": {"200": json_op("The response", "Response"), **STORED_ERRORS},
            },
            "delete": {
                "summary": "Delete a stored response",
                "parameters": [_RESPONSE_ID],
                "responses": {"200": json_op("Deleted", "ResponseDeleted"), **STORED_ERRORS},
            },
        },
        "/v1/responses/{response_id}/cancel": {
            "post": {
                "summary": "Cancel a background response (on any gateway of the pool)",
                "parameters": [_RESPONSE_ID],
                "responses": {"200": json_op("The response, cancelled", "Response"), **STORED_ERRORS},
            }
        },
        "/v1/responses/{response_id}/input_items": {
            "get": {
                "summary": "List a stored response's input items",
                "parameters": [_RESPONSE_ID, *PAGE],
                "responses": {"200": json_op("A page of items", "ResponseItemList"), **STORED_ERRORS},
            }
        },
        "/v1/conversations": {
            "post": body_op("Create a conversation", "ConversationCreateRequest", "Conversation", POST_ERRORS)
        },
        "/v1/conversations/{conversation_id}": {
            "get": stored_op("Retrieve a conversation", [_CONVERSATION_ID], "Conversation"),
            "post": {
                **body_op("Update a conversation's metadata", "ConversationUpdateRequest", "Conversation"),
                "parameters": [_CONVERSATION_ID],
            },
            "delete": stored_op("Delete a conversation", [_CONVERSATION_ID], "ConversationDeleted"),
        },
        "/v1/conversations/{conversation_id}/items": {
            "get": stored_op("List a conversation's items", [_CONVERSATION_ID, *PAGE], "ResponseItemList"),
            "post": {
                **body_op("Add items to a conversation", "ConversationItemsRequest", "ResponseItemList"),
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
                    **STORED_ERRORS,
                },
            },
            "delete": stored_op("Delete a conversation's item", [_CONVERSATION_ID, _ITEM_ID], "Conversation"),
        },
        "/health": status_op("Liveness: the process answers", "The engine failed or died"),
        "/ready": status_op("Readiness: model loaded and engine running", "Not ready (yet)"),
    }
