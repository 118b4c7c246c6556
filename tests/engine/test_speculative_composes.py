"""Speculative decoding composes with LoRA, tensor parallelism and sliding windows: each greedy
run with every draft verified in full (`speculate_always`) gives the token ids the same requests
get without speculation, verified drafts were accepted (and some rejected), and every KV block
comes back.

A tiny random model does not repeat itself, so prompt lookup finds no draft; each request
carries a prediction (Predicted Outputs) instead: the output decoding without speculation gives,
with two tokens changed, so drafts are accepted, cut where the output departs and taken up again
after it (engine/speculative/proposers.py's PredictionLookup)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.llm_engine import LLMEngine
from engine.step import SchedulerOutput
from engine.types import GenerationRequest
from tests.engine.helpers import greedy, run_all, tiny_engine, tokens_of
from tests.lora_adapters import make_adapter
from tests.tiny_model import make_tiny_model

SPECULATE = dict(speculate_always=True, num_speculative_tokens=4)
PLAIN = dict(enable_speculative_decoding=False)
WINDOW = 16
BANDED = ["sliding_attention", "full_attention"]
# A prompt longer than the window and one whose output crosses position WINDOW (where the window
# starts to slide), so drafts are verified with the earliest tokens out of the window.
WINDOW_PROMPTS = [list(range(100, 140)), list(range(300, 310))]


@dataclass(frozen=True)
class Req:
    prompt: list[int]
    lora: str | None = None


def _wrong_twice(plain: list[int]) -> tuple[int, ...]:
    """`plain` with two tokens changed: a prediction the output follows, leaves, and rejoins."""
    prediction = list(plain)
    for i in (len(plain) // 4, len(plain) // 2 + 1):
        prediction[i] = 5 if plain[i] != 5 else 6
    return tuple(prediction)


def _run(
    engine: LLMEngine, reqs: list[Req], max_tokens: int, predictions: list[tuple[int, ...]] | None = None
) -> list[list[int]]:
    """Every request at once (one batch), greedy; each one's output ids. Every block comes back."""
    requests = [
        GenerationRequest(
            f"r{i}",
            r.prompt,
            greedy(max_tokens, prediction=predictions[i] if predictions else ()),
            lora=engine.loras.get(r.lora) if r.lora else None,
        )
        for i, r in enumerate(reqs)
    ]
    outputs = run_all(engine, requests)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # every block back
    return [tokens_of(outputs[(f"r{i}", 0)]) for i in range(len(reqs))]


def _same_with_drafts(on: LLMEngine, off: LLMEngine, reqs: list[Req], max_tokens: int) -> None:
    """Decoded without speculation, then with every draft verified: the same ids, drafts accepted
    and rejected."""
    plain = _run(off, reqs, max_tokens)
    assert all(len(p) == max_tokens for p in plain)
    stats = on.speculator.stats
    verified, drafted, accepted = stats.num_verified_drafts, stats.num_draft_tokens, stats.num_accepted_tokens
    drafts = _run(on, reqs, max_tokens, [_wrong_twice(p) for p in plain])
    assert drafts == plain
    verified, drafted, accepted = (
        stats.num_verified_drafts - verified,
        stats.num_draft_tokens - drafted,
        stats.num_accepted_tokens - accepted,
    )
    assert verified > 0 and accepted > 0, (verified, accepted)
    assert accepted < drafted  # the changed tokens were drafted and rejected
    # Drafts bought tokens: at least a third of the outputs came as accepted draft tokens.
    assert accepted >= len(reqs) * max_tokens // 3, (accepted, drafted)


def _recording_drafts(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """From now on, each step's drafted sequences' LoRA slots (-1: the base model), a list a step."""
    plan: Callable[[SchedulerOutput], SchedulerOutput] = engine.speculator.plan
    steps: list[list[int]] = []

    def recording(out: SchedulerOutput) -> SchedulerOutput:
        planned = plan(out)
        steps.append([c.seq.lora_slot for c in planned.decodes if c.draft])
        return planned

    monkeypatch.setattr(engine.speculator, "plan", recording)
    return steps


# ---- LoRA ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_engines(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[bool, LLMEngine]:
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    root = tmp_path_factory.mktemp("spec-loras")
    adapters = {
        "a": make_adapter(base, root / "a", r=8, alpha=16, seed=11),
        "b": make_adapter(base, root / "b", r=4, targets=("q_proj", "v_proj", "down_proj"), seed=12),
    }
    engines = {True: tiny_engine(tiny_model_dir, **SPECULATE), False: tiny_engine(tiny_model_dir, **PLAIN)}
    for engine in engines.values():
        for name, path in adapters.items():
            engine.load_lora(name, str(path))
    return engines


def test_lora_drafts_of_different_adapters_in_one_step_change_no_output(
    lora_engines: dict[bool, LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two adapters and the base model in one batch (one prompt twice, under adapter a and b):
    their draft rows share decode steps, each with its own adapter's delta."""
    on, off = lora_engines[True], lora_engines[False]
    prompt = list(range(500, 520))
    reqs = [Req(prompt, "a"), Req(prompt, "b"), Req(list(range(700, 712)), None), Req(prompt, "a")]
    steps = _recording_drafts(on, monkeypatch)
    _same_with_drafts(on, off, reqs, 24)
    assert any(len(set(slots)) == 3 for slots in steps), steps  # a's, b's and the base's drafts at once
    outputs = _run(off, reqs, 24)
    assert outputs[0] == outputs[3] and outputs[0] != outputs[1]  # the adapters do change the output


# ---- tensor parallelism -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_rank_plain(tiny_model_dir: Path) -> Iterator[LLMEngine]:
    engine = tiny_engine(tiny_model_dir, **PLAIN)
    yield engine
    engine.close()


def test_two_ranks_speculating_answer_as_one_rank_without(
    tiny_model_dir: Path, one_rank_plain: LLMEngine
) -> None:
    """Speculation on at 2 ranks (the draft rows broadcast to the other rank with the step) gives
    the ids of 1 rank without it; a 90-token prompt is prefilled in chunks beside the others."""
    two = tiny_engine(tiny_model_dir, tensor_parallel_size=2, **SPECULATE)
    try:
        reqs = [Req(list(range(5, 12))), Req(list(range(100, 190))), Req([7] * 13)]
        _same_with_drafts(two, one_rank_plain, reqs, 20)
    finally:
        two.close()


# ---- sliding windows ----------------------------------------------------------------------------

WINDOW_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral-window": ("mistral", dict(sliding_window=WINDOW)),
    "gemma3_text-banded": ("gemma3_text", dict(head_dim=16, sliding_window=WINDOW, layer_types=BANDED)),
}


@pytest.fixture(scope="module", params=sorted(WINDOW_MODELS))
def window_model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path
) -> Path:
    model_type, overrides = WINDOW_MODELS[request.param]
    return make_tiny_model(tmp_path_factory.mktemp(request.param), real_model_dir, model_type, **overrides)


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_drafts_across_the_window_edge_change_no_output(window_model: Path, kernels: str) -> None:
    """Prompts of 40 and 10 tokens, 40 tokens out (past 4x the 16-token window): every draft row
    attends to its own window, which slides within the draft."""
    on = tiny_engine(window_model, kernels=kernels, **SPECULATE)
    off = tiny_engine(window_model, kernels=kernels, **PLAIN)
    _same_with_drafts(on, off, [Req(p) for p in WINDOW_PROMPTS], 40)
