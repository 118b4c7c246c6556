"""A Batch API batch against the engine's offline throughput on the same lines, side by side in one run.

    python -m bench.batch --num-requests 2000 --max-tokens 64 --concurrency 32 --dtype bfloat16

The issue's target: on an idle server, a 2,000-line chat batch (64 output tokens a line) runs at
>= 90% of `bench.engine_offline`'s output tokens/s on the same prompts. Both use the same workload
(`bench.offline.workload`: the chat prompts, `ignore_eos`, greedy) and the same concurrency (the
engine's `--max-num-seqs`, and the tenant's batch lines in flight). The offline figure runs first
in its own process (`bench.engine_offline --json`), then a `batchgate serve` with a fresh storage
directory takes the batch: timed from `batches.create` to `completed` (validation, every line
through the pipeline, the journal, the output file), with its output tokens read from the output
file's usage. `--repeat N` alternates the two N times. A smoke run: `--num-requests 16 --max-tokens 8`.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.offline import add_workload_args, workload
from bench.servers import batchgate_spec, launched


def offline(args: argparse.Namespace) -> float:
    """Output tokens/s of the engine in process (a subprocess of its own)."""
    argv = [
        sys.executable,
        "-m",
        "bench.engine_offline",
        "--json",
        *("--num-requests", str(args.num_requests), "--max-tokens", str(args.max_tokens)),
        *("--concurrency", str(args.concurrency), "--dtype", args.dtype, "--seed", str(args.seed)),
        *("--prompt-lengths", args.prompt_lengths),
        *(("--model", args.model) if args.model else ()),
        *(("--threads", str(args.threads)) if args.threads else ()),
    ]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    return float(json.loads(out.strip().splitlines()[-1])["output_tokens_per_s"])


def batch(args: argparse.Namespace, workdir: Path) -> tuple[float, float]:
    """(output tokens/s, seconds) of one batch of the workload through `batchgate serve`."""
    import openai

    extra = [
        *("--storage-dir", str(workdir / "storage"), "--embedding-model", "none"),
        *("--batch-max-concurrent-lines", str(args.concurrency), "--batch-max-lines", str(args.num_requests)),
        *(("--model", args.model) if args.model else ()),
        *(("--num-threads", str(args.threads)) if args.threads else ()),
    ]
    spec = batchgate_spec(args.dtype, args.concurrency, extra)
    with launched(spec, workdir / "logs"):
        client = openai.OpenAI(base_url=spec.base_url, api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        lines = [
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": model,
                    "messages": messages,
                    "max_tokens": args.max_tokens,
                    "ignore_eos": True,
                    "temperature": 0,
                },
            }
            for i, messages in enumerate(workload(args))
        ]
        data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
        upload = client.files.create(file=("batch.jsonl", io.BytesIO(data)), purpose="batch")
        start = time.perf_counter()
        created = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        while (done := client.batches.retrieve(created.id)).status not in (
            "completed",
            "failed",
            "cancelled",
        ):
            time.sleep(0.2)
        duration_s = time.perf_counter() - start
        if done.status != "completed" or done.output_file_id is None:
            raise RuntimeError(f"the batch ended {done.status}: {done.errors}")
        out = client.files.content(done.output_file_id).content.splitlines()
        num_output = sum(json.loads(line)["response"]["body"]["usage"]["completion_tokens"] for line in out)
        if len(out) != args.num_requests:
            raise RuntimeError(f"{len(out)} output lines for {args.num_requests} requests")
        return num_output / duration_s, duration_s


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(parser)
    parser.add_argument("--repeat", type=int, default=1, help="alternate offline and batch this many times")
    args = parser.parse_args(argv)
    for round_ in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
            engine_tps = offline(args)
            batch_tps, seconds = batch(args, Path(tmp))
        result = {
            "round": round_,
            "num_requests": args.num_requests,
            "max_tokens": args.max_tokens,
            "concurrency": args.concurrency,
            "dtype": args.dtype,
            "offline_tokens_per_s": round(engine_tps, 1),
            "batch_tokens_per_s": round(batch_tps, 1),
            "batch_seconds": round(seconds, 2),
            "ratio": round(batch_tps / engine_tps, 3),
        }
        print(json.dumps(result) if args.json else result, flush=True)


if __name__ == "__main__":
    main()
