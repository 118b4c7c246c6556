"""The public model endpoints: for each, only what differs (its request model, the task it asks
of a model, its span, how the in-process engine plans and answers it, what a relaying gateway
holds for it). Everything else is the one pipeline (gateway/pipeline.py).

`/v1/generate` is the seed-style alias of `/v1/completions`: `{model, prompt, max_tokens,
temperature, stream}` and nothing else, answered exactly as a completion (a replica gets it at
/v1/completions).

`/v1/messages` and `/v1/messages/count_tokens` are Anthropic's Messages API (gateway/anthropic/):
planned as the chat request they render, in Anthropic's dialect (errors, key header, stream end).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, TypeVar

import anyio

from gateway.anthropic import chat_form as messages_form
from gateway.anthropic import output as messages_output
from gateway.anthropic.errors import ANTHROPIC
from gateway.anthropic.request import (
    CountTokensRequest,
    MessagesRequest,
    parse_count_tokens_request,
    parse_messages_request,
)
from gateway.backend import APIRequest, Body, Call, Endpoint, Plan, RelayHold, Reply, Task, Work
from gateway.errors import APIError, ErrorKind
from gateway.local.hooks import Answer, LocalPlanner, LocalRoute
from gateway.openai import bodies, generation, protocol
from gateway.openai.generation import Job, Outputs
from gateway.openai.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingsRequest
from gateway.responses import output as responses_output
from gateway.responses.chat_form import drop_oldest, dumps, to_chat
from gateway.responses.custom_tools import plan_output
from gateway.responses.request import ResponsesRequest, parse_input_tokens_request, parse_responses_request
from gateway.telemetry import ChatSpan

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Mapping

    from tenancy.tokens import TokenCounter

_Request = TypeVar(
    "_Request",
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingsRequest,
    ResponsesRequest,
    MessagesRequest,
    CountTokensRequest,
)
# Why a Messages request names fields it does not use: the response header (as the Responses API's).
IGNORED_HEADER = "x-batchgate-ignored"

# Reserved against the tenant when a relayed chat request names no max_tokens (no model here to
# say how much context is left); settlement refunds what was not used.
DEFAULT_CHAT_MAX_TOKENS = 1024


# Each endpoint's parser returns its own request model; this narrows the union to it.
def _as(kind: type[_Request], req: APIRequest) -> _Request:
    assert isinstance(req, kind)
    return req


# -- spans -------------------------------------------------------------------------------------


def _chat_span(
    work: Work,
    req: ChatCompletionRequest | CompletionRequest | ResponsesRequest,
    max_tokens: int | None,
    messages: list[object],
) -> ChatSpan:
    """The GenAI span of a generation: the request's sampling parameters and its messages."""
    return ChatSpan(
        work.endpoint.operation,
        work.model,
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        tenant=work.caller.name,
        priority=work.caller.priority.name.lower(),
        messages=messages,
    )


def _generation_span(work: Work) -> ChatSpan:
    req = work.request
    assert isinstance(req, ChatCompletionRequest | CompletionRequest)
    messages: list[object]
    if isinstance(req, ChatCompletionRequest):
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
    else:
        messages = list(req.prompt)
    return _chat_span(work, req, req.requested_max_tokens, messages)


def _responses_span(work: Work) -> ChatSpan:
    req = _as(ResponsesRequest, work.request)
    messages: list[object] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += [item.model_dump(exclude_none=True) for item in req.input]
    return _chat_span(work, req, req.max_output_tokens, messages)


def _messages_span(work: Work) -> ChatSpan:
    """A Messages request's span: its sampling parameters, system and messages as sent, and its
    end user (`metadata.user_id`)."""
    req = work.request
    assert isinstance(req, MessagesRequest | CountTokensRequest)
    messages: list[object] = []
    if req.system:
        messages.append({"role": "system", "content": [b.model_dump(exclude_none=True) for b in req.system]})
    messages += [m.model_dump(exclude_none=True) for m in req.messages]
    sampled = req if isinstance(req, MessagesRequest) else None
    span = ChatSpan(
        work.endpoint.operation,
        work.model,
        max_tokens=sampled.max_tokens if sampled else None,
        temperature=sampled.temperature if sampled else None,
        top_p=sampled.top_p if sampled else None,
        tenant=work.caller.name,
        priority=work.caller.priority.name.lower(),
        messages=messages,
    )
    if req.user is not None:
        span.set("user.id", req.user)
    return span


def _embeddings_span(work: Work) -> ChatSpan:
    """The `embeddings {model}` span with the GenAI attributes (no sampling parameters)."""
    req = _as(EmbeddingsRequest, work.request)
    span = ChatSpan(
        "embeddings",
        work.model,
        max_tokens=None,
        temperature=None,
        top_p=None,
        tenant=work.caller.name,
        priority=work.caller.priority.name.lower(),
    )
    span.set("gen_ai.request.encoding_formats", [req.encoding_format or "float"])
    if req.dimensions is not None:
        span.set("gen_ai.embeddings.dimension.count", req.dimensions)
    return span


