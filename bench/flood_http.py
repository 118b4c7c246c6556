"""A free-tier flood over HTTP against a paid tenant's latency (issue 43), and where its cost sits.

    python -m bench.flood_http                          # bundled SmolLM2-135M, 96 flood clients, 30 s
    python -m bench.flood_http --shed rate --json bench/results/flood_http.json

`batchgate serve` runs in its own process with two tenants: `flood` (free) and `paid`. The flood is
`--flood-clients` (96) closed-loop clients in a process of their own (this script with `--worker`),
each sending chat requests as fast as they are answered; it is shed either by the engine's queue
deadline (`--shed deadline`, the default: the free plan's `queue_deadline_seconds` is short, so
most requests get a fast 503 at arrival, as in the issue's run) or by the free plan's rate limit
(`--shed rate`: a 429 at admission). Meanwhile one paid client streams `--probes` requests, one
after another, and a third client GETs `/health` every 50 ms.

Each paid probe is timed three ways: the response's headers (parse, authenticate, admit, submit:
the edge), its first token (TTFT), and the gaps between its tokens (the decode step). `/health`
touches neither tenancy nor the engine: its latency under the flood is the event loop's and the
shared CPUs' delay alone. CPU seconds of the server, of the flood process and of everything else
on the machine are read around each phase. Target: the paid TTFT p50 under the flood within
2 x idle + one decode step (the idle ITL p50).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.cpu import busy_fraction, pid_cpu_s, wait_quiet
from bench.offline import machine
from bench.policy_bench import percentile
from bench.servers import batchgate_spec, launched

PROMPT = "Write one sentence about the sea and the wind, and nothing else."
TENANTS = """
[plans.free]
priority = "free"
tokens_per_minute = 100000000
requests_per_minute = {free_rpm}
max_concurrent_requests = 1000
queue_deadline_seconds = {free_deadline}

[plans.paid]
priority = "paid"
tokens_per_minute = 100000000
requests_per_minute = 100000
max_concurrent_requests = 100
queue_deadline_seconds = 30

[tenants.flood]
plan = "free"
keys = ["{flood_hash}"]

[tenants.paid]
plan = "paid"
keys = ["{paid_hash}"]
"""
FLOOD_KEY, PAID_KEY = "sk-bench-flood", "sk-bench-paid"


# ---- the flood: its own process ---------------------------------------------------------------------


async def flood(url: str, model: str, clients: int, seconds: float, max_tokens: int) -> dict[str, Any]:
    """`clients` closed loops of free-tier chat requests for `seconds`; statuses and latencies."""
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens}
    latencies: dict[int, list[float]] = {}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    headers = {"authorization": f"Bearer {FLOOD_KEY}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60, limits=limits) as client:
        until = time.perf_counter() + seconds

        async def loop() -> None:
            while time.perf_counter() < until:
                start = time.perf_counter()
                try:
                    status = (await client.post("/v1/chat/completions", json=body)).status_code
                except httpx.HTTPError:
                    status = 0
                latencies.setdefault(status, []).append(time.perf_counter() - start)

        start = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(clients)))
        wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        "cpu_s": time.process_time(),
        "by_status": {
            str(status): {
                "num": len(v),
                "per_s": len(v) / wall,
                "p50_s": percentile(v, 50),
                "p99_s": percentile(v, 99),
            }
            for status, v in sorted(latencies.items())
        },
    }


# ---- the paid client and the /health probe ------------------------------------------------------------


def probe_paid(url: str, model: str, num: int, max_tokens: int, gap_s: float) -> dict[str, Any]:
    """`num` streamed paid requests one after another: headers, TTFT and inter-token gaps."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    heads, ttfts, gaps, errors = [], [], [], 0
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {PAID_KEY}"}, timeout=60) as client:
        for _ in range(num):
            start = time.perf_counter()
            first = last = None
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                heads.append(time.perf_counter() - start)
                if response.status_code != 200:
                    errors += 1
                    response.read()
                    continue
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if not chunk.get("choices") or not chunk["choices"][0]["delta"].get("content"):
                        continue
                    now = time.perf_counter()
                    if first is None:
                        first = now
                        ttfts.append(now - start)
                    elif last is not None:
                        gaps.append(now - last)
                    last = now
            time.sleep(gap_s)
    return {
        "num": num,
        "errors": errors,
        "headers_p50_s": percentile(heads, 50),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "itl_p50_s": percentile(gaps, 50),
    }


