"""Shared test helpers for the engine: engines on tiny models, reference runs through transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.types import GenerationRequest, RequestOutput, SamplingParams


def tiny_engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    settings: dict[str, Any] = dict(
        model=str(model_dir),
        dtype="float32",
        kv_cache_memory_bytes=8 << 20,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        block_size=4,
    )
    settings.update(overrides)
    return LLMEngine(EngineConfig.of(**settings))


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def run_all(
    engine: LLMEngine, requests: list[GenerationRequest]
) -> dict[tuple[str, int], list[RequestOutput]]:
    """Submit everything, step to completion, return outputs per (request_id, choice)."""
    for r in requests:
        engine.add_request(r)
    outputs: dict[tuple[str, int], list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault((out.request_id, out.index), []).append(out)
    return outputs


def tokens_of(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def text_of(outs: list[RequestOutput]) -> str:
    return "".join(o.new_text for o in outs)


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def compare_one_call_decode(engine: LLMEngine, monkeypatch: Any) -> list[bool]:
    """From now on each decode-only step of `engine` also runs through the Python layer loop (the
    one-call decode turned off, engine/device/models/decoder.py) on the same inputs; returns a list
    that gets, per such step, whether the two gave the same logits bit for bit (K/V are rewritten
    alike)."""
    llama = engine.runner.model
    assert llama.decode_weights is not None
    forward = type(llama).forward
    compared: list[bool] = []

    def both(self: Any, batch: Any, kv_caches: Any) -> torch.Tensor:
        fused = forward(self, batch, kv_caches)
        if batch.prefills:
            return fused
        weights, self.decode_weights = self.decode_weights, None
        try:
            compared.append(torch.equal(fused, forward(self, batch, kv_caches)))
        finally:
            self.decode_weights = weights
        return fused

    monkeypatch.setattr(type(llama), "forward", both)
    return compared


def assert_greedy_matches(reference: Any, prompt: list[int], ours: list[int], label: str = "") -> None:
    """`ours` equals transformers' greedy tokens after `prompt`, or departs from them only at a step
    where the reference's top-2 logit gap is below 1e-3 (a tie the two may break apart)."""
    want = hf_greedy(reference, prompt, len(ours))
    if ours == want:
        return
    step = next(i for i, (a, b) in enumerate(zip(ours, want, strict=True)) if a != b)
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + want[:step]])).logits[0, -1].float()
    top2 = logits.topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < 1e-3, f"{label}: departs from transformers at step {step} (gap {gap:.4f}): {ours} {want}"


def teacher_forced(
    engine: LLMEngine, reference: Any, prompts: list[list[int]], num_tokens: int
) -> tuple[int, int, list[float]]:
    """Issue 22's quality measure: the reference's greedy tokens after each prompt; the engine's
    next-token choice after every prefix of them (so one early departure does not decide the
    rest). Returns (agreeing steps, steps, the reference's top-2 logit gap at each disagreement)."""
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    agree, total, gaps = 0, 0, []
    for prompt in prompts:
        want = hf_greedy(reference, prompt, num_tokens)
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + want])).logits[0, len(prompt) - 1 : -1].float()
        top2 = logits.topk(2).values
        choices = [o[0] for o in engine.generate([prompt + want[:i] for i in range(num_tokens)], one)]
        for i, (ours, theirs) in enumerate(zip(choices, want, strict=True)):
            total += 1
            if ours == theirs:
                agree += 1
            else:
                gaps.append(float(top2[i, 0] - top2[i, 1]))
    return agree, total, gaps
