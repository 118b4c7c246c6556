"""Every served family against transformers on tiny checkpoints written by transformers itself:
greedy fp32 tokens equal (alone, and batched with other requests in chunked prefill), for prompts
past 4x the 16-token window wherever a family has windows; through the int8 path, issue 22's
criterion; windows after a prefix-cache hit and after preemption; MXFP4 experts; the refusal of
a model_type the engine does not serve."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_spec import MODEL_TYPES, ModelSpec, UnsupportedModelError
from engine.types import GenerationRequest
from tests.engine.helpers import (
    assert_greedy_matches,
    greedy,
    run_all,
    teacher_forced,
    tiny_engine,
    tokens_of,
)
from tests.tiny_model import counting_batch, make_tiny_model

WINDOW = 16
BANDED = ["sliding_attention", "full_attention"]
# name -> (model_type, config overrides): every family, with its windows, norms and experts.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral-window": ("mistral", dict(sliding_window=WINDOW)),
    "qwen2-window": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "qwen3": ("qwen3", dict(head_dim=16)),
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    "mixtral-window": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW)),
    "gemma3_text": (
        "gemma3_text",
        dict(
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=BANDED,
            query_pre_attn_scalar=24,
            final_logit_softcapping=30.0,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
    ),
    "gemma3": ("gemma3", dict(head_dim=16, sliding_window=WINDOW, layer_types=BANDED)),
    "phi3-partial-rotary": ("phi3", dict(sliding_window=WINDOW, partial_rotary_factor=0.75)),
    "gpt_oss": (
        "gpt_oss",
        dict(
            num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW, head_dim=16, layer_types=BANDED
        ),
    ),
}
assert {model_type for model_type, _ in FAMILIES.values()} | {"llama"} == set(MODEL_TYPES)
# Rope variants, for fp32 parity only: Phi-3.5's and Phi-4-mini's longrope (short factors and the
# attention factor below original_max_position_embeddings).
PARITY = FAMILIES | {
    "phi3-longrope": (
        "phi3",
        dict(
            max_position_embeddings=16384,
            original_max_position_embeddings=4096,
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0 + 0.05 * i for i in range(8)],
                "long_factor": [2.0 + 0.5 * i for i in range(8)],
            },
        ),
    ),
}


def reference_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM, Gemma3ForConditionalGeneration

    model_type = json.loads((path / "config.json").read_text())["model_type"]
    cls = Gemma3ForConditionalGeneration if model_type == "gemma3" else AutoModelForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32)


@pytest.fixture(scope="module", params=sorted(PARITY))
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path
) -> Path:
    model_type, overrides = PARITY[request.param]
    return make_tiny_model(tmp_path_factory.mktemp(request.param), real_model_dir, model_type, **overrides)


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_greedy_matches_transformers_alone_and_batched(family: Path, backend: str) -> None:
    """Prompts of 5, 70 and 90 tokens (past 4x the window): alone, then together in steps of 16
    tokens (chunked prefill beside decodes), 24 tokens each."""
    reference = reference_model(family)
    prompts = [list(range(100, 100 + n)) for n in (5, 70, 90)]
    alone = tiny_engine(family, kernels=backend, max_num_batched_tokens=128)
    assert_greedy_matches(
        reference,
        prompts[2],
        tokens_of(run_all(alone, [GenerationRequest("a", prompts[2], greedy(24))])[("a", 0)]),
        "alone",
    )
    engine = tiny_engine(family, kernels=backend, max_num_batched_tokens=16)
    outputs = run_all(engine, [GenerationRequest(f"r{i}", p, greedy(24)) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        assert_greedy_matches(reference, prompt, tokens_of(outputs[(f"r{i}", 0)]), f"prompt {i}")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_windows_hold_after_a_prefix_cache_hit_and_after_preemption(
    tmp_path: Path, real_model_dir: Path
) -> None:
    """Gemma 3's banded and global layers: a prompt of 6 windows served twice (the second time its
    full blocks come from the prefix cache), then four at once in a KV cache too small for them
    (sequences preempted and recomputed): transformers' tokens each time."""
    model_type, overrides = FAMILIES["gemma3_text"]
    path = make_tiny_model(tmp_path / "g", real_model_dir, model_type, **overrides)
    reference = reference_model(path)
    prompt = list(range(200, 296))
    engine = tiny_engine(path, enable_prefix_caching=True, max_num_batched_tokens=32)
    for request_id in ("first", "cached"):
        outs = run_all(engine, [GenerationRequest(request_id, prompt, greedy(20))])
        assert_greedy_matches(reference, prompt, tokens_of(outs[(request_id, 0)]), request_id)
    assert engine.block_manager.num_hit_tokens >= 92
    # 4 sequences of up to 116 tokens in 64 blocks of 4: they cannot all stay.
    small = tiny_engine(path, kv_cache_memory_bytes=64 * 4 * 2 * 2 * 2 * 16 * 4, max_num_batched_tokens=32)
    prompts = [list(range(300 + 7 * i, 396 + 7 * i)) for i in range(4)]
    outs = run_all(small, [GenerationRequest(f"p{i}", p, greedy(20)) for i, p in enumerate(prompts)])
    assert small.scheduler.num_preemptions > 0
    for i, p in enumerate(prompts):
        assert_greedy_matches(reference, p, tokens_of(outs[(f"p{i}", 0)]), f"preempted {i}")
    assert small.block_manager.num_free_blocks == small.block_manager.num_blocks