class HealthProbe:
    """GET /health every `period_s` in a thread: the edge's delay with no tenancy and no engine."""

    def __init__(self, url: str, period_s: float = 0.05) -> None:
        self.url, self.period_s = url, period_s
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                client.get("/health")
                self.latencies.append(time.perf_counter() - start)
                self._stop.wait(self.period_s)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, Any]:
        return {
            "num": len(self.latencies),
            "p50_s": percentile(self.latencies, 50),
            "p99_s": percentile(self.latencies, 99),
        }


def ttft_totals(url: str) -> tuple[float, float]:
    """The server's own TTFT histogram: (sum of seconds, count), every request it admitted."""
    text = httpx.get(url + "/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        for name in (
            "batchgate_time_to_first_token_seconds_sum",
            "batchgate_time_to_first_token_seconds_count",
        ):
            if line.startswith(name + " "):
                values[name] = float(line.split()[1])
    return values.get("batchgate_time_to_first_token_seconds_sum", 0.0), values.get(
        "batchgate_time_to_first_token_seconds_count", 0.0
    )


def machine_cpu_s() -> float:
    """Busy CPU seconds of the whole machine so far (all CPUs together)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


# ---- the run ------------------------------------------------------------------------------------------


def phase(
    args: argparse.Namespace, url: str, model: str, server_pid: int, with_flood: bool, workdir: Path
) -> dict[str, Any]:
    server0, machine0, ours0 = pid_cpu_s(server_pid), machine_cpu_s(), time.process_time()
    ttft0 = ttft_totals(url)
    start = time.perf_counter()
    worker = None
    out = workdir / "flood.json"
    if with_flood:
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.flood_http",
                "--worker",
                url,
                model,
                str(args.flood_clients),
                str(args.seconds),
                str(args.max_tokens),
                str(out),
            ],
        )
        time.sleep(2.0)  # the flood at full strength before the first probe
    with HealthProbe(url) as health:
        paid = probe_paid(url, model, args.probes, args.max_tokens, args.gap)
    flood_cpu = 0.0
    result: dict[str, Any] = {"paid": paid, "health": health.summary()}
    if worker is not None:
        worker.wait()
        result["flood"] = json.loads(out.read_text())
        flood_cpu = result["flood"]["cpu_s"]
    result["wall_s"] = time.perf_counter() - start
    ttft1 = ttft_totals(url)
    admitted = ttft1[1] - ttft0[1]
    result["server_ttft_mean_s"] = (ttft1[0] - ttft0[0]) / admitted if admitted else None
    result["server_admitted"] = admitted
    server_cpu = pid_cpu_s(server_pid) - server0
    busy = machine_cpu_s() - machine0
    ours = time.process_time() - ours0
    result["cpu_s"] = {
        "server": server_cpu,
        "flood_process": flood_cpu,
        "paid_and_health_clients": ours,
        "everything_else": max(0.0, busy - server_cpu - flood_cpu - ours),
        "machine_busy": busy,
    }
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tenancy import hash_key

    workdir = Path(tempfile.mkdtemp(prefix="batchgate-flood-"))
    tenants = workdir / "tenants.toml"
    free_rpm = 60 if args.shed == "rate" else 100_000_000
    free_deadline = 30 if args.shed == "rate" else args.free_deadline
    tenants.write_text(
        TENANTS.format(
            free_rpm=free_rpm,
            free_deadline=free_deadline,
            flood_hash=hash_key(FLOOD_KEY),
            paid_hash=hash_key(PAID_KEY),
        )
    )
    extra = ["--tenants", str(tenants), "--internal-token", "bench", "--embedding-model", "none"]
    extra += ["--storage-dir", str(workdir / "storage")]
    if args.model:
        extra += ["--model", args.model]
    spec = batchgate_spec("auto", args.max_num_seqs, extra)
    results: dict[str, Any] = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    with launched(spec, workdir / "logs") as proc:
        url = spec.base_url.removesuffix("/v1")
        with httpx.Client(base_url=url, headers={"authorization": f"Bearer {PAID_KEY}"}) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
        probe_paid(url, model, 5, args.max_tokens, 0.0)  # warm-up: kernels' trials, step costs
        results["idle"] = phase(args, url, model, proc.pid, False, workdir)
        results["flood"] = phase(args, url, model, proc.pid, True, workdir)
    idle, under = results["idle"], results["flood"]
    step = idle["paid"]["itl_p50_s"] or 0.0
    target = 2 * idle["paid"]["ttft_p50_s"] + step
    results["target_s"] = target
    results["paid_ttft_p50_vs_target"] = under["paid"]["ttft_p50_s"] / target
    shed = sum(v["per_s"] for s, v in under["flood"]["by_status"].items() if s in ("429", "503"))
    results["shed_per_s"] = shed
    return results


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f} ms"


def report(r: dict[str, Any]) -> str:
    idle, under = r["idle"], r["flood"]
    lines = [
        f"flood: {r['args']['flood_clients']} clients in their own process, shed by {r['args']['shed']}",
    ]
    for status, v in under["flood"]["by_status"].items():
        lines.append(f"  status {status}: {v['per_s']:.0f}/s, p50 {ms(v['p50_s'])}, p99 {ms(v['p99_s'])}")
    lines += [
        f"  shed {r['shed_per_s']:.0f} requests/s",
        f"paid TTFT p50: idle {ms(idle['paid']['ttft_p50_s'])}, "
        f"under the flood {ms(under['paid']['ttft_p50_s'])}; "
        f"target 2 x idle + one decode step ({ms(idle['paid']['itl_p50_s'])}) = {ms(r['target_s'])} -> "
        f"{r['paid_ttft_p50_vs_target']:.2f} of it [target <= 1]",
        f"where it sits: paid response headers p50 idle {ms(idle['paid']['headers_p50_s'])}, flood "
        f"{ms(under['paid']['headers_p50_s'])}; first token after the headers idle "
        f"{ms((idle['paid']['ttft_p50_s'] or 0) - (idle['paid']['headers_p50_s'] or 0))}, flood "
        f"{ms((under['paid']['ttft_p50_s'] or 0) - (under['paid']['headers_p50_s'] or 0))}; /health p50 idle "
        f"{ms(idle['health']['p50_s'])}, flood {ms(under['health']['p50_s'])} "
        f"(p99 {ms(under['health']['p99_s'])}); "
        f"paid decode step p50 idle {ms(idle['paid']['itl_p50_s'])}, flood {ms(under['paid']['itl_p50_s'])}; "
        f"the server's own TTFT mean (submit to first token, every admitted request) idle "
        f"{ms(idle['server_ttft_mean_s'])}, flood {ms(under['server_ttft_mean_s'])} "
        f"({under['server_admitted']:.0f} admitted)",
    ]
    for name in ("idle", "flood"):
        c = r[name]["cpu_s"]
        lines.append(
            f"CPU seconds ({name}, {r[name]['wall_s']:.1f} s): server {c['server']:.1f}, flood process "
            f"{c['flood_process']:.1f}, probes {c['paid_and_health_clients']:.1f}, everything else "
            f"{c['everything_else']:.1f} (machine {c['machine_busy']:.1f})"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or GGUF (default: the bundled SmolLM2-135M)")
    p.add_argument("--flood-clients", type=int, default=96)
    p.add_argument("--seconds", type=float, default=30.0, help="the flood's length")
    p.add_argument("--probes", type=int, default=40, help="paid requests per phase")
    p.add_argument("--gap", type=float, default=0.25, help="seconds between paid requests")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--shed", choices=("deadline", "rate"), default="deadline")
    p.add_argument("--free-deadline", type=float, default=0.5, help="the free plan's queue deadline (s)")
    p.add_argument("--quiet", type=float, default=0.25, help="wait (up to 10 min) until others use < this")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        url, model, clients, seconds, max_tokens, out = argv[1:7]
        result = asyncio.run(flood(url, model, int(clients), float(seconds), int(max_tokens)))
        Path(out).write_text(json.dumps(result))
        return
    args = parse_args(argv)
    quiet, busy = wait_quiet(args.quiet, 600.0)
    print(
        f"machine busy {busy * 100:.0f}% before the start ({'quiet' if quiet else 'NOT quiet'})", flush=True
    )
    results = run(args)
    results["busy_before"] = busy
    results["busy_after"] = busy_fraction()
    print(report(results), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
