"""A prefill step in the one-call native layers against the Python layer loop, in turns in one
process (engine/step.py's ONE_CALL_PREFILL_CONTEXT and _TOKENS switched around each step), on the bundled
model with our int8 kernels (AVX2 or newer).

    python -m bench.one_call_prefill --lengths 13,30,64,128,256 --reps 7 --threads 1
    python -m bench.one_call_prefill --lengths 32,64 --cached 1008 --reps 5   # after a cached context

Per prompt length: the median CPU time of the step (1 thread; with more threads, its wall time),
for fresh prompts, or with `--cached N` for a chunk after N tokens the prefix cache holds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import engine.step as step_module
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.types import GenerationRequest, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="13,30,64,128,256", help="new prompt tokens a step")
    parser.add_argument("--cached", type=int, default=0, help="tokens of context the prefix cache holds")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig.of(max_num_seqs=1, max_num_batched_tokens=2048))
    torch.set_num_threads(args.threads)
    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    base = list(range(300, 300 + args.cached))
    if base:
        engine.generate([base], one)
    engine.generate([list(range(100, 145))], one)  # warm
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    n = 0
    print("| new tokens | cached | Python layer loop, ms | one call, ms | loop / one call |")
    print("|---:|---:|---:|---:|---:|")
    for length in (int(x) for x in args.lengths.split(",")):
        times: dict[str, list[float]] = {"loop": [], "one call": []}
        for _ in range(args.reps):
            for mode, bound in (("one call", 10**12), ("loop", -1)):
                step_module.ONE_CALL_PREFILL_CONTEXT = step_module.ONE_CALL_PREFILL_TOKENS = bound
                n += 1
                fresh = list(range(1000 + 7 * n, 1000 + 7 * n + length))  # never a cache hit
                engine.add_request(GenerationRequest(f"p{n}", base + fresh, one))
                start = clock()
                engine.step()
                times[mode].append((clock() - start) * 1e3)
                while engine.has_unfinished():
                    engine.step()
        loop, fused = (statistics.median(times[m]) for m in ("loop", "one call"))
        print(f"| {length} | {args.cached} | {loop:.1f} | {fused:.1f} | {loop / fused:.2f}x |")


if __name__ == "__main__":
    main()
