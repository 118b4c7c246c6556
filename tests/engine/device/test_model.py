"""Our forward pass against transformers' on tiny random models of each supported shape."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.types import GenerationRequest, SamplingParams
from tests.engine.helpers import greedy, hf_greedy, run_all, tiny_engine, tokens_of
from tests.tiny_model import make_tiny_model

SHAPES = {
    "llama-untied": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2-bias": ("qwen2", {}),
    "mistral": ("mistral", {"sliding_window": None}),
    "llama3-rope-scaling": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "head-dim-override": ("llama", {"head_dim": 32}),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def shaped_model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path
) -> Path:
    model_type, overrides = SHAPES[request.param]
    return make_tiny_model(tmp_path_factory.mktemp(request.param), real_model_dir, model_type, **overrides)


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_greedy_matches_transformers_chunked_and_batched(shaped_model: Path, backend: str) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(shaped_model, dtype=torch.float32)
    # A token budget of 8 forces chunked prefill; three prompts of different lengths share steps.
    engine = tiny_engine(shaped_model, max_num_batched_tokens=8, kernels=backend)
    prompts = [list(range(100, 100 + n)) for n in (5, 19, 33)]
    requests = [GenerationRequest(f"r{i}", p, greedy(24)) for i, p in enumerate(prompts)]
    outputs = run_all(engine, requests)
    for i, prompt in enumerate(prompts):
        assert tokens_of(outputs[(f"r{i}", 0)]) == hf_greedy(reference, prompt, 24), f"prompt {i}"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_logprobs_match_transformers(shaped_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(shaped_model, dtype=torch.float32)
    engine = tiny_engine(shaped_model, max_num_batched_tokens=8)
    prompt = list(range(300, 320))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3)
    outs = run_all(engine, [GenerationRequest("lp", prompt, params)])[("lp", 0)]
    generated = tokens_of(outs)
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + generated])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
    got = [lp for o in outs for lp in o.logprobs]
    assert len(got) == len(generated)
    for step, lp in enumerate(got):
        assert lp.logprob == pytest.approx(float(expected[step, lp.token_id]), abs=1e-4)
        top_ids = [t for t, _ in lp.top]
        assert top_ids == expected[step].topk(3).indices.tolist()
