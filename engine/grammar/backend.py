"""The llguidance backend: specs compiled to matchers, one matcher copy per sequence.

llguidance compiles lazily, so a schema a server has not seen costs its request little, where a
mask-precomputing engine first builds every mask (`python -m bench.grammar_engines` compares them).
A process's first llguidance grammar also builds its tokenizer tables, on the compile thread.

Runaway whitespace (models looping on newlines until max_tokens inside grammar-constrained JSON,
a known failure of other servers): JSON is compiled compact (`whitespace_flexible: false`), so no
whitespace is allowed between tokens at all; inside strings it is content the schema allows.
Runaway digits likewise: a number or integer without bounds gets JSON's safe range, and a number
without `multipleOf` at most NUMBER_DECIMALS decimals, an email's local part and a URI's scheme
at most 64 characters (`engine.json_schema.bound_schema`).
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, cast

import torch

from engine.grammar.closing import ClosingTokens, JsonState, shortest_completion
from engine.grammar.interface import CompiledGrammar, Grammar
from engine.json_schema import bound_schema
from engine.types import GrammarError, GrammarSpec

if TYPE_CHECKING:
    # Imported lazily at run time (llguidance's tokenizer tables are slow to build).
    from llguidance import LLMatcher, LLTokenizer
    from llguidance._lib import JsonCompileOptions
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast


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
        # Tokens accepted so far, and which of them came after the matcher had stopped: it accepts
        # those (an EOS after a closed JSON) without recording them, so a rollback must skip them.
        self._num_accepted = 0
        self._unrecorded: list[int] = []

    def accept_token(self, token_id: int) -> bool:
        stopped = self._matcher.is_stopped()
        accepted = bool(self._matcher.consume_token(token_id)) and not self._matcher.is_error()
        if accepted:
            if stopped:
                self._unrecorded.append(self._num_accepted)
            self._num_accepted += 1
        text = self._closing.token_bytes[token_id]
        if accepted and self._json:
            self._states.append(self._states[-1].after(text))
        if self._plan:  # written along the plan, or off it: searched again from there
            self._plan = self._plan[len(text) :] if self._plan.startswith(text) else None
        return accepted

    def valid_prefix(self, token_ids: list[int]) -> int:
        return int(self._matcher.validate_tokens(token_ids))

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
        self._num_accepted -= num_tokens
        skipped = 0
        while self._unrecorded and self._unrecorded[-1] >= self._num_accepted:
            self._unrecorded.pop()
            skipped += 1
        self._matcher.rollback(num_tokens - skipped)
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
