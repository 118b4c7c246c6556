"""Typed OpenAI request bodies (chat and legacy completions), validated at the edge.

Parsing turns any JSON value into a `ChatCompletionRequest` / `CompletionRequest` or raises an
`APIError` (400) that names the offending field in `param`. Nothing is silently ignored:

- a field we do not know is "Unrecognized request argument supplied: <name>";
- a field OpenAI defines but we do not implement (`functions`, `audio`, ...) is accepted only when
  it is null (clients that always send every key keep working) and otherwise named as unsupported;
- types are strict: `"max_tokens": "5"` or `"stream": 1` are 400s, not coerced.

`sampling_params()` turns a parsed request plus its prompt length into the engine's
`SamplingParams`, applying OpenAI's defaults and the context-length rule.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
)

from engine.types import SamplingParams
from gateway.errors import APIError, ErrorKind, invalid_request

MAX_NUM_CHOICES = 128
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's, for the legacy completions endpoint
MAX_NUM_STOP = 4
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_LOGIT_BIAS = 300
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# OpenAI fields we do not implement. Null (and the listed "off" values) means "not asked for".
UNSUPPORTED_CHAT_FIELDS: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "web_search_options": (None,),
    "store": (None, False),
    "metadata": (None,),
    "service_tier": (None, "auto", "default"),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "prompt_cache_key": (None,),
    "safety_identifier": (None,),
}
UNSUPPORTED_COMPLETION_FIELDS: dict[str, tuple[Any, ...]] = {"suffix": (None, "")}
# Keys an assistant message carries when a client sends a previous response back verbatim.
UNSUPPORTED_MESSAGE_FIELDS: dict[str, tuple[Any, ...]] = {
    "function_call": (None,),
    "refusal": (None,),
    "audio": (None,),
    "annotations": (None, []),
}
# OpenAI's pattern for function and response-format names.
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


# -- field validators that normalize a union into one type, with messages a person can act on ---


def _text_parts(value: Any) -> Any:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of text content parts")
    texts: list[str] = []
    for i, part in enumerate(value):
        if not isinstance(part, dict):
            raise ValueError(f"part {i} must be an object like {{'type': 'text', 'text': '...'}}")
        kind = part.get("type")
        if kind != "text":
            raise ValueError(f"part {i} has type {kind!r}; only 'text' content parts are supported")
        extra = sorted(set(part) - {"type", "text"})
        if extra:
            raise ValueError(f"part {i} has unrecognized field {extra[0]!r}")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"part {i} must have a string 'text'")
        texts.append(part["text"])
    return "".join(texts)


def _integral(value: Any) -> Any:
    """JSON has one number type: 5.0 is the integer 5 (as JSON Schema's "integer" says); 5.5 is not."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _role(value: Any) -> Any:
    if value == "function":
        raise ValueError("role 'function' (the deprecated function calling) is not supported; use 'tool'")
    return value


def _stop(value: Any) -> Any:
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ValueError("must be a string or a list of strings")
    if len(items) > MAX_NUM_STOP:
        raise ValueError(f"at most {MAX_NUM_STOP} stop sequences are allowed, got {len(items)}")
    if not all(items):
        raise ValueError("stop sequences must be non-empty strings")
    return tuple(items)


def _logit_bias(value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("must be an object mapping token ids (as strings) to biases")
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens may be biased, got {len(value)}")
    bias: dict[int, float] = {}
    for key, b in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
            raise ValueError(f"key {key!r} is not a token id")
        if isinstance(b, bool) or not isinstance(b, int | float) or not -100 <= b <= 100:
            raise ValueError(f"bias for token {key} must be a number in [-100, 100]")
        bias[int(key)] = float(b)
    return bias


def _prompt(value: Any) -> Any:
    """str | list[str] | list[int] | list[list[int]] -> a tuple of prompts (str or token-id tuple)."""

    def is_ids(v: Any) -> bool:
        return isinstance(v, list) and all(
            (isinstance(t, int) and not isinstance(t, bool)) or (isinstance(t, float) and t.is_integer())
            for t in v
        )

    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not value:
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of those lists")
    if is_ids(value):
        return (tuple(int(t) for t in value),)
    if all(isinstance(v, str) for v in value):
        return tuple(value)
    if all(is_ids(v) and v for v in value):
        return tuple(tuple(int(t) for t in v) for v in value)
    raise ValueError("must be a string, a list of strings, a list of token ids or a list of those lists")


_STRING_OR_STRINGS = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_NUM_STOP},
        {"type": "null"},
    ]
}
_TEXT_PART = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
    "additionalProperties": False,
}
_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}
_LOGIT_BIAS = {
    "anyOf": [
        {
            "type": "object",
            "propertyNames": {"pattern": "^[0-9]{1,5}$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
            "maxProperties": MAX_LOGIT_BIAS,
        },
        {"type": "null"},
    ]
}


def prompt_schema(vocab_size: int | None = None, max_items: int | None = None) -> dict[str, Any]:
    """JSON schema of a completions `prompt` (and an embeddings `input`): a string, strings, token
    ids or lists of them; with `vocab_size`, token ids are bounded by it; with `max_items`, so are
    the lists of prompts."""
    token_id: dict[str, Any] = {"type": "integer", "minimum": 0}
    if vocab_size is not None:
        token_id["maximum"] = vocab_size - 1
    token_ids = {"type": "array", "items": token_id, "minItems": 1}
    bound = {} if max_items is None else {"maxItems": max_items}
    return {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, **bound},
            token_ids,
            {"type": "array", "items": token_ids, "minItems": 1, **bound},
        ]
    }


