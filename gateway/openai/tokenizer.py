"""Prompt rendering and tokenization, and the text/bytes of single tokens for logprobs.

Everything here runs the tokenizer, which is CPU work: `Tokenizer.encode_*` are plain functions;
backends run them through `inline_or_thread`, in a worker thread when the input is large, so the
event loop stays free.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from jinja2 import TemplateError

from gateway.errors import invalid_request
from gateway.openai.formats import ChatFormat
from gateway.openai.protocol import ChatMessage, Tool

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Inputs longer than this (characters, in all) are tokenized in a worker thread, not on the loop.
TOKENIZE_INLINE_MAX_CHARS = 4096
A = TypeVar("A")
R = TypeVar("R")


async def inline_or_thread(fn: Callable[[A], R], arg: A, size: int) -> R:
    """`fn(arg)`, on the event loop when `size` (characters) is small, else in a worker thread."""
    if size <= TOKENIZE_INLINE_MAX_CHARS:
        return fn(arg)
    return await anyio.to_thread.run_sync(fn, arg)


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable stand-in character -> raw byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _is_byte_level(tokenizer: PreTrainedTokenizerBase) -> bool:
    try:
        decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    except (AttributeError, ValueError, TypeError):
        return False
    kinds = {decoder.get("type")} | {
        d.get("type") for d in decoder.get("decoders", []) if isinstance(d, dict)
    }
    return "ByteLevel" in kinds


class Tokenizer:
    """The gateway's view of the engine's Hugging Face tokenizer.

    Contract: `encode_chat` renders the model's chat template with a generation prompt and returns
    token ids; control tokens typed by a user inside message content are encoded as plain text,
    so a message cannot forge a turn boundary. `token(id)` returns OpenAI's logprob pair: the
    token's text and its raw UTF-8 bytes (a token that is only part of a character shows as
    `bytes:\\xe2\\x80`, as OpenAI does). `format` is the model family's conventions (its tool calls,
    its reasoning: gateway/openai/formats.py), read from the template and the config's `model_type`.
    """

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase, model_type: str = "llama") -> None:
        self.hf = hf_tokenizer
        self.vocab_size = len(hf_tokenizer)
        self._byte_level = _is_byte_level(hf_tokenizer)
        self.format = ChatFormat(hf_tokenizer, model_type)
        self.renders_tools = self.format.native_tools
        self.token = functools.lru_cache(maxsize=65536)(self._token)

    def encode_chat(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[Tool] = (),
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """`messages` (and the `tools` shown to the model, gateway/openai/tools.py) rendered and
        encoded; `template_kwargs`: the request's variables for the template (`enable_thinking`)."""
        conversation, template_tools = self.format.conversation(messages, tools)
        # the template takes JSON schemas or functions; ours are schemas (a list is invariant)
        schemas: list[dict[Any, Any] | Callable[..., Any]] | None = (
            None if template_tools is None else list(template_tools)
        )
        try:
            ids = self.hf.apply_chat_template(
                conversation,
                tools=schemas,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
                sanitize_control_tokens=True,
                **(template_kwargs or {}),
            )
        except (TemplateError, ValueError) as exc:
            # Templates reject conversations with `raise_exception(...)` (a TemplateError), e.g.
            # "roles must alternate"; a model without a template raises ValueError. Both are about
            # this request's messages, not a fault of the server.
            raise invalid_request(
                f"The chat template rejected the messages: {exc}", param="messages"
            ) from None
        except TypeError as exc:
            if not template_kwargs:
                raise
            # a variable of a type the template cannot use (a string where it compares numbers)
            raise invalid_request(
                f"The chat template failed with these chat_template_kwargs: {exc}",
                param="chat_template_kwargs",
            ) from None
        return list(ids)

    def encode_text(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=True))

    def encode_output(self, text: str) -> list[int]:
        """Text as a model's output would hold it: no BOS or other special tokens added."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def encode_prompt(self, prompt: str | tuple[int, ...]) -> list[int]:
        """A completions prompt (text or token ids) -> validated token ids."""
        if isinstance(prompt, str):
            ids = self.encode_text(prompt)
        else:
            ids = list(prompt)
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise invalid_request(
                    f"Token id {bad} in 'prompt' is outside the vocabulary (0..{self.vocab_size - 1}).",
                    param="prompt",
                )
        if not ids:
            raise invalid_request("'prompt' must not be empty.", param="prompt")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.hf.decode(list(ids)))

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        raw: bytes | None = None
        piece = self.hf.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            byte_fallback = _BYTE_FALLBACK.match(piece)
            if byte_fallback:
                raw = bytes([int(byte_fallback.group(1), 16)])
            elif self._byte_level:
                table = _byte_decoder()
                raw = b"".join(bytes([table[c]]) if c in table else c.encode() for c in piece)
        if raw is None:
            raw = self.decode([token_id]).encode()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text, list(raw)