# -- plans on the in-process engine (gateway/local/engine_backend.py) --------------------------


async def _plan_chat(backend: LocalPlanner, work: Work) -> Plan:
    return await backend.plan_chat(work, _as(ChatCompletionRequest, work.request), param="messages")


async def _plan_completion(backend: LocalPlanner, work: Work) -> Plan:
    return await backend.plan_completion(work, _as(CompletionRequest, work.request))


async def _plan_response(backend: LocalPlanner, work: Work) -> Plan:
    """A Responses request is planned as the chat request it renders, with its own output plan
    (custom tools, its field names); truncation "auto" drops the oldest items until it fits."""
    req = _as(ResponsesRequest, work.request)
    while True:
        try:
            chat = to_chat(req)
            output = plan_output(req, chat, backend.closed_arguments, backend.chat_format)
            return await backend.plan_chat(work, chat, param="input", output=output)
        except APIError as exc:
            # truncation "auto": the oldest items go until the conversation fits (OpenAI's rule)
            shorter = drop_oldest(req) if req.truncation == "auto" else None
            if exc.kind is not ErrorKind.CONTEXT_LENGTH_EXCEEDED or shorter is None:
                raise
            req = shorter


async def _plan_input_tokens(backend: LocalPlanner, work: Work) -> Plan:
    return await backend.plan_count(to_chat(_as(ResponsesRequest, work.request)))


async def _plan_message(backend: LocalPlanner, work: Work) -> Plan:
    """A Messages request is planned as the chat request it renders, under its own window rule
    (a max_tokens over the window's room is cut to it: said in a header); the fields it ignores
    are named in another."""
    req = _as(MessagesRequest, work.request)
    window = messages_form.Window(req.max_tokens)
    plan = await backend.plan_chat(work, messages_form.to_chat(req), param="messages", fit=window.fit)
    headers = window.headers
    if req.ignored:
        headers[IGNORED_HEADER] = ", ".join(req.ignored)
    if not headers:
        return plan
    execute = plan.execute

    async def run(call: Call) -> Reply:
        reply = await execute(call)
        reply.headers.update(headers)
        return reply

    return Plan(plan.num_prompt_tokens, plan.max_num_tokens, run)


async def _plan_count_tokens(backend: LocalPlanner, work: Work) -> Plan:
    """The prompt's tokens as a message request with the same fields would hold them."""
    plan = await backend.plan_count(messages_form.to_chat(_as(CountTokensRequest, work.request)))

    async def execute(call: Call) -> Reply:
        return Body({"input_tokens": plan.num_prompt_tokens})

    return Plan(plan.num_prompt_tokens, 0, execute)


# -- answers from the in-process engine's outputs -----------------------------------------------


def _response_events(req: APIRequest, outputs: Outputs, job: Job) -> AsyncIterator[bytes]:
    return responses_output.response_events(_as(ResponsesRequest, req), outputs, job)


def _response_body(req: APIRequest, job: Job, choices: list[bodies.Choice]) -> Mapping[str, object]:
    return responses_output.response_body(_as(ResponsesRequest, req), job, choices[0])


def _answer_of_job(
    events: Callable[[Outputs, Job], AsyncIterator[bytes]],
    body: Callable[[Job, list[bodies.Choice]], Mapping[str, object]],
) -> Answer:
    """The answer of an endpoint whose reply depends on the job only, not on the request model."""
    return Answer(
        lambda req, outputs, job: events(outputs, job), lambda req, job, choices: body(job, choices)
    )


def _message_events(req: APIRequest, outputs: Outputs, job: Job) -> AsyncIterator[bytes]:
    return messages_output.message_events(_as(MessagesRequest, req), outputs, job)


def _message_body(req: APIRequest, job: Job, choices: list[bodies.Choice]) -> Mapping[str, object]:
    return messages_output.message_body(_as(MessagesRequest, req), job, choices[0])


CHAT_ANSWER = _answer_of_job(generation.chat_events, generation.chat_body)
COMPLETION_ANSWER = _answer_of_job(generation.completion_events, generation.completion_body)
RESPONSE_ANSWER = Answer(_response_events, _response_body)
MESSAGE_ANSWER = Answer(_message_events, _message_body)


# -- holds of a relaying gateway (gateway/pool/relay.py): its own token counts ------------------------


async def _hold_chat(work: Work, counter: TokenCounter) -> RelayHold:
    req = _as(ChatCompletionRequest, work.request)
    num_prompt = await anyio.to_thread.run_sync(counter.count_messages, work.body["messages"])
    per_choice = req.requested_max_tokens or DEFAULT_CHAT_MAX_TOKENS
    return RelayHold(num_prompt, per_choice * req.num_choices, per_choice)


async def _hold_completion(work: Work, counter: TokenCounter) -> RelayHold:
    req = _as(CompletionRequest, work.request)
    prompts = req.prompt

    def count() -> int:
        return sum(len(p) if isinstance(p, tuple) else counter.count(p) for p in prompts)

    num_prompt = await anyio.to_thread.run_sync(count)
    max_tokens = req.requested_max_tokens * req.num_choices  # OpenAI's default 16 when unset
    return RelayHold(num_prompt, max_tokens * len(prompts), req.requested_max_tokens or 0)


