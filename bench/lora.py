"""LoRA adapters against the base model, side by side in one process (issue 26's speed figures).

    python -m bench.lora --num-requests 64 --concurrency 32 --max-tokens 64 --adapters 8 --rank 16

One engine (the default configuration: on an AVX2 CPU the bundled GGUF's Q4_1 layers on our int8
kernels), the same prompts, alternating runs: every stream on the base model, then the streams
spread round-robin over `--adapters` adapters of rank `--rank` on all seven projections (random
A and B, generated with PEFT into a temporary folder), `--repeat` times. Reports each run's output
tokens/s and the adapters' ratio to the base, the cold-load time of one adapter from local disk
(p50/p95 over `--loads` loads), and the adapter bytes the engine holds before and after unloading
(with RSS after malloc_trim).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.cpu import CpuMeter
from bench.model import chat_token_ids, hf_folder
from bench.offline import add_workload_args, set_threads, workload


def make_adapters(model_dir: Path, root: Path, count: int, rank: int) -> list[Path]:
    import torch
    from transformers import AutoModelForCausalLM

    from tests.lora_adapters import make_adapter

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return [make_adapter(base, root / f"a{i}", r=rank, alpha=rank, seed=i) for i in range(count)]


def timed(engine: Any, prompts: list[list[int]], loras: list[Any], max_tokens: int) -> float:
    """Output tokens/s of one run; `loras[i % len]` is request i's adapter (None: the base)."""
    from engine.types import GenerationRequest, SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        request_id = f"b{time.monotonic_ns()}-{i}"
        engine.add_request(GenerationRequest(request_id, prompt, sampling, lora=loras[i % len(loras)]))
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    return tokens / (time.perf_counter() - start)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_args(parser)
    parser.set_defaults(dtype="auto")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--loads", type=int, default=20, help="cold loads timed")
    parser.add_argument("--kv-cache-mib", type=int, default=512, help="KV cache memory (a shared machine)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    threads = set_threads(args)
    folder = hf_folder(args.model)
    prompts = chat_token_ids(AutoTokenizer.from_pretrained(folder), workload(args))
    config: dict[str, Any] = {
        "max_num_seqs": args.concurrency,
        "dtype": args.dtype,
        "max_loras": args.adapters,
        "kv_cache_memory_bytes": args.kv_cache_mib << 20,
    }
    if args.model is not None:
        config["model"] = args.model
    engine = LLMEngine(EngineConfig.of(**config))
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(folder, Path(tmp), args.adapters, args.rank)
        adapters = [engine.load_lora(f"a{i}", str(p)) for i, p in enumerate(paths)]
        timed(engine, prompts[:4], [None], 4)  # warm-up
        timed(engine, prompts[:8], adapters, 4)
        runs: dict[str, list[float]] = {"base": [], "lora": []}
        meter = CpuMeter()
        meter.start()
        for _ in range(args.repeat):
            runs["base"].append(timed(engine, prompts, [None], args.max_tokens))
            runs["lora"].append(timed(engine, prompts, adapters, args.max_tokens))
        others = meter.stop().others_busy
        loads = []
        for i in range(args.loads):
            start = time.perf_counter()
            engine.load_lora("cold", str(paths[i % len(paths)]))
            loads.append(time.perf_counter() - start)
        held = engine.loras.nbytes
        rss_before = rss_mib()
        for name in [*engine.loras.names()]:
            engine.loras.unload(name)
        engine.step()  # the slots let go of the released weights
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        after = engine.loras.nbytes
        rss_after = rss_mib()
    base, lora = statistics.mean(runs["base"]), statistics.mean(runs["lora"])
    loads.sort()
    print(
        f"{args.num_requests} requests, concurrency {args.concurrency}, {args.max_tokens} tokens, "
        f"{threads} threads, {args.adapters} adapters of rank {args.rank}\n"
        f"  base: {', '.join(f'{r:.1f}' for r in runs['base'])} tokens/s (mean {base:.1f})\n"
        f"  lora: {', '.join(f'{r:.1f}' for r in runs['lora'])} tokens/s (mean {lora:.1f})"
        f" -> {lora / base:.2f}x base (others' CPU share {others:.0%})\n"
        f"  cold load: p50 {statistics.median(loads) * 1e3:.1f} ms,"
        f" p95 {loads[int(0.95 * (len(loads) - 1))] * 1e3:.1f} ms\n"
        f"  adapter bytes held {held / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB after unload; "
        f"RSS {rss_before:.0f} -> {rss_after:.0f} MiB after malloc_trim"
    )


if __name__ == "__main__":
    main()
