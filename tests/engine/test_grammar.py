"""Constrained decoding: the grammar interface and cache, mask application in the sampler, and the
engine's handling of constrained sequences (waiting for compiles, termination, errors).

A fake backend (token-literal grammars) stands in for llguidance where the test is about the
engine's side of the interface; llguidance itself is tested on the real tokenizer (its grammars'
outputs must parse and validate whatever the model's weights).
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from bench.schemas import SCHEMAS
from engine.grammar import mask as mask_module
from engine.grammar.backend import LLGuidanceBackend
from engine.grammar.closing import ClosingTokens, JsonState, shortest_completion
from engine.grammar.interface import GrammarCache, allocate_bitmask, token_row
from engine.grammar.mask import CLOSE_RESERVE, closing_reserve
from engine.json_schema import bound_schema
from engine.llm_engine import LLMEngine
from engine.sampler import SamplingRow, _apply_bitmask_batched, apply_bitmask, sample
from engine.types import FinishReason, GenerationRequest, GrammarError, GrammarSpec, SamplingParams
from tests.engine.helpers import chat_ids, run_all, text_of, tiny_engine, tokens_of
from tests.lark_check import APPLY_PATCH_GRAMMAR, lark_parser

VOCAB = 40


class LiteralGrammar:
    """Allows exactly `tokens`, in order, then terminates."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.pos = 0
        self.closing: list[bool] = []  # each fill's `closing`, in order

    def accept_token(self, token_id: int) -> bool:
        if self.pos >= len(self.tokens) or self.tokens[self.pos] != token_id:
            return False
        self.pos += 1
        return True

    def valid_prefix(self, token_ids: list[int]) -> int:
        n = 0
        while (
            n < len(token_ids)
            and self.pos + n < len(self.tokens)
            and self.tokens[self.pos + n] == token_ids[n]
        ):
            n += 1
        return n

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, closing: bool = False) -> None:
        self.closing.append(closing)
        bitmask[row] = 0
        if self.pos < len(self.tokens):
            t = self.tokens[self.pos]
            bitmask[row, t // 32] = torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)

    def is_terminated(self) -> bool:
        return self.pos == len(self.tokens)

    def rollback(self, num_tokens: int) -> None:
        self.pos -= num_tokens


class LiteralCompiled:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.made: list[LiteralGrammar] = []

    def new_grammar(self) -> LiteralGrammar:
        self.made.append(LiteralGrammar(self.tokens))
        return self.made[-1]


class FakeBackend:
    """`lark` specs whose source is token ids ("5 9 12"); "bad" fails; `gate` holds compiles."""

    def __init__(self) -> None:
        self.compiled: list[GrammarSpec] = []
        self.gate = threading.Event()
        self.gate.set()

    def compile(self, spec: GrammarSpec) -> LiteralCompiled:
        self.gate.wait(30)
        self.compiled.append(spec)
        if spec.source == "bad":
            raise GrammarError("unsupported keyword 'bad'")
        self.last = LiteralCompiled([int(t) for t in spec.source.split()])
        return self.last


def literal(*tokens: int) -> GrammarSpec:
    return GrammarSpec.lark(" ".join(map(str, tokens)))


# ---- the interface and the cache ---------------------------------------------------------------------


def test_literal_grammar_follows_the_interface() -> None:
    g = LiteralCompiled([3, 7]).new_grammar()
    mask = allocate_bitmask(1, VOCAB)
    g.fill_bitmask(mask, 0)
    logits = torch.zeros(1, VOCAB)
    apply_bitmask(logits, mask, [0])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [3]
    assert g.accept_token(3) and not g.is_terminated()
    assert g.accept_token(7) and g.is_terminated()
    g.rollback(1)
    assert not g.is_terminated() and not g.accept_token(3)


def test_cache_compiles_each_spec_once_and_caches_failures() -> None:
    backend = FakeBackend()
    cache = GrammarCache(backend, max_entries=2)
    assert cache.get(literal(1)).result() is cache.get(literal(1)).result()
    with pytest.raises(GrammarError, match="bad"):
        cache.get(GrammarSpec.lark("bad")).result()
    with pytest.raises(GrammarError):
        cache.get(GrammarSpec.lark("bad")).result()
    assert backend.compiled == [literal(1), GrammarSpec.lark("bad")]
    cache.get(literal(2)).result()  # evicts the least recently used: literal(1)
    cache.get(literal(1)).result()
    assert backend.compiled.count(literal(1)) == 2
    cache.shutdown()


def test_equal_schemas_share_one_spec_and_keep_their_field_order() -> None:
    a = GrammarSpec.json_schema({"type": "object", "properties": {"y": {}, "x": {}}})
    assert a == GrammarSpec.json_schema({"type": "object", "properties": {"y": {}, "x": {}}})
    assert hash(a) == hash(GrammarSpec.json_schema({"type": "object", "properties": {"y": {}, "x": {}}}))
    assert a.source.index('"y"') < a.source.index('"x"')  # fields are generated in the schema's order


# ---- the sampler -----------------------------------------------------------------------------------


def only(*tokens: int, rows: int = 1) -> torch.Tensor:
    mask = torch.zeros(rows, (VOCAB + 31) // 32, dtype=torch.int32)
    for r in range(rows):
        g = LiteralGrammar(list(tokens))
        for t in tokens:  # set every listed token's bit
            g.pos = tokens.index(t)
            part = allocate_bitmask(1, VOCAB)
            g.fill_bitmask(part, 0)
            mask[r] |= part[0]
    return mask


def srow(constrained: bool, seed: int | None = None, **params: Any) -> SamplingRow:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(SamplingParams(**params), [], (), generator, constrained=constrained)


def test_greedy_picks_the_best_allowed_token_and_leaves_free_rows_alone() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[:, 5] = 100.0  # the favourite everywhere, allowed nowhere in constrained rows
    mask = only(11, 33, rows=3)
    rows = [srow(True, temperature=0.0), srow(False, temperature=0.0), srow(True, temperature=0.0)]
    tokens, _ = sample(logits.clone(), rows, mask)
    best = 11 if logits[0, 11] > logits[0, 33] else 33
    assert tokens[0] == best
    assert tokens[1] == 5
    assert tokens[2] in (11, 33)


def test_sampled_rows_draw_only_allowed_tokens_and_logprobs_stay_the_model_s() -> None:
    num = 64  # like n=64 choices of one constrained request
    logits = torch.zeros(num, VOCAB)
    rows = [srow(True, seed=i, temperature=1.5, top_p=0.95, top_k=30, logprobs=True) for i in range(num)]
    tokens, logprobs = sample(logits.clone(), rows, only(2, 17, 39, rows=num))
    assert set(tokens) <= {2, 17, 39} and len(set(tokens)) == 3
    raw = torch.log_softmax(torch.zeros(VOCAB), -1)[0].item()
    assert all(lp is not None and lp.logprob == pytest.approx(raw) for lp in logprobs)


def test_min_tokens_does_not_override_the_grammar() -> None:
    # The grammar allows only the stop token: min_tokens must not mask it (nothing would be left).
    rows = [SamplingRow(SamplingParams(min_tokens=5, temperature=0.0), [], (7,), None, constrained=True)]
    tokens, _ = sample(torch.zeros(1, VOCAB), rows, only(7))
    assert tokens == [7]


def reference_mask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] bool, True where allowed: the bits read one by one (bit t % 32 of word t // 32)."""
    return torch.tensor(
        [[bool((int(row[t // 32]) >> (t % 32)) & 1) for t in range(vocab)] for row in bitmask]
    )


def apply_batched(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    _apply_bitmask_batched(logits, bitmask, rows)  # the GPU's way, here on the CPU
    return logits


@pytest.mark.parametrize("apply", [apply_bitmask, apply_batched])
@pytest.mark.parametrize("vocab", [VOCAB, 64, 97])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 3], [2], [3, 0]])
def test_apply_bitmask_masks_exactly_the_clear_bits_and_leaves_the_rest_bit_for_bit(
    apply: Any, vocab: int, rows: list[int]
) -> None:
    gen = torch.Generator().manual_seed(vocab + len(rows))
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
    bitmask[0, 0] = -1  # all 32 set
    bitmask[-1, -1] = 0  # all clear
    logits = torch.randn(4, vocab, generator=gen) * 10
    logits[:, 0] = float("-inf")  # already masked, e.g. by a logit bias
    before = logits.clone()
    assert apply(logits, bitmask, rows) is logits
    allowed = reference_mask(bitmask, vocab)
    for r in range(4):
        if r in rows:
            assert torch.equal(torch.isneginf(logits[r]), ~allowed[r] | torch.isneginf(before[r]))
            assert torch.equal(logits[r][allowed[r]], before[r][allowed[r]])
        else:
            assert torch.equal(logits[r], before[r])  # a row not listed is not touched


def test_apply_bitmask_on_bfloat16_logits() -> None:
    bitmask = only(3, 17, 39, rows=2)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    before = logits.clone()
    apply_bitmask(logits, bitmask, [1])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [3, 17, 39]
    assert torch.equal(logits[1, [3, 17, 39]], before[1, [3, 17, 39]])
    assert torch.equal(logits[0], before[0])


@pytest.mark.parametrize("overwrite", [False, True])
def test_n_constrained_choices_greedy_and_sampled_in_one_batch(overwrite: bool) -> None:
    # Like a request with n=4 beside one with n=3, both constrained, and a free greedy row between.
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(7)) * 4
    logits[:, 5] = 50.0  # the model's favourite, allowed in no constrained row
    allowed = (2, 11, 33)
    mask = only(*allowed, rows=8)
    rows = [srow(True, temperature=0.0) for _ in range(4)]
    rows += [srow(False, temperature=0.0)]
    rows += [srow(True, seed=i, temperature=1.0) for i in range(3)]
    before = logits.clone()
    tokens, _ = sample(logits, rows, mask, overwrite=overwrite)
    best = max(allowed, key=lambda t: float(before[0, t]))
    assert tokens[:4] == [max(allowed, key=lambda t: float(before[i, t])) for i in range(4)]
    assert tokens[0] == best
    assert tokens[4] == 5
    assert all(t in allowed for t in tokens[5:])
    masked = torch.isneginf(logits).any(dim=-1).tolist()
    assert masked == ([True] * 4 + [False] + [True] * 3 if overwrite else [False] * 8)


def test_sampled_constrained_rows_follow_the_masked_distribution() -> None:
    # 600 draws from 3 allowed tokens with equal logits: each about a third (a disallowed one
    # would show up, or a mask that let only some through would skew the counts).
    num = 600
    logits = torch.zeros(num, VOCAB)
    logits[:, 0] = 20.0
    gen = torch.Generator().manual_seed(0)
    rows = [SamplingRow(SamplingParams(temperature=1.0), [], (), gen, constrained=True) for _ in range(num)]
    tokens, _ = sample(logits, rows, only(4, 20, 36, rows=num), overwrite=True)
    counts = {t: tokens.count(t) for t in set(tokens)}
    assert set(counts) == {4, 20, 36}
    assert all(150 < c < 250 for c in counts.values())


def test_constrained_rows_need_a_bitmask() -> None:
    with pytest.raises(RuntimeError):
        sample(torch.zeros(1, VOCAB), [srow(True)])


# ---- the engine ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return tiny_engine(tiny_model_dir)


def with_fake_backend(engine: LLMEngine) -> FakeBackend:
    backend = FakeBackend()
    engine.grammars = GrammarCache(backend)
    return backend


def test_constrained_choices_follow_their_grammar_and_stop_when_it_terminates(engine: LLMEngine) -> None:
    with_fake_backend(engine)
    target = [100, 200, 300, 400]
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, grammar=literal(*target)),
        SamplingParams(max_tokens=20, temperature=1.0, seed=3, n=3, logprobs=True, grammar=literal(*target)),
    ]
    free = GenerationRequest(
        "free", [1, 2, 3], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    )
    outs = run_all(engine, [GenerationRequest(f"c{i}", [5, 6, 7], p) for i, p in enumerate(params)] + [free])
    for key in [("c0", 0), ("c1", 0), ("c1", 1), ("c1", 2)]:
        assert tokens_of(outs[key]) == target
        assert outs[key][-1].finish_reason is FinishReason.STOP
    assert len(tokens_of(outs[("free", 0)])) == 6
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize(("max_tokens", "num_open"), [(10, 5), (16, 8), (100, 10)])
def test_a_grammar_closes_once_its_budget_is_within_the_reserve(
    engine: LLMEngine, max_tokens: int, num_open: int
) -> None:
    """Each fill is told to close once the tokens left (max_tokens - output so far) are at most
    closing_reserve: half of a small budget, CLOSE_RESERVE of a large one."""
    backend = with_fake_backend(engine)
    params = SamplingParams(max_tokens=max_tokens, grammar=literal(*range(100, 110)))
    run_all(engine, [GenerationRequest("c", [5, 6, 7], params)])
    assert closing_reserve(max_tokens) == min(CLOSE_RESERVE, max_tokens // 2) and CLOSE_RESERVE == 32
    assert backend.last.made[0].closing == [False] * num_open + [True] * (10 - num_open)


def test_a_request_waits_for_its_grammar_while_others_run(engine: LLMEngine) -> None:
    backend = with_fake_backend(engine)
    backend.gate.clear()
    engine.add_request(GenerationRequest("slow", [5, 6], SamplingParams(max_tokens=5, grammar=literal(9, 8))))
    engine.add_request(GenerationRequest("other", [5, 6], SamplingParams(max_tokens=3, temperature=0.0)))
    seen: list[str] = []
    for _ in range(10):
        seen += [o.request_id for o in engine.step()]
    assert "other" in seen and "slow" not in seen
    assert engine.has_unfinished()  # waiting for its compile, outside the batch
    backend.gate.set()
    outs = run_all(engine, [])
    assert tokens_of(outs[("slow", 0)]) == [9, 8]


def test_a_grammar_that_fails_to_compile_fails_only_its_request(engine: LLMEngine) -> None:
    backend = with_fake_backend(engine)
    backend.gate.clear()  # it fails after the request was accepted
    engine.add_request(GenerationRequest("bad", [5], SamplingParams(n=2, grammar=GrammarSpec.lark("bad"))))
    backend.gate.set()
    good = GenerationRequest("good", [5], SamplingParams(max_tokens=2, temperature=0.0))
    outs = run_all(engine, [good])
    for i in range(2):
        assert outs[("bad", i)][-1].finish_reason is FinishReason.ERROR
        assert isinstance(outs[("bad", i)][-1].error, GrammarError)
    assert outs[("good", 0)][-1].finish_reason is not FinishReason.ERROR
    # Known bad now: refused at once.
    with pytest.raises(GrammarError):
        engine.add_request(GenerationRequest("bad2", [5], SamplingParams(grammar=GrammarSpec.lark("bad"))))


def test_abort_while_compiling_ends_the_request(engine: LLMEngine) -> None:
    backend = with_fake_backend(engine)
    backend.gate.clear()
    engine.add_request(GenerationRequest("gone", [5], SamplingParams(n=2, grammar=literal(1))))
    outs = engine.abort_request("gone")
    assert [o.finish_reason for o in outs] == [FinishReason.ABORT] * 2
    backend.gate.set()
    assert run_all(engine, []) == {}
    assert not engine.has_unfinished()


# ---- llguidance, for real -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llguidance_engine(tiny_model_dir: Path) -> LLMEngine:
    return tiny_engine(tiny_model_dir, max_num_seqs=32, max_num_batched_tokens=256)


def test_random_weights_still_produce_valid_json_for_every_schema(llguidance_engine: LLMEngine) -> None:
    """Valid by construction: every output of a random-weight model (which ends nothing on its
    own) stops with its grammar, parses and validates, compact (no whitespace between tokens),
    even at a max_tokens its strings alone would overrun without the closing steer."""
    engine = llguidance_engine
    requests = [
        GenerationRequest(
            case.name,
            chat_ids(engine.tokenizer, case.prompt),
            SamplingParams(
                max_tokens=160, temperature=0.7, seed=i, grammar=GrammarSpec.json_schema(case.schema)
            ),
        )
        for i, case in enumerate(SCHEMAS)
    ]
    outs = run_all(engine, requests)
    for case in SCHEMAS:
        out = outs[(case.name, 0)]
        text = text_of(out)
        assert out[-1].finish_reason is FinishReason.STOP, (case.name, text)
        jsonschema.validate(json.loads(text), case.schema)
        outside = re.sub(r'"(?:[^"\\]|\\.)*"', "", text)
        assert not any(c.isspace() for c in outside), "whitespace outside strings"


def test_llguidance_names_what_it_cannot_compile(llguidance_engine: LLMEngine) -> None:
    backend = LLGuidanceBackend(llguidance_engine.tokenizer, 49152, (2,))
    with pytest.raises(GrammarError, match="not"):
        backend.compile(GrammarSpec.json_schema({"not": {"type": "string"}}))
    with pytest.raises(GrammarError, match="strin"):
        backend.compile(GrammarSpec.json_schema({"type": "strin"}))
    backend.compile(GrammarSpec.json_object())
    backend.compile(GrammarSpec.json_schema({"not": {"type": "string"}}, strict=False))  # ignored


def test_json_object_output_is_one_object(llguidance_engine: LLMEngine) -> None:
    engine = llguidance_engine
    params = SamplingParams(max_tokens=300, temperature=1.0, seed=1, n=4, grammar=GrammarSpec.json_object())
    outs = run_all(engine, [GenerationRequest("obj", chat_ids(engine.tokenizer, "Give JSON."), params)])
    for i in range(4):  # an unbounded object too is closed before max_tokens
        assert outs[("obj", i)][-1].finish_reason is FinishReason.STOP
        assert isinstance(json.loads(text_of(outs[("obj", i)])), dict)


# Grammars with free text, which the JSON steer cannot close: Codex's apply_patch (a line runs until
# a newline the random weights never pick), a regex, a nested Lark rule.
FREE_TEXT_GRAMMARS = {
    "patch": GrammarSpec.lark(APPLY_PATCH_GRAMMAR),
    "regex": GrammarSpec.regex(r"[A-Z]{3}-[0-9]{4} [a-z ]{1,200}!"),
    "nested": GrammarSpec.lark('start: "(" expr ")"\nexpr: /[a-z ]+/ | "(" expr ")" | expr "," expr'),
}


def test_grammars_with_free_text_close_before_max_tokens(llguidance_engine: LLMEngine) -> None:
    """Near max_tokens a Lark or regex grammar is steered along its shortest completion: every
    output of the random weights stops with its grammar, whole in the language (by the official
    Lark parser, not the matcher that made it)."""
    engine = llguidance_engine
    requests = [
        GenerationRequest(
            name,
            chat_ids(engine.tokenizer, "Write it."),
            SamplingParams(max_tokens=48, temperature=1.0, seed=3, n=2, grammar=spec),
        )
        for name, spec in FREE_TEXT_GRAMMARS.items()
    ]
    outs = run_all(engine, requests)
    patch, nested = lark_parser(APPLY_PATCH_GRAMMAR), lark_parser(FREE_TEXT_GRAMMARS["nested"].source)
    for i in range(2):
        for name in FREE_TEXT_GRAMMARS:
            assert outs[(name, i)][-1].finish_reason is FinishReason.STOP, (name, text_of(outs[(name, i)]))
        patch.parse(text_of(outs[("patch", i)]))
        nested.parse(text_of(outs[("nested", i)]))
        assert re.fullmatch(r"[A-Z]{3}-[0-9]{4} [a-z ]{1,200}!", text_of(outs[("regex", i)]))


def test_a_shortest_completion_takes_forced_text_whole_and_counts_repeats(
    llguidance_engine: LLMEngine,
) -> None:
    tokenizer = llguidance_engine.tokenizer
    backend = LLGuidanceBackend(tokenizer, 49152, (2,))
    for spec, prefix, plan in [
        (
            GrammarSpec.lark(APPLY_PATCH_GRAMMAR),
            "*** Begin Patch\n*** Add File: a.txt\n+hi th",
            b"\n*** End Patch",
        ),
        (GrammarSpec.regex(r"[A-Z]{3}-[0-9]{4}"), "Q", b"AA-0000"),  # a repeat looks alike at each count
        (GrammarSpec.regex(r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"), "bob", b"@a.com"),
    ]:
        grammar = backend.compile(spec).new_grammar()
        assert all(grammar.accept_token(t) for t in tokenizer.encode(prefix, add_special_tokens=False))
        assert shortest_completion(grammar._matcher, grammar._closing) == plan  # type: ignore[attr-defined]


def test_masks_filled_during_the_forward_pass_give_the_same_outputs(llguidance_engine: LLMEngine) -> None:
    engine = llguidance_engine
    case = SCHEMAS[0]
    params = SamplingParams(max_tokens=60, temperature=0.0, n=2, grammar=GrammarSpec.json_schema(case.schema))
    prompt = chat_ids(engine.tokenizer, case.prompt)
    default = engine.masks.overlap
    try:
        engine.masks.overlap = False
        serial = run_all(engine, [GenerationRequest("serial", prompt, params)])
        engine.masks.overlap = True
        overlapped = run_all(engine, [GenerationRequest("overlap", prompt, params)])
    finally:
        engine.masks.overlap = default
    for i in range(2):
        assert tokens_of(overlapped[("overlap", i)]) == tokens_of(serial[("serial", i)])
        jsonschema.validate(json.loads(text_of(overlapped[("overlap", i)])), case.schema)


def test_an_overlapped_mask_is_allocated_on_the_engine_thread(
    llguidance_engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A torch op on the filler thread gave it an OpenMP team of its own, which slowed every later
    # step of the process by ~30% on 2 cores (engine/grammar/mask.py): it gets its bitmask ready-made.
    engine = llguidance_engine
    allocated_on: list[threading.Thread] = []

    def recording(num_rows: int, vocab_size: int) -> torch.Tensor:
        allocated_on.append(threading.current_thread())
        return allocate_bitmask(num_rows, vocab_size)

    monkeypatch.setattr(mask_module, "allocate_bitmask", recording)
    monkeypatch.setattr(engine.masks, "overlap", True)
    case = SCHEMAS[1]
    params = SamplingParams(max_tokens=20, temperature=0.0, n=2, grammar=GrammarSpec.json_schema(case.schema))
    run_all(engine, [GenerationRequest("alloc", chat_ids(engine.tokenizer, case.prompt), params)])
    assert allocated_on and set(allocated_on) == {threading.current_thread()}


def test_unbounded_numbers_get_json_s_safe_range_and_bounded_decimals() -> None:
    safe = 2**53 - 1
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": ["integer", "null"], "maximum": 5},
            "c": {"type": "number"},
            "d": {"type": "number", "multipleOf": 0.5, "exclusiveMinimum": 0},
        },
    }
    bounded = bound_schema(schema)["properties"]
    assert bounded["a"] == {"type": "integer", "maximum": safe, "minimum": -safe}
    assert bounded["b"]["maximum"] == 5 and bounded["b"]["minimum"] == -safe
    assert bounded["c"] == {"type": "number", "maximum": safe, "minimum": -safe, "multipleOf": 1e-6}
    assert bounded["d"] == {"type": "number", "multipleOf": 0.5, "exclusiveMinimum": 0, "maximum": safe}
    assert schema["properties"]["a"] == {"type": "integer"}  # the caller's schema is not modified


def test_a_number_cannot_run_past_its_decimals(llguidance_engine: LLMEngine) -> None:
    """The grammar refuses a seventh decimal, so sampling cannot run a number to max_tokens."""
    tokenizer = llguidance_engine.tokenizer
    backend = LLGuidanceBackend(tokenizer, 49152, (2,))
    compiled = backend.compile(GrammarSpec.json_schema({"type": "number"}))

    def accepts(text: str) -> bool:
        grammar = compiled.new_grammar()
        return all(grammar.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))

    assert accepts("0.123456") and accepts("-12.5")
    assert not accepts("0.1234567")


def test_string_formats_that_end_after_a_separator_are_bounded_before_it(
    llguidance_engine: LLMEngine,
) -> None:
    """An email's local part and a URI's scheme get at most 64 characters: the grammar then
    requires the `@` or `:`, where sampling could otherwise run the string to max_tokens."""
    schema = {"type": "object", "properties": {"e": {"type": "string", "format": "email"}}}
    assert bound_schema(schema)["properties"]["e"]["pattern"] == "^[^@]{1,64}@"
    own = {"type": "string", "format": "email", "pattern": "@example[.]com$"}
    assert bound_schema(own) == own  # a schema's own pattern is kept as it is
    tokenizer = llguidance_engine.tokenizer
    backend = LLGuidanceBackend(tokenizer, 49152, (2,))

    def accepts(fmt: str, text: str) -> bool:
        grammar = backend.compile(GrammarSpec.json_schema({"type": "string", "format": fmt})).new_grammar()
        ids = tokenizer.encode(json.dumps(text), add_special_tokens=False)
        return all(grammar.accept_token(t) for t in ids) and grammar.is_terminated()

    assert accepts("email", "a" * 64 + "@b.co") and not accepts("email", "a" * 65 + "@b.co")
    assert accepts("uri", "https://example.com/" + "x" * 200) and accepts("uri", "urn:isbn:0451450523")
    assert not accepts("uri", "h" * 65 + "://x")


TOKENS = [b"a", b'"', b"}", b"]", b'"}', b'"]}', b"}]", b",", b'},{"', b"\\", b'a"b', b'""', b"</s>"]


def allowed_after_closing(allowed: list[bytes], state: JsonState) -> set[bytes]:
    closing = ClosingTokens(TOKENS, [TOKENS.index(b"</s>")])
    ids = [TOKENS.index(t) for t in allowed]
    bitmask = allocate_bitmask(2, len(TOKENS))
    bitmask[1] = token_row(ids, len(TOKENS))
    closing.narrow(bitmask, 1, state)
    assert torch.equal(bitmask[0], allocate_bitmask(1, len(TOKENS))[0])  # other rows untouched
    return {t for i, t in enumerate(TOKENS) if bitmask[1, i // 32] >> (i % 32) & 1}


def test_closing_keeps_the_allowed_tokens_that_end_the_output_soonest() -> None:
    outside, inside = JsonState(), JsonState(in_string=True)
    # The end, where the grammar allows it (it accepts, and could go on: another tool call).
    assert allowed_after_closing([b"a", b"}", b"</s>"], outside) == {b"</s>"}
    # Outside a string: brackets alone (not a new element after them, not a string starting "}).
    assert allowed_after_closing([b"a", b"}", b"}]", b'},{"', b",", b'"}'], outside) == {b"}", b"}]"}
    # Inside one, "}" is content: the quote that ends the string, with the brackets after it.
    assert allowed_after_closing([b"a", b"}", b'"}', b'"]}', b'"'], inside) == {b'"}', b'"]}'}
    # No bracket allowed: the lone quote (ends a string; outside, starts one the next step ends).
    assert allowed_after_closing([b"a", b'"', b",", b'a"b'], inside) == {b'"'}
    assert allowed_after_closing([b"a", b'"', b'""'], outside) == {b'"'}
    # Neither: everything the grammar allows (a required key, a comma, an email's `@`).
    assert allowed_after_closing([b"a", b","], inside) == {b"a", b","}


def test_json_state_follows_strings_and_escapes() -> None:
    state = JsonState()
    for text, in_string in [(b'{"k', True), (b'":"a\\', True), (b'"', True), (b"\\\\", True), (b'"', False)]:
        state = state.after(text)
        assert state.in_string is in_string, text
    assert JsonState().after(b'{"a":"b"}') == JsonState()


def test_a_rolled_back_grammar_closes_from_where_it_is_again(llguidance_engine: LLMEngine) -> None:
    """The string state rolls back with the parser: after undoing a string's closing quote, a
    closing fill offers the quote (plus brackets) again, not the bracket alone."""
    tokenizer = llguidance_engine.tokenizer
    backend = LLGuidanceBackend(tokenizer, 49152, (2,))
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "string"}}})
    grammar = backend.compile(spec).new_grammar()
    ids = tokenizer.encode('{"a":"xyz"', add_special_tokens=False)
    assert all(grammar.accept_token(t) for t in ids)

    def closing_texts() -> set[str]:
        bitmask = allocate_bitmask(1, 49152)
        grammar.fill_bitmask(bitmask, 0, closing=True)
        allowed = [i for i in range(49152) if bitmask[0, i // 32] >> (i % 32) & 1]
        return {tokenizer.decode([i]) for i in allowed}

    assert closing_texts() == {"}"}
    grammar.rollback(1)  # back inside the string: `"}` ends it and the object
    assert closing_texts() == {'"}'}


def test_a_cancelled_compile_is_compiled_again() -> None:
    backend = FakeBackend()
    backend.gate.clear()
    cache = GrammarCache(backend)
    cache.get(literal(0))  # occupies the one worker
    queued = cache.get(literal(1))
    assert queued.cancel()
    backend.gate.set()
    assert cache.get(literal(1)).result().tokens == [1]
    cache.shutdown()
