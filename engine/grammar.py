"""Constrained decoding behind a small interface: specs, backends, per-sequence grammars, a cache.

    GrammarSpec --(GrammarBackend.compile, on a worker thread, LRU-cached)--> CompiledGrammar
    CompiledGrammar.new_grammar() --> Grammar (one per sequence: its own parser state)

Each engine step fills one token bitmask for the constrained rows of the batch (`fill_bitmask`,
one row each); the sampler masks the disallowed tokens before it samples; the engine feeds each
sampled token back (`accept_token`) and ends the sequence when `is_terminated()`.

The backend is llguidance: it compiles lazily, so a schema a server has not seen costs its request
about a millisecond rather than the fraction of a second a mask-precomputing engine takes, with no
worse masks on average (`python -m bench.grammar_engines` compares them). A process's first
llguidance grammar also builds its tokenizer tables, on the compile thread.

Runaway whitespace (models looping on newlines until max_tokens inside grammar-constrained JSON,
a known failure of other servers): JSON is compiled compact (`whitespace_flexible: false`), so no
whitespace is allowed between tokens at all; inside strings it is content the schema allows.
Runaway digits likewise: a number or integer without bounds gets JSON's safe range, and a number
without `multipleOf` at most NUMBER_DECIMALS decimals, an email's local part and a URI's scheme
at most 64 characters (`engine.json_schema.bound_schema`).

Running out of max_tokens inside the JSON (a free-form string the model will not end, a long list)
would leave it unparseable: once a sequence's remaining budget is within `closing_reserve`, its row
of the mask is narrowed to the allowed tokens that end the output soonest (`fill_bitmask(...,
closing=True)`, `ClosingTokens`): the end of sequence where the grammar allows it, else tokens
that close containers (`}` `]`, after a string's closing quote inside one), else a lone quote
(ending a string, or starting one that the next step ends), else whatever the grammar allows (a
required key, a comma, a number's digits), so the output ends valid and the sequence stops with
its grammar. JSON kinds and Lark grammars marked `json_only` are steered so (measured in
docs/BENCHMARKS.md). Any other grammar (Lark with free text, a regex) is steered along a plan: the
shortest bytes that take the parser from where it is to an accepting state (`shortest_completion`,
a breadth-first search over single-byte tokens on copies of the matcher, forced bytes taken whole),
searched once when closing starts; its rows allow the allowed tokens that spell the plan's next
bytes, and where the grammar accepts, the end of sequence (unless free text may go on: a text
answer beside tools is cut by max_tokens as without a grammar, `incomplete`, not ended early).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol, cast

import numpy
import torch

from engine.json_schema import bound_schema
from engine.types import GrammarError, GrammarSpec

if TYPE_CHECKING:
    # Imported lazily at run time (llguidance's tokenizer tables are slow to build).
    from llguidance import LLMatcher, LLTokenizer
    from llguidance._lib import JsonCompileOptions
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

__all__ = [  # the records live in engine.types (they travel in SamplingParams and outputs)
    "CompiledGrammar",
    "Grammar",
    "GrammarBackend",
    "GrammarCache",
    "GrammarError",
    "GrammarSpec",
    "LLGuidanceBackend",
    "allocate_bitmask",
    "closing_reserve",
]

# One bit per token, 32 tokens per int32 word (the layout llguidance and xgrammar both fill).
BITS_PER_WORD = 32


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """A [num_rows, words] int32 bitmask with every token allowed (all bits set)."""
    return torch.full((num_rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


class Grammar(Protocol):
    """One sequence's parser state. Not thread-safe: the engine thread alone drives it."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by `token_id`; False if the grammar does not allow it (the state is then unusable)."""
        ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, closing: bool = False) -> None:
        """Write the allowed next tokens into `bitmask[row]` (bit set: allowed); `closing`: the
        budget is nearly spent, allow only those of them that end the output soonest (a grammar
        that cannot tell allows them all)."""
        ...

    def is_terminated(self) -> bool:
        """The output is complete: nothing but the end of the sequence may follow."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding, stop-string trims)."""
        ...


class CompiledGrammar(Protocol):
    """Immutable and shared: the result of compiling one spec, cached."""

    def new_grammar(self) -> Grammar: ...


