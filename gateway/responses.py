"""Response bodies in OpenAI's exact shapes, built from the engine's outputs.

`Choice` accumulates one choice's outputs; the builders below turn choices into
`chat.completion`, `chat.completion.chunk`, `text_completion` objects and their usage. Plain
dicts, not models: a stream builds one per token, and the shapes are pinned by tests against the
OpenAPI document (gateway/openapi.py) and by the official SDK parsing them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.types import FinishReason, RequestOutput, TokenLogprob
from gateway.tokens import Tokenizer

# OpenAI never sends -inf (JSON cannot carry it); it floors logprobs at -9999.
MIN_LOGPROB = -9999.0


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens`: prompt tokens whose K/V came
    from the prefix cache (as OpenAI reports its own prompt caching)."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


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
    finish_reason: str | None = None

    def add(self, out: RequestOutput) -> None:
        self.parts.append(out.new_text)
        self.logprobs.extend(out.logprobs)
        self.num_output_tokens = max(self.num_output_tokens, out.num_output_tokens)
        if out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.finish_reason = out.finish_reason.value

    @property
    def text(self) -> str:
        return self.prefix + "".join(self.parts)


# -- chat ---------------------------------------------------------------------------------------


def chat_logprobs(tokenizer: Tokenizer, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    """`choices[i].logprobs` of a chat response: {"content": [...], "refusal": null}."""
    content = []
    for lp in logprobs:
        text, raw = tokenizer.token(lp.token_id)
        top = []
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
) -> dict[str, Any]:
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
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": usage(num_prompt_tokens, sum(c.num_output_tokens for c in choices), num_cached_tokens),
    }


def chat_chunk(
    *,
    request_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    include_usage: bool,
    usage_: dict[str, int] | None = None,
) -> dict[str, Any]:
    """One `chat.completion.chunk`. With include_usage every chunk carries `usage` (null but on the last)."""
    chunk: dict[str, Any] = {
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
    delta: dict[str, Any],
    *,
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


# -- legacy completions -----------------------------------------------------------------------


def completion_logprobs(
    tokenizer: Tokenizer, logprobs: Sequence[TokenLogprob], text_offset: int = 0
) -> dict[str, Any]:
    """`choices[i].logprobs` of a text completion: parallel lists, as the legacy API returns them."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
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
    choices: list[dict[str, Any]],
    include_usage: bool,
    usage_: dict[str, int] | None = None,
) -> dict[str, Any]:
    """A `text_completion` object: a whole response, or a stream chunk (usage only as for chat chunks)."""
    body: dict[str, Any] = {
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
    index: int, text: str, *, finish_reason: str | None, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
