"""How often the engine's bf16 greedy output matches the fp32 reference, and where it departs.

    .venv/bin/python -m bench.bf16_parity

For the 8 parity prompts (tests/engine/test_parity_real.py), runs transformers' fp32 `generate`
(the reference), our engine in fp32, in bf16, and in bf16 with int4 decode steps (the served
default for the bundled Q4_1 model: engine/device/quant.py), and reports per prompt the first token where
each departs from the reference, with the reference's top-2 logit gap at that step: bf16 keeps ~8
bits of mantissa, so a departure where the gap is small is rounding, not a bug.
"""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.types import SamplingParams
from tests.engine.helpers import chat_ids, hf_greedy
from tests.engine.test_parity_real import NUM_TOKENS, QUESTIONS
from tests.tiny_model import bundled_dir


def first_departure(ours: list[int], ref: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b), None)


def main() -> None:
    from transformers import AutoModelForCausalLM

    cfg = EngineConfig()
    model_dir = bundled_dir(cfg.model.cache_dir)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reference.generation_config.eos_token_id = None
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    variants = {
        "float32": ("float32", "none"),
        "bfloat16": ("bfloat16", "none"),
        "bf16+int4": ("bfloat16", "int4"),
    }
    engines = {
        label: LLMEngine(
            EngineConfig.of(dtype=d, quantization=q, max_model_len=2048, kv_cache_memory_bytes=256 << 20)
        )
        for label, (d, q) in variants.items()
    }
    tok = engines["float32"].tokenizer
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    rows = []
    for q, prompt in zip(QUESTIONS, prompts, strict=True):
        ref = hf_greedy(reference, prompt, NUM_TOKENS)
        row = [q[:40]]
        for dtype, engine in engines.items():
            ours = engine.generate([prompt], params)[0]
            k = first_departure(ours, ref)
            if k is None:
                row.append(f"{dtype}: identical")
                continue
            with torch.no_grad():
                top2 = reference(torch.tensor([prompt + ref[:k]])).logits[0, -1].topk(2).values
            row.append(f"{dtype}: departs at token {k} (fp32 top-2 gap {float(top2[0] - top2[1]):.3f})")
        rows.append(row)
    for i, label in enumerate(variants, start=1):
        identical = sum(f"{label}: identical" in r[i] for r in rows)
        print(
            f"{label} identical to the fp32 reference for all {NUM_TOKENS} tokens: "
            f"{identical}/{len(rows)} prompts"
        )
    for r in rows:
        print(" | ".join(r))


if __name__ == "__main__":
    main()
