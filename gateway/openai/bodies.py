"""Response bodies in OpenAI's exact shapes, built from the engine's outputs.

`Choice` accumulates one choice's outputs; the builders below turn choices into
`chat.completion`, `chat.completion.chunk`, `text_completion` objects and their usage, and build
the embeddings list, model cards and the models list. Each returns a typed dict of
gateway/openai/schemas.py (the shapes the OpenAPI document is generated from): plain dicts at runtime,
because a stream builds one per token, and checked by mypy against their shapes.
"""

from __future__ import annotations

import base64
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.types import FinishReason, RequestOutput, TokenLogprob
from gateway.openai import schemas
from gateway.openai.tokenizer import Tokenizer

# OpenAI never sends -inf (JSON cannot carry it); it floors logprobs at -9999.
MIN_LOGPROB = -9999.0

OWNED_BY = "batchgate"

# The engine's reasons a choice may end with in a response; abort and error become errors instead.
FINISH_REASONS: dict[FinishReason, schemas.CompletionFinishReason] = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
}


def now() -> int:
    return int(time.time())


def finish_reason_of(out: RequestOutput) -> schemas.CompletionFinishReason | None:
    """The reason `out` ends its choice with, or None (not finished, or ended by an error)."""
    return FINISH_REASONS.get(out.finish_reason) if out.finish_reason is not None else None


def usage(
    num_prompt_tokens: int,
    num_completion_tokens: int,
    num_cached_tokens: int = 0,
    prediction: tuple[int, int] | None = None,
) -> schemas.Usage:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens`: prompt tokens whose K/V came
    from the prefix cache (as OpenAI reports its own prompt caching); `prediction`: a Predicted
    Output's (accepted, rejected) tokens."""
    body: schemas.Usage = {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }
    if prediction is not None:
        accepted, rejected = prediction
        body["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": rejected,
        }
    return body


def _lp(value: float) -> float:
    return max(float(value), MIN_LOGPROB) if value == value else MIN_LOGPROB


@dataclass
class Choice:
    """One choice's text, logprobs and finish reason, gathered output by output."""

    index: int
    prefix: str = ""  # the echoed prompt (completions with echo=true)
    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_output_tokens: int = 0
    finish_reason: schemas.CompletionFinishReason | None = None
    token_ids: list[int] = field(default_factory=list)  # as generated (a matched stop string's too)

    def add(self, out: RequestOutput) -> None:
        self.parts.append(out.new_text)
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.logprobs)
        self.num_output_tokens = max(self.num_output_tokens, out.num_output_tokens)
        reason = finish_reason_of(out)
        if reason is not None:
            self.finish_reason = reason

    @property
    def text(self) -> str:
        return self.prefix + "".join(self.parts)

    @property
    def final_reason(self) -> schemas.CompletionFinishReason:
        """The reason a gathered choice ended with: gather() returns only choices whose streams
        ended, and a stream ends with stop or length (an abort or error raises first)."""
        if self.finish_reason is None:
            raise RuntimeError(f"choice {self.index} was gathered before it finished")
        return self.finish_reason


# -- chat ---------------------------------------------------------------------------------------


def chat_logprobs(tokenizer: Tokenizer, logprobs: Sequence[TokenLogprob]) -> schemas.ChatLogprobs:
    """`choices[i].logprobs` of a chat response: {"content": [...], "refusal": null}."""
    content: list[schemas.TokenLogprob] = []
    for lp in logprobs:
        text, raw = tokenizer.token(lp.token_id)
        top: list[schemas.TopLogprob] = []
        for token_id, value in lp.top:
            t_text, t_raw = tokenizer.token(token_id)
            top.append({"token": t_text, "logprob": _lp(value), "bytes": t_raw})
        content.append({"token": text, "logprob": _lp(lp.logprob), "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def chat_completion(
    *,
    request_id: str,
    created: int,
    model: str,
    choices: Sequence[Choice],
    num_prompt_tokens: int,
    tokenizer: Tokenizer,
    with_logprobs: bool,
    num_cached_tokens: int = 0,
    prediction: tuple[int, int] | None = None,
) -> schemas.ChatCompletion:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text, "refusal": None},
                "logprobs": chat_logprobs(tokenizer, c.logprobs) if with_logprobs else None,
                "finish_reason": c.final_reason,
            }
            for c in choices
        ],
        "usage": usage(
            num_prompt_tokens, sum(c.num_output_tokens for c in choices), num_cached_tokens, prediction
        ),
    }


def chat_chunk(
    *,
    request_id: str,
    created: int,
    model: str,
    choices: list[schemas.ChatCompletionChunkChoice],
    include_usage: bool,
    usage_: schemas.Usage | None = None,
) -> schemas.ChatCompletionChunk:
    """One `chat.completion.chunk`. With include_usage every chunk carries `usage` (null but on the last)."""
    chunk: schemas.ChatCompletionChunk = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": choices,
    }
    if include_usage:
        chunk["usage"] = usage_
    return chunk


def chat_delta(
    index: int,
    delta: schemas.ChatCompletionDelta,
    *,
    finish_reason: schemas.ChatFinishReason | None = None,
    logprobs: schemas.ChatLogprobs | None = None,
) -> schemas.ChatCompletionChunkChoice:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


# -- legacy completions -----------------------------------------------------------------------


def completion_logprobs(
    tokenizer: Tokenizer, logprobs: Sequence[TokenLogprob], text_offset: int = 0
) -> schemas.CompletionLogprobs:
    """`choices[i].logprobs` of a text completion: parallel lists, as the legacy API returns them."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for lp in logprobs:
        text, _ = tokenizer.token(lp.token_id)
        tokens.append(text)
        token_logprobs.append(_lp(lp.logprob))
        top_logprobs.append({tokenizer.token(t)[0]: _lp(v) for t, v in lp.top})
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def text_completion(
    *,
    request_id: str,
    created: int,
    model: str,
    choices: list[schemas.CompletionChoice],
    include_usage: bool,
    usage_: schemas.Usage | None = None,
) -> schemas.Completion:
    """A `text_completion` object: a whole response, or a stream chunk (usage only as for chat chunks)."""
    body: schemas.Completion = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": choices,
    }
    if include_usage:
        body["usage"] = usage_
    return body


def completion_choice(
    index: int,
    text: str,
    *,
    finish_reason: schemas.CompletionFinishReason | None,
    logprobs: schemas.CompletionLogprobs | None,
) -> schemas.CompletionChoice:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


# -- embeddings -------------------------------------------------------------------------------


def encode_embedding(vector: list[float], encoding_format: str | None) -> list[float] | str:
    """`float`: the numbers; `base64`: their little-endian float32 bytes, as OpenAI sends."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


def embedding_list(
    model: str, vectors: Sequence[list[float]], encoding_format: str | None, num_tokens: int
) -> schemas.CreateEmbeddingResponse:
    """The embeddings of one request, one per input in input order; `num_tokens`: over all inputs."""
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encode_embedding(v, encoding_format)}
            for i, v in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }


# -- models -----------------------------------------------------------------------------------


def model_card(model: str, created: int) -> schemas.Model:
    return {"id": model, "object": "model", "created": created, "owned_by": OWNED_BY}


def model_list(cards: Sequence[schemas.Model]) -> schemas.ModelList:
    return {"object": "list", "data": list(cards)}
