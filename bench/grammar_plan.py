"""The closing steer's plan search (engine/grammar/closing.py `shortest_completion`): its time per search,
which the engine thread pays when a Lark or regex sequence enters its closing window.

    python -m bench.grammar_plan [--repeat 20]

Cases: Codex's apply_patch Lark grammar (tests/gateway/data/) stopped inside a file's line and
inside a file header, and two regexes with bounded repeats; the bundled model's tokenizer."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from bench.cpu import CpuMeter
from engine.grammar.backend import LLGuidanceBackend
from engine.grammar.closing import shortest_completion
from engine.types import GrammarSpec

PATCH = (Path(__file__).parents[1] / "tests" / "gateway" / "data" / "codex_apply_patch.lark").read_text()
CASES = [
    ("apply_patch, in a line", GrammarSpec.lark(PATCH), "*** Begin Patch\n*** Add File: a.txt\n+hi th"),
    ("apply_patch, in a header", GrammarSpec.lark(PATCH), "*** Begin Patch\n*** Update File: src/m"),
    ("regex [A-Z]{3}-[0-9]{4}", GrammarSpec.regex(r"[A-Z]{3}-[0-9]{4}"), "Q"),
    ("regex email", GrammarSpec.regex(r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"), "bob"),
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from engine.config import EngineConfig
    from engine.resolve import resolve_model_dir

    hf = AutoTokenizer.from_pretrained(resolve_model_dir(None, EngineConfig().model.cache_dir))
    backend = LLGuidanceBackend(hf, 49152, (2,))
    meter = CpuMeter()
    meter.start()
    print(f"{'case':<26} {'plan':>22} {'p50 ms':>8} {'max ms':>8}")
    for name, spec, prefix in CASES:
        grammar = backend.compile(spec).new_grammar()
        for token in hf.encode(prefix, add_special_tokens=False):
            assert grammar.accept_token(token)
        matcher, closing = grammar._matcher, grammar._closing  # type: ignore[attr-defined]
        times, plan = [], None
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            plan = shortest_completion(matcher, closing)
            times.append((time.perf_counter() - t0) * 1000)
        print(f"{name:<26} {plan!r:>22} {statistics.median(times):8.2f} {max(times):8.2f}")
    print(f"others' CPU share: {meter.stop().others_busy:.0%}")


if __name__ == "__main__":
    main()
