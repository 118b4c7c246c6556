"""Side by side, in one invocation, on the same prompts: our engine offline, transformers'
`generate_batch`, and optionally HTTP servers (batchgate, `transformers serve --continuous-batching`,
llama.cpp's `llama-server`) through the load generator; prints throughput and the ratios.

    python -m bench.compare                                   # engine vs generate_batch, bf16
    python -m bench.compare --dtypes bfloat16,float32 --batchgate --transformers-serve \
        --llama-server /path/to/llama-server --repeat 2

Workload (issue 2's throughput floor, issue 7's comparisons): 64 chat requests, 32 at a time,
64 output tokens each with EOS ignored, greedy. Contenders run one after another, never together
(they would share the cores); offline ones each in a fresh subprocess (`bench.engine_offline`,
`bench.hf_baseline`), so neither inherits the other's torch state. With `--repeat N` the offline
contenders take turns N times (A B A B ...) and each server gets N load runs; the median is
reported. Every server first gets `--warmup` untimed requests.

On a shared machine, before each timed run compare waits (up to `--wait-timeout` s) until the CPUs are
at most `--wait-quiet` busy, and records how much of the machine *other* processes took during the
run (`others_busy`, from /proc/stat minus our own processes' CPU time): a figure taken while others
were busy is noisy, and a ratio between runs with different `others_busy` is too.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from bench.cpu import CpuMeter, wait_quiet
from bench.loadgen import LoadConfig, format_table, run
from bench.model import bundled_gguf, hf_folder
from bench.offline import machine
from bench.servers import (
    REPO,
    ServerSpec,
    batchgate_spec,
    fastapi_path,
    launched,
    llama_server_spec,
    transformers_serve_spec,
)


def run_offline(module: str, dtype: str, args: argparse.Namespace) -> dict:
    """One offline contender in a fresh subprocess; its JSON result, or {"error": ...}."""
    argv = [
        sys.executable,
        "-m",
        module,
        "--json",
        "--dtype",
        dtype,
        "--num-requests",
        str(args.num_requests),
        "--concurrency",
        str(args.concurrency),
        "--max-tokens",
        str(args.max_tokens),
        "--prompt-lengths",
        args.prompt_lengths,
        "--seed",
        str(args.seed),
    ]
    if args.model:
        argv += ["--model", args.model]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    if module == "bench.hf_baseline":
        argv += shlex.split(args.hf_args)
    if module == "bench.engine_offline":
        argv += shlex.split(args.engine_args)
    quiet = settle(args)
    meter = CpuMeter()
    meter.start()
    try:
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"no result after --run-timeout {args.run_timeout:.0f} s"}
    usage = meter.stop()
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}"}
    result = json.loads(lines[-1])
    result.update(busy_before=quiet, cpu=usage.as_dict())  # cpu: over the whole subprocess, load included
    return result


def settle(args: argparse.Namespace) -> float:
    """Wait for a quiet machine (see the module doc); the busy share seen last."""
    if args.wait_quiet >= 1.0:
        return -1.0
    _, busy = wait_quiet(args.wait_quiet, args.wait_timeout)
    return round(busy, 3)


def server_runs(spec: ServerSpec, args: argparse.Namespace, log_dir: Path) -> list[dict]:
    """Launch (unless already running), warm up, then `--repeat` load runs at `--concurrency`."""
    base = LoadConfig(
        base_url=spec.base_url,
        concurrency=args.concurrency,
        num_requests=args.num_requests,
        max_tokens=args.max_tokens,
        prompt_lengths=args.prompt_lengths,
        seed=args.seed,
        api_key=args.api_key,
    )
    cfg = dataclasses.replace(base, **spec.load_options)
    runs = []

    def measure(pgid: int | None) -> None:
        if args.warmup:
            run(
                dataclasses.replace(
                    cfg, num_requests=args.warmup, concurrency=min(args.warmup, 4), seed=cfg.seed + 1000
                )
            )
        for _ in range(args.repeat):
            quiet = settle(args)
            meter = CpuMeter(pgid)
            meter.start()
            summary = run(cfg)
            summary.update(busy_before=quiet, cpu=meter.stop().as_dict())
            print(format_table(summary, spec.label), file=sys.stderr, flush=True)
            runs.append(summary)

    try:
        if spec.argv:
            with launched(spec, log_dir) as proc:
                measure(proc.pid)
        else:
            measure(None)  # an outside server: its CPU time counts as "others"
    except Exception as exc:  # a peer that cannot start is reported, not fatal
        return [{"error": f"{type(exc).__name__}: {exc}"[-1500:]}]
    return runs


def median_tps(runs: list[dict]) -> float | None:
    values = [r["output_tokens_per_s"] for r in runs if "error" not in r and r.get("output_tokens_per_s")]
    return statistics.median(values) if values else None


def summarize(name: str, kind: str, dtype: str, runs: list[dict]) -> dict:
    good = [r for r in runs if "error" not in r]
    row = {
        "name": name,
        "kind": kind,
        "dtype": dtype,
        "runs": runs,
        "output_tokens_per_s": median_tps(runs),
        "all_tokens_per_s": [r.get("output_tokens_per_s") for r in good],
        "errors": [r["error"] for r in runs if "error" in r],
    }
    if kind == "http" and good:
        last = sorted(good, key=lambda r: r["output_tokens_per_s"])[len(good) // 2]  # the median run
        row.update(
            ttft_ms=last["ttft_ms"],
            tpot_ms=last["tpot_ms"],
            itl_ms=last["itl_ms"],
            short=last["num_short"],
            http_errors=last["errors_by_status"],
        )
    elif good:
        row["short"] = max(r["num_short"] for r in good)
    return row


def fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def comparable(ours: dict, peer: dict) -> bool:
    """Which ratios mean something: in-process vs in-process at the same dtype; a server vs any server
    (llama.cpp runs its own quantized weights); a server vs an in-process peer at the same dtype."""
    if ours["kind"] == "offline":
        return peer["kind"] == "offline" and peer["dtype"] == ours["dtype"]
    return peer["kind"] == "http" or peer["dtype"] == ours["dtype"]


def code_version() -> str:
    """The git commit (if any) plus a hash of the engine and gateway sources as they are on disk, since
    those change under a benchmark while others work on them."""
    digest = hashlib.sha256()
    for path in sorted([*REPO.glob("engine/*.py"), *REPO.glob("gateway/*.py")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    commit = head.stdout.strip() if head.returncode == 0 else "no commit"
    return f"{commit}, engine+gateway sources {digest.hexdigest()[:12]}"


def report(rows: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        "| contender | kind | dtype | output tok/s (median) | runs | others' CPU share | TTFT p50 / p99 ms "
        "| TPOT p50 ms | short / errors |",
        "|---|---|---|---:|---|---|---|---:|---|",
    ]
    for r in rows:
        runs = ", ".join(fmt(v) for v in r["all_tokens_per_s"]) or "-"
        ttft = r.get("ttft_ms") or {}
        ttft_cell = f"{fmt(ttft.get('p50'), 0)} / {fmt(ttft.get('p99'), 0)}" if ttft else "-"
        errs = len(r["errors"]) + sum((r.get("http_errors") or {}).values())
        others = ", ".join(f"{100 * x['cpu']['others_busy']:.0f}%" for x in r["runs"] if "cpu" in x) or "-"
        lines.append(
            f"| {r['name']} | {r['kind']} | {r['dtype']} | {fmt(r['output_tokens_per_s'])} | {runs} "
            f"| {others} | {ttft_cell} | {fmt((r.get('tpot_ms') or {}).get('p50'))} "
            f"| {r.get('short', '-')} / {errs} |"
        )
    lines += ["", "Ratios (output tokens/s, ours / peer):", ""]
    ours = [r for r in rows if r["name"].startswith("batchgate") and r["output_tokens_per_s"]]
    peers = [r for r in rows if not r["name"].startswith("batchgate") and r["output_tokens_per_s"]]
    for a in ours:
        for b in peers:
            if not comparable(a, b):
                continue
            ratio = a["output_tokens_per_s"] / b["output_tokens_per_s"]
            extra = ""
            if a.get("ttft_ms") and b.get("ttft_ms") and a["ttft_ms"]["p99"] and b["ttft_ms"]["p99"]:
                extra = f"; TTFT p99 {a['ttft_ms']['p99']:.0f} vs {b['ttft_ms']['p99']:.0f} ms"
            lines.append(
                f"- {a['name']} [{a['dtype']}] / {b['name']} [{b['dtype']}]: **{ratio:.2f}x**{extra}"
            )
    if not ours or not peers:
        lines.append("- (none: need at least one batchgate contender and one peer with a result)")
    for r in rows:
        for e in r["errors"]:
            lines.append(
                f"\n{r['name']} [{r['dtype']}] failed: {e.strip().splitlines()[-1] if e.strip() else e}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--dtypes", default="bfloat16", help="offline contenders run at each (bfloat16,float32)"
    )
    parser.add_argument("--prompt-lengths", default="natural")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="HF folder or .gguf for the offline contenders")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--no-engine", action="store_true", help="skip our engine offline")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers generate_batch")
    parser.add_argument("--engine-args", default="", help="extra args for bench.engine_offline")
    parser.add_argument("--hf-args", default="", help="extra args for bench.hf_baseline (--num-blocks N ...)")
    parser.add_argument("--batchgate", action="store_true", help="start `batchgate serve` and measure it")
    parser.add_argument("--batchgate-url", default=None, help="measure an already running batchgate (…/v1)")
    parser.add_argument("--batchgate-args", default="", help="extra flags for `batchgate serve`")
    parser.add_argument(
        "--transformers-serve",
        action="store_true",
        help="start `transformers serve --continuous-batching` and measure it",
    )
    parser.add_argument("--llama-server", default=None, metavar="PATH", help="llama-server binary to start")
    parser.add_argument("--llama-args", default="", help="extra flags for llama-server")
    parser.add_argument("--endpoint", action="append", default=[], help="LABEL=URL of another running server")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--warmup", type=int, default=4, help="untimed requests per server before measuring")
    parser.add_argument("--run-timeout", type=float, default=1800.0)
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0.25,
        help="before each run wait until at most this share of the CPUs is busy (1: don't)",
    )
    parser.add_argument("--wait-timeout", type=float, default=120.0, help="longest wait for --wait-quiet, s")
    parser.add_argument("--out-dir", default=None, help="default: bench/results/compare-<UTC time>")
    args = parser.parse_args(argv)

    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path(args.out_dir or REPO / "bench" / "results" / f"compare-{stamp}")
    out_dir.mkdir(parents=True, exist_ok=True)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    hf_folder(args.model)  # convert once up front, outside any timed run
    code_version_at_start = code_version()

    rows: list[dict] = []
    offline = []
    for dtype in dtypes:
        if not args.no_engine:
            offline.append(("batchgate engine (offline)", "bench.engine_offline", dtype))
        if not args.no_hf:
            offline.append(("transformers generate_batch", "bench.hf_baseline", dtype))
    offline_runs: dict[tuple[str, str], list[dict]] = {(n, d): [] for n, _, d in offline}
    for i in range(args.repeat):
        for name, module, dtype in offline:
            print(f"[compare] {name} [{dtype}] run {i + 1}/{args.repeat}", file=sys.stderr, flush=True)
            result = run_offline(module, dtype, args)
            print(
                f"[compare]   -> {result.get('output_tokens_per_s', result.get('error'))}",
                file=sys.stderr,
                flush=True,
            )
            offline_runs[(name, dtype)].append(result)
    for name, _, dtype in offline:
        rows.append(summarize(name, "offline", dtype, offline_runs[(name, dtype)]))

    serve_dtype = dtypes[0]
    specs: list[ServerSpec] = []
    if args.batchgate:
        specs.append(batchgate_spec(serve_dtype, args.concurrency, shlex.split(args.batchgate_args)))
    if args.batchgate_url:
        specs.append(ServerSpec("batchgate serve", [], args.batchgate_url, args.batchgate_url))
    if args.transformers_serve:
        if fastapi_path() is None:
            rows.append(
                summarize(
                    "transformers serve --continuous-batching",
                    "http",
                    serve_dtype,
                    [{"error": "FastAPI not found: see docs/BENCHMARKS.md (transformers serve)"}],
                )
            )
        else:
            # Size its paged cache for the workload (256-token blocks), not 60% of RAM (see hf_baseline).
            blocks = ["--cb-num-blocks", str(max(16, 2 * args.concurrency))]
            specs.append(
                transformers_serve_spec(
                    hf_folder(args.model), serve_dtype, args.max_tokens, extra_args=blocks
                )
            )
    if args.llama_server:
        gguf = Path(args.model) if args.model and args.model.endswith(".gguf") else bundled_gguf()
        specs.append(
            llama_server_spec(
                args.llama_server,
                gguf,
                args.concurrency,
                args.threads or os.cpu_count() or 1,
                extra_args=shlex.split(args.llama_args),
            )
        )
    for spec in (s.partition("=") for s in args.endpoint):
        specs.append(ServerSpec(spec[0], [], spec[2], spec[2]))
    for spec in specs:
        print(f"[compare] {spec.label}: {' '.join(spec.argv) or spec.base_url}", file=sys.stderr, flush=True)
        dtype = "gguf Q4_1" if spec.label.startswith("llama.cpp") else serve_dtype
        rows.append(summarize(spec.label, "http", dtype, server_runs(spec, args, out_dir / "logs")))

    info = machine()
    info["code"] = code_version_at_start
    header = (
        f"## compare {stamp}\n\n{args.num_requests} requests, {args.concurrency} concurrent, "
        f"{args.max_tokens} output tokens each (EOS ignored), greedy; machine: {info['cpu']}, "
        f'{info["cpus"]} CPUs; repeat {args.repeat}; "others\' CPU share": the part of the machine that '
        f"processes other than the benchmark's took during each run (0% = a quiet machine); "
        f"code: {info['code']}" + ("" if code_version() == info["code"] else " (changed during the run!)")
    )
    text = report(rows, header)
    (out_dir / "compare.md").write_text(text + "\n")
    (out_dir / "compare.json").write_text(
        json.dumps({"args": vars(args), "machine": info, "rows": rows}, indent=2)
    )
    print(text)
    print(f"\nwrote {out_dir / 'compare.md'} and compare.json")


if __name__ == "__main__":
    main()
