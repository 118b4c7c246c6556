"""Draft sources: what a sequence's next tokens probably are, read from text it already has.

`NgramIndex` finds where the last few tokens occurred before in a token list and proposes what
followed them there (prompt lookup, as vLLM's ngram proposer and llama.cpp's lookup decoding do).
`PromptLookup` searches the sequence's own prompt and output; `PredictionLookup` follows the
request's predicted output (OpenAI's Predicted Outputs), in step while the output matches it and
re-found by n-gram after an edit. A draft model or EAGLE/MTP heads would be another `Proposer`:
one that needs a forward pass of its own would run it from `Speculator.plan`, before the step's
batch is packed, over the same block tables (docs/SPECULATIVE.md).
"""

from __future__ import annotations

from typing import Protocol

# The n-gram lengths looked up, longest first: a longer match predicts better, a shorter one more often.
NGRAM_SIZES = (4, 3, 2)
# Prompt lookup compares the latest this many occurrences, each back over at most MAX_MATCH tokens.
MAX_CANDIDATES = 64
MAX_MATCH = 32


class Proposer(Protocol):
    def propose(self, token_ids: list[int], num_prompt_tokens: int, k: int) -> list[int]:
        """At most `k` tokens likely to follow `token_ids` (the prompt, then the output); [] for none."""
        ...


class NgramIndex:
    """Where each n-gram of a growing token list ended, for n in NGRAM_SIZES: all positions in
    order (a position is the index just past the n-gram). Indexed incrementally as tokens grow."""

    def __init__(self) -> None:
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self._indexed = 0  # n-grams ending at positions <= this are in the index

    def extend(self, tokens: list[int], upto: int) -> None:
        """Index the n-grams of `tokens` that end at positions up to `upto` (exclusive of later ones)."""
        for end in range(max(self._indexed + 1, 2), upto + 1):
            for n in NGRAM_SIZES:
                if end >= n:
                    self._ends.setdefault(tuple(tokens[end - n : end]), []).append(end)
        self._indexed = max(self._indexed, upto)

    def ends(self, key: tuple[int, ...]) -> list[int]:
        """Every end of `key` indexed so far, in order (do not modify)."""
        return self._ends.get(key, [])

    def find(self, key: tuple[int, ...], after: int = 0, before: int | None = None) -> int | None:
        """The first end of `key` at or after `after` (and before `before`), else its latest end
        before `before`; None if it never occurred there."""
        ends = self._ends.get(key)
        if not ends:
            return None
        usable = [e for e in ends if before is None or e < before]
        if not usable:
            return None
        later = [e for e in usable if e >= after]
        return later[0] if later else usable[-1]


class PromptLookup:
    """Drafts from the sequence's own text: the continuation of the earlier occurrence of its last
    n tokens (the longest n that matches) whose match reaches furthest back (the latest of equals):
    in a listing of similar lines, the line being copied rather than the last one written."""

    def __init__(self) -> None:
        self.index = NgramIndex()

    def propose(self, token_ids: list[int], num_prompt_tokens: int, k: int) -> list[int]:
        end = len(token_ids)
        self.index.extend(token_ids, end - 1)  # every n-gram but the suffix itself
        for n in NGRAM_SIZES:
            if end < n:
                continue
            ends = self.index.ends(tuple(token_ids[end - n :]))
            if not ends:
                continue
            best, best_len = ends[-1], 0
            for at in reversed(ends[-MAX_CANDIDATES:]):
                length = n
                while (
                    length < MAX_MATCH
                    and at - length > 0
                    and token_ids[at - length - 1] == token_ids[end - length - 1]
                ):
                    length += 1
                if length > best_len:
                    best, best_len = at, length
            return token_ids[best : best + k]
        return []


class PredictionLookup:
    """Drafts from a predicted output: the prediction's next tokens while the output follows it;
    after the output departs from it, the continuation of the output's last n tokens in the
    prediction, nearest after where it was (an edit keeps the rest of the file in order).
    `matched`: the prediction's tokens the output has taken so far, in order (OpenAI's accepted
    prediction tokens)."""

    def __init__(self, prediction: tuple[int, ...]) -> None:
        self.prediction = list(prediction)
        self.index = NgramIndex()
        self.index.extend(self.prediction, len(self.prediction))
        self.matched = 0
        self._cursor = 0  # the prediction's next token, while in step
        self._seen = 0  # output tokens followed so far
        self._in_step = True

    def follow(self, output: list[int]) -> None:
        """Follow the output's tokens produced since the last call."""
        for token in output[self._seen :]:
            if (
                self._in_step
                and self._cursor < len(self.prediction)
                and self.prediction[self._cursor] == token
            ):
                self._cursor += 1
                self.matched += 1
            else:
                self._in_step = False
                self._find_again(output[: self._seen + 1])
            self._seen += 1

    def _find_again(self, output: list[int]) -> None:
        for n in NGRAM_SIZES:
            if len(output) < n:
                continue
            at = self.index.find(tuple(output[-n:]), after=self._cursor)
            if at is not None:
                self._cursor, self._in_step = at, True
                return

    def propose(self, token_ids: list[int], num_prompt_tokens: int, k: int) -> list[int]:
        self.follow(token_ids[num_prompt_tokens:])
        return self.prediction[self._cursor : self._cursor + k] if self._in_step else []
