"""What settlement costs a request as its client sees it (issue 24): sequential requests through
a real gateway (uvicorn, a fake engine, tenancy over a real redis-server, a money budget), one
keep-alive connection, timed at the client; this checkout against others in the same run.

    python -m bench.settle_latency                                   # this checkout alone
    python -m bench.settle_latency --baseline main=/path/to/main     # A/B, interleaved

Each checkout's gateway runs as its own process (its code from its own directory) over one
redis-server, each with a tenant of its own. The checkouts take turns request by request (in
ABBA order), `--requests` whole answers and as many streams each per round. A whole
answer is timed from the request to its last body byte; a stream to its `data: [DONE]` (where the
openai SDK stops reading) and to the end of the response. Settlement happens in each gateway as
its code does it (main: the answer waits for the settlement's round trip; since issue 24's
last lever: the settlement is sent before the answer's last byte and not waited for), so the
difference (of the medians, and the median of the differences of requests paired by turn) is what
the round trip cost a request. Afterwards each tenant's ledger
(read on its own gateway) must count every request and every token the answers reported.

Prints a JSON summary (`--out` writes it too), with the machine's busy share from other work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.cpu import CpuMeter
from tenancy.keys import hash_key
from tests.conftest_redis import RedisProcess
from tests.pool.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]

# The gateway: only APIs every checkout since issue 24 has (create_app, Settings, build_tenancy,
# the fake engine of the gateway's tests).
SERVER = """
import sys
import uvicorn
from gateway.app import create_app
from gateway.cli import build_tenancy
from gateway.settings import Settings
from tests.gateway.fakes import FakeEngine

tenants, redis_url, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
settings = Settings(tenants=tenants, redis_url=redis_url, embedding_model="none")
app = create_app(settings, engine=FakeEngine(), tenancy=build_tenancy(settings), owns_tenancy=True)
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
"""

TENANTS = """
[prices."fake-model"]
input = 1.0
cached_input = 0.5
output = 4.0

[plans.paid]
priority = "paid"
tokens_per_minute = 100000000
requests_per_minute = 10000000
max_concurrent_requests = 1000
queue_deadline_seconds = 30
"""


@dataclass
class Gateway:
    name: str
    directory: Path
    tenant: str
    key: str
    proc: subprocess.Popen[bytes] | None = None
    url: str = ""
    whole_ms: list[float] = field(default_factory=list)
    done_ms: list[float] = field(default_factory=list)  # a stream, to its [DONE]
    stream_end_ms: list[float] = field(default_factory=list)  # a stream, to its last byte
    reported: list[tuple[int, int]] = field(default_factory=list)  # (prompt, completion) tokens

    @property
    def auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"}


def tenants_file(path: Path, gateways: list[Gateway]) -> None:
    tables = "".join(
        f'[tenants.{g.tenant}]\nplan = "paid"\nkeys = ["{hash_key(g.key)}"]\n'
        'budget_usd = 1000000.0\nbudget_window = "monthly"\n\n'
        for g in gateways
    )
    path.write_text(TENANTS + tables)


def start(gateway: Gateway, tenants: Path, redis_url: str, log: Path) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(gateway.directory)}
    gateway.proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(tenants), redis_url, str(port)],
        cwd=gateway.directory,
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    gateway.url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(gateway.url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if gateway.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the {gateway.name} gateway did not start: {log.read_text()[-2000:]}")
        time.sleep(0.05)


def body(stream: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 16,
    }
    if stream:
        out |= {"stream": True, "stream_options": {"include_usage": True}}
    return out


def whole(http: httpx.Client, gateway: Gateway) -> None:
    t0 = time.perf_counter()
    response = http.post(gateway.url + "/v1/chat/completions", json=body(False), headers=gateway.auth)
    elapsed = time.perf_counter() - t0
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    gateway.whole_ms.append(elapsed * 1000)
    gateway.reported.append((usage["prompt_tokens"], usage["completion_tokens"]))


def stream(http: httpx.Client, gateway: Gateway) -> None:
    usage: dict[str, int] | None = None
    t0 = time.perf_counter()
    done = None
    with http.stream(
        "POST", gateway.url + "/v1/chat/completions", json=body(True), headers=gateway.auth
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = time.perf_counter()
            elif line.startswith("data: ") and '"usage":{' in line:
                usage = json.loads(line[6:])["usage"]
    end = time.perf_counter()
    assert done is not None and usage is not None
    gateway.done_ms.append((done - t0) * 1000)
    gateway.stream_end_ms.append((end - t0) * 1000)
    gateway.reported.append((usage["prompt_tokens"], usage["completion_tokens"]))


def ledger_check(gateway: Gateway) -> dict[str, Any]:
    """The tenant's ledger read on its own gateway (which sees its own settlements) against the
    answers' usage."""
    now = int(time.time())
    params = {"bucket_width": "1d", "start_time": now - 2 * 86400, "end_time": now + 3600}
    data = httpx.get(gateway.url + "/v1/usage", params=params, headers=gateway.auth, timeout=30).json()
    results = [r for b in data["data"] for r in b["results"]]
    ledger = (
        sum(r["num_model_requests"] for r in results),
        sum(r["input_tokens"] for r in results),
        sum(r["output_tokens"] for r in results),
    )
    answered = (
        len(gateway.reported),
        sum(p for p, _ in gateway.reported),
        sum(c for _, c in gateway.reported),
    )
    return {"ledger": ledger, "answers": answered, "equal": ledger == answered}


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "median_ms": round(statistics.median(ordered), 4),
        "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))], 4),
        "n": len(ordered),
    }