Content = Annotated[str, BeforeValidator(_text_parts), WithJsonSchema(_CONTENT)]
Role = Annotated[
    Literal["system", "user", "assistant", "developer", "tool"],
    BeforeValidator(_role),
]
Stop = Annotated[tuple[str, ...] | None, BeforeValidator(_stop), WithJsonSchema(_STRING_OR_STRINGS)]
LogitBias = Annotated[dict[int, float] | None, BeforeValidator(_logit_bias), WithJsonSchema(_LOGIT_BIAS)]
Prompt = Annotated[
    tuple[str | tuple[int, ...], ...], BeforeValidator(_prompt), WithJsonSchema(prompt_schema())
]
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX), BeforeValidator(_integral)] | None
MaxTokens = Annotated[int, Field(ge=1), BeforeValidator(_integral)] | None
Penalty = Annotated[float | None, Field(ge=-2.0, le=2.0)]


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(StrictModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(StrictModel):
    """One message. `content` may be null only on an assistant message that carries `tool_calls`;
    a `tool` message answers one call (`tool_call_id`)."""

    role: Role
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # An assistant message's reasoning, as this server returns it (and vLLM takes it back): given
    # to templates that render it (Qwen3's, gpt-oss's), dropped by the others.
    reasoning_content: str | None = None

    @property
    def text(self) -> str:
        return self.content or ""


class StreamOptions(StrictModel):
    include_usage: bool | None = None


class JsonSchemaFormat(StrictModel):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    description: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None


class TextFormat(StrictModel):
    type: Literal["text"]


class JsonObjectFormat(StrictModel):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(StrictModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")
]


class FunctionDefinition(StrictModel):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: ToolChoiceFunction


def _tool_choice(value: Any) -> Any:
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise ValueError(
                "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"
            )
        return value
    if value is None or isinstance(value, NamedToolChoice):
        return value
    try:
        return NamedToolChoice.model_validate(value)
    except ValidationError:
        raise ValueError(
            "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"
        ) from None


ToolChoice = Annotated[Literal["none", "auto", "required"] | NamedToolChoice, BeforeValidator(_tool_choice)]

# apply_chat_template's own arguments, and what the server renders itself: not variables a request
# may set through `chat_template_kwargs`.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "processor_kwargs",
        "sanitize_control_tokens",
    }
)


def _template_kwargs(value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object of the chat template's variables")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(value))
    if reserved:
        raise ValueError(f"{reserved[0]!r} is set by the server, not by a request")
    return value


TemplateKwargs = Annotated[dict[str, Any] | None, BeforeValidator(_template_kwargs)]


class _SamplingFields(StrictModel):
    """Fields shared by chat and completions, with OpenAI's ranges (and vLLM's extensions)."""

    model: str
    max_tokens: MaxTokens = None
    temperature: Annotated[float | None, Field(ge=0.0, le=2.0)] = None
    top_p: Annotated[float | None, Field(gt=0.0, le=1.0)] = None
    n: Annotated[int, Field(ge=1, le=MAX_NUM_CHOICES), BeforeValidator(_integral)] | None = None
    stop: Stop = None
    seed: Seed = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = None
    frequency_penalty: Penalty = None
    logit_bias: LogitBias = None
    user: str | None = None
    # vLLM's extensions, under vLLM's names.
    top_k: Annotated[int, Field(ge=-1), BeforeValidator(_integral)] | None = None
    min_tokens: Annotated[int, Field(ge=0), BeforeValidator(_integral)] | None = None
    ignore_eos: bool | None = None
    # Ours: false turns speculative decoding off for this request (the server's setting otherwise).
    speculative_decoding: bool | None = None

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class Prediction(StrictModel):
    """OpenAI's Predicted Outputs: text the output is expected to be mostly like (a file to edit),
    verified as drafts by speculative decoding (engine/speculative/)."""

    type: Literal["content"]
    content: Content


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    prediction: Prediction | None = None
    max_completion_tokens: MaxTokens = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), BeforeValidator(_integral)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extension: variables for the model's chat template (Qwen3's `enable_thinking`,
    # gpt-oss's `reasoning_effort`).
    chat_template_kwargs: TemplateKwargs = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_top_logprobs(self) -> int:
        return self.top_logprobs or 0


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS), BeforeValidator(_integral)] | None = (
        None
    )
    echo: bool | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_NUM_CHOICES), BeforeValidator(_integral)] | None = None

    @property
    def requested_max_tokens(self) -> int:
        # OpenAI's legacy default; chat's default is "whatever context is left".
        return self.max_tokens if self.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS

    @property
    def num_top_logprobs(self) -> int:
        return self.logprobs or 0


