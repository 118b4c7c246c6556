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

    python -m bench.batch --interactive --num-requests 2000 --interactive-requests 16

`--interactive`: the issue's second target, in one server (a tenants file: a paid and a free tenant
for interactive traffic, a third for the batch). (1) Interactive alone: a paid and a free client,
4 concurrent streams each (8 in all, `bench.prompts` as issue 7's loadgen sends them), TTFT p99 and
output tokens/s. (2) The batch alone on the idle server for as long as (1) took: the lines it
completes. (3) Interactive again with a fresh batch running: TTFT p99 within 1.5x of (1), output
tokens/s within 0.85x, and the batch's lines completed meanwhile, per second, at least 30% of (2)'s.
Each batch is cancelled once its phase is measured, so `--num-requests` only has to outlast a phase
(one phase is 2 x `--interactive-requests` x `--max-tokens` tokens at the 8 streams' rate); every
wait is bounded (`--phase-timeout`), and each phase's start goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.cpu import CpuMeter
from bench.loadgen import LoadConfig, run_load
from bench.offline import add_workload_args, workload
from bench.servers import batchgate_spec, launched

# --interactive: three tenants, limits far above the load (batch lines have a lane of their own).
TENANTS = """
[plans.paid]
priority = "paid"
tokens_per_minute = 100000000
requests_per_minute = 1000000
max_concurrent_requests = 1000
queue_deadline_seconds = 600

[plans.free]
priority = "free"
tokens_per_minute = 100000000
requests_per_minute = 1000000
max_concurrent_requests = 1000
queue_deadline_seconds = 600

[tenants.paid]
plan = "paid"
keys = ["{paid}"]

[tenants.free]
plan = "free"
keys = ["{free}"]

[tenants.batch]
plan = "paid"
keys = ["{batch}"]
"""
KEYS = {"paid": "sk-bench-paid", "free": "sk-bench-free", "batch": "sk-bench-batch"}


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


def server_args(args: argparse.Namespace, workdir: Path) -> list[str]:
    return [
        *("--storage-dir", str(workdir / "storage"), "--embedding-model", "none"),
        *("--batch-max-concurrent-lines", str(args.concurrency), "--batch-max-lines", str(args.num_requests)),
        *(("--model", args.model) if args.model else ()),
        *(("--num-threads", str(args.threads)) if args.threads else ()),
    ]


def upload_batch(args: argparse.Namespace, client: Any) -> str:
    """The workload as a batch input file; its id."""
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
    return str(client.files.create(file=("batch.jsonl", io.BytesIO(data)), purpose="batch").id)


def batch(args: argparse.Namespace, workdir: Path) -> tuple[float, float]:
    """(output tokens/s, seconds) of one batch of the workload through `batchgate serve`."""
    import openai

    spec = batchgate_spec(args.dtype, args.concurrency, server_args(args, workdir))
    spec = replace(spec, start_timeout_s=900)
    with launched(spec, workdir / "logs"):
        client = openai.OpenAI(base_url=spec.base_url, api_key="unused", max_retries=0)
        upload_id = upload_batch(args, client)
        start = time.perf_counter()
        created = client.batches.create(
            input_file_id=upload_id, endpoint="/v1/chat/completions", completion_window="24h"
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


def done_lines(client: Any, batch_id: str) -> int:
    """Lines the batch has answered so far; RuntimeError once it ended (nothing left to measure)."""
    batch = client.batches.retrieve(batch_id)
    if batch.status not in ("validating", "in_progress"):
        raise RuntimeError(f"batch {batch_id} is {batch.status} before its phase ended: {batch.errors}")
    counts = batch.request_counts
    return 0 if counts is None else int(counts.completed + counts.failed)


def wait_for(what: str, done: Any, timeout_s: float) -> None:
    """Poll `done()` until true; RuntimeError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.05)


def phase(name: str, began: float) -> None:
    print(f"[bench.batch {time.perf_counter() - began:7.1f} s] {name}", file=sys.stderr, flush=True)


async def interactive_load(args: argparse.Namespace, base_url: str, model: str) -> dict[str, Any]:
    """A paid and a free client, 4 streams each at once: TTFT p99 and output tokens/s of both;
    RuntimeError if any request failed (the figures would be of errors)."""

    def config(tenant: str, seed: int) -> LoadConfig:
        return LoadConfig(
            base_url=base_url,
            model=model,  # (the load generator's own lookup sends no key: a 401 with tenants)
            api_key=KEYS[tenant],
            concurrency=4,
            num_requests=args.interactive_requests,
            max_tokens=args.max_tokens,
            seed=seed,
        )

    start = time.perf_counter()
    paid, free = await asyncio.gather(run_load(config("paid", 1)), run_load(config("free", 2)))
    wall_s = time.perf_counter() - start
    for name, run in (("paid", paid), ("free", free)):
        if run["errors_by_status"]:
            raise RuntimeError(f"{name} interactive requests failed: {run['sample_errors']}")
    return {
        "wall_s": round(wall_s, 2),
        "output_tokens_per_s": round((paid["output_tokens"] + free["output_tokens"]) / wall_s, 1),
        "ttft_p99_ms": {"paid": paid["ttft_ms"]["p99"], "free": free["ttft_ms"]["p99"]},
        "errors": {"paid": paid["errors_by_status"], "free": free["errors_by_status"]},
    }


def interactive(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The three phases of `--interactive` (see the module docstring) on one server."""
    import openai

    from tenancy import hash_key

    hashes = {name: hash_key(key) for name, key in KEYS.items()}
    (workdir / "tenants.toml").write_text(TENANTS.format(**hashes))
    extra = [
        *server_args(args, workdir),
        "--tenants",
        str(workdir / "tenants.toml"),
        "--internal-token",
        "bench",
    ]
    spec = replace(batchgate_spec(args.dtype, args.concurrency, extra), start_timeout_s=900)
    timeout_s = args.phase_timeout
    t0 = time.perf_counter()
    phase("starting the server", t0)
    others: dict[str, float] = {}  # the share of the CPUs other work took, per measured phase
    with launched(spec, workdir / "logs") as proc:
        meter = CpuMeter(proc.pid)  # the server's process group counts as ours
        client = openai.OpenAI(base_url=spec.base_url, api_key=KEYS["batch"], max_retries=0, timeout=60)
        upload_id = upload_batch(args, client)
        model = client.models.list().data[0].id

        def load() -> dict[str, Any]:
            return asyncio.run(asyncio.wait_for(interactive_load(args, spec.base_url, model), timeout_s))

        def start_batch() -> str:
            batch_id = str(
                client.batches.create(
                    input_file_id=upload_id, endpoint="/v1/chat/completions", completion_window="24h"
                ).id
            )
            wait_for(f"the first line of {batch_id}", lambda: done_lines(client, batch_id) >= 1, timeout_s)
            return batch_id

        def cancel(batch_id: str) -> None:
            client.batches.cancel(batch_id)
            wait_for(
                f"cancelling {batch_id}",
                lambda: client.batches.retrieve(batch_id).status == "cancelled",
                timeout_s,
            )

        phase("interactive warm-up (untimed)", t0)
        load()
        phase("(1) interactive alone", t0)
        meter.start()
        alone = load()
        others["interactive_alone"] = meter.stop().others_busy
        phase(f"(2) the batch alone for {alone['wall_s']} s", t0)
        idle_id = start_batch()
        first = done_lines(client, idle_id)
        began = time.perf_counter()
        meter.start()
        time.sleep(alone["wall_s"])
        idle_rate = (done_lines(client, idle_id) - first) / (time.perf_counter() - began)
        others["batch_alone"] = meter.stop().others_busy
        phase("cancelling the idle batch", t0)
        cancel(idle_id)
        phase("(3) interactive with a batch", t0)
        mixed_id = start_batch()
        first = done_lines(client, mixed_id)
        began = time.perf_counter()
        meter.start()
        mixed = load()
        mixed_rate = (done_lines(client, mixed_id) - first) / (time.perf_counter() - began)
        others["interactive_with_batch"] = meter.stop().others_busy
        phase("cancelling the batch, stopping the server", t0)
        cancel(mixed_id)
    phase("done", t0)
    return {
        "num_requests": args.num_requests,
        "interactive_requests": args.interactive_requests,
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "interactive_alone": alone,
        "interactive_with_batch": mixed,
        "ttft_p99_ratio": {
            c: round(mixed["ttft_p99_ms"][c] / alone["ttft_p99_ms"][c], 3) for c in ("paid", "free")
        },
        "output_tokens_per_s_ratio": round(mixed["output_tokens_per_s"] / alone["output_tokens_per_s"], 3),
        "batch_lines_per_s_idle": round(idle_rate, 3),
        "batch_lines_per_s_with_interactive": round(mixed_rate, 3),
        "batch_share": round(mixed_rate / idle_rate, 3) if idle_rate else None,
        "targets": "TTFT p99 ratio <= 1.5, output tokens/s ratio >= 0.85, batch share >= 0.30",
        "others_cpu_share": {name: round(share, 3) for name, share in others.items()},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(parser)
    parser.add_argument("--repeat", type=int, default=1, help="alternate offline and batch this many times")
    parser.add_argument("--interactive", action="store_true", help="the interactive-with-a-batch run")
    parser.add_argument("--interactive-requests", type=int, default=16, help="requests per client")
    parser.add_argument(
        "--phase-timeout", type=float, default=300.0, help="--interactive: seconds any one wait may take"
    )
    args = parser.parse_args(argv)
    if args.interactive:
        with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
            try:
                print(json.dumps(interactive(args, Path(tmp))), flush=True)
            except BaseException:
                for log in Path(tmp, "logs").glob("*.log"):  # the server's last words, before they go
                    tail = log.read_text(errors="replace").splitlines()[-40:]
                    print(f"--- {log.name} (last lines)", *tail, sep="\n", file=sys.stderr)
                raise
        return
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
