"""The one-shot device check: the engine on a GPU, measured, then the suite's CUDA tests.

    python bench/gpu_check.py          # on a GPU machine: Qwen3-8B's shape, then Qwen3-30B-A3B's, bf16
    python bench/gpu_check.py --shape llama-3.1-8b
    python bench/gpu_check.py --device cpu --shape tiny,tiny-moe --dtype float32  # the CPU smoke test

Builds a random-weight model of each chosen shape straight on the device (no checkpoint to carry),
one after the other, runs the engine (engine/llm_engine.py, as `batchgate serve` does) and prints
for each:

- the memory bandwidth, from a device-to-device copy in this run, and the decode bound it implies
  (bytes of weights one decode step reads / bandwidth): single-stream decode tokens/s against it;
- output tokens/s of a batch of 64 streams;
- time to first token of a 2,000-token prompt;
- continuous against static batching (`--batching static`) on outputs of 8..512 tokens (the first
  shape only: a second engine of a 30B model would not fit beside the first);
- whether the step used CUDA graphs and which decode-attention kernel;

then runs the tests marked `cuda` (`pytest -m cuda`). Only torch, numpy, triton and pytest are
needed (what a bare GPU image has): no tokenizer, no weights, no install of this repo. Runs from the
repository root. Every section checks a time budget (`--budget-s`), so the whole stays inside the
device lease; a section that would not fit says "skipped".
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python bench/gpu_check.py` puts bench/, not the root, on the path
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.device.loader import LoadedModel  # noqa: E402
from engine.device.worker import EngineWorker  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model_spec import ModelSpec  # noqa: E402
from engine.resolve import resolve  # noqa: E402
from engine.types import GenerationRequest, SamplingParams  # noqa: E402

# Hugging Face configs of the shapes (weights are random).
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        eos_token_id=[128001, 128008, 128009],
    ),
    # Qwen3-8B: q/k norms; and Qwen3-30B-A3B: 128 experts of 768, 8 per token, in every layer.
    "qwen3-8b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        eos_token_id=151645,
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        eos_token_id=151645,
    ),
    "tiny-moe": dict(
        model_type="qwen3_moe",
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=2,
    ),
    "tiny": dict(
        model_type="llama",
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=2,
    ),
}


@dataclass(frozen=True)
class Workload:
    decode_tokens: int  # single stream
    batch: int
    batch_prompt: int
    batch_output: int
    ttft_prompt: int
    mixed_requests: int  # continuous vs static: this many requests ...
    mixed_min_output: int  # ... with outputs log-uniform in [min, max]
    mixed_max_output: int
    kv_cache_bytes: int


WORKLOADS = {
    "llama-3.1-8b": Workload(256, 64, 128, 128, 2000, 256, 8, 512, 24 << 30),
    "qwen3-8b": Workload(256, 64, 128, 128, 2000, 256, 8, 512, 24 << 30),
    "qwen3-30b-a3b": Workload(256, 64, 128, 128, 2000, 256, 8, 512, 24 << 30),
    "tiny": Workload(16, 64, 16, 8, 2000, 48, 8, 32, 64 << 20),
    "tiny-moe": Workload(16, 64, 16, 8, 2000, 48, 8, 32, 64 << 20),
}


class NullTokenizer:
    """Random weights produce no text worth decoding; the engine's detokenizer gets empty strings."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def random_weights(spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors under the engine's canonical names (engine/device/models/checkpoint.py:
    experts stacked), N(0, 0.02) matrices and unit norms, on `device`."""
    h, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size

    def matrix(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=device).normal_(0.0, 0.02)

    w = {
        "model.embed_tokens.weight": matrix(spec.vocab_size, h),
        "lm_head.weight": matrix(spec.vocab_size, h),
        "model.norm.weight": torch.ones(h, dtype=dtype, device=device),
    }
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = matrix(spec.num_heads * d, h)
        w[p + "self_attn.k_proj.weight"] = matrix(spec.num_kv_heads * d, h)
        w[p + "self_attn.v_proj.weight"] = matrix(spec.num_kv_heads * d, h)
        w[p + "self_attn.o_proj.weight"] = matrix(h, spec.num_heads * d)
        if spec.qk_norm:
            w[p + "self_attn.q_norm.weight"] = torch.ones(d, dtype=dtype, device=device)
            w[p + "self_attn.k_norm.weight"] = torch.ones(d, dtype=dtype, device=device)
        if spec.moe is not None and spec.is_sparse(i):
            e, experts = spec.moe.intermediate_size, spec.moe.num_experts
            w[p + "mlp.router.weight"] = matrix(experts, h)
            w[p + "mlp.experts.gate_proj.weight"] = matrix(experts, e, h)
            w[p + "mlp.experts.up_proj.weight"] = matrix(experts, e, h)
            w[p + "mlp.experts.down_proj.weight"] = matrix(experts, h, e)
        else:
            w[p + "mlp.gate_proj.weight"] = matrix(inter, h)
            w[p + "mlp.up_proj.weight"] = matrix(inter, h)
            w[p + "mlp.down_proj.weight"] = matrix(h, inter)
        w[p + "input_layernorm.weight"] = torch.ones(h, dtype=dtype, device=device)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype, device=device)
    return w


def decode_bytes(spec: ModelSpec, weights: dict[str, torch.Tensor]) -> int:
    """Bytes one single-stream decode step must read: every weight but the embedding table (a lookup
    reads rows), and of each layer's experts only the k a token is routed to."""
    total = 0
    for name, t in weights.items():
        nbytes = t.numel() * t.element_size()
        if name == "model.embed_tokens.weight":
            continue
        if ".mlp.experts." in name and spec.moe is not None:
            nbytes = nbytes * spec.moe.top_k // spec.moe.num_experts
        total += nbytes
    return total


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(device: torch.device) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read and written."""
    n = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    synchronize(device)
    reps = 20 if device.type == "cuda" else 5
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    synchronize(device)
    return 2 * n * reps / (time.perf_counter() - start)


def make_engine(
    name: str,
    spec: ModelSpec,
    weights: dict[str, torch.Tensor],
    args: argparse.Namespace,
    work: Workload,
    batching: str = "continuous",
) -> LLMEngine:
    config = EngineConfig.of(
        dtype=args.dtype,
        device=args.device,
        kv_cache_memory_bytes=work.kv_cache_bytes,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        max_model_len=4096,
        batching=batching,
        enable_prefix_caching=False,  # random prompts share nothing; keep the figures plain
        quantization="none",
    )
    model = LoadedModel(Path("."), name, spec, {}, NullTokenizer(), dict(weights))
    return LLMEngine(config, worker=EngineWorker.start(resolve(config, in_memory_model=True), model))


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(length)]


def drain(engine: LLMEngine) -> int:
    """Step until idle; the number of output tokens."""
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return tokens


def single_stream(engine: LLMEngine, rng: random.Random, work: Workload, device: torch.device) -> float:
    """Decode tokens/s of one stream, prefill excluded."""
    engine.add_request(
        GenerationRequest("single", prompt(rng, 16, engine.spec.vocab_size), params(work.decode_tokens))
    )
    engine.step()  # the prefill and the first token
    synchronize(device)
    start = time.perf_counter()
    tokens = drain(engine)
    return tokens / (time.perf_counter() - start)


def batch_throughput(engine: LLMEngine, rng: random.Random, work: Workload, device: torch.device) -> float:
    for i in range(work.batch):
        prompt_ids = prompt(rng, work.batch_prompt, engine.spec.vocab_size)
        engine.add_request(GenerationRequest(f"batch-{i}", prompt_ids, params(work.batch_output)))
    start = time.perf_counter()
    tokens = drain(engine)
    synchronize(device)
    return tokens / (time.perf_counter() - start)


def time_to_first_token(engine: LLMEngine, rng: random.Random, work: Workload, device: torch.device) -> float:
    engine.add_request(
        GenerationRequest("ttft", prompt(rng, work.ttft_prompt, engine.spec.vocab_size), params(1))
    )
    start = time.perf_counter()
    while not any(o.new_token_ids for o in engine.step()):
        pass
    elapsed = time.perf_counter() - start
    drain(engine)
    return elapsed


def mixed_outputs(engine: LLMEngine, work: Workload, device: torch.device) -> float:
    """Output tokens/s of requests whose outputs are log-uniform in [min, max] tokens (seeded alike
    for both batching modes)."""
    rng = random.Random(7)
    lo, hi = math.log(work.mixed_min_output), math.log(work.mixed_max_output)
    for i in range(work.mixed_requests):
        out = int(round(math.exp(rng.uniform(lo, hi))))
        engine.add_request(
            GenerationRequest(f"mixed-{i}", prompt(rng, 64, engine.spec.vocab_size), params(out))
        )
    start = time.perf_counter()
    tokens = drain(engine)
    synchronize(device)
    return tokens / (time.perf_counter() - start)


def warm_up(engine: LLMEngine, rng: random.Random, work: Workload) -> None:
    """Compile kernels and settle allocations (prefill shapes included) before anything is timed."""
    for i, length in enumerate((16, 300, work.ttft_prompt)):
        engine.add_request(
            GenerationRequest(f"warm-{i}", prompt(rng, length, engine.spec.vocab_size), params(4))
        )
    drain(engine)


def describe_step(engine: LLMEngine) -> tuple[str, str]:
    """Whether the steps replayed CUDA graphs, and which decode-attention kernel ran."""
    graphs = engine.runner.graphs
    steps = engine.stats().total_steps
    if graphs is None:
        used = "not used (they need CUDA, triton and one rank)"
    else:
        buckets = f"{graphs.buckets[0]}..{graphs.buckets[-1]}"
        used = f"used: {graphs.num_replays} of {steps} steps replayed (decode batch buckets {buckets})"
    return used, engine.runner.attention_backend


def cuda_test_files() -> list[str]:
    """Test files that hold `cuda`-marked tests (found by text, so nothing else is imported)."""
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if "pytest.mark.cuda" in p.read_text()
    )


def run_cuda_tests(timeout_s: float) -> str:
    """`pytest -m cuda` over the files that have such tests; its summary line."""
    files = cuda_test_files()
    # No conftest: the suite's fixtures need services (Redis) and packages a bare GPU image lacks;
    # the cuda tests build what they need themselves.
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "--noconftest", "-p", "no:cacheprovider"]
    command += ["-o", "addopts=", "-W", "ignore::pytest.PytestConfigWarning", *files]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout_s:.0f}s"
    print(done.stdout[-4000:] + done.stderr[-2000:])
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return f"{lines[-1] if lines else 'no output'} (exit {done.returncode})"


def measure_shape(
    shape: str, args: argparse.Namespace, device: torch.device, left: Any, with_static: bool
) -> None:
    """Every figure of one shape; `with_static`: also a second engine for static batching."""
    work = WORKLOADS[shape]
    dtype = getattr(torch, args.dtype)
    spec = ModelSpec.from_config(SHAPES[shape])
    torch.manual_seed(0)
    rng = random.Random(0)

    def section(label: str, run: Any, fmt: Any, min_left: float = 10.0) -> Any:
        if left() < min_left:
            print(f"{label}: skipped (time budget)")
            return None
        t0 = time.monotonic()
        value = run()
        print(f"{label}: {fmt(value)}   [{time.monotonic() - t0:.1f}s]", flush=True)
        return value

    print(f"== {shape} ({spec.model_type}), {args.dtype}", flush=True)
    weights = random_weights(spec, dtype, device)
    weight_bytes = decode_bytes(spec, weights)
    num_params = sum(t.numel() for t in weights.values())
    experts = f", {spec.moe.top_k} of {spec.moe.num_experts} experts a token" if spec.moe else ""
    read = f"{weight_bytes / 1e9:.2f} GB read per decode step"
    print(f"model: {num_params / 1e9:.2f}B parameters{experts}, {read}")
    bandwidth = section(
        "memory bandwidth (device copy)", lambda: measure_bandwidth(device), lambda v: f"{v / 1e12:.2f} TB/s"
    )
    bound = bandwidth / weight_bytes

    t0 = time.monotonic()
    kept = dict(weights) if with_static else None  # the static engine's; else the engine owns them
    engine = make_engine(shape, spec, weights, args, work)
    del weights
    warm_up(engine, rng, work)
    print(f"engine: built and warmed up in {time.monotonic() - t0:.1f}s", flush=True)
    section(
        "single-stream decode",
        lambda: single_stream(engine, rng, work, device),
        lambda v: f"{v:.1f} tokens/s (HBM bound {bound:.1f} tokens/s: {100 * v / bound:.0f}%)",
    )
    section(
        f"batch-{work.batch} output",
        lambda: batch_throughput(engine, rng, work, device),
        lambda v: f"{v:.0f} tokens/s ({work.batch_prompt}-token prompts, {work.batch_output} tokens each)",
    )
    section(
        f"TTFT {work.ttft_prompt}-token prompt",
        lambda: time_to_first_token(engine, rng, work, device),
        lambda v: f"{1000 * v:.0f} ms",
    )
    mixed = f"{work.mixed_requests} requests, outputs {work.mixed_min_output}..{work.mixed_max_output} tokens"
    continuous = section(
        "continuous batching",
        lambda: mixed_outputs(engine, work, device),
        lambda v: f"{v:.0f} tokens/s ({mixed})",
    )
    graphs_line, attention = describe_step(engine)
    engine = None  # free its weights and KV cache before the next engine takes its own
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    static = None
    if kept is not None and continuous is not None and left() > 30:
        static_engine = make_engine(shape, spec, kept, args, work, batching="static")
        static = section(
            "static batching",
            lambda: mixed_outputs(static_engine, work, device),
            lambda v: f"{v:.0f} tokens/s ({mixed})",
        )
        static_engine = None
    kept = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if continuous is not None and static is not None:
        print(f"continuous vs static: {continuous / static:.2f}x")
    elif not with_static:
        print("continuous vs static: measured on the first shape only")
    else:
        print("continuous vs static: skipped (time budget)")
    print(f"CUDA graphs: {graphs_line}")
    print(f"attention kernel: {attention}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--shape", default="qwen3-8b,qwen3-30b-a3b", help=f"comma-separated, of {', '.join(sorted(SHAPES))}"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop starting sections after this")
    parser.add_argument("--no-tests", action="store_true", help="skip `pytest -m cuda`")
    args = parser.parse_args(argv)
    shapes = args.shape.split(",")
    unknown = [shape for shape in shapes if shape not in SHAPES]
    if unknown:
        parser.error(f"unknown shape {unknown[0]!r}: choose from {', '.join(sorted(SHAPES))}")
    started = time.monotonic()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available here (use --device cpu --shape tiny for the CPU smoke run)")
        return 2

    def left() -> float:
        return args.budget_s - (time.monotonic() - started)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"gpu_check: {name}, torch {torch.__version__}, shapes {args.shape}, {args.dtype}", flush=True)
    for i, shape in enumerate(shapes):
        measure_shape(shape, args, device, left, with_static=i == 0)
    if args.no_tests:
        print("cuda tests: not run (--no-tests)")
    elif device.type != "cuda":
        print("cuda tests: not run (no CUDA device)")
    else:
        print(f"cuda tests: {run_cuda_tests(max(60.0, left() + 60))}")
    print(f"gpu_check: done in {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
