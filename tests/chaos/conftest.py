"""Processes for the chaos tests: real `batchgate serve` replicas and gateways (tests/pool/conftest.py
starts them), real redis-server (tests/conftest_redis.py), and what the tests read from them."""

from __future__ import annotations

from pathlib import Path

import httpx
import redis
from prometheus_client.parser import text_string_to_metric_families

from tests.pool.conftest import INTERNAL_TOKEN, PAID_KEY, TENANTS, Process, replica_args, start
from tests.pool.conftest import wait_ready as wait_ready  # re-exported for the chaos tests

# Room for streams long enough to be in flight when a fault comes (the tiny model is fast).
LONG_CONTEXT_ARGS = ["--max-model-len", "4096", "--kv-cache-memory", "32MiB"]
INTERNAL = {"x-batchgate-internal": INTERNAL_TOKEN}
AUTH = {"authorization": f"Bearer {PAID_KEY}"}  # tenant "acme" of the pool tenants file


def start_replica(name: str, workdir: Path, model_dir: Path, *extra: str) -> Process:
    return start(name, [*replica_args(model_dir), *LONG_CONTEXT_ARGS, *extra], workdir)


def start_gateway(
    workdir: Path, upstreams: list[Process], *extra: str, redis_url: str | None = None
) -> Process:
    """A proxy gateway over `upstreams` (open mode, or the pool tenants with `redis_url`)."""
    args = [a for r in upstreams for a in ("--upstream", r.url)]
    args += ["--internal-token", INTERNAL_TOKEN, "--route-affinity-tokens", "0"]
    if redis_url is not None:
        tenants = workdir / "tenants.toml"
        tenants.write_text(TENANTS)
        args += ["--tenants", str(tenants), "--redis-url", redis_url]
    return start("gateway", [*args, *extra], workdir)


def upstreams(gateway: Process) -> list[dict]:
    return httpx.get(gateway.url + "/v1/internal/upstreams", headers=INTERNAL, timeout=10).json()


def stats(replica: Process) -> dict:
    return httpx.get(replica.url + "/v1/internal/stats", headers=INTERNAL, timeout=10).json()


def metric(url: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """One sample of /metrics, or None if the server does not export it."""
    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == (labels or {}):
                return float(s.value)
    return None


def live_leases(client: redis.Redis, tenant: str) -> int:
    """Leases of `tenant` not expired by Redis's clock."""
    seconds, micros = client.time()
    return int(client.zcount(f"{{tenant:{tenant}}}:leases", f"({seconds + micros / 1e6}", "+inf"))


def answered(url: str) -> float:
    """Generation requests the server has answered (batchgate_requests_total over status classes)."""
    return sum(
        metric(url, "batchgate_requests_total", {"code": c}) or 0 for c in ("2xx", "3xx", "4xx", "5xx")
    )
