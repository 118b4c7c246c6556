"""LoRA on the real bundled model equals transformers + PEFT, token for token (fp32, greedy).

Adapters of rank 8 and 64 on all seven projections, random A and B, generated here. Each alone
equals PEFT's output on the same adapter; a batch mixing the base model and 4 adapters gives every
row the tokens of that row alone. A divergence is accepted only at a near-tie of the reference's
top two logits (< 1e-4), as in test_parity_real.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.types import GenerationRequest
from tests.engine.helpers import chat_ids, greedy, hf_greedy, run_all, tokens_of
from tests.lora_adapters import make_adapter, peft_reference

pytestmark = pytest.mark.real_model

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]
NUM_TOKENS = 12
NEAR_TIE = 1e-4
# name -> (rank, alpha, rsLoRA, seed)
ADAPTERS = {
    "r8": (8, 16, False, 1),
    "r64": (64, 8, True, 2),
    "r8b": (8, 16, False, 3),
    "r16": (16, 32, False, 4),
}


@pytest.fixture(scope="module")
def adapter_dirs(real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32)
    root = tmp_path_factory.mktemp("real-loras")
    return {
        name: make_adapter(base, root / name, r=r, alpha=alpha, use_rslora=rs, seed=seed)
        for name, (r, alpha, rs, seed) in ADAPTERS.items()
    }


@pytest.fixture(scope="module")
def engine(adapter_dirs: dict[str, Path]) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig.of(
            dtype="float32",
            max_num_seqs=16,
            max_num_batched_tokens=256,
            kv_cache_memory_bytes=64 << 20,
            max_model_len=512,
        )
    )
    for name, path in adapter_dirs.items():
        engine.load_lora(name, str(path))
    return engine


def run(engine: LLMEngine, cases: list[tuple[list[int], str | None]]) -> list[list[int]]:
    requests = [
        GenerationRequest(f"r{i}", prompt, greedy(NUM_TOKENS), lora=engine.loras.get(lora) if lora else None)
        for i, (prompt, lora) in enumerate(cases)
    ]
    outs = run_all(engine, requests)
    return [tokens_of(outs[(f"r{i}", 0)]) for i in range(len(cases))]


def assert_same(reference: Any, prompt: list[int], ours: list[int], theirs: list[int]) -> None:
    diverged = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
    if diverged is None:
        return
    with torch.no_grad():
        top2 = reference(torch.tensor([prompt + theirs[:diverged]])).logits[0, -1].topk(2).values
    assert float(top2[0] - top2[1]) < NEAR_TIE, f"diverged at token {diverged}: {ours} != {theirs}"


@pytest.mark.parametrize("name", ["r8", "r64"])
def test_an_adapter_equals_transformers_and_peft(
    engine: LLMEngine, real_model_dir: Path, adapter_dirs: dict[str, Path], name: str
) -> None:
    reference = peft_reference(real_model_dir, adapter_dirs[name])
    prompts = [chat_ids(engine.tokenizer, q) for q in QUESTIONS]
    ours = run(engine, [(p, name) for p in prompts])
    for prompt, mine in zip(prompts, ours, strict=True):
        assert_same(reference, prompt, mine, hf_greedy(reference, prompt, NUM_TOKENS))


def test_a_batch_of_base_and_four_adapters_gives_each_row_its_own_tokens(engine: LLMEngine) -> None:
    first, second = (chat_ids(engine.tokenizer, q) for q in QUESTIONS)
    cases = [(first, lora) for lora in (None, *ADAPTERS)] + [(second, None), (second, "r64")]
    alone = [run(engine, [case])[0] for case in cases]
    assert len({tuple(a) for a in alone}) == len(cases)  # every adapter changes the output
    assert run(engine, cases) == alone
