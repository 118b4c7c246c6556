"""Fair shares by work (issue 43): a tenant of long prompts against a tenant of short ones, in one
class, on the engine in process (no HTTP), each tenant a closed loop of its own clients.

    python -m bench.fair_tokens                        # bundled SmolLM2-135M, buckets on and off
    python -m bench.fair_tokens --seconds 30 --json bench/results/fair_tokens.json

Tenant A sends `--long-prompt` (2,000) token prompts from `--long-clients` (32) clients at once,
tenant B `--short-prompt` (20) token prompts from `--short-clients` (4), both paid, each request
`--max-tokens` (32) output tokens (ignore_eos). Phases, each on a fresh engine: B alone, A alone,
then A and B together. Targets: B's TTFT p50 with A within 2x of B's alone, and A still gets at
least its fair share of the work: at least half of the tokens the engine computes while both
run (B asks for less than half, so max-min fairness gives A everything B leaves), and about all
that B leaves of its rate alone. The default also runs `--length-buckets 0`, where only the
per-tenant turns (engine/scheduler/fair_share.py) share the engine: without buckets no prompt is
long and the step-time budget is off, so A's chunks make whole steps and B waits for them.

B's closed loop arrives differently alone and beside A: alone, the engine starts a step at each
arrival, so B's four clients drift apart and a prompt mostly shares its step with one other; beside
A the engine never idles, B's streams end in the same step and all four prompts arrive together
and share the next one. `--short-arrivals together` makes B's clients send in rounds (all four at
once, the next round when all have ended) in both phases, so the two phases compare the same
arrivals. `--short-spread S` draws each B request's outputs from 32 +- S, so B's streams end in
different steps as real ones do; `--short-arrivals poisson` sends B's requests at random instead,
`--short-rate` a second (open loop: a prompt then also waits for the step in flight). `--explain`
logs every step and says where B's first tokens waited: before the step that took its prompt,
that step's time and how many B prompts it carried, and how many of those steps carried a chunk
of A's.

Run it under another checkout (`PYTHONPATH=<checkout> python bench/fair_tokens.py`) to measure
that checkout's scheduler with the same workload.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from bench.cpu import CpuMeter, busy_fraction, wait_quiet
from bench.offline import machine
from bench.policy_bench import Record, Workload, percentile


async def serve_one(engine: Any, request: Any, record: Record) -> None:
    """`record` filled as `request` streams; cancelled, the request is aborted in the engine
    (policy_bench's `run_one` leaves a cancelled one running)."""
    start = time.perf_counter()
    record.sent_at = start
    stream = engine.submit(request)
    try:
        async for out in stream:
            if out.error is not None:
                record.error = f"{type(out.error).__name__}: {out.error}"
                continue
            if out.new_token_ids and record.ttft_s is None:
                record.ttft_s = time.perf_counter() - start
            record.num_output_tokens += len(out.new_token_ids)
        record.e2e_s = time.perf_counter() - start
    finally:
        await stream.aclose()


async def send_requests(
    engine: Any,
    wl: Workload,
    tag: str,
    clients: int,
    prompt_len: int,
    max_tokens: int,
    records: list[Record],
    arrivals: str = "closed",
    spread: int = 0,
    rate: float = 1.0,
) -> None:
    """`clients` requests of `prompt_len` tokens in flight until cancelled; each request's record
    is in `records` from its start (so one cut short counts what it was served). `arrivals`:
    closed (each client sends its next when its last ends), together (in rounds: all `clients`
    at once, the next round when the last has ended) or poisson (open loop at `rate` a second,
    however many are in flight). `spread`: each request's outputs drawn from max_tokens +- spread."""
    draw = random.Random(f"{tag}-arrivals")

    async def one() -> None:
        wanted = max_tokens + draw.randint(-spread, spread) if spread else max_tokens
        request, record = wl.request(tag, prompt_len, wanted, key=tag)
        records.append(record)
        await serve_one(engine, request, record)

    if arrivals == "together":
        while True:
            await asyncio.gather(*(one() for _ in range(clients)))
    if arrivals == "poisson":
        in_flight: set[asyncio.Task[None]] = set()
        try:
            while True:
                await asyncio.sleep(draw.expovariate(rate))
                task = asyncio.ensure_future(one())
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
        finally:
            for task in list(in_flight):
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)

    async def client() -> None:
        while True:
            await one()

    await asyncio.gather(*(client() for _ in range(clients)))