class GrammarBackend(Protocol):
    """A grammar engine. `compile` may be slow and is called off the engine thread."""

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile `spec`, or raise GrammarError naming what is wrong with it."""
        ...


# A sequence closes its output (Grammar.fill_bitmask(closing=True)) once at most this many of its
# max_tokens are left, or half of them if fewer: enough to close from wherever it is (the required
# keys left, a comma or two, the brackets).
CLOSE_RESERVE = 32


def closing_reserve(max_tokens: int) -> int:
    return min(CLOSE_RESERVE, max_tokens // 2)


def token_row(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    """One bitmask row with exactly `token_ids` allowed."""
    bits = numpy.zeros(bitmask_words(vocab_size) * BITS_PER_WORD, dtype=bool)
    bits[token_ids] = True
    return torch.from_numpy(numpy.packbits(bits, bitorder="little").view(numpy.int32).copy())


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


# -- llguidance ---------------------------------------------------------------------------------


class _LLGuidanceGrammar:
    def __init__(self, matcher: LLMatcher, closing: ClosingTokens, json_only: bool) -> None:
        import llguidance.torch

        self._matcher = matcher
        self._closing = closing
        self._json = json_only  # closed as JSON (`narrow`), else along a plan (`follow`)
        self._states = [JsonState()]  # after each accepted token (JSON grammars only)
        # The plan's bytes still to write; None: none searched yet; b"": none found (not retried).
        self._plan: bytes | None = None
        self._fill = llguidance.torch.fill_next_token_bitmask

    def accept_token(self, token_id: int) -> bool:
        accepted = bool(self._matcher.consume_token(token_id)) and not self._matcher.is_error()
        text = self._closing.token_bytes[token_id]
        if accepted and self._json:
            self._states.append(self._states[-1].after(text))
        if self._plan:  # written along the plan, or off it: searched again from there
            self._plan = self._plan[len(text) :] if self._plan.startswith(text) else None
        return accepted

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, closing: bool = False) -> None:
        self._fill(self._matcher, bitmask, row)
        if not closing:
            return
        if self._json:
            self._closing.narrow(bitmask, row, self._states[-1])
            return
        if self._matcher.is_accepting():
            self._closing.finish(bitmask, row)
            self._plan = None  # should a structure start after all, its own plan is searched
            return
        if self._plan is None:
            self._plan = shortest_completion(self._matcher, self._closing) or b""
        if not self._closing.follow(bitmask, row, self._plan):
            self._plan = b""  # no allowed token spells it: the grammar's own mask goes on

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_stopped())

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)
        if num_tokens:
            self._plan = None
            if self._json:
                del self._states[-num_tokens:]


class _LLGuidanceCompiled:
    """A matcher at the start of the grammar, copied for each sequence: a copy costs microseconds,
    building one from the grammar text again up to milliseconds."""

    def __init__(self, prototype: LLMatcher, closing: ClosingTokens, json_only: bool) -> None:
        self._prototype = prototype
        self._closing = closing
        self._json = json_only
        self._lock = threading.Lock()  # shared by every request with this spec

    def new_grammar(self) -> Grammar:
        with self._lock:
            return _LLGuidanceGrammar(self._prototype.deep_copy(), self._closing, self._json)


class LLGuidanceBackend:
    """llguidance over a Hugging Face tokenizer; `vocab_size` is the width of the model's logits.

    `eos_token_ids` are the tokens that may end an output once the grammar accepts. Building the
    llguidance tokenizer is slow, so it happens on first use (on the compile thread).
    """

    def __init__(
        self, hf_tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: tuple[int, ...]
    ) -> None:
        self._hf = hf_tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: LLTokenizer | None = None
        self._closing: ClosingTokens | None = None
        self._lock = threading.Lock()

    def _lltokenizer(self) -> LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                # AutoTokenizer loads the fast (Rust) tokenizer of every model we serve, the one
                # llguidance reads its vocabulary from.
                self._tokenizer = llguidance.hf.from_tokenizer(
                    cast("PreTrainedTokenizerFast", self._hf),
                    n_vocab=self._vocab_size,
                    eos_token=self._eos or None,
                )
                tokenizer = self._tokenizer
                token_bytes = [tokenizer.decode_bytes([t]) for t in range(self._vocab_size)]
                self._closing = ClosingTokens(token_bytes, self._eos)
            return self._tokenizer

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        import llguidance

        try:
            grammar = self._grammar_text(spec)
        except ValueError as exc:  # llguidance's own message for a malformed input
            raise GrammarError(str(exc)) from None
        matcher = llguidance.LLMatcher(self._lltokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        assert self._closing is not None  # built with the tokenizer
        return _LLGuidanceCompiled(matcher, self._closing, spec.kind != "lark" or spec.json_only)

    @staticmethod
    def _grammar_text(spec: GrammarSpec) -> str:
        import llguidance

        options: JsonCompileOptions = {"whitespace_flexible": False, "lenient": not spec.strict}
        if spec.kind == "json_schema":
            try:
                schema = json.loads(spec.source)
            except ValueError as exc:
                raise GrammarError(f"the schema is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise GrammarError("the schema must be a JSON object")
            return str(llguidance.LLMatcher.grammar_from_json_schema(bound_schema(schema), defaults=options))
        if spec.kind == "json_object":
            return str(llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options))
        if spec.kind == "lark":
            if not spec.subgrammars:
                return str(llguidance.LLMatcher.grammar_from_lark(spec.source))
            named = [{"name": name, "lark_grammar": text} for name, text in spec.subgrammars]
            return json.dumps({"grammars": [{"lark_grammar": spec.source}, *named]})
        raise GrammarError(f"unknown grammar kind {spec.kind!r}")


# -- the cache ----------------------------------------------------------------------------------


class GrammarCache:
    """Compiles specs on a worker pool, at most once per spec while it stays in the LRU.

    `get(spec)` returns a Future at once (done if cached). Failures are cached too, so a client
    repeating a bad schema costs nothing. Thread-safe: the gateway asks from the event loop (to
    fail a bad schema with a 400 before admission), the engine from its thread.
    """

    def __init__(self, backend: GrammarBackend, max_entries: int = 512, max_workers: int = 1) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.backend = backend
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[GrammarSpec, Future[CompiledGrammar]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="batchgate-grammar")
        self.num_compiles = 0

    def get(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        with self._lock:
            future = self._entries.get(spec)
            if future is not None and not future.cancelled():
                self._entries.move_to_end(spec)
                return future
            self.num_compiles += 1
            future = self._pool.submit(self.backend.compile, spec)
            self._entries[spec] = future
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
            return future

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# -- the step's mask ----------------------------------------------------------------------------

# One row of a step's mask: the row's grammar and whether it closes (`closing_due`); None: free.
MaskRow = tuple[Grammar, bool] | None


def closing_due(max_tokens: int, num_output_tokens: int) -> bool:
    """Whether a constrained output should be steered to its end now: its budget runs out soon."""
    return max_tokens - num_output_tokens <= closing_reserve(max_tokens)


def fill_bitmask(
    rows: list[MaskRow], vocab_size: int, bitmask: torch.Tensor | None = None
) -> torch.Tensor | None:
    """The step's one token bitmask (`bitmask`, all bits set, or a new one): each constrained row
    filled by its grammar, all tokens allowed in the others; None when no row is constrained."""
    if all(row is None for row in rows):
        return None
    if bitmask is None:
        bitmask = allocate_bitmask(len(rows), vocab_size)
    # One llguidance call per row: its batch call measured slower in the engine on few cores.
    for i, row in enumerate(rows):
        if row is not None:
            grammar, closing = row
            grammar.fill_bitmask(bitmask, i, closing=closing)
    return bitmask


class StepMask:
    """One step's bitmask: being filled on the filler thread, or filled when asked for."""

    def __init__(
        self, rows: list[MaskRow], vocab_size: int, future: Future[torch.Tensor | None] | None
    ) -> None:
        self._rows, self._vocab_size, self._future = rows, vocab_size, future

    def result(self) -> torch.Tensor | None:
        """The bitmask (None: no row is constrained); raises what filling it raised."""
        if self._future is not None:
            return self._future.result()
        return fill_bitmask(self._rows, self._vocab_size)


class MaskFiller:
    """Starts each step's mask. With `overlap` (the GPU default) it is filled on a worker thread
    while the forward pass runs, when the CPU is idle (llguidance fills with the GIL released); on
    the CPU after the pass, which keeps every core busy already."""

    def __init__(self, vocab_size: int, overlap: bool) -> None:
        self.vocab_size = vocab_size
        self.overlap = overlap
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchgate-masks")

    def start(self, rows: list[MaskRow]) -> StepMask:
        """The mask of a step whose sampled rows are `rows` (every grammar's state is final now)."""
        if not self.overlap or all(row is None for row in rows):
            return StepMask(rows, self.vocab_size, None)
        # Allocated here, not on the filler thread: a torch op that may go parallel there would give
        # that thread an OpenMP team of its own, and more OpenMP threads than cores slow every step.
        with torch.inference_mode(False):  # a grammar may write it in place from that thread
            bitmask = allocate_bitmask(len(rows), self.vocab_size)
        future = self._thread.submit(fill_bitmask, rows, self.vocab_size, bitmask)
        return StepMask(rows, self.vocab_size, future)
