"""Incremental detokenization with stop strings.

Text is released only when it is final: never in the middle of a multi-byte character (the
tokenizer yields U+FFFD while a character's bytes are incomplete), and never a tail that could
still turn out to be the start of a stop string. A matched stop string and everything after it is
not returned.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

# Prompt tokens kept as left context, so a tokenizer that drops a leading space when decoding
# from a word boundary still sees what came before the first output token.
_PREFIX_CONTEXT = 5

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        stop: tuple[str, ...],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_PREFIX_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all output text so far (truncated at a stop string)
        self._num_emitted = 0

    def _decode(self, ids: list[int]) -> str:
        # decode() of one id list is one string (transformers types it `str | list[str]`)
        return cast(str, self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens))

    def add(self, token_id: int) -> bool:
        """Append a generated token. Returns True when a stop string was matched."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False  # nothing new yet, or an incomplete character: wait for more bytes
        start = len(self.text)
        self.text += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if not self._stop:
            return False
        window_start = max(0, start - self._hold)
        hits = [i for s in self._stop if (i := self.text.find(s, window_start)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False

    def take(self, final: bool) -> str:
        """Text not yet returned; while not `final`, keep back a tail that may begin a stop string."""
        end = (
            len(self.text) if final or not self._hold else max(self._num_emitted, len(self.text) - self._hold)
        )
        delta = self.text[self._num_emitted : end]
        self._num_emitted = end
        return delta
