"""Speculative decoding and Predicted Outputs through the server, side by side with llama.cpp's
server and its own n-gram speculation on the same GGUF (docs/BENCHMARKS.md, issue 41).

    .venv/bin/python -m bench.speculative [--llama-server PATH] [--rounds 3] [--streams 32]

One stream, greedy, each request alone: free text (EOS ignored) and a ~250-token code listing the
prompt asks to repeat, with batchgate's defaults (prompt lookup), then the listing with a perfect
and a partly wrong `prediction`, and a code edit (rename an identifier in a 60-line file, the file
as the prediction); every output compared with the one speculation off gives. Decode rate: the
output's tokens after the first over the time from the first to the last. Then 32 streams of free
text at once against a second batchgate with `--speculative-decoding off`, in turns. The memory
bound of one token per pass (the GGUF's bytes over the read bandwidth) is measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.model import bundled_gguf
from bench.qmatmul import bandwidth_gb_s
from bench.servers import batchgate_spec, launched, llama_server_spec

LISTING = "\n".join(
    f"def area_{i}(width, height):\n    scale = {i} + 1\n    return width * height * scale\n"
    for i in range(8)
)
REPEAT = "Repeat this code exactly, with no other text:\n\n" + LISTING
FREE = "Describe the history of Rome from its founding to the fall of the Western Empire."
EDIT_FILE = "\n".join(
    line
    for i in range(10)
    for line in (
        f"def compute_total_{i}(prices, tax):",
        "    subtotal = sum(prices)",
        f"    # item group {i}",
        "    total = subtotal * (1 + tax)",
        "    return round(total, 2)",
        "",
    )
)
EDIT = (
    "Rename every `subtotal` to `base` in this file. Answer with the whole file and nothing else.\n\n"
    + EDIT_FILE
)


@dataclass
class Run:
    text: str
    tokens: int
    decode_tok_s: float
    accepted: int | None = None
    rejected: int | None = None


def stream_one(base: str, model: str, prompt: str, max_tokens: int, **extra: Any) -> Run:
    """One greedy chat request, streamed; its text, token count and decode rate."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    parts: list[str] = []
    first = last = 0.0
    usage: dict[str, Any] = {}
    with httpx.stream("POST", base + "/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    parts.append(piece)
    tokens = int(usage.get("completion_tokens", 0))
    details = usage.get("completion_tokens_details") or {}
    rate = (tokens - 1) / (last - first) if last > first else 0.0
    return Run(
        "".join(parts),
        tokens,
        rate,
        details.get("accepted_prediction_tokens"),
        details.get("rejected_prediction_tokens"),
    )


async def streams_throughput(base: str, model: str, streams: int, max_tokens: int) -> float:
    """Output tokens per second of `streams` free-text requests at once (EOS ignored)."""
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(i: int) -> int:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": f"{FREE} Chapter {i}."}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            r = await client.post(base + "/chat/completions", json=body)
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(streams)))
        return sum(counts) / (time.perf_counter() - start)