def difference(ours: list[float], theirs: list[float]) -> dict[str, float]:
    """The difference of the medians, and the median of the differences of requests paired by
    turn (the same i-th request of each checkout, sent one after the other)."""
    return {
        "of_medians": round(statistics.median(ours) - statistics.median(theirs), 4),
        "paired": round(statistics.median([a - b for a, b in zip(ours, theirs, strict=True)]), 4),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=200, help="of each kind, per checkout and round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument(
        "--baseline", action="append", default=[], metavar="NAME=DIR", help="another checkout to compare"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    gateways = [Gateway("this", ROOT, "t0", "sk-bench-0")]
    for i, spec in enumerate(args.baseline, start=1):
        name, _, directory = spec.partition("=")
        gateways.append(Gateway(name, Path(directory).resolve(), f"t{i}", f"sk-bench-{i}"))
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="settle-latency-") as tmp:
        work = Path(tmp)
        redis = RedisProcess(work / "redis")
        redis.start()
        try:
            tenants = work / "tenants.toml"
            tenants_file(tenants, gateways)
            for g in gateways:
                start(g, tenants, redis.url, work / f"{g.name}.log")
            with httpx.Client(timeout=30) as http:
                for g in gateways:  # warm up: connections, scripts, first-use code paths
                    for _ in range(20):
                        whole(http, g)
                        stream(http, g)
                    for samples in (g.whole_ms, g.done_ms, g.stream_end_ms):
                        samples.clear()
                pids = [g.proc.pid for g in gateways if g.proc is not None]
                if redis._proc is not None:
                    pids.append(redis._proc.pid)
                meter = CpuMeter(pids=tuple(pids))
                meter.start()
                for r in range(args.rounds):
                    for i in range(args.requests):  # interleaved request by request, ABBA
                        order = gateways if (r + i) % 2 == 0 else gateways[::-1]
                        for g in order:
                            whole(http, g)
                        for g in order:
                            stream(http, g)
                out["machine"] = meter.stop().as_dict()
            for g in gateways:
                out[g.name] = {
                    "directory": str(g.directory),
                    "whole": summary(g.whole_ms),
                    "stream_to_done": summary(g.done_ms),
                    "stream_to_end": summary(g.stream_end_ms),
                    "ledger_check": ledger_check(g),
                }
            base = gateways[0]
            for g in gateways[1:]:
                out[f"{base.name}_minus_{g.name}_ms"] = {
                    kind: difference(getattr(base, kind), getattr(g, kind))
                    for kind in ("whole_ms", "done_ms", "stream_end_ms")
                }
        finally:
            for g in gateways:
                if g.proc is not None:
                    g.proc.terminate()
                    try:
                        g.proc.wait(timeout=15)
                    except subprocess.TimeoutExpired:
                        g.proc.kill()
            redis.stop()
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if all(out[g.name]["ledger_check"]["equal"] for g in gateways) else 1


if __name__ == "__main__":
    sys.exit(main())
