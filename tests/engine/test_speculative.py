"""Speculative decoding (engine/speculative/): the drafts' sources, the step's choice of drafts,
verification's exactness (greedy: the same output; sampled: the same distribution), on the
bundled model's int8 kernels (whose rows are computed alike in any batch) and the tiny model."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.sampler import SamplingRow
from engine.sequence import Sequence
from engine.speculative.proposers import PredictionLookup, PromptLookup
from engine.speculative.speculator import STALE_STEPS, Speculator, StepTimes
from engine.speculative.verify import verify
from engine.step import ScheduledChunk, SchedulerOutput
from engine.types import GenerationRequest, GrammarSpec, SamplingParams
from tests.engine.helpers import chat_ids, tiny_engine

CODE = "\n".join(f"def area_{i}(width, height):\n    return width * height + {i}\n" for i in range(8))
REPEAT = "Repeat this code exactly, with no other text:\n\n" + CODE


# ---- draft sources --------------------------------------------------------------------------


def test_prompt_lookup_continues_the_occurrence_that_matches_furthest_back() -> None:
    # "5 6 7" occurs twice before the end; the one preceded by "1 2" (as the end is) wins over
    # the latest, and the draft is what followed it there.
    tokens = [1, 2, 5, 6, 7, 10, 11, 9, 9, 5, 6, 7, 20, 21, 3, 1, 2, 5, 6, 7]
    assert PromptLookup().propose(tokens, 3, k=3) == [10, 11, 9]
    assert PromptLookup().propose([1, 2, 3, 4], 2, k=3) == []  # nothing repeats


def test_prediction_lookup_follows_the_prediction_and_finds_it_again_after_an_edit() -> None:
    prediction = (10, 11, 12, 13, 14, 15, 16, 17)
    lookup = PredictionLookup(prediction)
    prompt = [1, 2]
    assert lookup.propose(prompt, 2, k=3) == [10, 11, 12]
    assert lookup.propose(prompt + [10, 11], 2, k=3) == [12, 13, 14]
    # The output departs (99 instead of 12, 13), then writes 14 15: found again after them.
    assert lookup.propose(prompt + [10, 11, 99], 2, k=3) == []
    assert lookup.propose(prompt + [10, 11, 99, 14, 15], 2, k=3) == [16, 17]


# ---- the step's choice ----------------------------------------------------------------------


def _decoding(blocks: BlockManager, n: int, tokens: list[int]) -> list[Sequence]:
    seqs = []
    for i in range(n):
        seq = Sequence(f"r{i}", 0, tokens, SamplingParams(max_tokens=64, temperature=0))
        blocks.allocate(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens - 1
        seqs.append(seq)
    return seqs


@pytest.mark.parametrize(("per_row_s", "drafted"), [(0.0002, True), (0.01, False)])
def test_drafts_go_where_rows_are_cheap_and_not_to_a_compute_bound_batch(
    per_row_s: float, drafted: bool
) -> None:
    """Steps measured as memory-bound (a row adds 2% of the step) get drafts; compute-bound ones
    (a row costs as much as the step's share per sequence) none, at the same acceptance."""
    blocks = BlockManager(256, 16)
    speculator = Speculator(SpeculativeConfig(), blocks, max_model_len=4096)
    for rows in range(1, 41):
        speculator.times.observe(0.01 + per_row_s * rows, rows)
    repeating = [1, 2, 3, 4, 5, 6, 7, 8] * 4
    seqs = _decoding(blocks, 8, repeating)
    out = speculator.plan(SchedulerOutput(tuple(ScheduledChunk(s, 1) for s in seqs), (), (), ()))
    assert any(c.draft for c in out.decodes) is drafted
    for chunk in out.decodes:  # a draft has its KV slots, and continues the repeat
        assert len(chunk.seq.block_table) * 16 >= chunk.seq.num_tokens + len(chunk.draft)
        assert list(chunk.draft) == repeating[: len(chunk.draft)]


def test_a_row_count_timed_during_a_busy_spell_is_measured_again_later() -> None:
    times = StepTimes()
    times.observe(0.010, 1)
    times.observe(1.2, 2)  # another process had the cores
    assert times.estimate(2) == 1.2
    for _ in range(STALE_STEPS):
        times.observe(0.010, 1)
    estimate = times.estimate(2)
    assert estimate is not None and estimate < 0.012  # optimistic again: tried, then known


# ---- verification ---------------------------------------------------------------------------


def _row(params: SamplingParams, generator: torch.Generator | None = None) -> SamplingRow:
    return SamplingRow(params, [], (), generator)


def test_rejection_sampling_keeps_the_distribution_of_each_token() -> None:
    """A point-mass draft verified many times: the first token is distributed as the processed
    distribution (top-k applied), whether the draft is its likeliest token or one it cuts."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]))
    params = SamplingParams(temperature=1.0, top_k=3)
    expected = [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]
    for draft in (1, 3):
        generator = torch.Generator().manual_seed(draft)
        counts: Counter[int] = Counter()
        trials = 8000
        for _ in range(trials):
            (result,) = verify(logits.clone(), [_row(params, generator)] * 2, [(draft,)], None)
            counts[result.tokens[0]] += 1
            assert result.num_accepted == (1 if result.tokens[0] == draft else 0)
        for token, p in enumerate(expected):
            assert abs(counts[token] / trials - p) < 0.025, (draft, token, counts)


def test_greedy_verification_accepts_the_agreeing_prefix_and_adds_the_model_s_token() -> None:
    logits = torch.full((4, 8), -5.0)
    for row, best in enumerate([3, 4, 6, 2]):
        logits[row, best] = 5.0
    greedy = SamplingParams(temperature=0)
    (result,) = verify(logits, [_row(greedy)] * 4, [(3, 4, 5)], None)
    assert result.tokens == [3, 4, 6] and result.num_accepted == 2


# ---- the engine ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[bool, LLMEngine]]:
    """The bundled model on its int8 kernels, with speculative decoding on and off."""
    made = {
        on: LLMEngine(EngineConfig.of(enable_speculative_decoding=on, max_num_seqs=8, max_model_len=2048))
        for on in (True, False)
    }
    yield made
    for engine in made.values():
        engine.close()


def _greedy(engine: LLMEngine, prompt: str, max_tokens: int, **params: object) -> tuple[list[int], int]:
    """The output ids and the accepted prediction tokens of one greedy request, alone."""
    ids = chat_ids(engine.tokenizer, prompt)
    request = GenerationRequest(
        f"g{engine.num_steps}", ids, SamplingParams(max_tokens=max_tokens, temperature=0, **params)
    )  # type: ignore[arg-type]
    engine.add_request(request)
    out: list[int] = []
    accepted = 0
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
            accepted = o.num_accepted_prediction_tokens
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # every block back
    return out, accepted


def test_a_repeated_listing_is_the_same_output_in_fewer_steps(engines: dict[bool, LLMEngine]) -> None:
    on, off = engines[True], engines[False]
    plain, _ = _greedy(off, REPEAT, 120)
    steps, accepted = on.num_steps, on.speculator.stats.num_accepted_tokens
    drafted, _ = _greedy(on, REPEAT, 120)
    assert drafted == plain
    assert on.speculator.stats.num_accepted_tokens - accepted >= 40
    assert on.num_steps - steps < 0.7 * len(plain)


def test_a_prediction_right_or_partly_wrong_gives_the_same_output(engines: dict[bool, LLMEngine]) -> None:
    on, off = engines[True], engines[False]
    plain, _ = _greedy(off, REPEAT, 100)
    right = tuple(plain)
    same, accepted = _greedy(on, REPEAT, 100, prediction=right)
    assert same == plain and accepted >= 0.8 * len(plain)
    text = on.tokenizer.decode(plain)
    wrong = tuple(on.tokenizer.encode(text.replace("height", "depth"), add_special_tokens=False))
    same, accepted = _greedy(on, REPEAT, 100, prediction=wrong)
    assert same == plain and 0 < accepted < len(wrong)
    same, accepted = _greedy(on, REPEAT, 100, prediction=right, speculative=False)
    assert same == plain and accepted == 0  # turned off for this request: no draft at all


def test_a_grammar_never_accepts_a_draft_it_forbids(engines: dict[bool, LLMEngine]) -> None:
    """The prediction is JSON the schema forbids after its first field (a string where an integer
    must be): drafts stop there, and the output is what decoding without them writes."""
    on, off = engines[True], engines[False]
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "year": {"type": "integer"}},
        "required": ["name", "year"],
        "additionalProperties": False,
    }
    grammar = GrammarSpec.json_schema(schema)
    prompt = "Give the name and year of the first moon landing as JSON."
    for engine in (on, off):  # compiled before the run, so both run the same steps
        engine.grammar(grammar).result(timeout=60)
    plain, _ = _greedy(off, prompt, 40, grammar=grammar)
    name = json.loads(off.tokenizer.decode(plain))["name"]
    forbidden = json.dumps({"name": name, "year": "soon"}, separators=(",", ":"))
    prediction = tuple(on.tokenizer.encode(forbidden, add_special_tokens=False))
    drafted, accepted = _greedy(on, prompt, 40, grammar=grammar, prediction=prediction)
    assert drafted == plain and accepted > 0
    json.loads(on.tokenizer.decode(drafted))
    # A valid JSON with another year, and the end of turn after it (as a previous turn in a prompt
    # reads): the draft runs past the grammar's end, is rejected at the year, and the grammar is
    # rolled back to the accepted tokens exactly (the matcher records no token after it stopped).
    year = json.loads(off.tokenizer.decode(plain))["year"]
    other = json.dumps({"name": name, "year": year + 1}, separators=(",", ":"))
    eos = on.tokenizer.convert_tokens_to_ids("<|im_end|>")
    prediction = (*on.tokenizer.encode(other, add_special_tokens=False), eos)
    always = LLMEngine(EngineConfig.of(speculate_always=True, num_speculative_tokens=16, max_model_len=2048))
    try:
        always.grammar(grammar).result(timeout=60)
        drafted, accepted = _greedy(always, prompt, 40, grammar=grammar, prediction=prediction)
        assert drafted == plain and accepted > 0
    finally:
        always.close()


def test_sampled_outputs_keep_their_distribution(tiny_model_dir: Path) -> None:
    """Three tokens sampled (top-k 3) from a short prompt, hundreds of times with a prediction as
    the draft and without speculation: the second and third tokens (verified, when the draft
    applies) are distributed alike (a chi-squared test of the pairs, at the 0.1% level)."""
    prompt = [1, 2, 3, 4, 5]
    counts = {}
    for on in (True, False):
        engine = tiny_engine(
            tiny_model_dir, enable_speculative_decoding=on, speculate_always=True, max_num_seqs=4
        )
        (greedy,) = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0))
        pairs: Counter[tuple[int, int]] = Counter()
        for i in range(400):
            params = SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=i, prediction=tuple(greedy))
            (out,) = engine.generate([prompt], params)
            pairs[(out[0], out[1])] += 1
        counts[on] = pairs
        if on:
            assert engine.speculator.stats.num_verified_drafts >= 100
    keys = set(counts[True]) | set(counts[False])
    chi2 = sum((counts[True][k] - counts[False][k]) ** 2 / (counts[True][k] + counts[False][k]) for k in keys)
    # At most 9 pairs: the 0.1% critical value of chi-squared with 8 degrees of freedom.
    assert len(keys) <= 9 and chi2 < 26.12, (counts, chi2)


def test_drafts_in_a_batch_with_preemption_and_prefix_hits_change_no_output(
    engines: dict[bool, LLMEngine],
) -> None:
    """Four listings at once, every draft verified in full, in a KV cache too small for all of
    them (sequences are preempted and recomputed, their prefixes found cached): each output is the
    one decoding it alone without speculation gives, and every block comes back."""
    off = engines[False]
    prompts = [
        chat_ids(off.tokenizer, REPEAT.replace("area", name)) for name in ("cost", "size", "mass", "time")
    ]
    expected = [_greedy_ids(off, p, 80) for p in prompts]
    crowded = LLMEngine(
        EngineConfig.of(
            speculate_always=True,
            num_speculative_tokens=4,
            max_num_seqs=4,
            max_model_len=2048,
            kv_cache_memory_bytes=14 << 20,
        )
    )
    try:
        outputs = crowded.generate(prompts, SamplingParams(max_tokens=80, temperature=0))
        assert outputs == expected
        assert crowded.scheduler.num_preemptions > 0 and crowded.speculator.stats.num_accepted_tokens > 0
        assert crowded.block_manager.num_hit_tokens > 0
        assert crowded.block_manager.num_free_blocks == crowded.block_manager.num_blocks
    finally:
        crowded.close()


def _greedy_ids(engine: LLMEngine, prompt: list[int], max_tokens: int) -> list[int]:
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0))
    return out