def tokens_served(record: Record) -> int:
    """A request's tokens computed: its prompt once its first token came, and its outputs."""
    if record.error is not None or record.ttft_s is None:
        return 0
    return record.num_prompt_tokens + record.num_output_tokens


def summary(records: list[Record], wall_s: float) -> dict[str, Any]:
    started = [r for r in records if r.ttft_s is not None and r.error is None]
    return {
        "requests": len(started),
        "ended": sum(r.e2e_s is not None for r in started),
        "errors": sum(r.error is not None for r in records),
        "ttft_p50_s": percentile((r.ttft_s for r in started), 50),
        "ttft_p90_s": percentile((r.ttft_s for r in started), 90),
        # the decode step as the client sees it: (e2e - TTFT) / (outputs - 1), requests that ended
        "tpot_p50_s": percentile(
            (
                (r.e2e_s - r.ttft_s) / (r.num_output_tokens - 1)
                for r in started
                if r.e2e_s and r.num_output_tokens > 1
            ),
            50,
        ),
        "tokens_per_s": sum(tokens_served(r) for r in records) / wall_s,
        "ttfts_s": [round(r.ttft_s, 4) for r in started if r.ttft_s is not None],
    }


async def phase(
    args: argparse.Namespace, buckets: tuple[int, ...], long: bool, short: bool
) -> dict[str, Any]:
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig

    settings: dict[str, Any] = {
        "model": args.model,
        "max_num_seqs": args.max_num_seqs,
        "kv_cache_memory_bytes": args.kv_cache_mib << 20,
        "length_buckets": buckets,
    }
    if args.target_itl_ms is not None:
        settings["target_itl_ms"] = args.target_itl_ms
    engine = await asyncio.to_thread(AsyncEngine.from_config, EngineConfig.of(**settings))
    computed = _computed(engine)
    steps = _step_log(engine) if args.explain else None
    try:
        wl = Workload(7)

        async def window(seconds: float) -> tuple[list[Record], float]:
            """The phase's clients for `seconds`, then cut (their streams aborted)."""
            records: list[Record] = []
            start = time.perf_counter()
            jobs = []
            for tag, clients, prompt_len, wanted in (
                ("long", args.long_clients, args.long_prompt, long),
                ("short", args.short_clients, args.short_prompt, short),
            ):
                if wanted:
                    is_b = tag == "short"
                    loop = send_requests(
                        engine,
                        wl,
                        tag,
                        clients,
                        prompt_len,
                        args.max_tokens,
                        records,
                        args.short_arrivals if is_b else "closed",
                        args.short_spread if is_b else 0,
                        args.short_rate,
                    )
                    jobs.append(asyncio.ensure_future(loop))
            await asyncio.sleep(seconds)
            wall = time.perf_counter() - start
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
            return records, wall

        # Warm-up, untimed: the same workload first, so the engine's first steps at each batch
        # shape, the threads' trials and the step-cost model are behind the window (without it, B
        # alone saw steps stall 0.6-2.4 s at a time in its first half minute: B's p90 in seconds).
        await window(args.warmup)
        before = dict(computed)
        records, wall = await window(args.seconds)
        out: dict[str, Any] = {"wall_s": wall}
        for tag in ("long", "short"):
            mine = [r for r in records if r.tag == tag]
            if mine:
                out[tag] = summary(mine, wall)
                out[tag]["computed_per_s"] = (computed.get(tag, 0) - before.get(tag, 0)) / wall
        if steps is not None and "short" in out:
            out["short"]["explained"] = explain([r for r in records if r.tag == "short"], steps)
        return out
    finally:
        await asyncio.to_thread(engine.shutdown)


