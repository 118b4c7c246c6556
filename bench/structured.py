"""Structured output on the engine with the bundled model: validity over the schema set, and the
throughput cost of constraining a full batch.

    PYTHONPATH=. .venv/bin/python -m bench.structured validity [--temperatures 0,0.7,1.0 --seeds 1]
    PYTHONPATH=. .venv/bin/python -m bench.structured throughput [--concurrency 32 --steps 200 --overlap]

`validity`: every schema of bench/schemas.py at each temperature, as one batch, `--seeds` times
with other seeds (once at temperature 0); counts outputs that parse and validate (jsonschema), that
hit max_tokens, that contain a run of 3+ whitespace characters outside strings (the
runaway-whitespace failure), and that reached the last `closing_reserve` tokens of their budget
(steered to close, engine/grammar/closing.py).

`throughput`: a closed loop of `--concurrency` requests (a finished one is replaced at once) for
`--steps` engine steps, once with every request constrained by a cached schema (compiled before
the run) and once unconstrained with each request capped at the length its constrained twin
produced (the same prefill/decode mix), alternating for `--rounds`; prints output tokens/s of
each, their ratio, the mask time per step (filling the batch's bitmask) and the first-use compile
time of the schemas.
`--overlap` fills the masks on a worker thread during the forward pass, `--no-overlap` after it;
neither: the engine's default (overlapped on a GPU, after the pass on the CPU).
Runs offline on LLMEngine (no HTTP), on this machine's CPU unless `--device` says otherwise.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import time
from typing import Any

import jsonschema

from bench.schemas import SCHEMAS
from engine.config import EngineConfig
from engine.grammar import mask as mask_module
from engine.grammar.backend import LLGuidanceBackend
from engine.grammar.mask import closing_reserve
from engine.llm_engine import LLMEngine
from engine.types import FinishReason, GenerationRequest, GrammarSpec, RequestOutput, SamplingParams

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def _engine(args: argparse.Namespace) -> LLMEngine:
    return LLMEngine(
        EngineConfig.of(
            device=args.device,
            kv_cache_memory_bytes=args.kv_cache_mib << 20,
            max_model_len=2048,
            max_num_seqs=max(64, args.concurrency),
        )
    )


def _prompt(engine: LLMEngine, text: str) -> list[int]:
    return list(
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": text + " Answer in JSON."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )


def validity(args: argparse.Namespace) -> None:
    engine = _engine(args)
    reserve = closing_reserve(args.max_tokens)
    for temperature in (float(t) for t in args.temperatures.split(",")):
        valid = length = runaway = closed = 0
        rounds = 1 if temperature == 0 else args.seeds  # greedy gives the same outputs every round
        for round_ in range(rounds):
            for i, case in enumerate(SCHEMAS):
                params = SamplingParams(
                    max_tokens=args.max_tokens,
                    temperature=temperature,
                    seed=round_ * 1000 + i,
                    grammar=GrammarSpec.json_schema(case.schema),
                )
                engine.add_request(GenerationRequest(case.name, _prompt(engine, case.prompt), params))
            texts: dict[str, str] = {c.name: "" for c in SCHEMAS}
            last: dict[str, RequestOutput] = {}
            while engine.has_unfinished():
                for out in engine.step():
                    texts[out.request_id] += out.new_text
                    last[out.request_id] = out
            for case in SCHEMAS:
                text = texts[case.name]
                length += last[case.name].finish_reason is FinishReason.LENGTH
                closed += last[case.name].num_output_tokens > args.max_tokens - reserve
                runaway += bool(re.search(r"\s{3,}", _STRING.sub("", text)))
                try:
                    jsonschema.validate(json.loads(text), case.schema)
                    valid += 1
                except (ValueError, jsonschema.ValidationError):
                    print(f"  invalid at T={temperature} round {round_}: {case.name}: {text[-120:]!r}")
        print(
            f"T={temperature}: {valid}/{rounds * len(SCHEMAS)} parse and validate ({rounds} seed rounds), "
            f"{length} hit max_tokens, {runaway} with a whitespace run outside strings, {closed} steered "
            f"to close (within the last {reserve} tokens)"
        )


def _closed_loop(
    engine: LLMEngine, args: argparse.Namespace, lengths: list[int] | None
) -> tuple[float, int, list[int]]:
    """Run the loop; constrained when `lengths` is None (returns each request's output length),
    else unconstrained with request i capped at lengths[i] (ignore_eos): the same mix of prefill
    and decode work, so the difference is the grammar's cost."""
    cases = itertools.cycle(SCHEMAS)
    serial = itertools.count()
    produced: dict[str, int] = {}

    def submit() -> None:
        case, i = next(cases), next(serial)
        if lengths is None:
            params = SamplingParams(
                max_tokens=args.max_tokens,
                temperature=0.7,
                seed=i,
                grammar=GrammarSpec.json_schema(case.schema),
            )
        else:
            cap = lengths[i] if i < len(lengths) else args.max_tokens
            params = SamplingParams(max_tokens=max(1, cap), temperature=0.7, seed=i, ignore_eos=True)
        engine.add_request(GenerationRequest(f"r{i}", _prompt(engine, case.prompt), params))

    for _ in range(args.concurrency):
        submit()
    num_tokens = 0
    start = time.perf_counter()
    for _ in range(args.steps):
        for out in engine.step():
            num_tokens += len(out.new_token_ids)
            if out.finished:
                produced[out.request_id] = out.num_output_tokens
                submit()
    elapsed = time.perf_counter() - start
    for request_id in list(engine.output_processor.seqs):
        engine.abort_request(request_id)
    while engine.has_unfinished():
        engine.step()
    ordered = [produced.get(f"r{i}", args.max_tokens) for i in range(len(produced) + args.concurrency)]
    return elapsed, num_tokens, ordered


def throughput(args: argparse.Namespace) -> None:
    engine = _engine(args)
    if args.overlap is not None:  # else the engine's default for the device
        engine.masks.overlap = args.overlap
    first_use = []
    backend = LLGuidanceBackend(engine.tokenizer, engine.spec.vocab_size, tuple(engine.spec.eos_token_ids))
    backend.compile(GrammarSpec.json_object())  # builds the tokenizer once, outside the timing
    for case in SCHEMAS:
        t0 = time.perf_counter()
        backend.compile(GrammarSpec.json_schema(case.schema)).new_grammar()
        first_use.append(time.perf_counter() - t0)
        engine.grammar(GrammarSpec.json_schema(case.schema)).result()  # cached for the run
    mask_s: list[float] = []
    fill = mask_module.fill_bitmask

    def timed_fill(*a: Any) -> Any:
        t0 = time.perf_counter()
        bitmask = fill(*a)
        if bitmask is not None:  # a step with constrained rows
            mask_s.append(time.perf_counter() - t0)
        return bitmask

    mask_module.fill_bitmask = timed_fill  # type: ignore[assignment]
    # Warm-up, not measured: each grammar's first masks build its lexer states, and new step
    # shapes warm oneDNN (measured first, the constrained run read 10% of the other).
    warm = argparse.Namespace(**{**vars(args), "steps": max(10, args.steps // 4)})
    _closed_loop(engine, warm, _closed_loop(engine, warm, None)[2])
    mask_s.clear()
    results: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):  # interleaved: the machine's load drifts
        elapsed, tokens, lengths = _closed_loop(engine, args, None)
        results[True].append(tokens / elapsed)
        elapsed, tokens, _ = _closed_loop(engine, args, lengths)
        results[False].append(tokens / elapsed)
    mask_module.fill_bitmask = fill  # type: ignore[assignment]
    free, bound = statistics.fmean(results[False]), statistics.fmean(results[True])
    ordered = sorted(first_use)
    masks = [m for m in mask_s if m > 0]
    print(
        f"{args.concurrency} concurrent, {args.steps} steps x{args.rounds} each, "
        f"overlap={engine.masks.overlap}: "
        f"unconstrained {free:.0f} tok/s, constrained {bound:.0f} tok/s ({bound / free:.1%})"
    )
    print(
        f"mask time per constrained step: mean {statistics.fmean(masks) * 1e3:.2f} ms, "
        f"p99 {sorted(masks)[int(0.99 * (len(masks) - 1))] * 1e3:.2f} ms over {len(masks)} steps"
    )
    print(
        f"compile (first use) over {len(ordered)} schemas: p50 {ordered[len(ordered) // 2] * 1e3:.2f} ms, "
        f"p99 {ordered[int(0.99 * (len(ordered) - 1))] * 1e3:.2f} ms"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", choices=["validity", "throughput"])
    parser.add_argument("--temperatures", default="0,0.7,1.0")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seeds", type=int, default=1, help="validity: rounds of seeds per temperature")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--kv-cache-mib", type=int, default=256)
    args = parser.parse_args(argv)
    validity(args) if args.mode == "validity" else throughput(args)


if __name__ == "__main__":
    main()