# -- parsing ----------------------------------------------------------------------------------


def _param(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _check_unsupported(body: dict[str, Any], fields: dict[str, tuple[Any, ...]], where: str = "") -> None:
    for name, allowed in fields.items():
        if name in body:
            if body[name] not in allowed:
                raise invalid_request(
                    f"'{where}{name}' is not supported by this server (only the text generation subset "
                    "of the OpenAI API is implemented); remove it from the request",
                    param=where + name,
                )
            del body[name]


def _drop_sdk_fields(message: dict[str, Any]) -> None:
    """Drop what the openai SDK's parse()/stream helpers add to a message on the client side
    (`parsed`; a call's `parsed_arguments`, and its stream `index`), so a response the SDK
    assembled can be sent back as history."""
    message.pop("parsed", None)
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        message["tool_calls"] = [_drop_sdk_call_fields(c) for c in calls]


def _drop_sdk_call_fields(call: Any) -> Any:
    if not isinstance(call, dict):
        return call
    call = {k: v for k, v in call.items() if k != "index"}
    if isinstance(call.get("function"), dict):
        call["function"] = {k: v for k, v in call["function"].items() if k != "parsed_arguments"}
    return call


def validation_error(exc: ValidationError) -> APIError:
    err = exc.errors(include_url=False)[0]
    loc = tuple(err["loc"])
    param = _param(loc)
    kind = err["type"]
    msg = err["msg"].removeprefix("Value error, ")
    # Say it in JSON's words, not Python's.
    msg = re.sub(r"a valid dictionary( or instance of \w+)?", "a JSON object", msg)
    msg = msg.replace("a valid list", "an array")
    if kind == "extra_forbidden":
        if len(loc) == 1:
            return invalid_request(f"Unrecognized request argument supplied: {param}", param=param)
        return invalid_request(f"Unrecognized argument: {param}", param=param)
    if kind == "missing":
        return invalid_request(f"Missing required parameter: '{param}'.", param=param)
    if kind == "too_short" and param == "messages":
        return invalid_request("'messages' must contain at least one message.", param=param)
    return invalid_request(f"Invalid value for '{param}': {msg}.", param=param)


def _parse(model: type[_SamplingFields], body: Any, unsupported: dict[str, tuple[Any, ...]]) -> Any:
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    body = dict(body)
    _check_unsupported(body, unsupported)
    messages = body.get("messages")
    if isinstance(messages, list):
        cleaned = []
        for i, message in enumerate(messages):
            if isinstance(message, dict):
                message = dict(message)
                _check_unsupported(message, UNSUPPORTED_MESSAGE_FIELDS, where=f"messages[{i}].")
                _drop_sdk_fields(message)
            cleaned.append(message)
        body["messages"] = cleaned
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    """Validate a decoded JSON body as a chat request; APIError(400) names the bad field."""
    req: ChatCompletionRequest = _parse(ChatCompletionRequest, body, UNSUPPORTED_CHAT_FIELDS)
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        if req.max_tokens != req.max_completion_tokens:
            raise invalid_request(
                "'max_tokens' and 'max_completion_tokens' are aliases; give one of them, not two different "
                "values.",
                param="max_completion_tokens",
            )
    if req.top_logprobs is not None and req.top_logprobs > 0 and not req.logprobs:
        raise invalid_request("'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
    _check_messages(req)
    _check_tools(req)
    _check_prediction(req)
    _check_common(req)
    return req


def _check_prediction(req: ChatCompletionRequest) -> None:
    """What OpenAI's Predicted Outputs refuse beside a prediction, refused the same way."""
    if req.prediction is None:
        return
    conflicts = (
        ("n", req.num_choices > 1, "'n' greater than 1"),
        ("logprobs", bool(req.logprobs), "'logprobs'"),
        ("presence_penalty", (req.presence_penalty or 0) > 0, "a 'presence_penalty' greater than 0"),
        ("frequency_penalty", (req.frequency_penalty or 0) > 0, "a 'frequency_penalty' greater than 0"),
        ("tools", bool(req.tools), "'tools'"),
    )
    for param, conflict, what in conflicts:
        if conflict:
            raise invalid_request(
                f"'prediction' cannot be used with {what} (as with OpenAI's Predicted Outputs).", param=param
            )


def _check_messages(req: ChatCompletionRequest) -> None:
    for i, m in enumerate(req.messages):
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise invalid_request(
                f"Invalid value for 'messages[{i}].content': a {m.role} message needs content (it may "
                "be null only on an assistant message with 'tool_calls').",
                param=f"messages[{i}].content",
            )
        if m.tool_calls and m.role != "assistant":
            raise invalid_request(
                "Only assistant messages carry 'tool_calls'.", param=f"messages[{i}].tool_calls"
            )
        if (m.tool_call_id is not None) != (m.role == "tool"):
            raise invalid_request(
                "A 'tool' message needs 'tool_call_id' (the call it answers); only a tool message has one.",
                param=f"messages[{i}].tool_call_id",
            )


def _check_tools(req: ChatCompletionRequest) -> None:
    names = [t.function.name for t in req.tools or ()]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise invalid_request(
                f"Duplicate tool name '{name}' in 'tools'.", param=f"tools[{i}].function.name"
            )
    choice = req.tool_choice
    if choice is not None and choice != "none" and not names:
        raise invalid_request(
            "'tool_choice' is only allowed when 'tools' are specified.", param="tool_choice"
        )
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise invalid_request(
            f"'tool_choice' names function '{choice.function.name}', which is not in 'tools'.",
            param="tool_choice",
        )
    ids = {call.id for m in req.messages for call in m.tool_calls or ()}
    for i, m in enumerate(req.messages):
        if m.tool_call_id is not None and m.tool_call_id not in ids:
            raise invalid_request(
                f"'tool_call_id' {m.tool_call_id!r} answers no tool call of an earlier assistant message.",
                param=f"messages[{i}].tool_call_id",
            )


def parse_completion_request(body: Any) -> CompletionRequest:
    """Validate a decoded JSON body as a legacy completions request."""
    req: CompletionRequest = _parse(CompletionRequest, body, UNSUPPORTED_COMPLETION_FIELDS)
    if req.best_of is not None and req.best_of != req.num_choices:
        raise invalid_request(
            "'best_of' other than 'n' is not supported: this server returns every choice it generates.",
            param="best_of",
        )
    if req.echo and req.logprobs is not None:
        raise invalid_request(
            "'echo' together with 'logprobs' is not supported (prompt logprobs are not computed).",
            param="echo",
        )
    if len(req.prompt) * req.num_choices > MAX_NUM_CHOICES:
        raise invalid_request(
            f"The number of prompts times 'n' must be at most {MAX_NUM_CHOICES}, "
            f"got {len(req.prompt)} x {req.num_choices}.",
            param="n",
        )
    _check_common(req)
    return req


class GenerateRequest(StrictModel):
    """`POST /v1/generate`: the seed-style subset of a completions request."""

    model: str
    prompt: Prompt
    max_tokens: MaxTokens = None
    temperature: Annotated[float | None, Field(ge=0.0, le=2.0)] = None
    stream: bool | None = None


def parse_generate_request(body: Any) -> CompletionRequest:
    """Validate a `/v1/generate` body (its five fields only), answered as a completion."""
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    try:
        GenerateRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    return parse_completion_request(body)


def _check_common(req: _SamplingFields) -> None:
    if req.stream_options is not None and not req.stream:
        raise invalid_request(
            "'stream_options' is only allowed when 'stream' is true.", param="stream_options"
        )


# -- embeddings -------------------------------------------------------------------------------

# OpenAI's limits for /v1/embeddings.
MAX_INPUTS = 2048
MAX_TOKENS_PER_INPUT = 8192
MAX_TOKENS_PER_REQUEST = 300_000


def _input(value: Any) -> Any:
    """str | list[str] | list[int] | list[list[int]] -> a tuple of inputs (str or token-id tuple)."""

    def is_id(t: Any) -> bool:
        return (isinstance(t, int) and not isinstance(t, bool)) or (isinstance(t, float) and t.is_integer())

    shape = "must be a string, an array of strings, an array of token ids or an array of token-id arrays"
    if isinstance(value, str):
        if not value:
            raise ValueError("must not be an empty string")
        return (value,)
    if not isinstance(value, list) or not value:
        raise ValueError(shape + " (not empty)")
    if all(isinstance(v, str) for v in value):
        if any(not v for v in value):
            raise ValueError("must not hold an empty string")
        return tuple(value)
    if all(is_id(t) for t in value):
        return (tuple(int(t) for t in value),)
    if all(isinstance(v, list) and v and all(is_id(t) for t in v) for v in value):
        return tuple(tuple(int(t) for t in v) for v in value)
    raise ValueError(shape)


def input_schema(vocab_size: int | None = None) -> dict[str, Any]:
    """JSON schema of `input`; with `vocab_size`, token ids are bounded by it."""
    return prompt_schema(vocab_size, max_items=MAX_INPUTS)


Input = Annotated[tuple[str | tuple[int, ...], ...], BeforeValidator(_input), WithJsonSchema(input_schema())]


class EmbeddingsRequest(StrictModel):
    """OpenAI's create-embeddings body, plus vLLM's `truncate_prompt_tokens`."""

    model: str
    input: Input
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None


def parse_embeddings_request(body: Any) -> EmbeddingsRequest:
    """Validate a decoded JSON body; APIError(400) names the bad field and the limit it breaks."""
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    try:
        req = EmbeddingsRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    if len(req.input) > MAX_INPUTS:
        raise invalid_request(
            f"'input' holds {len(req.input)} inputs; at most {MAX_INPUTS} are allowed per request.",
            param="input",
        )
    if req.truncate_prompt_tokens == 0:
        raise invalid_request(
            "'truncate_prompt_tokens' must be -1 (the model's window) or a positive token count.",
            param="truncate_prompt_tokens",
        )
    return req


# -- conversion to the engine's sampling parameters -------------------------------------------


def context_error(
    max_model_len: int, num_prompt_tokens: int, max_tokens: int | None, param: str, limit: str = "max_tokens"
) -> APIError:
    """`context_length_exceeded`; `limit` names the completion's token limit as the request does."""
    if max_tokens is None:
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt is "
            f"{num_prompt_tokens} tokens, which leaves no room for a completion. Please reduce the length "
            "of the prompt."
        )
    else:
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} "
            f"in the completion). Please reduce the length of the prompt or of {limit}."
        )
    return APIError(ErrorKind.CONTEXT_LENGTH_EXCEEDED, message, param=param)