def _computed(engine: Any) -> dict[str, int]:
    """Tokens the engine computes for each tenant from now on (prefill chunks and decodes, counted as
    each step ends): a tenant's work as it is done. `tokens_per_s` counts a 2,000-token prompt only
    once its first token came, so in a 40 s window A's figure moves in steps of ~15%."""
    counts: dict[str, int] = {}
    scheduler = engine.engine.scheduler
    record = scheduler.record_step

    def counted(output: Any, seconds: float) -> None:
        for chunk in output.chunks:
            key = chunk.seq.fairness_key
            counts[key] = counts.get(key, 0) + chunk.num_tokens
        record(output, seconds)

    scheduler.record_step = counted
    return counts


def _step_log(engine: Any) -> list[tuple[float, float, int, bool, int, int]]:
    """Every step the engine runs from now on, as (start, end, short prompts it completes, whether
    it carries a long prompt's chunk, the long prompts' tokens in it, its decode rows), from the
    scheduler's record of each step (perf_counter)."""
    steps: list[tuple[float, float, int, bool, int, int]] = []
    scheduler = engine.engine.scheduler
    record = scheduler.record_step

    def logged(output: Any, seconds: float) -> None:
        end = time.perf_counter()
        prompts = [c.seq for c in output.prefills]  # their progress already advanced by this step
        short = sum(
            s.fairness_key == "short" and s.num_computed_tokens >= s.num_prompt_tokens for s in prompts
        )
        long_tokens = sum(c.num_tokens for c in output.prefills if c.seq.fairness_key == "long")
        steps.append((end - seconds, end, short, long_tokens > 0, long_tokens, output.num_decode_rows))
        record(output, seconds)

    scheduler.record_step = logged
    return steps


def explain(records: list[Record], steps: list[tuple[float, float, int, bool, int, int]]) -> dict[str, Any]:
    """Where B's TTFTs went: for each B request, its own prompt's step (the last that ended before
    its first token and completed a B prompt), what else it carried, and the wait before it started."""
    waits, own, together, behind_chunk, long_tokens, rows = [], [], [], 0, [], []
    for r in records:
        if r.ttft_s is None or r.error is not None:
            continue
        first = r.sent_at + r.ttft_s
        mine = [s for s in steps if s[1] <= first and s[2] and s[1] > r.sent_at]
        if not mine:
            continue
        start, end, short, _, in_long, in_rows = mine[-1]
        waits.append(max(0.0, start - r.sent_at))
        own.append(end - start)
        together.append(short)
        long_tokens.append(in_long)
        rows.append(in_rows)
        behind_chunk += any(s[3] and s[0] < start and s[1] > r.sent_at for s in steps)
    return {
        "requests": len(own),
        "wait_p50_s": percentile(waits, 50),
        "own_step_p50_s": percentile(own, 50),
        "prompts_in_own_step_p50": percentile(together, 50),
        "long_tokens_in_own_step_p50": percentile(long_tokens, 50),
        "decode_rows_in_own_step_p50": percentile(rows, 50),
        "waited_behind_long_chunk": behind_chunk / len(own) if own else None,
    }


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms"