async def _hold_response(work: Work, counter: TokenCounter) -> RelayHold:
    req = _as(ResponsesRequest, work.request)
    chat = to_chat(req)  # what the replica renders; a 400 here, before admission, as there
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    num_prompt = await anyio.to_thread.run_sync(counter.count_messages, messages)
    max_tokens = 0 if work.endpoint.count_only else req.max_output_tokens or DEFAULT_CHAT_MAX_TOKENS
    return RelayHold(num_prompt, max_tokens, req.requested_max_tokens or 0)


async def _hold_message(work: Work, counter: TokenCounter) -> RelayHold:
    """The rendered chat messages and the tools' definitions, by the gateway's counter; the
    completion tokens asked for (the replica cuts them to its window's room: settled after)."""
    req = work.request
    assert isinstance(req, MessagesRequest | CountTokensRequest)
    chat = messages_form.to_chat(req)  # a 400 here, before admission, as the replica's
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    tools = [t.model_dump(exclude_none=True) for t in chat.tools or ()]

    def count() -> int:
        return counter.count_messages(messages) + (counter.count(dumps(tools)) if tools else 0)

    num_prompt = await anyio.to_thread.run_sync(count)
    max_tokens = req.max_tokens if isinstance(req, MessagesRequest) else 0
    return RelayHold(num_prompt, max_tokens, max_tokens)


async def _hold_embeddings(work: Work, counter: TokenCounter) -> RelayHold:
    """Token ids as given, texts by the gateway's counter plus 2 each for [CLS] and [SEP] (the
    replica reports the exact count, settled after)."""
    req = _as(EmbeddingsRequest, work.request)

    def count() -> int:
        return sum(len(i) if isinstance(i, tuple) else counter.count(i) + 2 for i in req.input)

    return RelayHold(await anyio.to_thread.run_sync(count), 0)


CHAT = Endpoint(
    path="/v1/chat/completions",
    upstream_path="/v1/chat/completions",
    task=Task.GENERATE,
    operation="chat",
    id_prefix="chatcmpl",
    parse=protocol.parse_chat_request,
    span=_generation_span,
    relay_hold=_hold_chat,
    countable=True,
)
COMPLETIONS = Endpoint(
    path="/v1/completions",
    upstream_path="/v1/completions",
    task=Task.GENERATE,
    operation="text_completion",
    id_prefix="cmpl",
    parse=protocol.parse_completion_request,
    span=_generation_span,
    relay_hold=_hold_completion,
    countable=True,
)
# The seed-style alias (see the module docstring): a completion in all but its path and parser.
GENERATE = dataclasses.replace(
    COMPLETIONS, path="/v1/generate", parse=protocol.parse_generate_request, countable=False
)
EMBEDDINGS = Endpoint(
    path="/v1/embeddings",
    upstream_path="/v1/embeddings",
    task=Task.EMBED,
    operation="embeddings",
    id_prefix="emb",
    parse=protocol.parse_embeddings_request,
    span=_embeddings_span,
    relay_hold=_hold_embeddings,
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
    relay_hold=_hold_response,
    usage_in_stream=True,
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
    relay_hold=_hold_response,
)

MESSAGES = Endpoint(
    path="/v1/messages",
    upstream_path="/v1/messages",
    task=Task.GENERATE,
    operation="chat",
    id_prefix="msg_",
    parse=parse_messages_request,
    span=_messages_span,
    relay_hold=_hold_message,
    countable=True,
    usage_in_stream=True,
    dialect=ANTHROPIC,
)

MESSAGES_COUNT_TOKENS = Endpoint(
    path="/v1/messages/count_tokens",
    upstream_path="/v1/messages/count_tokens",
    task=Task.GENERATE,
    operation="chat",
    id_prefix="msg_",
    parse=parse_count_tokens_request,
    span=_messages_span,
    count_only=True,
    relay_hold=_hold_message,
    dialect=ANTHROPIC,
)

ENDPOINTS = (
    CHAT,
    COMPLETIONS,
    GENERATE,
    EMBEDDINGS,
    RESPONSES,
    RESPONSE_INPUT_TOKENS,
    MESSAGES,
    MESSAGES_COUNT_TOKENS,
)

# The endpoints the in-process generation engine serves (gateway/local/engine_backend.py), by path.
LOCAL_ROUTES = {
    CHAT.path: LocalRoute(_plan_chat, CHAT_ANSWER),
    COMPLETIONS.path: LocalRoute(_plan_completion, COMPLETION_ANSWER),
    GENERATE.path: LocalRoute(_plan_completion, COMPLETION_ANSWER),
    RESPONSES.path: LocalRoute(_plan_response, RESPONSE_ANSWER),
    RESPONSE_INPUT_TOKENS.path: LocalRoute(_plan_input_tokens),
    MESSAGES.path: LocalRoute(_plan_message, MESSAGE_ANSWER),
    MESSAGES_COUNT_TOKENS.path: LocalRoute(_plan_count_tokens),
}
