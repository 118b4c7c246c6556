"""Compare grammar engines (xgrammar, llguidance) on our schema set with the bundled tokenizer.

    PYTHONPATH=. .venv/bin/python -m bench.grammar_engines [--steps 48] [--repeat 3]

For each engine and each schema of bench/schemas.py (34 schemas, SmolLM2's 49152-token vocab):

- first use: compile the schema with the engine's cache off, build a matcher and fill its first
  token bitmask (llguidance compiles lazily, so its first mask is part of the cost); p50/p99/max
  over the schemas, best of `--repeat` runs;
- per-token mask time: a seeded random walk of `--steps` tokens through the grammar (each step:
  fill the bitmask, pick an allowed token, accept it); p50/p99 over every step of every schema.

Both engines are configured as engine/grammar/backend.py uses them: compact JSON (no free whitespace)
except where the schema's own strings need it. Prints one table; nothing is written.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.schemas import SCHEMAS


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class _Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.vocab_size = vocab_size

    def first_use(self, schema: dict[str, Any]) -> Any:
        xgr = self.xgr
        compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        return matcher

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_terminated())


class _Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        self.fill_fn = llguidance.torch.fill_next_token_bitmask
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size

    def first_use(self, schema: dict[str, Any]) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        matcher = self.ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        bitmask = torch.zeros(1, (self.vocab_size + 31) // 32, dtype=torch.int32)
        self.fill_fn(matcher, bitmask, 0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        self.fill_fn(matcher, bitmask, 0)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_stopped())


def _allowed(bitmask: torch.Tensor, vocab_size: int) -> list[int]:
    words = bitmask[0].to(torch.int64) & 0xFFFFFFFF
    bits = (words.unsqueeze(1) >> torch.arange(32)) & 1
    return bits.flatten()[:vocab_size].nonzero().flatten().tolist()


def measure(engine: Any, steps: int, repeat: int, seed: int = 0) -> dict[str, Any]:
    first_use: list[float] = []
    failures: list[str] = []
    mask_s: list[float] = []
    for case in SCHEMAS:
        best = float("inf")
        matcher = None
        try:
            for _ in range(repeat):
                t0 = time.perf_counter()
                matcher = engine.first_use(case.schema)
                best = min(best, time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - a schema an engine rejects is reported, not fatal
            failures.append(f"{case.name}: {type(exc).__name__}: {str(exc)[:80]}")
            continue
        first_use.append(best)
        rng = random.Random(seed)
        bitmask = torch.zeros(1, (engine.vocab_size + 31) // 32, dtype=torch.int32)
        for _ in range(steps):
            if engine.done(matcher):
                break
            t0 = time.perf_counter()
            engine.fill(matcher, bitmask)
            mask_s.append(time.perf_counter() - t0)
            allowed = _allowed(bitmask, engine.vocab_size)
            if not allowed:
                break
            engine.accept(matcher, rng.choice(allowed))
    return {"first_use": first_use, "mask": mask_s, "failures": failures}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--engines", default="xgrammar,llguidance")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from engine.config import EngineConfig
    from engine.resolve import resolve_model_dir

    hf = AutoTokenizer.from_pretrained(resolve_model_dir(None, EngineConfig().model.cache_dir))
    vocab_size = 49152
    factories: dict[str, Callable[..., Any]] = {"xgrammar": _Xgrammar, "llguidance": _Llguidance}
    print(f"{len(SCHEMAS)} schemas, vocab {vocab_size}, {args.steps} steps each, best of {args.repeat}")
    print(
        f"{'engine':<11} {'first use p50':>13} {'p99':>9} {'max':>9} {'mask p50':>9} {'p99':>9} {'steps':>6}"
    )
    for name in args.engines.split(","):
        engine = factories[name](hf, vocab_size)
        r = measure(engine, args.steps, args.repeat)
        fu, mk = r["first_use"], r["mask"]
        print(
            f"{name:<11} {_pct(fu, 0.5) * 1e3:>10.2f} ms {_pct(fu, 0.99) * 1e3:>6.2f} ms "
            f"{max(fu) * 1e3:>6.2f} ms {_pct(mk, 0.5) * 1e6:>6.0f} us {_pct(mk, 0.99) * 1e6:>6.0f} us "
            f"{len(mk):>6}  (mean mask {statistics.fmean(mk) * 1e6:.0f} us)"
        )
        for failure in r["failures"]:
            print(f"    rejected {failure}")


if __name__ == "__main__":
    main()