def num(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


async def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    for label, buckets in (("buckets on", (256, 1024, 4096)), ("buckets off", ())):
        if args.length_buckets == "on" and buckets == () or args.length_buckets == "off" and buckets:
            continue
        meter = CpuMeter()
        meter.start()
        short_alone = await phase(args, buckets, long=False, short=True)
        long_alone = await phase(args, buckets, long=True, short=False)
        both = await phase(args, buckets, long=True, short=True)
        b_alone, a_alone = short_alone["short"], long_alone["long"]
        a, b = both["long"], both["short"]
        ratio = b["ttft_p50_s"] / b_alone["ttft_p50_s"] if b["ttft_p50_s"] and b_alone["ttft_p50_s"] else None
        a_rate, b_rate = a["computed_per_s"], b["computed_per_s"]
        share = a_rate / (a_rate + b_rate)
        left = a_alone["computed_per_s"] - b_rate  # what B leaves of A's rate alone
        results[label] = {
            "short_alone": short_alone,
            "long_alone": long_alone,
            "both": both,
            "short_ttft_p50_vs_alone": ratio,
            "long_share_of_tokens": share,
            "long_tokens_vs_left_by_short": a_rate / left if left > 0 else None,
            "cpu": meter.stop().as_dict(),
        }
        r = results[label]
        print(
            f"== {label}  (other work on the machine: {r['cpu']['others_busy'] * 100:.0f}% of all CPUs)\n"
            f"  B (short) TTFT p50: alone {ms(b_alone['ttft_p50_s'])}, with A {ms(b['ttft_p50_s'])} -> "
            f"{num(ratio)}x [target <= 2x]; p90 alone {ms(b_alone['ttft_p90_s'])}, with A "
            f"{ms(b['ttft_p90_s'])}; requests started {b['requests']} (alone {b_alone['requests']}); B's "
            f"decode step p50 alone {ms(b_alone['tpot_p50_s'])}, with A {ms(b['tpot_p50_s'])}\n"
            f"  A (long) tokens computed/s: alone {a_alone['computed_per_s']:.0f}, with B {a_rate:.0f} "
            f"(B {b_rate:.0f}): A's share {share * 100:.1f}% [target >= 50%], "
            f"{num(r['long_tokens_vs_left_by_short'])}x of what B leaves of A's rate alone; A TTFT p50 "
            f"alone {ms(a_alone['ttft_p50_s'])}, with B {ms(a['ttft_p50_s'])}",
            flush=True,
        )
        for name, b_phase in (("alone", short_alone["short"]), ("with A", b)):
            e = b_phase.get("explained")
            if e:
                print(
                    f"  B {name}: wait before its prompt's step p50 {ms(e['wait_p50_s'])}, that step "
                    f"p50 {ms(e['own_step_p50_s'])} with {e['prompts_in_own_step_p50']:.0f} B prompts, "
                    f"{e['long_tokens_in_own_step_p50']:.0f} of A's prompt tokens and "
                    f"{e['decode_rows_in_own_step_p50']:.0f} decode rows; "
                    f"{e['waited_behind_long_chunk'] * 100:.0f}% waited behind a step with A's chunk",
                    flush=True,
                )
    return results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or GGUF (default: the bundled SmolLM2-135M)")
    p.add_argument("--seconds", type=float, default=60.0, help="length of each phase")
    p.add_argument("--warmup", type=float, default=20.0, help="seconds of the same workload before it")
    p.add_argument("--long-prompt", type=int, default=2000)
    p.add_argument("--long-clients", type=int, default=32)
    p.add_argument("--short-prompt", type=int, default=20)
    p.add_argument("--short-clients", type=int, default=4)
    p.add_argument(
        "--short-arrivals",
        choices=("closed", "together", "poisson"),
        default="closed",
        help="B's clients: each sends its next request when its last ends (closed), or all in rounds "
        "(together: the arrivals B's closed loop makes beside A, in both phases), or B's requests "
        "arrive at random, --short-rate a second on average (poisson, open loop)",
    )
    p.add_argument("--short-rate", type=float, default=2.0, help="B's requests a second (poisson)")
    p.add_argument(
        "--short-spread", type=int, default=0, help="B's outputs: --max-tokens +- this, drawn per request"
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--explain", action="store_true", help="log the steps: where B's TTFTs went")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-mib", type=int, default=1024)
    p.add_argument("--length-buckets", choices=("on", "off", "both"), default="both")
    p.add_argument("--target-itl-ms", type=float, default=None, help="the engine's (default: its own, 120)")
    p.add_argument(
        "--fair-step-share",
        type=float,
        default=None,
        help="what if: engine/scheduler/budget.py's FAIR_STEP_SHARE (default: its own, 0.3), the share of "
        "the target a long prompt's step keeps while a less served tenant's streams decode",
    )
    p.add_argument("--quiet", type=float, default=0.25, help="wait (up to 10 min) until others use < this")
    p.add_argument("--json", type=Path, default=None, help="also write all figures here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.fair_step_share is not None:
        import engine.scheduler.budget

        engine.scheduler.budget.FAIR_STEP_SHARE = args.fair_step_share  # read at each step: in process
    quiet, busy = wait_quiet(args.quiet, 600.0)
    print(
        f"machine busy {busy * 100:.0f}% before the start ({'quiet' if quiet else 'NOT quiet'})", flush=True
    )
    results = asyncio.run(run(args))
    results["busy_before"] = busy
    results["busy_after"] = busy_fraction()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=str))
        print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