def model_of(base: str) -> str:
    return str(httpx.get(base + "/models", timeout=30).json()["data"][0]["id"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--stream-tokens", type=int, default=128)
    parser.add_argument("--stream-rounds", type=int, default=6, help="32-stream rounds, alternating order")
    args = parser.parse_args()
    gguf = bundled_gguf()
    revision = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    gbs = bandwidth_gb_s()
    bound = gbs * 1e9 / gguf.stat().st_size
    print(
        f"revision {revision}; read bandwidth {gbs:.1f} GB/s; {gguf.name} {gguf.stat().st_size / 1e6:.0f} MB;"
    )
    print(f"one token per pass over the weights: at most {bound:.0f} tokens/s")
    logs = Path(tempfile.mkdtemp(prefix="bench-spec-"))
    with ExitStack() as stack:
        on = batchgate_spec("auto", args.streams)
        off = batchgate_spec("auto", args.streams, ["--speculative-decoding", "off"])
        stack.enter_context(launched(on, logs / "on"))
        stack.enter_context(launched(off, logs / "off"))
        llama = None
        if args.llama_server:
            plain = llama_server_spec(args.llama_server, gguf, 1, 2)
            ngram = llama_server_spec(
                args.llama_server,
                gguf,
                1,
                2,
                extra_args=["--spec-type", "ngram-simple", "--spec-draft-n-max", "16"],
            )
            stack.enter_context(launched(plain, logs / "llama-plain"))
            stack.enter_context(launched(ngram, logs / "llama-ngram"))
            llama = {"llama.cpp": plain.base_url, "llama.cpp ngram-simple": ngram.base_url}
        model = model_of(on.base_url)
        stream_one(on.base_url, model, FREE, 16)  # warm both
        stream_one(off.base_url, model, FREE, 16)
        rows: dict[str, list[Run]] = {}
        outputs: dict[str, str] = {}
        for _ in range(args.rounds):
            reference = stream_one(off.base_url, model, REPEAT, 400)
            outputs["listing"] = reference.text
            wrong = reference.text.replace("height", "depth").replace("scale", "factor")
            edit_ref = stream_one(off.base_url, model, EDIT, 600)
            outputs["edit"] = edit_ref.text
            cases: list[tuple[str, str, str, int, dict[str, Any]]] = [
                ("free text, off", off.base_url, FREE, reference.tokens, {"ignore_eos": True}),
                ("free text", on.base_url, FREE, reference.tokens, {"ignore_eos": True}),
                ("listing, off", off.base_url, REPEAT, 400, {}),
                ("listing (prompt lookup)", on.base_url, REPEAT, 400, {}),
                (
                    "listing, perfect prediction",
                    on.base_url,
                    REPEAT,
                    400,
                    {"prediction": {"type": "content", "content": reference.text}},
                ),
                (
                    "listing, partly wrong prediction",
                    on.base_url,
                    REPEAT,
                    400,
                    {"prediction": {"type": "content", "content": wrong}},
                ),
                ("edit, off", off.base_url, EDIT, 600, {}),
                ("edit (prompt lookup)", on.base_url, EDIT, 600, {}),
                (
                    "edit, file as prediction",
                    on.base_url,
                    EDIT,
                    600,
                    {"prediction": {"type": "content", "content": EDIT_FILE}},
                ),
            ]
            for name, base, prompt, max_tokens, extra in cases:
                run = stream_one(base, model, prompt, max_tokens, **extra)
                rows.setdefault(name, []).append(run)
                expected = (
                    outputs["listing"] if prompt == REPEAT else outputs["edit"] if prompt == EDIT else None
                )
                if expected is not None and run.text != expected:
                    pairs = zip(run.text, expected, strict=False)
                    shorter = min(len(run.text), len(expected))
                    at = next((i for i, (a, b) in enumerate(pairs) if a != b), shorter)
                    print(
                        f"!! {name}: output differs from speculation off at char {at}: "
                        f"{run.text[max(0, at - 40) : at + 20]!r} vs {expected[max(0, at - 40) : at + 20]!r}"
                    )
            for label, base in (llama or {}).items():
                for name, prompt, max_tokens, extra in (
                    ("free text", FREE, reference.tokens, {"ignore_eos": True}),
                    ("listing", REPEAT, 400, {}),
                    ("edit", EDIT, 600, {}),
                ):
                    run = stream_one(base, model, prompt, max_tokens, **extra)
                    rows.setdefault(f"{label}: {name}", []).append(run)
        free = statistics.median(r.decode_tok_s for r in rows["free text, off"])
        print(f"\none stream, greedy, median of {args.rounds} (x: of batchgate's free text, off)")
        print("| case | tokens | decode tok/s | x free text | accepted / rejected prediction tokens |")
        print("|---|---:|---:|---:|---:|")
        for name, runs in rows.items():
            rate = statistics.median(r.decode_tok_s for r in runs)
            pred = f"{runs[-1].accepted} / {runs[-1].rejected}" if runs[-1].accepted is not None else ""
            print(f"| {name} | {runs[-1].tokens} | {rate:.1f} | {rate / free:.2f}x | {pred} |")
        print(f"\n{args.streams} streams of free text ({args.stream_tokens} tokens each), in turns")
        ratios = []
        for i in range(args.stream_rounds):
            # The order alternates by round: the machine's drift does not favour either server.
            first, second = (on, off) if i % 2 == 0 else (off, on)
            runs = {
                s.base_url: asyncio.run(
                    streams_throughput(s.base_url, model, args.streams, args.stream_tokens)
                )
                for s in (first, second)
            }
            with_spec, without = runs[on.base_url], runs[off.base_url]
            ratios.append(with_spec / without)
            print(f"round {i + 1}: on {with_spec:.1f} tok/s, off {without:.1f} tok/s, {ratios[-1]:.3f}x")
        print(f"median {statistics.median(ratios):.3f}x")


if __name__ == "__main__":
    main()
