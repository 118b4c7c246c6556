"""Mixture-of-experts decode throughput against a dense model of the same active parameters, on the
CPU, in one run (issue 39: 32 streams of a top-2-of-8 MoE reach >= 0.7x the dense model's tokens/s).

    .venv/bin/python -m bench.moe_throughput [--rounds 3] [--streams 32] [--layers 30]

Both models have the bundled model's width (SmolLM2-135M: hidden 576, 9 query and 3 KV heads of 64,
a 49,152-token vocabulary, tied embeddings) and random weights: the dense one a SiLU MLP of 1,536
(Llama), the MoE one 8 experts of 768 with 2 per token (Mixtral: softmax, top 2, renormalized), so
a token's active parameters are the same. Both run as `batchgate serve` would run such a checkpoint
on this CPU with `--quantization int8`: float32 activations on our int8 kernels (the experts through
the grouped int8 matmul, engine/device/models/moe.py), a bf16 KV cache. Each round serves
`--streams` requests of 64-token prompts and 128 output tokens to completion, on the dense model
then the MoE one (alternating, so a change of the machine's load weighs on both); reported: the
output tokens/s of the decode phase (from the step after the last prefill to the end) and of the
whole run, medians over the rounds.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from bench.cpu import CpuMeter, wait_quiet
from bench.gpu_check import NullTokenizer, random_weights
from engine.config import EngineConfig
from engine.device.loader import LoadedModel
from engine.device.worker import EngineWorker
from engine.llm_engine import LLMEngine
from engine.model_spec import ModelSpec
from engine.resolve import resolve
from engine.types import GenerationRequest, SamplingParams

WIDTH = dict(
    vocab_size=49152,
    hidden_size=576,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    eos_token_id=2,
)
PROMPT_TOKENS, OUTPUT_TOKENS = 64, 128


def specs(layers: int) -> dict[str, ModelSpec]:
    dense = ModelSpec.from_config(
        dict(WIDTH, model_type="llama", intermediate_size=1536, num_hidden_layers=layers)
    )
    moe = ModelSpec.from_config(
        dict(
            WIDTH,
            model_type="mixtral",
            intermediate_size=768,
            num_local_experts=8,
            num_experts_per_tok=2,
            num_hidden_layers=layers,
        )
    )
    return {"dense": dense, "moe": moe}


def build(name: str, spec: ModelSpec, streams: int) -> LLMEngine:
    config = EngineConfig.of(
        dtype="float32",
        quantization="int8",
        max_num_seqs=streams,
        max_num_batched_tokens=1024,
        max_model_len=PROMPT_TOKENS + OUTPUT_TOKENS,
        kv_cache_memory_bytes=256 << 20,
        enable_prefix_caching=False,
    )
    torch.manual_seed(0)
    weights = random_weights(spec, torch.float32, torch.device("cpu"))
    model = LoadedModel(Path("."), name, spec, {}, NullTokenizer(), weights)
    return LLMEngine(config, worker=EngineWorker.start(resolve(config, in_memory_model=True), model))


def serve(engine: LLMEngine, prompts: list[list[int]]) -> tuple[float, float, float]:
    """(decode-phase tokens/s, whole-run tokens/s, decode-phase tokens per CPU second of this
    process) of serving `prompts` to the end."""
    sampling = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerationRequest(f"r{i}", prompt, sampling))
    started = time.perf_counter()
    tokens = {f"r{i}": 0 for i in range(len(prompts))}
    while not all(tokens.values()):  # until every stream has its first token: the prefills
        for out in engine.step():
            tokens[out.request_id] += len(out.new_token_ids)
    decode_start, before, cpu_start = time.perf_counter(), sum(tokens.values()), time.process_time()
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += len(out.new_token_ids)
    end, cpu = time.perf_counter(), time.process_time() - cpu_start
    total = sum(tokens.values())
    return (total - before) / (end - decode_start), total / (end - started), (total - before) / cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=0, help="torch's threads (0: its default)")
    parser.add_argument(
        "--wait-quiet-s", type=float, default=300.0, help="wait this long for a quiet machine"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    revision = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    cpu = next(
        (line.split(":", 1)[1].strip() for line in lines if "model name" in line), platform.processor()
    )
    print(
        f"moe_throughput: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, git {revision}, {cpu}, "
        f"{torch.get_num_threads()} threads"
    )
    engines = {name: build(name, spec, args.streams) for name, spec in specs(args.layers).items()}
    for name, engine in engines.items():
        print(f"{name}: {type(engine.runner.model.layers[0].mlp).__name__}, {args.layers} layers")
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, WIDTH["vocab_size"]) for _ in range(PROMPT_TOKENS)] for _ in range(args.streams)
    ]
    for engine in engines.values():  # warm up: kernels, allocations
        serve(engine, prompts[:4])
    quiet, busy = wait_quiet(0.15, args.wait_quiet_s)
    print(f"machine {'quiet' if quiet else 'NOT quiet'}: {100 * busy:.0f}% busy before the rounds")
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name, engine in engines.items():
            meter = CpuMeter()
            meter.start()
            results[name].append(serve(engine, prompts))
            others = meter.stop().others_busy
            decode, whole, per_cpu = results[name][-1]
            print(
                f"round {r + 1} {name}: decode {decode:.1f} tokens/s ({per_cpu:.1f} per CPU second), "
                f"whole run {whole:.1f} tokens/s; others took {100 * others:.0f}% of the machine"
            )
    medians = {name: [statistics.median(r[i] for r in rs) for i in range(3)] for name, rs in results.items()}
    for name, (decode, whole, per_cpu) in medians.items():
        print(
            f"{name} median: decode {decode:.1f} tokens/s ({per_cpu:.1f} per CPU second), "
            f"whole run {whole:.1f}"
        )
    moe, dense = medians["moe"], medians["dense"]
    print(
        f"moe / dense: decode {moe[0] / dense[0]:.2f}x, whole run {moe[1] / dense[1]:.2f}x, "
        f"decode per CPU second {moe[2] / dense[2]:.2f}x ({args.streams} streams)"
    )


if __name__ == "__main__":
    main()