def sampling_params(
    req: ChatCompletionRequest | CompletionRequest,
    *,
    num_prompt_tokens: int,
    max_model_len: int,
    vocab_size: int,
    prompt_param: str | None = None,
    limit: str = "max_tokens",
) -> SamplingParams:
    """The engine's SamplingParams for `req`; APIError(400) when the prompt and max_tokens do not fit
    (`limit`: the request's name for max_tokens, `max_output_tokens` for a Responses request).

    Defaults follow OpenAI: temperature 1.0, top_p 1.0, n 1; chat's max_tokens defaults to the
    context left after the prompt, completions' to 16.
    """
    is_chat = isinstance(req, ChatCompletionRequest)
    prompt_param = prompt_param or ("messages" if is_chat else "prompt")
    max_tokens = req.requested_max_tokens
    if max_tokens is None:
        max_tokens = max_model_len - num_prompt_tokens
        if max_tokens < 1:
            raise context_error(max_model_len, num_prompt_tokens, None, prompt_param)
    elif num_prompt_tokens + max_tokens > max_model_len:
        raise context_error(max_model_len, num_prompt_tokens, max_tokens, prompt_param, limit)
    min_tokens = req.min_tokens or 0
    if min_tokens > max_tokens:
        raise invalid_request(
            f"'min_tokens' ({min_tokens}) must not exceed max_tokens ({max_tokens}).", param="min_tokens"
        )
    bias = req.logit_bias or {}
    bad = next((t for t in bias if t >= vocab_size), None)
    if bad is not None:
        raise invalid_request(
            f"'logit_bias' names token {bad}, outside the vocabulary (0..{vocab_size - 1}).",
            param="logit_bias",
        )
    if is_chat:
        logprobs = bool(req.logprobs)
    else:
        logprobs = req.logprobs is not None
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        seed=req.seed,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=dict(bias),
        stop=req.stop or (),
        ignore_eos=bool(req.ignore_eos),
        min_tokens=min_tokens,
        logprobs=logprobs,
        top_logprobs=req.num_top_logprobs if logprobs else 0,
        n=req.num_choices,
        speculative=req.speculative_decoding is not False,
    )
