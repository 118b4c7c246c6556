"""A batch survives its gateway being SIGKILLed: a real `batchgate serve` process over the tiny model,
the storage directory on disk, killed twice mid-batch and started again. The batch completes with
exactly one line per custom_id, and the ledger equals the sum of the lines' usage at the batch
price (a line that ran again after a kill is billed once)."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import httpx
import openai
from openai.types import Batch

from tenancy import hash_key
from tenancy.config import load_config
from tests.pool.conftest import Process, replica_args, start, wait_ready

KEY = "sk-durable"
NUM_LINES = 36
TENANTS = f"""
[prices.tiny]
input = 1.0
cached_input = 1.0      # the cost of a line does not depend on what the prefix cache held
output = 4.0
batch_multiplier = 0.5

[plans.paid]
priority = "paid"
tokens_per_minute = 10000000
requests_per_minute = 100000
max_concurrent_requests = 64
queue_deadline_seconds = 60
batch_max_concurrent_lines = 3

[tenants.acme]
plan = "paid"
keys = ["{hash_key(KEY)}"]
"""


def serve(workdir: Path, model_dir: Path, name: str) -> Process:
    args = [
        *replica_args(model_dir),
        "--served-model-name",
        "tiny",
        "--tenants",
        str(workdir / "tenants.toml"),
    ]
    process = start(name, [*args, "--storage-dir", str(workdir / "storage")], workdir)
    try:
        wait_ready([process])
    except BaseException:
        process.stop()
        raise
    return process


def chat_lines() -> bytes:
    """The batch's input file: NUM_LINES chat lines of 24 output tokens each."""
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tiny",
                "messages": [{"role": "user", "content": f"Count to {i}"}],
                "max_tokens": 24,
                "ignore_eos": True,
                "temperature": 0,
            },
        }
        for i in range(NUM_LINES)
    ]
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def completed(client: openai.OpenAI, batch_id: str) -> int:
    counts = client.batches.retrieve(batch_id).request_counts
    return 0 if counts is None else counts.completed + counts.failed


def wait_for_lines(client: openai.OpenAI, batch_id: str, at_least: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while completed(client, batch_id) < at_least:
        assert time.monotonic() < deadline, f"fewer than {at_least} lines done after {timeout_s}s"
        time.sleep(0.05)


def assert_completed_once_and_billed_once(url: str, batch_id: str, tenants: Path) -> Batch:
    """Wait for the batch to complete: one output line per custom_id, each of 24 tokens, and the
    ledger (`/v1/usage` by batch) equal to the lines' usage at the batch price."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    deadline = time.monotonic() + 120
    while (batch := client.batches.retrieve(batch_id)).status != "completed":
        assert batch.status in ("in_progress", "finalizing"), batch
        assert time.monotonic() < deadline, f"batch not completed: {batch}"
        time.sleep(0.1)
    assert batch.error_file_id is None and batch.output_file_id is not None
    out = [json.loads(line) for line in client.files.content(batch.output_file_id).content.splitlines()]
    assert sorted(line["custom_id"] for line in out) == sorted(f"line-{i}" for i in range(NUM_LINES))
    usage = [line["response"]["body"]["usage"] for line in out]
    assert all(u["completion_tokens"] == 24 for u in usage)
    price = load_config(tenants).price("tiny")
    ledger = httpx.get(
        url + "/v1/usage",
        params={"start_time": int(time.time()) - 3600, "group_by": "batch"},
        headers={"authorization": f"Bearer {KEY}"},
    ).json()
    rows = [r for bucket in ledger["data"] for r in bucket["results"]]
    assert rows and all(r["batch"] for r in rows)
    assert sum(r["num_model_requests"] for r in rows) == NUM_LINES
    assert sum(r["input_tokens"] for r in rows) == sum(u["prompt_tokens"] for u in usage)
    assert sum(r["output_tokens"] for r in rows) == 24 * NUM_LINES
    expected = sum(price.cost(u["prompt_tokens"], 0, 24, batch=True) for u in usage)
    assert sum(r["cost_micros"] for r in rows) == expected
    return batch


def test_a_batch_killed_twice_completes_once_per_line_and_is_billed_once(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "tenants.toml").write_text(TENANTS)
    gateway = serve(tmp_path, tiny_model_dir, "gateway-1")
    try:
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0)
        upload = client.files.create(file=("in.jsonl", io.BytesIO(chat_lines())), purpose="batch")
        batch_id = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id
        for at_least, name in ((6, "gateway-2"), (18, "gateway-3")):
            wait_for_lines(client, batch_id, at_least)
            gateway.kill()  # SIGKILL: lines in flight are lost mid-generation
            gateway = serve(tmp_path, tiny_model_dir, name)
            client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0)
        batch = assert_completed_once_and_billed_once(gateway.url, batch_id, tmp_path / "tenants.toml")
        assert batch.usage is not None and batch.usage.output_tokens == 24 * NUM_LINES
    finally:
        gateway.stop()
