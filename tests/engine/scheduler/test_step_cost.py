"""The step-cost model: an online least-squares fit of step seconds on prefill tokens, decode rows and
the prefill chunks' query-key pairs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.config import EngineConfig, SchedulerConfig
from engine.scheduler.step_cost import StepCost, StepCostModel, context_pairs
from engine.types import SamplingParams
from tests.engine.helpers import tiny_engine

TRUE = StepCost(fixed_s=0.020, per_prefill_token_s=0.0008, per_decode_row_s=0.0015)


def test_converges_on_synthetic_step_times_with_noise() -> None:
    rng = random.Random(0)
    model = StepCostModel()
    for _ in range(400):
        p, d = rng.randint(1, 512), rng.randint(0, 48)
        model.observe(TRUE.predict(p, d) * rng.uniform(0.95, 1.05), p, d)
    cost = model.cost
    assert cost is not None
    assert cost.fixed_s == pytest.approx(TRUE.fixed_s, rel=0.15)
    assert cost.per_prefill_token_s == pytest.approx(TRUE.per_prefill_token_s, rel=0.05)
    assert cost.per_decode_row_s == pytest.approx(TRUE.per_decode_row_s, rel=0.15)
    # What the scheduler asks: prefill tokens that fit 100 ms beside 16 decodes (true answer 70).
    assert abs(cost.max_prefill_tokens(0.1, 16) - 70) <= 5  # type: ignore[operator]


def test_follows_a_change_of_costs() -> None:
    """Recent steps count most: the machine got twice as slow, and the fit follows within ~200 steps."""
    rng = random.Random(1)
    model = StepCostModel()
    slower = StepCost(2 * TRUE.fixed_s, 2 * TRUE.per_prefill_token_s, 2 * TRUE.per_decode_row_s)
    for truth in (TRUE, slower):
        for _ in range(300):
            p, d = rng.randint(1, 512), rng.randint(0, 48)
            model.observe(truth.predict(p, d), p, d)
    assert model.cost is not None
    assert model.cost.per_prefill_token_s == pytest.approx(slower.per_prefill_token_s, rel=0.05)


def test_nothing_is_predicted_before_enough_prefill_steps() -> None:
    model = StepCostModel(min_steps=8)
    for _ in range(50):
        model.observe(0.01, 0, 16)  # decode-only steps are not what the scheduler predicts
    model.observe(float("nan"), 100, 0)
    model.observe(-1.0, 100, 0)
    assert model.cost is None and model.num_steps == 0
    for i in range(8):
        model.observe(0.05 + 0.001 * i, 100 + i, 0)
    assert model.cost is not None and model.num_steps == 8


def test_identical_steps_give_a_proportional_non_negative_model() -> None:
    """Every step alike: fixed cost and per-token cost cannot be told apart; the tie goes to cost
    growing with the chunk (safe for a budget), and no coefficient is negative."""
    model = StepCostModel()
    for _ in range(50):
        model.observe(0.4, 512, 16)
    cost = model.cost
    assert cost is not None
    assert min(cost.fixed_s, cost.per_prefill_token_s, cost.per_decode_row_s) >= 0
    assert cost.predict(512, 16) == pytest.approx(0.4, rel=0.01)
    assert cost.per_prefill_token_s > 0.5 * 0.4 / 528
    assert cost.max_prefill_tokens(0.1, 16) < 200  # a quarter of the step time: a small chunk


def test_a_feature_that_would_cost_negative_is_dropped() -> None:
    rng = random.Random(2)
    model = StepCostModel()
    for _ in range(200):  # more decode rows make the step faster in this (odd) data
        p, d = rng.randint(1, 512), rng.randint(0, 48)
        model.observe(0.01 + 0.001 * p - 0.0001 * d + 0.0001 * 48, p, d)
    cost = model.cost
    assert cost is not None and cost.per_decode_row_s == 0.0 and cost.per_prefill_token_s > 0


def test_max_prefill_tokens() -> None:
    cost = StepCost(0.02, 0.001, 0.002)
    assert cost.max_prefill_tokens(0.1, 10) == 60
    assert cost.max_prefill_tokens(0.1, 10, num_prefill_tokens=20) == 40  # beside 20 already in it
    assert cost.max_prefill_tokens(0.1, 100) == 0  # decodes alone are over budget
    assert StepCost(0.02, 0.0, 0.002).max_prefill_tokens(0.1, 10) is None  # prefill is free: no limit


def test_context_pairs_count_each_tokens_keys_causally() -> None:
    assert context_pairs(0, 1) == 1 and context_pairs(0, 3) == 1 + 2 + 3
    assert context_pairs(100, 2) == 101 + 102
    assert sum(context_pairs(c, 16) for c in range(0, 64, 16)) == context_pairs(0, 64)  # chunking keeps it


def test_a_chunk_deep_in_its_prompt_fits_fewer_tokens() -> None:
    """1 us per query-key pair (a CPU's attention): at 2,000 tokens of context each new token costs
    2 ms more than a first one, and the largest chunk that fits is the root of the quadratic."""
    cost = StepCost(0.01, 0.0005, 0.002, per_context_pair_s=1e-6)
    fresh = cost.max_prefill_tokens(0.1, 10)
    deep = cost.max_prefill_tokens(0.1, 10, context=2000)
    assert fresh is not None and deep is not None and deep < fresh / 3
    for context, n in ((0, fresh), (2000, deep)):
        fits, over = (cost.predict(k, 10, context_pairs(context, k)) for k in (n, n + 1))
        assert fits <= 0.1 < over
    # What the step already holds counts, its pairs too.
    held = context_pairs(1000, 20)
    n = cost.max_prefill_tokens(0.1, 10, 20, held, context=2000)
    assert n is not None and cost.predict(20 + n, 10, held + context_pairs(2000, n)) <= 0.1


def test_learns_what_attention_over_the_context_costs() -> None:
    """Steps of chunks at random depths: the fit finds the per-pair cost, and a chunk's prediction at
    2,000 tokens of context is within 5% (a fit without the pairs was 2x low there)."""
    truth = StepCost(0.008, 0.0007, 0.0019, per_context_pair_s=5.5e-7)
    rng = random.Random(3)
    model = StepCostModel()
    for _ in range(400):
        p, d, c = rng.randint(1, 256), rng.randint(0, 16), rng.randint(0, 2000)
        pairs = context_pairs(c, p)
        model.observe(truth.predict(p, d, pairs) * rng.uniform(0.97, 1.03), p, d, pairs)
    cost = model.cost
    assert cost is not None
    assert cost.per_context_pair_s == pytest.approx(truth.per_context_pair_s, rel=0.1)
    deep = context_pairs(2000, 32)
    assert cost.predict(32, 4, deep) == pytest.approx(truth.predict(32, 4, deep), rel=0.05)


def test_the_engine_trains_its_schedulers_cost_model_from_its_own_steps(tiny_model_dir: Path) -> None:
    engine = tiny_engine(tiny_model_dir, target_itl_ms=50.0)
    assert engine.scheduler.config.target_itl_ms == 50.0
    assert engine.scheduler.step_cost.cost is None
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for i in range(10):  # ten steps with a prompt chunk in them, measured on the engine's clock
        engine.generate([list(range(100 + i, 140 + i))], params)
    assert engine.scheduler.step_cost.num_steps >= 10
    cost = engine.scheduler.step_cost.cost
    assert cost is not None and cost.predict(40, 0) > 0


def test_the_target_is_validated() -> None:
    with pytest.raises(ValueError, match="target_itl_ms"):
        EngineConfig.of(target_itl_ms=-1.0)
    with pytest.raises(ValueError, match="target_itl_ms"):
        SchedulerConfig(target_itl_ms=float("nan"))
