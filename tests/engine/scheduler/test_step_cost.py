"""The step-cost model: an online least-squares fit of step seconds on prefill tokens and decode rows."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.config import EngineConfig, SchedulerConfig
from engine.scheduler.step_cost import StepCost, StepCostModel
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
    assert cost.max_prefill_tokens(0.1, 100) == 0  # decodes alone are over budget
    assert StepCost(0.02, 0.0, 0.002).max_prefill_tokens(0.1, 10) is None  # prefill is free: no limit


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
