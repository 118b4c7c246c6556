"""Concurrency sweep: the load generator at 1, 4, 16, 32, 64 concurrent requests against one or more
endpoints, written as a markdown table, JSON and a PNG of throughput against latency (the knee).

    python -m bench.sweep --endpoint batchgate=http://127.0.0.1:8000/v1 \
        --endpoint llama.cpp=http://127.0.0.1:8080/v1 --max-tokens 64
    python -m bench.sweep --batchgate --llama-server /path/to/llama-server --max-tokens 64

`--batchgate`, `--transformers-serve` and `--llama-server PATH` start those servers themselves (as
`bench.compare` does, one at a time, sized for the highest level: `--max-num-seqs`, `-np`,
`--cb-num-blocks`) and stop them after their sweep.

Endpoints run one after the other (never at once: on a small machine they would share the cores).
Per level, `--requests-per-level` requests are sent (default: max(8, 2 x concurrency), so every
level runs at least two "waves"). `--warmup N` untimed requests go to each endpoint before its
first level. An endpoint that needs different request fields (e.g. `transformers serve` rejects
`ignore_eos`) gets them with `--endpoint-options LABEL='{"ignore_eos": false, "extra_body": {...}}'`
(any `LoadConfig` field).

The knee is marked at the lowest concurrency that reaches 90% of the endpoint's best throughput:
beyond it, more concurrency buys little throughput and costs latency. When the highest level is
still 10%+ above the one before, no knee is marked (throughput still rising: sweep further, e.g.
`--concurrency 1,4,16,32,64,128`). Each level also records the share of the machine that other
processes took while it ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench.cpu import CpuMeter
from bench.loadgen import LoadConfig, add_load_args, config_from_args, format_table, run
from bench.model import bundled_gguf, hf_folder
from bench.servers import (
    ServerSpec,
    batchgate_spec,
    launched,
    llama_server_spec,
    transformers_serve_spec,
)

DEFAULT_LEVELS = (1, 4, 16, 32, 64)
KNEE_FRACTION = 0.9


@dataclass
class Endpoint:
    label: str
    base_url: str
    options: dict = field(default_factory=dict)  # LoadConfig field overrides
    server: ServerSpec | None = None  # started for the sweep when set


def requests_for(concurrency: int, requests_per_level: int | None) -> int:
    return requests_per_level if requests_per_level else max(8, 2 * concurrency)


def sweep_endpoint(
    endpoint: Endpoint,
    base: LoadConfig,
    levels: list[int],
    requests_per_level: int | None,
    warmup: int,
    verbose: bool = True,
    pgid: int | None = None,
) -> list[dict]:
    """Run every level against one endpoint; returns one loadgen summary per level, each with the
    share of the machine other processes took meanwhile (`cpu.others_busy`; the server's process
    group `pgid` counts as ours when we started it)."""
    results = []
    for key, value in endpoint.options.items():
        if key == "extra_body":
            value = {**base.extra_body, **value}
        base = dataclasses.replace(base, **{key: value})
    base = dataclasses.replace(base, base_url=endpoint.base_url, rate=None, warmup=0)
    if warmup:
        run(dataclasses.replace(base, num_requests=warmup, concurrency=min(warmup, 4), seed=base.seed + 1000))
    for concurrency in levels:
        cfg = dataclasses.replace(
            base, concurrency=concurrency, num_requests=requests_for(concurrency, requests_per_level)
        )
        meter = CpuMeter(pgid)
        meter.start()
        summary = run(cfg)
        summary["cpu"] = meter.stop().as_dict()
        summary["label"] = endpoint.label
        if verbose:
            print(format_table(summary, endpoint.label), file=sys.stderr, flush=True)
        results.append(summary)
    return results


def knee(series: list[dict]) -> dict | None:
    """The lowest-concurrency point within KNEE_FRACTION of the series' best throughput; None when
    there is none yet: the best is the highest level and it still gained >= 1/KNEE_FRACTION over the
    level before (throughput still rising: sweep further)."""
    good = sorted((s for s in series if s["output_tokens_per_s"]), key=lambda s: s["config"]["concurrency"])
    if not good:
        return None
    best = max(s["output_tokens_per_s"] for s in good)
    point = next(s for s in good if s["output_tokens_per_s"] >= KNEE_FRACTION * best)
    if point is good[-1] and len(good) > 1 and good[-2]["output_tokens_per_s"] < KNEE_FRACTION * best:
        return None
    return point


def _cell(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_table(all_results: dict[str, list[dict]]) -> str:
    lines = [
        "| endpoint | concurrency | requests ok | errors | output tok/s | TTFT p50 ms | TTFT p99 ms "
        "| TPOT p50 ms | TPOT p99 ms | ITL p99 ms | e2e p50 ms | others' CPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, series in all_results.items():
        k = knee(series)
        for s in series:
            c = s["config"]["concurrency"]
            mark = " (knee)" if k is s else ""
            errors = sum(s["errors_by_status"].values())
            lines.append(
                f"| {label} | {c}{mark} | {s['num_ok']}/{s['num_requests']} | {errors} "
                f"| {_cell(s['output_tokens_per_s'], 1)} | {_cell(s['ttft_ms']['p50'])} "
                f"| {_cell(s['ttft_ms']['p99'])} | {_cell(s['tpot_ms']['p50'], 1)} "
                f"| {_cell(s['tpot_ms']['p99'], 1)} "
                f"| {_cell(s['itl_ms']['p99'], 1)} | {_cell(s['e2e_ms']['p50'])} "
                f"| {_cell(100 * s['cpu']['others_busy']) + '%' if 'cpu' in s else '-'} |"
            )
    return "\n".join(lines)


def plot(all_results: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    ax_tput, ax_ttft, ax_tpot = axes
    for label, series in all_results.items():
        pts = [s for s in series if s["output_tokens_per_s"]]
        if not pts:
            continue
        conc = [s["config"]["concurrency"] for s in pts]
        tput = [s["output_tokens_per_s"] for s in pts]
        ttft = [s["ttft_ms"]["p50"] for s in pts]
        tpot = [s["tpot_ms"]["p50"] for s in pts]
        (line,) = ax_tput.plot(conc, tput, marker="o", label=label)
        color = line.get_color()
        ax_ttft.plot(tput, ttft, marker="o", color=color, label=label)
        ax_tpot.plot(tput, tpot, marker="o", color=color, label=label)
        for ax, ys in ((ax_ttft, ttft), (ax_tpot, tpot)):
            for x, y, c in zip(tput, ys, conc, strict=True):
                if y is not None:
                    ax.annotate(f"c={c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        k = knee(pts)
        if k is not None:
            kc, kt = k["config"]["concurrency"], k["output_tokens_per_s"]
            ax_tput.scatter([kc], [kt], s=180, facecolors="none", edgecolors=color, linewidths=2)
            ax_tput.annotate(
                f"knee c={kc}",
                (kc, kt),
                textcoords="offset points",
                xytext=(-20, -18),
                fontsize=9,
                color=color,
            )
            for ax, key in ((ax_ttft, "ttft_ms"), (ax_tpot, "tpot_ms")):
                if k[key]["p50"] is not None:
                    ax.scatter(
                        [kt], [k[key]["p50"]], s=180, facecolors="none", edgecolors=color, linewidths=2
                    )
    ax_tput.set(
        xscale="log",
        xlabel="concurrent requests",
        ylabel="output tokens/s",
        title="throughput vs concurrency",
    )
    ax_tput.set_xticks(sorted({s["config"]["concurrency"] for v in all_results.values() for s in v}))
    ax_tput.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax_ttft.set(yscale="log", xlabel="output tokens/s", ylabel="TTFT p50 (ms)", title="TTFT vs throughput")
    ax_tpot.set(xlabel="output tokens/s", ylabel="TPOT p50 (ms)", title="TPOT vs throughput")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(all_results: dict[str, list[dict]], out_dir: Path, title: str) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "sweep.json", "md": out_dir / "sweep.md", "png": out_dir / "sweep.png"}
    paths["json"].write_text(json.dumps(all_results, indent=2))
    paths["md"].write_text(f"{title}\n\n{markdown_table(all_results)}\n")
    plot(all_results, paths["png"], title)
    return paths


def parse_endpoints(specs: list[str], option_specs: list[str]) -> list[Endpoint]:
    endpoints = []
    for spec in specs:
        label, sep, url = spec.partition("=")
        if not sep or not url:
            raise SystemExit(f"--endpoint must be LABEL=URL, got {spec!r}")
        endpoints.append(Endpoint(label, url))
    by_label = {e.label: e for e in endpoints}
    for spec in option_specs:
        label, sep, text = spec.partition("=")
        if label not in by_label or not sep:
            raise SystemExit(f"--endpoint-options must be LABEL=JSON for a known label, got {spec!r}")
        by_label[label].options = json.loads(text)
    return endpoints


def started_endpoints(args: argparse.Namespace, max_level: int) -> list[Endpoint]:
    """Endpoints for the servers this sweep starts itself, sized for `max_level` concurrent requests."""
    specs = []
    if args.batchgate:
        specs.append(batchgate_spec(args.dtype, max_level, shlex.split(args.batchgate_args)))
    if args.transformers_serve:
        blocks = ["--cb-num-blocks", str(max(16, 2 * max_level))]
        specs.append(transformers_serve_spec(hf_folder(None), args.dtype, args.max_tokens, extra_args=blocks))
    if args.llama_server:
        threads = args.threads or os.cpu_count() or 1
        specs.append(
            llama_server_spec(
                args.llama_server,
                bundled_gguf(),
                max_level,
                threads,
                ctx_size=256 * max_level,
                extra_args=shlex.split(args.llama_args),
            )
        )
    return [Endpoint(s.label.split()[0], s.base_url, dict(s.load_options), server=s) for s in specs]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", action="append", default=[], help="LABEL=BASE_URL (repeatable)")
    parser.add_argument("--batchgate", action="store_true", help="start `batchgate serve` and sweep it")
    parser.add_argument("--batchgate-args", default="", help="extra flags for `batchgate serve`")
    parser.add_argument("--dtype", default="bfloat16", help="dtype for the servers started here")
    parser.add_argument("--transformers-serve", action="store_true", help="start `transformers serve` too")
    parser.add_argument("--llama-server", default=None, metavar="PATH", help="start this llama-server too")
    parser.add_argument("--llama-args", default="", help="extra flags for llama-server")
    parser.add_argument("--threads", type=int, default=None, help="llama-server -t (default: all CPUs)")
    parser.add_argument(
        "--endpoint-options", action="append", default=[], help="LABEL=JSON LoadConfig overrides"
    )
    parser.add_argument(
        "--concurrency", default=",".join(map(str, DEFAULT_LEVELS)), help="comma-separated levels"
    )
    parser.add_argument("--requests-per-level", type=int, default=None)
    add_load_args(parser)
    parser.add_argument("--out-dir", default=None, help="default: bench/results/sweep-<UTC time>")
    args = parser.parse_args(argv)

    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    endpoints = started_endpoints(args, max(levels)) + parse_endpoints(args.endpoint, args.endpoint_options)
    if not endpoints:
        raise SystemExit(
            "nothing to sweep: give --endpoint, --batchgate, --transformers-serve or --llama-server"
        )
    base = config_from_args(args, endpoints[0].base_url, levels[0], 1)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path(args.out_dir or Path(__file__).parent / "results" / f"sweep-{stamp}")
    all_results = {}
    for e in endpoints:
        if e.server is None:
            all_results[e.label] = sweep_endpoint(e, base, levels, args.requests_per_level, args.warmup)
            continue
        print(f"[sweep] starting {e.label}: {' '.join(e.server.argv)}", file=sys.stderr, flush=True)
        try:
            with launched(e.server, out_dir / "logs") as proc:
                all_results[e.label] = sweep_endpoint(
                    e, base, levels, args.requests_per_level, args.warmup, pgid=proc.pid
                )
        except RuntimeError as exc:  # a server that cannot start is reported, the others still run
            print(f"[sweep] {e.label} skipped: {exc}", file=sys.stderr, flush=True)
    title = f"concurrency sweep, {args.max_tokens} output tokens/request, {stamp}"
    paths = write_outputs(all_results, out_dir, title)
    print(markdown_table(all_results))
    print(f"\nwrote {paths['md']}, {paths['json']}, {paths['png']}")


if __name__ == "__main__":
    main()
