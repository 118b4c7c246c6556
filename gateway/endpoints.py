"""The public model endpoints: for each, only what differs (its request model, the task it asks
of a model, its span). Everything else is the one pipeline (gateway/pipeline.py).

`/v1/generate` is the seed-style alias of `/v1/completions`: `{model, prompt, max_tokens,
temperature, stream}` and nothing else, answered exactly as a completion (a replica gets it at
/v1/completions).
"""

from __future__ import annotations

from gateway import embeddings, protocol
from gateway.backend import Endpoint, Task, Work
from gateway.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingsRequest
from gateway.responses_request import ResponsesRequest, parse_input_tokens_request, parse_responses_request
from gateway.telemetry import ChatSpan


def _generation_span(work: Work) -> ChatSpan:
    req = work.request
    assert isinstance(req, ChatCompletionRequest | CompletionRequest)
    messages: list[object]
    if isinstance(req, ChatCompletionRequest):
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
    else:
        messages = list(req.prompt)
    return ChatSpan(
        work.endpoint.operation,
        work.model,
        max_tokens=req.requested_max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        tenant=work.caller.name,
        priority=work.caller.priority.name.lower(),
        messages=messages,
    )


def _responses_span(work: Work) -> ChatSpan:
    req = work.request
    assert isinstance(req, ResponsesRequest)
    messages: list[object] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += [item.model_dump(exclude_none=True) for item in req.input]
    return ChatSpan(
        work.endpoint.operation,
        work.model,
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        tenant=work.caller.name,
        priority=work.caller.priority.name.lower(),
        messages=messages,
    )


def _embeddings_span(work: Work) -> ChatSpan:
    assert isinstance(work.request, EmbeddingsRequest)
    return embeddings.span(work.model, work.caller, work.request)


CHAT = Endpoint(
    path="/v1/chat/completions",
    upstream_path="/v1/chat/completions",
    task=Task.GENERATE,
    operation="chat",
    id_prefix="chatcmpl",
    parse=protocol.parse_chat_request,
    span=_generation_span,
)
COMPLETIONS = Endpoint(
    path="/v1/completions",
    upstream_path="/v1/completions",
    task=Task.GENERATE,
    operation="text_completion",
    id_prefix="cmpl",
    parse=protocol.parse_completion_request,
    span=_generation_span,
)
GENERATE = Endpoint(
    path="/v1/generate",
    upstream_path="/v1/completions",
    task=Task.GENERATE,
    operation="text_completion",
    id_prefix="cmpl",
    parse=protocol.parse_generate_request,
    span=_generation_span,
)
EMBEDDINGS = Endpoint(
    path="/v1/embeddings",
    upstream_path="/v1/embeddings",
    task=Task.EMBED,
    operation="embeddings",
    id_prefix="emb",
    parse=protocol.parse_embeddings_request,
    span=_embeddings_span,
)

RESPONSES = Endpoint(
    path="/v1/responses",
    upstream_path="/v1/responses",
    task=Task.GENERATE,
    operation="chat",
    id_prefix="resp_",
    parse=parse_responses_request,
    span=_responses_span,
    stateful=True,
)

RESPONSE_INPUT_TOKENS = Endpoint(
    path="/v1/responses/input_tokens",
    upstream_path="/v1/responses/input_tokens",
    task=Task.GENERATE,
    operation="chat",
    id_prefix="resp_",
    parse=parse_input_tokens_request,
    span=_responses_span,
    stateful=True,
    count_only=True,
)

ENDPOINTS = (CHAT, COMPLETIONS, GENERATE, EMBEDDINGS, RESPONSES, RESPONSE_INPUT_TOKENS)
# What a replica counts for a gateway's budget hold (`POST /v1/internal/count`): no stored state.
COUNTABLE = (CHAT, COMPLETIONS)