VOCAB = 256  # the int8 criterion's models: trained on counting_batch sequences over 256 tokens


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_int8_path_meets_the_quality_criterion(name: str, tmp_path: Path, real_model_dir: Path) -> None:
    """Issue 22's criterion on our int8 kernels (every projection, the experts' grouped matmuls and
    the LM head int8; the KV cache bf16): >= 98% of teacher-forced greedy steps agree with the fp32
    reference, every disagreement at a reference top-2 logit gap below 0.5. Random weights have
    near-ties everywhere (even Llama's int8 path, which meets this on the real model, agrees on
    only ~93% of a random tiny model's steps), so these models are first trained briefly
    (tests/tiny_model.py: confident predictions, as a trained model's)."""
    model_type, overrides = FAMILIES[name]
    path = make_tiny_model(
        tmp_path / name, real_model_dir, model_type, train_steps=400, vocab_size=VOCAB, **overrides
    )
    reference = reference_model(path)
    engine = tiny_engine(path, quantization="int8", kernels="native")
    layer = engine.runner.model.layers[0]
    assert layer.qkv.quant is not None and engine.runner.model.lm_head.quant is not None
    gen = torch.Generator().manual_seed(1)
    prompts = [counting_batch(gen, 1, n, VOCAB)[0].tolist() for n in (8, 14, 20, 26, 32, 38)]
    agree, total, gaps = teacher_forced(engine, reference, prompts, 24)
    assert agree >= 0.98 * total and all(gap < 0.5 for gap in gaps), (agree, total, gaps)


def test_mxfp4_experts_are_dequantized_as_transformers_does(tmp_path: Path, real_model_dir: Path) -> None:
    """A gpt-oss checkpoint whose experts are stored as OpenAI ships them (MXFP4 blocks and scales):
    our dequantization equals transformers' own, and the engine answers as transformers does over
    the dequantized weights."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from engine.device.models.gpt_oss import dequantize_mxfp4

    model_type, overrides = FAMILIES["gpt_oss"]
    path = make_tiny_model(tmp_path / "oss", real_model_dir, model_type, **overrides)
    weights = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(3)
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, cols, rows = weights[name].shape  # [E, in, out]
        blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(120, 127, (experts, rows, cols // 32), generator=gen, dtype=torch.uint8)
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
        assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2), theirs)
        weights[name] = theirs.contiguous()
        weights[name + "_blocks"], weights[name + "_scales"] = blocks, scales
    # The reference: transformers over the dequantized weights; the engine's folder: MXFP4 only.
    save_file(
        {n: t for n, t in weights.items() if not n.endswith(("_blocks", "_scales"))},
        path / "model.safetensors",
        metadata={"format": "pt"},
    )
    reference = reference_model(path)
    save_file(
        {n: t for n, t in weights.items() if not n.endswith(("gate_up_proj", "down_proj"))},
        path / "model.safetensors",
        metadata={"format": "pt"},
    )
    prompt = list(range(100, 170))
    outs = run_all(tiny_engine(path), [GenerationRequest("m", prompt, greedy(16))])
    assert_greedy_matches(reference, prompt, tokens_of(outs[("m", 0)]), "mxfp4")


def test_an_unsupported_model_type_is_refused_at_once_naming_it(tmp_path: Path, real_model_dir: Path) -> None:
    """One line naming the model_type and the supported ones, from the config alone (torch-free),
    and from engine construction before any weight is read."""
    with pytest.raises(UnsupportedModelError) as refused:
        ModelSpec.from_config({"model_type": "falcon", "hidden_size": 8})
    message = str(refused.value)
    assert "\n" not in message and "'falcon'" in message and "qwen3_moe" in message and "gpt_oss" in message
    path = make_tiny_model(tmp_path / "m", real_model_dir)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"model_type": "falcon"}))
    (path / "model.safetensors").write_bytes(b"not weights")  # never read
    started = time.monotonic()
    with pytest.raises(
        UnsupportedModelError, match="unsupported model_type 'falcon': batchgate serves llama"
    ):
        LLMEngine(EngineConfig.of(model=str(path), dtype="float32", kv_cache_memory_bytes=1 << 20))
    assert time.monotonic() - started < 5
