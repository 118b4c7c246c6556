"""Scheduling-policy benchmarks, each run side by side in one process: the engine in process (no
HTTP), driven through its async API (`AsyncEngine.from_config`, `submit`, iterate) with asyncio
arrivals.

    python -m bench.policy_bench                                  # bundled SmolLM2-135M, all four
    python -m bench.policy_bench --model tiny --scale 0.25        # a quick check on a random tiny model
    python -m bench.policy_bench --scenarios flood,fair --json bench/results/policy.json

Scenarios (issue 5's targets in brackets):

  flood    A free-tier flood at `--flood-factor` (2) x capacity, with paid requests at 0.1 x capacity.
           Paid TTFT p50 under the flood vs on an idle engine [<= 2x]; free requests carry a
           `--free-deadline` queue deadline: how many are served, how many refused at arrival and
           how fast (the time `submit()` took to raise) [p50 < 100 ms], how many expired in the queue.
  buckets  90% prompts of 20..100 tokens, 10% of 1500..2000, Poisson at `--load` (0.8) x capacity,
           length buckets on vs off: short-prompt TTFT p99 [>= 3x better with buckets]; and the
           throughput of the same requests submitted at once [within 10%].
  static   Output lengths 8..256, all submitted at once: continuous vs static batching throughput
           [continuous >= 3x static].
  fair     Two free tenants, one at 10x the other's rate (heavy at `--heavy-factor` (1.5) x
           capacity), both with the free queue deadline: the light tenant's TTFT p50 alone, with
           fair share (distinct keys), and without (one shared key) [with fair share <= 2x alone].

"Capacity" is measured first for each workload: requests/s of a closed loop that keeps
`--max-num-seqs` requests in flight. Every request uses `ignore_eos`, so output lengths are exact;
prompts are random token ids (no tokenizer involved). Timings on a shared machine are noisy: the
report prints how busy the machine was with other work during each scenario.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.cpu import CpuMeter
from bench.offline import machine

VOCAB_LOW, VOCAB_HIGH = 1000, 40000  # token ids drawn from here: inside every SmolLM2-family vocab


# ---- one request, measured --------------------------------------------------------------------------


@dataclass
class Record:
    tag: str  # workload class, e.g. "paid", "free", "short", "light"
    num_prompt_tokens: int
    sent_at: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    num_output_tokens: int = 0
    refused: str | None = None  # "arrival" or "queue"
    refusal_s: float | None = None  # submit -> refusal, as the caller saw it
    error: str | None = None


async def run_one(engine: Any, request: Any, record: Record) -> Record:
    from engine.types import EngineOverloadedError

    start = time.perf_counter()
    record.sent_at = start
    try:
        stream = engine.submit(request)
    except EngineOverloadedError:
        record.refused, record.refusal_s = "arrival", time.perf_counter() - start
        return record
    async for out in stream:
        if out.error is not None:
            if isinstance(out.error, EngineOverloadedError):
                record.refused, record.refusal_s = "queue", time.perf_counter() - start
            else:
                record.error = f"{type(out.error).__name__}: {out.error}"
            continue
        if out.new_token_ids and record.ttft_s is None:
            record.ttft_s = time.perf_counter() - start
        record.num_output_tokens += len(out.new_token_ids)
    record.e2e_s = time.perf_counter() - start
    return record


Job = tuple[float, Any, Record]  # (seconds after the start, GenerationRequest, its record)


async def open_loop(engine: Any, jobs: list[Job]) -> tuple[list[Record], float]:
    """Send each job at its time regardless of how fast the engine is; wait for all to end."""
    start = time.perf_counter()
    tasks = []
    for at, request, record in sorted(jobs, key=lambda j: j[0]):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(run_one(engine, request, record)))
    records = await asyncio.gather(*tasks)
    return list(records), time.perf_counter() - start


async def closed_loop(engine: Any, jobs: list[Job], concurrency: int) -> tuple[list[Record], float]:
    """Keep `concurrency` jobs in flight until all have run (times in `jobs` are ignored)."""
    queue = list(jobs)
    start = time.perf_counter()

    async def worker() -> list[Record]:
        done = []
        while queue:
            _, request, record = queue.pop(0)
            done.append(await run_one(engine, request, record))
        return done

    parts = await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [r for part in parts for r in part], time.perf_counter() - start


# ---- workloads ------------------------------------------------------------------------------------------


class Workload:
    """Builds requests with distinct ids, random prompts of given lengths, exact output lengths."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self._n = 0

    def request(
        self,
        tag: str,
        prompt_len: int,
        max_tokens: int,
        *,
        priority: Any = None,
        deadline_s: float | None = None,
        key: str = "",
    ) -> tuple[Any, Record]:
        from engine.types import GenerationRequest, Priority, SamplingParams

        self._n += 1
        prompt = [self.rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(prompt_len)]
        request = GenerationRequest(
            f"{tag}-{self._n}",
            prompt,
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            priority=Priority.PAID if priority is None else priority,
            queue_deadline_s=deadline_s,
            fairness_key=key,
        )
        return request, Record(tag, prompt_len)

    def poisson(self, rate: float, duration_s: float) -> list[float]:
        times, t = [], 0.0
        while rate > 0:
            t += self.rng.expovariate(rate)
            if t >= duration_s:
                break
            times.append(t)
        return times


