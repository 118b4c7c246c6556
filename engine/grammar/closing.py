"""Steering a constrained output to its end before max_tokens runs out.

Running out of max_tokens inside the JSON (a free-form string the model will not end, a long list)
would leave it unparseable: once a sequence's remaining budget is within `closing_reserve`
(engine/grammar/mask.py), its row of the mask is narrowed to the allowed tokens that end the output
soonest (`ClosingTokens`): the end of sequence where the grammar allows it, else tokens that close
containers (`}` `]`, after a string's closing quote inside one), else a lone quote (ending a
string, or starting one that the next step ends), else whatever the grammar allows (a required
key, a comma, a number's digits), so the output ends valid and the sequence stops with its grammar.
JSON kinds and Lark grammars marked `json_only` are steered so (`JsonState` follows whether the
output is inside a string). Any other grammar (Lark with free text, a regex) is steered along a
plan: the shortest bytes that take the parser from where it is to an accepting state
(`shortest_completion`, a breadth-first search over single-byte tokens on copies of the matcher,
forced bytes taken whole), searched once when closing starts; its rows allow the allowed tokens
that spell the plan's next bytes, and where the grammar accepts, the end of sequence (unless free
text may go on: a text answer beside tools is cut by max_tokens as without a grammar,
`incomplete`, not ended early).
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import TYPE_CHECKING

import numpy
import torch

from engine.grammar.interface import token_row

if TYPE_CHECKING:
    from llguidance import LLMatcher


class ClosingTokens:
    """What a JSON grammar's closing rows are narrowed to, as bitmask rows over the vocabulary, and
    the bytes of every token (to follow whether the output is inside a string).

    First `end`, the end-of-sequence tokens (allowed once the grammar accepts and may go on, as a
    Lark grammar's repeated tool calls may). Inside a string `}` and `]` are content, so the next
    sets depend on where the output is: `in_string`, a quote then only brackets (`"}`, `"]}`);
    `outside`, only brackets (`}`, `]]`). Last `quote`, the lone `"` (ending a string, or starting
    one the next step ends)."""

    def __init__(self, token_bytes: list[bytes], end_ids: list[int]) -> None:
        self.token_bytes = token_bytes
        self.end = token_row(end_ids, len(token_bytes))
        # For plans (any grammar): the tokens of each byte string, and one token per single byte.
        self.by_bytes: dict[bytes, list[int]] = {}
        for t, text in enumerate(token_bytes):
            if text and t not in end_ids:
                self.by_bytes.setdefault(text, []).append(t)
        self.longest = max(map(len, self.by_bytes), default=1)
        self.byte_token = numpy.array([self.by_bytes.get(bytes([b]), [-1])[0] for b in range(256)])
        # The bytes that have a token of their own, and those tokens (to read a bitmask at once).
        self.token_byte_values = numpy.flatnonzero(self.byte_token >= 0).astype(numpy.uint8)
        self.byte_token_ids = self.byte_token[self.token_byte_values]

        def row(pattern: bytes) -> torch.Tensor:
            matcher = re.compile(pattern)
            ids = [t for t, text in enumerate(token_bytes) if matcher.fullmatch(text)]
            return token_row(ids, len(token_bytes))

        self.in_string = row(rb'"[\]}]+')
        self.outside = row(rb"[\]}]+")
        self.quote = row(rb'"')

    def narrow(self, bitmask: torch.Tensor, row: int, state: JsonState) -> None:
        """Keep in `bitmask[row]` the allowed end, else the allowed brackets (after a quote inside
        a string), else the allowed quote, else all it allows."""
        allowed = bitmask[row]
        for preferred in (self.end, self.in_string if state.in_string else self.outside, self.quote):
            narrowed = allowed & preferred
            if bool(narrowed.any()):
                allowed.copy_(narrowed)
                return

    def spelling(self, plan: bytes) -> torch.Tensor:
        """The row of the tokens whose bytes start `plan` (a non-empty prefix of it)."""
        ids = [t for k in range(1, min(len(plan), self.longest) + 1) for t in self.by_bytes.get(plan[:k], ())]
        return token_row(ids, len(self.token_bytes))

    def follow(self, bitmask: torch.Tensor, row: int, plan: bytes) -> bool:
        """Keep in `bitmask[row]` the allowed tokens that spell `plan`'s next bytes; False (the
        row unchanged) if it allows none of them."""
        allowed = bitmask[row]
        narrowed = allowed & self.spelling(plan) if plan else None
        if narrowed is None or not bool(narrowed.any()):
            return False
        allowed.copy_(narrowed)
        return True

    def finish(self, bitmask: torch.Tensor, row: int) -> None:
        """Where a grammar accepts: keep in `bitmask[row]` only the end, unless free text may go
        on (most of the vocabulary allowed: a text answer), which max_tokens then cuts as it
        would without a grammar, rather than ending it early as if complete."""
        allowed = bitmask[row]
        if int(numpy.unpackbits(allowed.numpy().view(numpy.uint8)).sum()) > len(self.token_bytes) // 2:
            return
        narrowed = allowed & self.end
        if bool(narrowed.any()):
            allowed.copy_(narrowed)


# A plan search (`shortest_completion`) gives up after this many parser states, so a closing step
# stays short; a closing Codex patch needs far fewer.
PLAN_STATES = 2000
# States alike are searched at most this often: a bounded repetition (`[0-9]{4}`) looks alike at
# each count, a free-text loop alike at every byte.
PLAN_REVISITS = 4
# Where a state allows more bytes than this, the search tries only its punctuation, whitespace and
# one letter or digit of each kind: free text (`/.+/`) ends at a separator, not at a letter.
PLAN_BRANCHES = 16


def _plan_candidates(allowed: list[int]) -> list[int]:
    """The bytes a state's search tries, letters and digits first (a plan of equal length then
    names a file `a`, not a tab)."""
    if len(allowed) <= PLAN_BRANCHES:
        return allowed
    out = []
    for kind in (str.islower, str.isupper, str.isdigit):
        out += [b for b in allowed if b < 128 and kind(chr(b))][:1]
    out += [b for b in allowed if 32 <= b < 127 and not chr(b).isalnum()]
    out += [b for b in allowed if b in (9, 10, 13)]
    return out or allowed


def _advance(state: LLMatcher, tokens: ClosingTokens) -> tuple[bytes, bytes] | None:
    """Take `state`'s forced bytes (in place); those and the bytes it allows next (after them), or
    None if a forced byte has no token of its own."""
    forced = b"" if state.is_accepting() else state.compute_ff_bytes()
    ids = [int(tokens.byte_token[b]) for b in forced]
    if ids and (min(ids) < 0 or not state.consume_tokens(ids)):
        return None
    if state.is_accepting():
        return forced, b""
    words = numpy.frombuffer(state.compute_bitmask(), dtype="<u4")  # token t: bit t % 32 of word t // 32
    singles = tokens.byte_token_ids
    allowed = (words[singles >> 5] >> (singles & 31).astype(numpy.uint32)) & 1
    return forced, tokens.token_byte_values[allowed.astype(bool)].tobytes()


def shortest_completion(
    matcher: LLMatcher, tokens: ClosingTokens, max_states: int = PLAN_STATES
) -> bytes | None:
    """The shortest bytes (as far as the search tells) that take `matcher` (left unchanged) to an
    accepting state; None if none is found within `max_states`. Breadth first over single-byte
    tokens on copies of the matcher; a state's forced bytes are taken whole, and states alike (the
    same forced and allowed bytes) are kept once among siblings and expanded at most
    PLAN_REVISITS times in all."""
    start = matcher.deep_copy()
    first = _advance(start, tokens)
    if first is None:
        return None
    if start.is_accepting():
        return first[0]
    queue = collections.deque([(start, first[0], first)])
    seen: collections.Counter[tuple[bytes, bytes]] = collections.Counter()
    states = 0
    while queue and states < max_states:
        state, path, key = queue.popleft()
        seen[key] += 1
        if seen[key] > PLAN_REVISITS:
            continue
        siblings: set[tuple[bytes, bytes]] = set()
        for b in _plan_candidates(list(key[1])):
            child = state.deep_copy()
            states += 1
            if not child.consume_token(int(tokens.byte_token[b])):
                continue
            child_key = _advance(child, tokens)
            if child_key is None or child_key in siblings:
                continue
            siblings.add(child_key)
            child_path = path + bytes([b]) + child_key[0]
            if child.is_accepting():  # the first accepting state in the queue's order, found early
                return child_path
            queue.append((child, child_path, child_key))
    return None


@dataclasses.dataclass(frozen=True)
class JsonState:
    """Whether a prefix of JSON text ends inside a string (and just after a backslash there)."""

    in_string: bool = False
    escaped: bool = False

    def after(self, text: bytes) -> JsonState:
        in_string, escaped = self.in_string, self.escaped
        for byte in text:
            if escaped:
                escaped = False
            elif in_string and byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = not in_string
        return JsonState(in_string, escaped)
