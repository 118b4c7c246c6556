"""The plots of docs/BENCHMARKS.md's first page, drawn from the result files committed beside them.

    python -m bench.published            # docs/figures/data/*.json -> docs/figures/*.png

Each result file holds one figure's numbers with its command, date, code revision and CPU
(copied from the run's dated result file in docs/results/). Needs matplotlib (the `bench` extra).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

FIGURES = Path(__file__).parent.parent / "docs" / "figures"
RESULTS = FIGURES / "data"


def _load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((RESULTS / f"{name}.json").read_text())
    return data


def _caption(data: dict[str, Any]) -> str:
    return f"{data['date']}, code {data['revision']}, {data['cpu']}"


def _column(data: dict[str, Any], name: str) -> int:
    columns: list[str] = data["columns"]
    return columns.index(name)


def throughput(plt: Any, name: str) -> Any:
    """Output tokens/s and TTFT p99 against concurrency, one line per system."""
    data = _load(name)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    tok, ttft = _column(data, "output_tokens_per_s"), _column(data, "ttft_p99_ms")
    for system, rows in data["series"].items():
        levels = [r[0] for r in rows]
        left.plot(levels, [r[tok] for r in rows], marker="o", label=system)
        right.plot(levels, [r[ttft] for r in rows], marker="o", label=system)
    for ax, label in ((left, "output tokens/s"), (right, "TTFT p99 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    left.legend(fontsize=8, loc="best")
    fig.suptitle(f"{data['title']}\n{_caption(data)}", fontsize=9)
    return fig


def long_mix(plt: Any) -> Any:
    """Short requests' TTFT p99 and all streams' inter-token p99, without and with documents."""
    data = _load("long_mix")
    systems = list(data["systems"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    pairs = (
        ("short TTFT p99 (ms)", "short_ttft_p99_ms_without", "short_ttft_p99_ms_with"),
        ("inter-token p99 (ms)", "itl_p99_ms_without", "itl_p99_ms_with"),
    )
    for ax, (label, without, with_) in zip(axes, pairs, strict=True):
        x = range(len(systems))
        a, b = _column(data, without), _column(data, with_)
        ax.bar([i - 0.2 for i in x], [data["systems"][s][a] for s in systems], 0.4, label="chat turns only")
        ax.bar([i + 0.2 for i in x], [data["systems"][s][b] for s in systems], 0.4, label="with documents")
        ax.set_xticks(list(x), systems, fontsize=8)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend()
    fig.suptitle(f"{data['title']}\n{_caption(data)}", fontsize=9)
    return fig


def embeddings(plt: Any) -> Any:
    """Served p50 latency at one client against the in-process call, by input length."""
    data = _load("embeddings_latency")
    fig, ax = plt.subplots(figsize=(6, 4))
    tokens = [r[0] for r in data["rows"]]
    for column, label in (
        ("in_process_p50_ms", "in-process model call"),
        ("sentence_transformers_p50_ms", "sentence-transformers encode"),
        ("served_raw_p50_ms", "batchgate served (bare socket)"),
        ("served_httpx_p50_ms", "batchgate served (httpx)"),
    ):
        i = _column(data, column)
        ax.plot(tokens, [r[i] for r in data["rows"]], marker="o", label=label)
    ax.set_xlabel("input tokens")
    ax.set_ylabel("latency p50 (ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(f"{data['title']}\n{_caption(data)}", fontsize=8)
    return fig


def speculative(plt: Any) -> Any:
    """One stream's decode tokens/s by workload, speculation off and on, beside llama.cpp's server
    plain and with its n-gram drafts; the one-token-a-pass bound of the same run as a line."""
    data = _load("speculative")
    workloads: list[str] = data["workloads"]
    systems: dict[str, list[float | None]] = data["systems"]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(systems)
    for k, (system, rates) in enumerate(systems.items()):
        xs = [i - 0.4 + width * (k + 0.5) for i, r in enumerate(rates) if r is not None]
        ax.bar(xs, [r for r in rates if r is not None], width, label=system)
    ax.axhline(data["bound_tok_s"], color="black", linestyle="--", linewidth=1)
    ax.annotate("one token per pass over the weights", (-0.45, data["bound_tok_s"] * 1.02), fontsize=8)
    ax.set_xticks(range(len(workloads)), workloads, fontsize=9)
    ax.set_ylabel("decode tokens/s, one stream")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, ncol=2)
    fig.suptitle(f"{data['title']}\n{_caption(data)}", fontsize=9)
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=FIGURES, help="folder for the PNG files")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.out.mkdir(parents=True, exist_ok=True)
    figures = {
        "throughput_concurrency": throughput(plt, "throughput_concurrency"),
        "throughput_avx2": throughput(plt, "throughput_avx2"),
        "throughput_zen4": throughput(plt, "throughput_zen4"),
        "throughput_zen4_avx2_profile": throughput(plt, "throughput_zen4_avx2_profile"),
        "throughput_xeon_avx2_profile": throughput(plt, "throughput_xeon_avx2_profile"),
        "long_mix": long_mix(plt),
        "embeddings_latency": embeddings(plt),
        "speculative": speculative(plt),
    }
    for name, fig in figures.items():
        path = args.out / f"{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        print(path)


if __name__ == "__main__":
    main()
