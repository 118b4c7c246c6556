"""The sampler as a pure function of logits and per-row parameters."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch

from engine.sampler import SamplingRow, draw, sample
from engine.types import SamplingParams

VOCAB = 50


def row(
    output: list[int] | None = None, stop_ids: tuple[int, ...] = (), seed: int | None = None, **params: Any
) -> SamplingRow:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(SamplingParams(**params), list(output or []), stop_ids, generator)


def random_logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def probs_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]])


def draws(logits: torch.Tensor, num: int, seed: int = 0, **params: Any) -> Counter[int]:
    """`num` draws from one row, as a batch of `num` identical rows sharing one seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    rows = [SamplingRow(SamplingParams(**params), [], (), generator) for _ in range(num)]
    tokens, _ = sample(logits.expand(num, -1).clone(), rows)
    return Counter(tokens)


# ---- greedy ----------------------------------------------------------------------------------------


def test_greedy_fast_path_is_argmax() -> None:
    logits = random_logits(8)
    before = logits.clone()
    tokens, logprobs = sample(logits, [row(temperature=0.0) for _ in range(8)])
    assert tokens == logits.argmax(dim=-1).tolist()
    assert logprobs == [None] * 8
    assert torch.equal(logits, before)  # the caller's logits are not modified


def test_greedy_rows_in_a_mixed_batch_are_still_argmax() -> None:
    logits = random_logits(6, seed=1)
    rows = [
        row(temperature=0.0),
        row(temperature=1.0, seed=3),
        row(top_k=1, temperature=1.5),
        row(temperature=0.0),
        row(temperature=0.7, top_p=0.9, seed=4),
        row(temperature=0.0),
    ]
    tokens, _ = sample(logits.clone(), rows)
    argmax = logits.argmax(dim=-1).tolist()
    for i in (0, 2, 3, 5):
        assert tokens[i] == argmax[i]


def test_top_k_one_is_always_argmax() -> None:
    logits = random_logits(4, seed=2)
    for seed in range(20):
        tokens, _ = sample(logits.clone(), [row(temperature=2.0, top_k=1, seed=seed) for _ in range(4)])
        assert tokens == logits.argmax(dim=-1).tolist()


# ---- temperature, top-k, top-p ----------------------------------------------------------------------


def test_tiny_top_p_is_argmax() -> None:
    logits = random_logits(1, seed=3)
    counts = draws(logits, 300, temperature=1.0, top_p=1e-6)
    assert set(counts) == {int(logits.argmax())}


def test_sampled_tokens_never_leave_the_top_k() -> None:
    logits = random_logits(1, seed=4)
    top3 = set(logits[0].topk(3).indices.tolist())
    counts = draws(logits, 1000, temperature=2.0, top_k=3)
    assert set(counts) == top3  # all three drawn, nothing else


@pytest.mark.parametrize(
    ("top_p", "support"), [(0.35, {0}), (0.5, {0, 1}), (0.75, {0, 1, 2}), (1.0, {0, 1, 2, 3})]
)
def test_top_p_keeps_the_smallest_prefix_reaching_the_mass(top_p: float, support: set[int]) -> None:
    logits = probs_logits([0.4, 0.3, 0.2, 0.1])
    counts = draws(logits, 1000, temperature=1.0, top_p=top_p)
    assert set(counts) == support


def test_top_k_and_top_p_together() -> None:
    logits = probs_logits([0.3, 0.25, 0.2, 0.15, 0.1])
    # top_k=4 drops token 4; of the renormalised rest (0.33, 0.28, 0.22, 0.17) top_p=0.5 keeps two.
    counts = draws(logits, 1000, temperature=1.0, top_k=4, top_p=0.5)
    assert set(counts) == {0, 1}


def test_plain_sampling_follows_the_distribution() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    counts = draws(probs_logits(probs), 4000, temperature=1.0)
    for token, p in enumerate(probs):
        assert abs(counts[token] / 4000 - p) < 0.03, counts


def test_temperature_sharpens_and_flattens() -> None:
    logits = probs_logits([0.5, 0.3, 0.15, 0.05])
    cold = draws(logits, 2000, temperature=0.1)
    warm = draws(logits, 2000, temperature=1.0)
    hot = draws(logits, 2000, temperature=2.0)
    assert cold[0] / 2000 > 0.99
    assert cold[0] > warm[0] > hot[0]
    assert hot[3] > warm[3]


