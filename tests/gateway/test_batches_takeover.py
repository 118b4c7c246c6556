"""Two `batchgate serve` gateways over one real redis-server and one bucket (moto's S3 server): the
gateway running a batch is SIGKILLed mid-batch, and the other takes the batch over as soon as the
runner's lease lapses (within `--batch-lease` of the kill). The batch completes with exactly one
line per custom_id, its ledger equals the sum of its lines' usage at the batch price, and its
trace links its lines: each line's request span links to the `batch {id}` span of its runner
(spans read by a real OTLP receiver)."""

from __future__ import annotations

import io
import time
from pathlib import Path

import openai
import redis

from tenancy.keyspace import tenant_tag
from tests.gateway.s3_server import BUCKET, moto_server
from tests.gateway.test_batches_durability import (
    KEY,
    TENANTS,
    assert_completed_once_and_billed_once,
    chat_lines,
    completed,
)
from tests.pool.conftest import Process, replica_args, start, wait_ready
from tests.pool.otlp_receiver import OTLPReceiver

LEASE_S = 3.0


def test_killing_the_runners_gateway_hands_the_batch_to_the_other(
    tiny_model_dir: Path, tmp_path: Path, redis_url: str
) -> None:
    (tmp_path / "tenants.toml").write_text(TENANTS)
    otlp = OTLPReceiver()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.url, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    gateways: dict[int, Process] = {}
    with moto_server(tmp_path) as s3_url:
        args = [
            *replica_args(tiny_model_dir),
            *("--served-model-name", "tiny", "--tenants", str(tmp_path / "tenants.toml")),
            *("--redis-url", redis_url, "--batch-lease", str(LEASE_S), "--request-lease", str(LEASE_S)),
            *("--files-bucket", f"s3://{BUCKET}/pool", "--s3-endpoint-url", s3_url),
        ]
        try:
            for name in ("gateway-a", "gateway-b"):
                process = start(name, args, tmp_path, env)
                gateways[process.proc.pid] = process
            wait_ready(list(gateways.values()))
            first, second = gateways.values()
            client = openai.OpenAI(base_url=first.url + "/v1", api_key=KEY, max_retries=0)
            upload = client.files.create(file=("in.jsonl", io.BytesIO(chat_lines())), purpose="batch")
            batch_id = client.batches.create(
                input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
            ).id
            runner_key = f"{tenant_tag('acme')}:batch:{batch_id}:runner"
            store = redis.Redis.from_url(redis_url, decode_responses=True)

            def runner() -> Process | None:
                owner = store.get(runner_key)
                return None if owner is None else gateways[int(str(owner).split(":")[1])]

            deadline = time.monotonic() + 60
            while completed(client, batch_id) < 8:
                assert time.monotonic() < deadline, "the batch did not start"
                time.sleep(0.05)
            victim = runner()
            assert victim is not None
            survivor = second if victim is first else first
            client = openai.OpenAI(base_url=survivor.url + "/v1", api_key=KEY, max_retries=0)
            victim.kill()  # SIGKILL: its lines in flight are lost mid-generation, its lease stays
            killed_at = time.monotonic()
            while runner() is not survivor:
                assert time.monotonic() - killed_at < 4 * LEASE_S, "the other gateway did not take over"
                time.sleep(0.02)
            takeover_s = time.monotonic() - killed_at
            print(f"takeover {takeover_s:.2f} s after the kill (lease {LEASE_S} s)")
            # The lease was renewed at most a third of it before the kill; the watch wakes as it lapses.
            assert takeover_s <= LEASE_S + 0.5, takeover_s

            assert_completed_once_and_billed_once(survivor.url, batch_id, tmp_path / "tenants.toml")

            # The survivor's run of the batch: a root span, each line it ran linked to it.
            service = f"batchgate-{survivor.name}"
            spans = otlp.wait_for(
                lambda spans: any(s.name == f"batch {batch_id}" and s.service == service for s in spans)
            )
            (run,) = [s for s in spans if s.name == f"batch {batch_id}" and s.service == service]
            assert run.parent_id == "" and run.attributes["batchgate.batch_id"] == batch_id
            lines = [s for s in spans if s.name == "chat tiny" and s.service == service]
            linked = [s for s in lines if (run.trace_id, run.span_id) in s.links]
            assert linked and len(linked) == len(lines)
            assert all(s.trace_id != run.trace_id and s.parent_id == "" for s in linked)
        finally:
            for process in gateways.values():
                process.stop()
            otlp.stop()
