"""Two `batchgate serve` processes with their own models sharing one Redis enforce ONE limit."""

from __future__ import annotations

from pathlib import Path

import httpx

from tenancy.keys import hash_key
from tests.pool.conftest import replica_args, start, wait_ready

KEY = "sk-shared-limit"
TENANTS = f"""
[plans.tight]
priority = "free"
tokens_per_minute = 1000000
requests_per_minute = 6
max_concurrent_requests = 8
queue_deadline_seconds = 60

[tenants.shared]
plan = "tight"
keys = ["{hash_key(KEY)}"]
"""


def test_two_servers_sharing_redis_enforce_one_global_limit(
    tiny_model_dir: Path, redis_server: str, tmp_path: Path
) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    args = [*replica_args(tiny_model_dir), "--tenants", str(tenants), "--redis-url", redis_server]
    servers = [start(f"server{i}", args, tmp_path) for i in range(2)]
    try:
        wait_ready(servers)
        body = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        models = httpx.get(servers[0].url + "/v1/models", headers={"authorization": f"Bearer {KEY}"})
        body["model"] = models.json()["data"][0]["id"]
        codes = []
        with httpx.Client(timeout=30, headers={"authorization": f"Bearer {KEY}"}) as http:
            for i in range(12):  # alternate between the two processes
                r = http.post(servers[i % 2].url + "/v1/chat/completions", json=body)
                codes.append(r.status_code)
        # A bucket of 6 requests/minute refills one request every 10 s: 12 quick requests across
        # both processes get 6 (or 7, if a refill lands inside the loop) admissions in total.
        assert codes.count(200) in (6, 7), codes
        assert codes.count(200) + codes.count(429) == 12, codes
        assert {c for c in codes[:6]} == {200}  # both processes admitted until the shared bucket ran dry
    finally:
        for s in servers:
            s.stop()