# ---- seeds ------------------------------------------------------------------------------------------


def test_same_seed_same_draws_whatever_the_batch() -> None:
    logits = random_logits(5, seed=5)
    target = logits[2:3] / 3  # flat enough that the draws vary

    def run(position: int, batch: int, seed: int = 1234) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        out = []
        for step in range(30):
            torch.manual_seed(step)  # unseeded neighbours draw from the global RNG
            rows = [
                row(temperature=1.0),
                row(temperature=0.8, seed=99 + step),
                row(temperature=0.0),
                row(temperature=1.3, top_k=5),
            ][: batch - 1]
            rows.insert(position, SamplingRow(SamplingParams(temperature=1.0, top_p=0.95), [], (), generator))
            batch_logits = torch.cat([logits[: batch - 1][:position], target, logits[: batch - 1][position:]])
            tokens, _ = sample(batch_logits, rows)
            out.append(tokens[position])
        return out

    alone = run(0, 1)
    assert len(set(alone)) > 3  # really sampling
    assert run(0, 3) == alone
    assert run(2, 5) == alone
    assert run(4, 5) == alone
    assert run(0, 1, seed=4321) != alone


# ---- penalties, bias, min_tokens --------------------------------------------------------------------


def two_way_logits() -> torch.Tensor:
    logits = torch.zeros(1, VOCAB)
    logits[0, 10] = 2.0
    logits[0, 11] = 1.5  # runner-up, 0.5 behind
    return logits


@pytest.mark.parametrize(
    ("params", "output", "expected"),
    [
        ({}, [10, 10, 10], 10),
        ({"presence_penalty": 0.6}, [10], 11),
        ({"presence_penalty": 0.4}, [10, 10, 10], 10),  # presence counts once
        ({"frequency_penalty": 0.3}, [10], 10),
        ({"frequency_penalty": 0.3}, [10, 10], 11),  # 2 x 0.3 > 0.5
        ({"presence_penalty": 0.3, "frequency_penalty": 0.15}, [10, 10], 11),  # 0.3 + 2 x 0.15 > 0.5
        ({"presence_penalty": 2.0}, [11], 10),
        ({"presence_penalty": -1.0}, [11], 11),  # a negative penalty favours repeats
        ({"frequency_penalty": 2.0}, [], 10),  # nothing generated yet: no effect
    ],
)
def test_penalties_move_the_argmax(params: dict[str, Any], output: list[int], expected: int) -> None:
    tokens, _ = sample(two_way_logits(), [row(output, temperature=0.0, **params)])
    assert tokens == [expected]


def test_logit_bias_moves_the_argmax() -> None:
    logits = two_way_logits()
    assert sample(logits.clone(), [row(temperature=0.0, logit_bias={10: -0.6})])[0] == [11]
    assert sample(logits.clone(), [row(temperature=0.0, logit_bias={10: -0.4})])[0] == [10]
    assert sample(logits.clone(), [row(temperature=0.0, logit_bias={42: 100.0})])[0] == [42]
    assert sample(logits.clone(), [row(temperature=0.0, logit_bias={11: 0.6, 10: 0.0})])[0] == [11]
    # A strongly banned token is never drawn when sampling either.
    counts = draws(logits, 500, temperature=1.0, logit_bias={10: -100.0, 11: -100.0})
    assert 10 not in counts and 11 not in counts


def test_processors_apply_per_row() -> None:
    logits = two_way_logits().expand(3, -1).clone()
    rows = [
        row([10], temperature=0.0, presence_penalty=1.0),
        row(temperature=0.0),
        row(temperature=0.0, logit_bias={12: 5.0}),
    ]
    assert sample(logits, rows)[0] == [11, 10, 12]


