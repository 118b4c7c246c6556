"""The engine on the real bundled model equals transformers' `generate`, token for token.

fp32, greedy, 64 tokens, 8 chat prompts: alone, and together with 20 other requests of different
lengths arriving at different times. A divergence is accepted only where transformers' own top two
logits at that step differ by less than 1e-4 (a near-tie that float rounding may flip); every such
case is reported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.types import GenerationRequest, SamplingParams
from tests.engine.helpers import chat_ids, hf_greedy, tokens_of

pytestmark = pytest.mark.real_model

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity in one sentence.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a tip for learning to code.",
    "Describe a cat to someone who has never seen one.",
]
NUM_TOKENS = 64
NEAR_TIE = 1e-4


@pytest.fixture(scope="module")
def reference(real_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # run all 64 tokens, like ignore_eos
    return model


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(
        EngineConfig.of(
            dtype="float32",
            max_num_seqs=32,
            max_num_batched_tokens=256,
            kv_cache_memory_bytes=256 << 20,
            max_model_len=2048,
        )
    )


@pytest.fixture(scope="module")
def prompts(engine: LLMEngine) -> list[list[int]]:
    return [chat_ids(engine.tokenizer, q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def expected(reference: Any, prompts: list[list[int]]) -> list[list[int]]:
    return [hf_greedy(reference, p, NUM_TOKENS) for p in prompts]


def check(reference: Any, prompt: list[int], ours: list[int], theirs: list[int], ties: list[str]) -> None:
    assert len(ours) == len(theirs) == NUM_TOKENS
    diverged = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
    if diverged is None:
        return
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + theirs[:diverged]])).logits[0, -1]
    top2 = logits.topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < NEAR_TIE, f"diverged at token {diverged} where the top-2 logit gap is {gap:.2e}"
    ties.append(f"near-tie at token {diverged} (gap {gap:.1e})")


def params() -> SamplingParams:
    return SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


def test_each_prompt_alone_matches_transformers(
    engine: LLMEngine, reference: Any, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    ties: list[str] = []
    for prompt, theirs in zip(prompts, expected, strict=True):
        ours = engine.generate([prompt], params())[0]
        check(reference, prompt, ours, theirs, ties)
    print("alone:", ties or "all identical")


def test_prompts_batched_with_traffic_match_transformers(
    engine: LLMEngine, reference: Any, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    tok = engine.tokenizer
    # 20 other requests: different lengths, sampled and greedy, arriving over the first 40 steps.
    others = [
        GenerationRequest(
            f"other-{i}",
            chat_ids(tok, "Tell me a story about a dragon. " * (1 + i % 5)),
            SamplingParams(max_tokens=8 + 5 * i, temperature=0.7 if i % 2 else 0.0, seed=i, ignore_eos=True),
        )
        for i in range(20)
    ]
    targets = [GenerationRequest(f"target-{i}", p, params()) for i, p in enumerate(prompts)]
    schedule: dict[int, list[GenerationRequest]] = {}
    for i, request in enumerate(others + targets):
        schedule.setdefault((i * 7) % 41, []).append(request)
    outputs: dict[str, list[Any]] = {}
    step = 0
    while schedule or engine.has_unfinished():
        for request in schedule.pop(step, []):
            engine.add_request(request)
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        step += 1
    assert max(engine.stats().last_batch_size, 0) >= 0
    ties: list[str] = []
    for i, (prompt, theirs) in enumerate(zip(prompts, expected, strict=True)):
        check(reference, prompt, tokens_of(outputs[f"target-{i}"]), theirs, ties)
    print("batched:", ties or "all identical")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