# ---- statistics ---------------------------------------------------------------------------------------


def percentile(values: Iterable[float | None], q: float) -> float | None:
    data = sorted(v for v in values if v is not None)
    if not data:
        return None
    k = (len(data) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return data[lo] + (data[hi] - data[lo]) * (k - lo)


def summarize(records: list[Record], wall_s: float | None = None) -> dict[str, Any]:
    served = [r for r in records if r.refused is None and r.error is None]
    out: dict[str, Any] = {
        "num": len(records),
        "served": len(served),
        "refused_at_arrival": sum(r.refused == "arrival" for r in records),
        "refused_in_queue": sum(r.refused == "queue" for r in records),
        "errors": sum(r.error is not None for r in records),
        "ttft_p50_s": percentile((r.ttft_s for r in served), 50),
        "ttft_p90_s": percentile((r.ttft_s for r in served), 90),
        "ttft_p99_s": percentile((r.ttft_s for r in served), 99),
        "arrival_refusal_p50_s": percentile((r.refusal_s for r in records if r.refused == "arrival"), 50),
        "arrival_refusal_p99_s": percentile((r.refusal_s for r in records if r.refused == "arrival"), 99),
        "queue_refusal_p50_s": percentile((r.refusal_s for r in records if r.refused == "queue"), 50),
    }
    if wall_s:
        num_out = sum(r.num_output_tokens for r in served)
        num_in = sum(r.num_prompt_tokens for r in served)
        out.update(
            wall_s=wall_s,
            output_tokens_per_s=num_out / wall_s,
            total_tokens_per_s=(num_out + num_in) / wall_s,
        )
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ---- the engine -----------------------------------------------------------------------------------------


def tiny_model_dir() -> str:
    """A random-weight 2-layer Llama with the bundled model's tokenizer (as the tests use)."""
    from engine.resolve import resolve_model_dir
    from tests.tiny_model import make_tiny_model

    target = Path(tempfile.gettempdir()) / "batchgate-bench" / "tiny-llama"
    if not (target / "config.json").is_file():
        cache = Path.home() / ".cache" / "batchgate"
        make_tiny_model(target, resolve_model_dir(None, cache))
    return str(target)


class Engines:
    """Starts one AsyncEngine per phase (so no phase inherits another's queues or measurements)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model = tiny_model_dir() if args.model == "tiny" else args.model

    async def run(self, phase: Callable[[Any], Any], **overrides: Any) -> Any:
        from engine.async_engine import AsyncEngine
        from engine.config import EngineConfig

        settings: dict[str, Any] = dict(
            model=self.model,
            dtype=self.args.dtype,
            max_num_seqs=self.args.max_num_seqs,
            max_num_batched_tokens=self.args.max_num_batched_tokens,
            num_threads=self.args.threads,
        )
        if self.args.kv_cache_mib:
            settings["kv_cache_memory_bytes"] = self.args.kv_cache_mib << 20
        settings.update(overrides)
        engine = await asyncio.to_thread(AsyncEngine.from_config, EngineConfig.of(**settings))
        try:
            warm = Workload(0)
            request, record = warm.request("warmup", 16, 4)
            await run_one(engine, request, record)
            return await phase(engine)
        finally:
            await asyncio.to_thread(engine.shutdown)


async def capacity(engines: Engines, make: Callable[[Workload], tuple[Any, Record]], num: int) -> float:
    """Requests/s with `max_num_seqs` requests in flight (closed loop), for this workload."""
    wl = Workload(1)
    jobs = [(0.0, *make(wl)) for _ in range(num)]

    async def phase(engine: Any) -> float:
        records, wall = await closed_loop(engine, jobs, engines.args.max_num_seqs)
        return sum(r.refused is None for r in records) / wall

    return await engines.run(phase, length_buckets=())


# ---- scenarios -------------------------------------------------------------------------------------------


async def scenario_flood(engines: Engines, args: argparse.Namespace) -> dict[str, Any]:
    from engine.types import Priority

    def make(wl: Workload, tag: str = "free") -> tuple[Any, Record]:
        prio = Priority.FREE if tag == "free" else Priority.PAID
        return wl.request(tag, wl.rng.randint(32, 96), args.max_tokens, priority=prio)

    cap = await capacity(engines, make, max(8, int(48 * args.scale)))
    wl = Workload(2)

    async def idle(engine: Any) -> list[Record]:
        records = []
        for _ in range(max(4, int(12 * args.scale))):
            request, record = make(wl, "paid")
            records.append(await run_one(engine, request, record))
        return records

    idle_paid = summarize(await engines.run(idle))

    duration = args.duration
    jobs: list[Job] = []
    for t in wl.poisson(args.flood_factor * cap, duration):
        request, record = make(wl, "free")
        request.queue_deadline_s = args.free_deadline
        jobs.append((t, request, record))
    for t in wl.poisson(max(0.1 * cap, 2.0 / duration), duration):
        jobs.append((t, *make(wl, "paid")))

    async def flood(engine: Any) -> tuple[list[Record], float, dict[str, Any]]:
        records, wall = await open_loop(engine, jobs)
        s = engine.stats()
        return (
            records,
            wall,
            {
                "refusals_by_reason": s.refusals_by_reason,
                "preemptions": s.num_preemptions,
                "priority_preemptions": s.num_priority_preemptions,
            },
        )

    records, wall, stats = await engines.run(flood)
    paid = summarize([r for r in records if r.tag == "paid"])
    free = summarize([r for r in records if r.tag == "free"], wall)
    return {
        "capacity_rps": cap,
        "free_rate_rps": args.flood_factor * cap,
        "idle_paid": idle_paid,
        "flood_paid": paid,
        "flood_free": free,
        "engine": stats,
        "paid_ttft_p50_vs_idle": ratio(paid["ttft_p50_s"], idle_paid["ttft_p50_s"]),
    }


async def scenario_buckets(engines: Engines, args: argparse.Namespace) -> dict[str, Any]:
    def make(wl: Workload) -> tuple[Any, Record]:
        if wl.rng.random() < 0.1:
            return wl.request("long", wl.rng.randint(1500, 2000), args.max_tokens)
        return wl.request("short", wl.rng.randint(20, 100), args.max_tokens)

    cap = await capacity(engines, make, max(10, int(40 * args.scale)))
    wl = Workload(3)
    open_jobs = [(t, *make(wl)) for t in wl.poisson(args.load * cap, args.duration)]
    burst_jobs = [(0.0, *make(wl)) for _ in range(max(10, int(60 * args.scale)))]
    modes = {"buckets_on": {"length_buckets": (256, 1024, 4096)}, "buckets_off": {"length_buckets": ()}}
    result: dict[str, Any] = {"capacity_rps": cap, "rate_rps": args.load * cap}
    for name, overrides in modes.items():

        async def phase(engine: Any) -> dict[str, Any]:
            fresh = [(t, req, Record(rec.tag, rec.num_prompt_tokens)) for t, req, rec in open_jobs]
            records, _ = await open_loop(engine, fresh)
            burst = [(t, req, Record(rec.tag, rec.num_prompt_tokens)) for t, req, rec in burst_jobs]
            burst_records, burst_wall = await open_loop(engine, burst)
            return {
                "short": summarize([r for r in records if r.tag == "short"]),
                "long": summarize([r for r in records if r.tag == "long"]),
                "burst": summarize(burst_records, burst_wall),
                "burst_short": summarize([r for r in burst_records if r.tag == "short"]),
            }

        result[name] = await engines.run(phase, **overrides)
    on, off = result["buckets_on"], result["buckets_off"]
    result["short_ttft_p99_off_over_on"] = ratio(off["short"]["ttft_p99_s"], on["short"]["ttft_p99_s"])
    result["burst_short_ttft_p99_off_over_on"] = ratio(
        off["burst_short"]["ttft_p99_s"], on["burst_short"]["ttft_p99_s"]
    )
    result["burst_throughput_on_over_off"] = ratio(
        on["burst"]["total_tokens_per_s"], off["burst"]["total_tokens_per_s"]
    )
    return result


async def scenario_static(engines: Engines, args: argparse.Namespace) -> dict[str, Any]:
    wl = Workload(4)
    jobs = [
        (0.0, *wl.request("req", wl.rng.randint(32, 64), wl.rng.randint(8, 256)))
        for _ in range(max(args.max_num_seqs, int(96 * args.scale)))
    ]
    result: dict[str, Any] = {}
    for mode in ("continuous", "static"):

        async def phase(engine: Any) -> dict[str, Any]:
            fresh = [(t, req, Record(rec.tag, rec.num_prompt_tokens)) for t, req, rec in jobs]
            records, wall = await open_loop(engine, fresh)
            return summarize(records, wall)

        result[mode] = await engines.run(phase, batching=mode)
    result["continuous_over_static"] = ratio(
        result["continuous"]["output_tokens_per_s"], result["static"]["output_tokens_per_s"]
    )
    return result


async def scenario_fair(engines: Engines, args: argparse.Namespace) -> dict[str, Any]:
    from engine.types import Priority

    def make(wl: Workload, tag: str = "heavy", key: str = "") -> tuple[Any, Record]:
        return wl.request(
            tag,
            wl.rng.randint(32, 96),
            args.max_tokens,
            priority=Priority.FREE,
            deadline_s=args.free_deadline,
            key=key,
        )

    cap = await capacity(engines, make, max(8, int(48 * args.scale)))
    wl = Workload(5)
    heavy_rate = args.heavy_factor * cap
    light_rate = max(heavy_rate / 10, 3.0 / args.duration)
    light_times = wl.poisson(light_rate, args.duration)
    heavy_times = wl.poisson(heavy_rate, args.duration)

    def jobs(with_heavy: bool, shared_key: bool) -> list[Job]:
        out = [(t, *make(wl, "light", "light")) for t in light_times]
        if with_heavy:
            out += [(t, *make(wl, "heavy", "light" if shared_key else "heavy")) for t in heavy_times]
        return out

    result: dict[str, Any] = {"capacity_rps": cap, "heavy_rate_rps": heavy_rate, "light_rate_rps": light_rate}
    for name, with_heavy, shared in (
        ("light_alone", False, False),
        ("fair_share", True, False),
        ("one_shared_key", True, True),
    ):
        phase_jobs = jobs(with_heavy, shared)

        async def phase(engine: Any, phase_jobs: list[Job] = phase_jobs) -> dict[str, Any]:
            records, wall = await open_loop(engine, phase_jobs)
            return {
                "light": summarize([r for r in records if r.tag == "light"]),
                "heavy": summarize([r for r in records if r.tag == "heavy"], wall),
            }

        result[name] = await engines.run(phase)
    alone = result["light_alone"]["light"]["ttft_p50_s"]
    result["light_ttft_p50_fair_vs_alone"] = ratio(result["fair_share"]["light"]["ttft_p50_s"], alone)
    result["light_ttft_p50_shared_key_vs_alone"] = ratio(
        result["one_shared_key"]["light"]["ttft_p50_s"], alone
    )
    return result


SCENARIOS = {
    "flood": scenario_flood,
    "buckets": scenario_buckets,
    "static": scenario_static,
    "fair": scenario_fair,
}


# ---- report ---------------------------------------------------------------------------------------------


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms"


def x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def report(name: str, r: dict[str, Any]) -> str:
    lines = [f"== {name}  (other work on the machine: {r['cpu']['others_busy'] * 100:.0f}% of all CPUs)"]
    if name == "flood":
        free, paid, idle = r["flood_free"], r["flood_paid"], r["idle_paid"]
        lines += [
            f"  capacity {r['capacity_rps']:.2f} req/s; free offered {r['free_rate_rps']:.2f} req/s",
            f"  paid TTFT p50: idle {ms(idle['ttft_p50_s'])}, under flood {ms(paid['ttft_p50_s'])} "
            f"-> {x(r['paid_ttft_p50_vs_idle'])} [target <= 2x]; paid refused: "
            f"{paid['refused_at_arrival'] + paid['refused_in_queue']}",
            f"  free: {free['num']} sent, {free['served']} served, {free['refused_at_arrival']} refused at "
            f"arrival (p50 {ms(free['arrival_refusal_p50_s'])}, p99 {ms(free['arrival_refusal_p99_s'])}) "
            f"[target p50 < 100 ms], {free['refused_in_queue']} expired in queue "
            f"(p50 {ms(free['queue_refusal_p50_s'])})",
            f"  engine: {r['engine']}",
        ]
    elif name == "buckets":
        on, off = r["buckets_on"], r["buckets_off"]
        lines += [
            f"  capacity {r['capacity_rps']:.2f} req/s; offered {r['rate_rps']:.2f} req/s",
            f"  short TTFT p50/p99: buckets on {ms(on['short']['ttft_p50_s'])}/"
            f"{ms(on['short']['ttft_p99_s'])}, off {ms(off['short']['ttft_p50_s'])}/"
            f"{ms(off['short']['ttft_p99_s'])} -> p99 off/on "
            f"{x(r['short_ttft_p99_off_over_on'])} [target >= 3x]",
            f"  long TTFT p50: on {ms(on['long']['ttft_p50_s'])}, off {ms(off['long']['ttft_p50_s'])}",
            f"  burst (all at once): short TTFT p99 on {ms(on['burst_short']['ttft_p99_s'])}, off "
            f"{ms(off['burst_short']['ttft_p99_s'])} ({x(r['burst_short_ttft_p99_off_over_on'])}); "
            f"throughput on {on['burst']['total_tokens_per_s']:.0f}, off "
            f"{off['burst']['total_tokens_per_s']:.0f} tokens/s -> on/off "
            f"{x(r['burst_throughput_on_over_off'])} [target within 10%]",
        ]
    elif name == "static":
        c, s = r["continuous"], r["static"]
        lines += [
            f"  {c['num']} requests, outputs 8..256: continuous {c['output_tokens_per_s']:.0f}, static "
            f"{s['output_tokens_per_s']:.0f} output tokens/s -> {x(r['continuous_over_static'])} "
            f"[target >= 3x]",
        ]
    elif name == "fair":
        lines += [
            f"  capacity {r['capacity_rps']:.2f} req/s; heavy {r['heavy_rate_rps']:.2f}, light "
            f"{r['light_rate_rps']:.2f} req/s",
        ]
        for phase in ("light_alone", "fair_share", "one_shared_key"):
            light = r[phase]["light"]
            lines.append(
                f"  {phase:>15}: light TTFT p50 {ms(light['ttft_p50_s'])}, served {light['served']}/"
                f"{light['num']}; heavy served {r[phase]['heavy']['served']}/{r[phase]['heavy']['num']}"
            )
        lines.append(
            f"  light TTFT p50 vs alone: fair share {x(r['light_ttft_p50_fair_vs_alone'])} [target <= 2x], "
            f"one shared key {x(r['light_ttft_p50_shared_key_vs_alone'])}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default=None, help="HF folder or GGUF; 'tiny' = random tiny model; default bundled"
    )
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated: " + ",".join(SCENARIOS))
    p.add_argument("--scale", type=float, default=1.0, help="multiplies the number of requests")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per open-loop phase")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens (flood, buckets, fair)")
    p.add_argument("--flood-factor", type=float, default=2.0, help="free arrival rate / capacity")
    p.add_argument("--heavy-factor", type=float, default=1.5, help="fair: heavy tenant's rate / capacity")
    p.add_argument("--load", type=float, default=0.8, help="buckets: arrival rate / capacity")
    p.add_argument("--free-deadline", type=float, default=2.0, help="queue deadline of free requests (s)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--kv-cache-mib", type=int, default=None, help="KV cache size (default: engine's)")
    p.add_argument("--json", type=Path, default=None, help="also write all figures here")
    return p.parse_args(argv)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    engines = Engines(args)
    results: dict[str, Any] = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    for name in args.scenarios.split(","):
        if name not in SCENARIOS:
            raise SystemExit(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
        meter = CpuMeter()
        meter.start()
        started = time.perf_counter()
        result = await SCENARIOS[name](engines, args)
        result["cpu"] = meter.stop().as_dict()
        result["wall_s"] = time.perf_counter() - started
        results[name] = result
        print(report(name, result), flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results = asyncio.run(main_async(args))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=str))
        print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
