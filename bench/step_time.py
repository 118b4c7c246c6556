"""Decode-step time of the engine in process, at a fixed batch: where a step's time goes.

    python -m bench.step_time --batch 32             # median of 4 windows of 8 steps, in ms
    python -m bench.step_time --batch 32 --profile   # plus torch.profiler's table of 10 steps
    python -m bench.step_time --batch 32 --adapters 8 --rank 16 --profile   # rows spread over 8 LoRAs

`batch` sequences share a 40-token prompt and decode greedily (EOS ignored); the windows start after
10 warm-up steps, so contexts run from ~50 to ~90 tokens. Engine settings are the defaults (the
bundled model, bf16 where the CPU has it), overridable with --set FIELD=VALUE (EngineConfig fields,
e.g. --set kernels=torch --set quantization=none). `--adapters N` spreads the rows round-robin over N
random LoRA adapters of rank `--rank` on all seven projections (bench/lora.py makes them).

    python -m bench.step_time --batch 32 --against dtype=bfloat16 --against kv_cache_dtype=float32

`--against` (repeatable; FIELD=VALUE[,FIELD=VALUE...] over the --set ones) builds one more engine
per value and steps them all in turns, one step each: on a shared machine the steps of a round
see the same load, and the median of the per-round ratios says how much faster each is than the
first (the --set engine).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def _value(text: str) -> Any:
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--adapters", type=int, default=0, help="LoRA adapters the rows use (0: none)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--against", action="append", default=[], metavar="FIELD=VALUE[,...]")
    args = parser.parse_args()
    if args.against:
        if args.adapters or args.profile:
            parser.error("--against takes neither --adapters nor --profile")
        compare(args)
        return

    import tempfile
    from pathlib import Path

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.types import GenerationRequest, SamplingParams

    overrides = {k: _value(v) for k, v in (item.split("=", 1) for item in args.set)}
    if args.adapters:
        overrides.setdefault("max_loras", args.adapters)
    config = EngineConfig.of(max_num_seqs=max(args.batch, 1), num_threads=args.threads, **overrides)
    engine = LLMEngine(config)
    loras: list[Any] = [None]
    if args.adapters:
        from bench.lora import make_adapters
        from bench.model import hf_folder

        with tempfile.TemporaryDirectory() as tmp:
            paths = make_adapters(hf_folder(config.model.model), Path(tmp), args.adapters, args.rank)
            loras = [engine.load_lora(f"a{i}", str(p)) for i, p in enumerate(paths)]
    params = SamplingParams(max_tokens=10 + 8 * args.windows + 20, ignore_eos=True, temperature=0.0)
    for i in range(args.batch):
        request = GenerationRequest(f"r{i}", list(range(100, 140)), params, lora=loras[i % len(loras)])
        engine.add_request(request)
    for _ in range(10):
        engine.step()
    windows = []
    for _ in range(args.windows):
        start = time.perf_counter()
        for _ in range(8):
            engine.step()
        windows.append((time.perf_counter() - start) / 8 * 1000)
    print(
        f"batch {args.batch}: decode step {statistics.median(windows):.1f} ms median, "
        f"{min(windows):.1f} ms best ({', '.join(f'{w:.1f}' for w in windows)})"
    )
    if args.profile:
        from torch.profiler import profile

        with profile() as prof:
            for _ in range(10):
                engine.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def compare(args: argparse.Namespace) -> None:
    """Engines of the --set settings and of each --against, stepped in turns (see the docstring)."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.types import GenerationRequest, SamplingParams

    base = dict(item.split("=", 1) for item in args.set)
    labels = ["(--set)"] + args.against
    engines = []
    for label in labels:
        extra = dict(i.split("=", 1) for i in label.split(",")) if label != "(--set)" else {}
        overrides = {k: _value(v) for k, v in {**base, **extra}.items()}
        config = EngineConfig.of(max_num_seqs=max(args.batch, 1), num_threads=args.threads, **overrides)
        engine = LLMEngine(config)
        params = SamplingParams(max_tokens=10 + 8 * args.windows + 20, ignore_eos=True, temperature=0.0)
        for i in range(args.batch):
            engine.add_request(GenerationRequest(f"r{i}", list(range(100, 140)), params))
        for _ in range(10):
            engine.step()
        engines.append(engine)
    times: list[list[float]] = [[] for _ in engines]
    for _ in range(8 * args.windows):
        for engine, spent in zip(engines, times, strict=True):
            start = time.perf_counter()
            engine.step()
            spent.append((time.perf_counter() - start) * 1000)
    for label, spent in zip(labels, times, strict=True):
        speed = statistics.median(a / b for a, b in zip(times[0], spent, strict=True))
        print(
            f"batch {args.batch}, {label}: decode step {statistics.median(spent):.1f} ms median, "
            f"{min(spent):.1f} ms best; {speed:.3f}x the first's speed (median of per-round ratios)"
        )


if __name__ == "__main__":
    main()