def test_min_tokens_masks_stop_ids_until_reached() -> None:
    logits = two_way_logits()  # token 10 (the argmax) plays EOS
    assert sample(logits.clone(), [row([], stop_ids=(10,), temperature=0.0, min_tokens=2)])[0] == [11]
    assert sample(logits.clone(), [row([5], stop_ids=(10,), temperature=0.0, min_tokens=2)])[0] == [11]
    assert sample(logits.clone(), [row([5, 5], stop_ids=(10,), temperature=0.0, min_tokens=2)])[0] == [10]
    # All stop ids are masked, not only the first.
    both = sample(logits.clone(), [row([], stop_ids=(10, 11), temperature=0.0, min_tokens=1)])[0]
    assert both not in ([10], [11])
    # Sampling never draws a masked id.
    generator = torch.Generator().manual_seed(0)
    rows = [
        SamplingRow(SamplingParams(temperature=1.0, min_tokens=1), [], (10, 11), generator)
        for _ in range(500)
    ]
    tokens, _ = sample(logits.expand(500, -1).clone(), rows)
    assert 10 not in tokens and 11 not in tokens


# ---- logprobs ---------------------------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_the_raw_logits() -> None:
    logits = random_logits(3, seed=6)
    raw = torch.log_softmax(logits, dim=-1)
    rows = [
        row(temperature=0.0, logprobs=True, top_logprobs=5),
        row([1, 2], temperature=1.0, seed=0, logprobs=True, presence_penalty=1.5, logit_bias={7: 4.0}),
        row(temperature=0.0),
    ]
    tokens, logprobs = sample(logits.clone(), rows)
    for i in (0, 1):
        lp = logprobs[i]
        assert lp is not None and lp.token_id == tokens[i]
        # The model's probability, before bias and penalties changed the choice.
        assert lp.logprob == pytest.approx(float(raw[i, tokens[i]]), abs=1e-6)
    assert logprobs[2] is None
    assert logprobs[1] is not None and logprobs[1].top == ()

    top = logprobs[0].top  # type: ignore[union-attr]
    assert len(top) == 5
    values = [v for _, v in top]
    assert values == sorted(values, reverse=True)
    assert [t for t, _ in top] == raw[0].topk(5).indices.tolist()
    for token, value in top:
        assert value == pytest.approx(float(raw[0, token]), abs=1e-6)
    assert top[0][0] == tokens[0]  # greedy: the chosen token is the best alternative


def test_logprobs_ignore_the_processing_that_chose_the_token() -> None:
    logits = two_way_logits()
    raw = torch.log_softmax(logits[0], dim=-1)
    tokens, logprobs = sample(
        logits.clone(), [row(temperature=0.0, logprobs=True, top_logprobs=2, logit_bias={11: 1.0})]
    )
    assert tokens == [11]
    lp = logprobs[0]
    assert lp is not None
    assert lp.logprob == pytest.approx(float(raw[11]))
    assert [t for t, _ in lp.top] == [10, 11]  # the raw ranking, not the biased one


def test_a_top_p_that_underflows_float32_keeps_the_most_likely_token() -> None:
    # 5e-324 is a valid top_p (> 0) that rounds to 0 in float32; found by the gateway's fuzz run.
    row = SamplingRow(SamplingParams(temperature=1.0, top_p=5e-324), [], (), None)
    tokens, _ = sample(torch.tensor([[2.0, 1.0, 0.0]]), [row])
    assert tokens == [0]


# ---- the draw ---------------------------------------------------------------------------------------


def test_a_token_without_mass_is_never_drawn_even_at_the_ends_of_the_uniform(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0, 0.0])
    for u in (0.0, 0.25, 0.5, 1.0 - 2**-53, 1.0):  # 1.0: u * total rounded up to the total
        monkeypatch.setattr(torch, "rand", lambda *a, u=u, **k: torch.tensor(u, dtype=torch.float64))
        assert int(draw(probs, None)) == (1 if u < 0.5 else 3)


def test_the_draw_follows_a_long_tail() -> None:
    # 49,152 tokens like the model's vocabulary, the last 49,000 sharing 10% of the mass: float32
    # cumulative sums would lose part of it.
    probs = torch.full((49152,), 0.1 / 49000)
    probs[:152] = 0.9 / 152
    gen = torch.Generator().manual_seed(0)
    tail = sum(int(draw(probs, gen)) >= 152 for _ in range(4000))
    assert abs(tail / 4000 - 0.1) < 0.02


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_a_row_without_any_probability_is_an_error_not_a_token(bad: float) -> None:
    logits = random_logits(3, seed=9)
    logits[1] = bad
    with pytest.raises(RuntimeError, match="row 1"):
        sample(logits, [row(temperature=1.0, seed=i) for i in range(3)])
