"""Teacher-forced agreement of the engine's greedy choices with the fp32 reference (issue 22's
quality criterion).

    .venv/bin/python -m bench.quant_parity [--variants float32:none,auto:auto@inf,auto:auto/float32]

For the 8 parity prompts (tests/engine/test_parity_real.py), transformers' fp32 `generate` gives
the reference's 64 greedy tokens; one fp32 forward over prompt + reference gives its logits at
each of those steps. Each engine variant (dtype:quantization) then picks its next token after
every prefix of the reference (prompt + reference[:i]), so one early departure does not decide
the rest. Reported: the share of the 512 steps whose choice agrees with the reference, and the
reference's top-2 logit gap at each disagreement (the criterion: >= 98% agree, every gap < 0.5).
"""

from __future__ import annotations

import argparse

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.types import SamplingParams
from tests.engine.helpers import chat_ids, hf_greedy
from tests.engine.test_parity_real import NUM_TOKENS, QUESTIONS
from tests.tiny_model import bundled_dir


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--variants",
        default="float32:none,auto:auto@inf,auto:auto@4",
        help="dtype:quantization[@outlier ratio of our kernels][/KV-cache dtype], comma-separated",
    )
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    cfg = EngineConfig()
    reference = AutoModelForCausalLM.from_pretrained(bundled_dir(cfg.model.cache_dir), dtype=torch.float32)
    reference.generation_config.eos_token_id = None
    engines = {}
    for label in args.variants.split(","):
        dtype, rest = label.split(":")
        rest, _, kv_dtype = rest.partition("/")
        quantization, _, ratio = rest.partition("@")
        config = EngineConfig.of(
            dtype=dtype,
            quantization=quantization,
            kv_cache_dtype=kv_dtype or "auto",
            max_model_len=2048,
            kv_cache_memory_bytes=256 << 20,
        )
        engine = LLMEngine(config)
        model = engine.runner.model
        projections = [getattr(x, n) for x in model.layers for n in ("qkv", "o", "gate_up", "down")]
        for linear in [model.lm_head, *projections]:
            if ratio and linear.quant is not None:
                linear.outlier_ratio = float(ratio)
        engines[label] = engine
    tok = next(iter(engines.values())).tokenizer
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    agree = dict.fromkeys(engines, 0)
    gaps: dict[str, list[float]] = {label: [] for label in engines}
    total = 0
    for q in QUESTIONS:
        prompt = chat_ids(tok, q)
        ref = hf_greedy(reference, prompt, NUM_TOKENS)
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + ref])).logits[0, len(prompt) - 1 : -1]
        top2 = logits.topk(2).values
        for label, engine in engines.items():
            choices = [o[0] for o in engine.generate([prompt + ref[:i] for i in range(NUM_TOKENS)], one)]
            for i, (ours, want) in enumerate(zip(choices, ref, strict=True)):
                if ours == want:
                    agree[label] += 1
                else:
                    gaps[label].append(float(top2[i, 0] - top2[i, 1]))
        total += NUM_TOKENS
    for label in engines:
        worst = max(gaps[label], default=0.0)
        print(
            f"{label}: {agree[label]}/{total} steps agree ({100 * agree[label] / total:.1f}%), "
            f"{len(gaps[label])} disagreements, largest reference top-2 gap there {worst:.3f}: "
            f"{sorted(round(g, 3) for g in gaps[label])}"
        )


if __name__ == "__main__":
    main()
