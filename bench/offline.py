"""What the offline contenders (transformers' generate_batch, our engine) share: the workload, the
result record and the command-line plumbing, so `compare.py` can run each in its own process and
read one JSON line back.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from dataclasses import asdict, dataclass, field

from bench.prompts import chat_prompts


@dataclass
class OfflineResult:
    """One offline run: `num_requests` prompts submitted at once, `max_tokens` generated each."""

    name: str
    dtype: str
    num_requests: int
    max_concurrency: int | None
    max_tokens: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_short: int  # requests that returned fewer than max_tokens tokens (EOS not ignored?)
    duration_s: float
    output_tokens_per_s: float
    load_s: float
    warmup_s: float
    num_threads: int
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32, help="max sequences running at once")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float32"],
        default="bfloat16",
        help="auto: the server's default (on AVX2: float32 on our int8 kernels; float32 is the exact mode)",
    )
    parser.add_argument("--prompt-lengths", default="natural", help="see bench.prompts.PromptLengths")
    parser.add_argument("--seed", type=int, default=0, help="prompt set seed")
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: bundled SmolLM2-135M)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the small untimed warm-up run")
    parser.add_argument("--json", action="store_true", help="print only the result as one JSON line")


def workload(args: argparse.Namespace) -> list[list[dict[str, str]]]:
    return chat_prompts(args.num_requests, seed=args.seed, lengths=args.prompt_lengths)


def set_threads(args: argparse.Namespace) -> int:
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return torch.get_num_threads()


def emit(result: OfflineResult, as_json: bool) -> None:
    if as_json:
        print(result.to_json(), flush=True)
        return
    print(
        f"{result.name} [{result.dtype}] {result.num_requests} requests, concurrency "
        f"{result.max_concurrency}, {result.max_tokens} tokens each, {result.num_threads} threads\n"
        f"  output tokens: {result.num_output_tokens} in {result.duration_s:.2f} s -> "
        f"{result.output_tokens_per_s:.1f} tokens/s  (short: {result.num_short}; load {result.load_s:.1f} s, "
        f"warm-up {result.warmup_s:.1f} s)"
    )
    for note in result.notes:
        print(f"  note: {note}")


def machine() -> dict[str, str | int]:
    """The machine a figure was measured on, for the record."""
    model_name = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model_name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": model_name, "cpus": os.cpu_count() or 0, "python": sys.version.split()[0]}
