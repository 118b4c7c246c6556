"""One gateway and two engine replicas as separate `batchgate serve` processes on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tenancy.keys import hash_key
from tests.conftest_redis import free_port
from tests.pool.otlp_receiver import OTLPReceiver

INTERNAL_TOKEN = "pool-test-internal-token"
PAID_KEY = "sk-pool-paid"
FREE_KEY = "sk-pool-free"
ROOT = Path(__file__).resolve().parents[2]

TENANTS = f"""
[plans.paid]
priority = "paid"
tokens_per_minute = 10000000
requests_per_minute = 100000
max_concurrent_requests = 64
queue_deadline_seconds = 60

[plans.free]
priority = "free"
tokens_per_minute = 10000000
requests_per_minute = 100000
max_concurrent_requests = 64
queue_deadline_seconds = 60

[tenants.acme]
plan = "paid"
keys = ["{hash_key(PAID_KEY)}"]

[tenants.hobbyist]
plan = "free"
keys = ["{hash_key(FREE_KEY)}"]
"""


@dataclass
class Process:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class PoolCluster:
    gateway: Process
    replicas: list[Process]
    model: str
    otlp: OTLPReceiver | None = None


def start(name: str, args: list[str], workdir: Path, env: dict[str, str] | None = None) -> Process:
    port = free_port()
    log = workdir / f"{name}.log"
    full_env = {
        **os.environ,
        "BATCHGATE_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "BATCHGATE_EMBEDDING_MODEL": "none",  # the embedding tests start their own
        **(env or {}),
    }
    if "OTEL_EXPORTER_OTLP_ENDPOINT" in full_env:
        full_env["OTEL_SERVICE_NAME"] = f"batchgate-{name}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--log-level", "warning", *args],
        cwd=ROOT,
        env=full_env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    return Process(name, port, proc, log)


def wait_ready(processes: list[Process], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(processes)
    with httpx.Client(timeout=5) as http:
        while pending:
            p = pending[0]
            if p.proc.poll() is not None:
                raise AssertionError(
                    f"{p.name} exited with {p.proc.returncode}:\n{p.log.read_text()[-4000:]}"
                )
            try:
                if http.get(p.url + "/ready").status_code == 200:
                    pending.pop(0)
                    continue
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{p.name} not ready after {timeout_s}s:\n{p.log.read_text()[-4000:]}")
            time.sleep(0.1)


def replica_args(model_dir: Path) -> list[str]:
    return [
        "--model",
        str(model_dir),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--kv-cache-memory",
        "16MiB",
        "--max-model-len",
        "512",
        "--num-threads",
        "1",
        "--internal-token",
        INTERNAL_TOKEN,
    ]


def start_cluster(
    workdir: Path, model_dir: Path, redis_url: str, env: dict[str, str] | None = None
) -> PoolCluster:
    tenants = workdir / "tenants.toml"
    tenants.write_text(TENANTS)
    replicas = [start(f"replica{i}", replica_args(model_dir), workdir, env) for i in range(2)]
    gateway_args = [a for r in replicas for a in ("--upstream", r.url)]
    gateway = start(
        "gateway",
        [
            *gateway_args,
            "--internal-token",
            INTERNAL_TOKEN,
            "--tenants",
            str(tenants),
            "--redis-url",
            redis_url,
            "--health-interval",
            "0.2",
            # Least loaded only: the spread test counts requests per replica (prefix affinity is
            # tested against fake replicas in test_proxy.py).
            "--route-affinity-tokens",
            "0",
        ],
        workdir,
        env,
    )
    try:
        wait_ready([*replicas, gateway])
        # The gateway is ready with one healthy upstream; wait (bounded) until it sees both.
        deadline = time.monotonic() + 30
        with httpx.Client(timeout=5) as http:
            while True:
                ups = http.get(
                    gateway.url + "/v1/internal/upstreams", headers={"x-batchgate-internal": INTERNAL_TOKEN}
                ).json()
                if all(u["healthy"] for u in ups):
                    break
                assert time.monotonic() < deadline, ups
                time.sleep(0.05)
            model = http.get(gateway.url + "/v1/models", headers={"authorization": f"Bearer {PAID_KEY}"})
            model = model.json()["data"][0]["id"]
    except BaseException:
        for p in [gateway, *replicas]:
            p.stop()
        raise
    return PoolCluster(gateway, replicas, model)


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, redis_server: str
) -> Iterator[PoolCluster]:
    otlp = OTLPReceiver()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.url,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
    }
    try:
        c = start_cluster(tmp_path_factory.mktemp("pool"), tiny_model_dir, redis_server, env)
    except BaseException:
        otlp.stop()
        raise
    c.otlp = otlp
    try:
        yield c
    finally:
        for p in [c.gateway, *c.replicas]:
            p.stop()
        otlp.stop()
