"""Long prompts among chat turns: does a pasted document stall everyone else? (issue 17)

    python -m bench.long_mix --batchgate --llama-server PATH --vllm      # all three, one invocation

Workload: 60 chat requests, 16 at a time (closed loop), 32 output tokens each with EOS ignored,
greedy; every 10th prompt is a ~1,500-token document to summarize, the rest short chat turns
(`bench.prompts`). No two requests share a prefix, so no prefix cache helps anybody: every prompt
starts with its own system message (a session number and a random code, inside the first 16
tokens), and each document is its own random text. Each server runs the mix twice on one launch:
without the documents (the 54 short requests alone, in the same order) and with them. Reported per
server: the short requests' TTFT p50/p99 in both runs and the p99 ratio, inter-token p99 over every
stream in both runs, the documents' TTFT p50, and throughput (output tokens/s; prompt + output
tokens/s). Servers run one after another, never together; before each timed run the machine is
given a chance to quiet down (`--wait-quiet`), and the share other processes took is recorded, as
in `bench.compare`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import os
import random
import shlex
import sys
import time
from pathlib import Path

import httpx

from bench.compare import code_version, settle
from bench.cpu import CpuMeter
from bench.loadgen import LoadConfig, RequestRecord, build_body, closed_loop, percentile, resolve_model
from bench.model import bundled_gguf, hf_folder
from bench.offline import machine
from bench.prompts import TOPICS, chat_prompts
from bench.servers import (
    REPO,
    ServerSpec,
    batchgate_spec,
    launched,
    llama_server_spec,
    vllm_cpu_spec,
)

DEFAULT_VLLM_SCRIPT = os.environ.get("BATCHGATE_BENCH_VLLM", "/work/shared/peers/vllm-cpu.sh")
# Tokens per word of a document request, chat template included, with SmolLM2's tokenizer: 40
# documents asked for 1,500 tokens came to 1,482-1,526 (~1,100 words each). Other Llama-family
# tokenizers differ by some percent; the report gives the measured prompt sizes from usage.
TOKENS_PER_WORD = 1.37

_WORDS = (
    "report quarter revenue growth market customer product team project budget schedule risk "
    "plan review decision meeting result analysis system process service policy change region "
    "supplier contract cost margin forecast demand capacity delivery quality incident support "
    "release feature survey partner training audit target metric goal issue action owner update"
).split()
_VERBS = "increased declined improved delayed doubled stabilised exceeded missed shifted expanded".split()


@dataclasses.dataclass(frozen=True)
class MixRequest:
    messages: list[dict[str, str]]
    long: bool


def document(rng: random.Random, num_words: int) -> str:
    """Random business-report prose of about `num_words` words: unlike any other document."""
    sentences: list[str] = []
    count = 0
    while count < num_words:
        n = rng.randint(4, 9)
        words = [rng.choice(_WORDS) for _ in range(n)]
        sentence = (
            f"The {words[0]} for {rng.choice(TOPICS)} {rng.choice(_VERBS)} by {rng.randint(2, 97)}% "
            f"after the {' '.join(words[1:])} in week {rng.randint(1, 52)}."
        )
        sentences.append(sentence)
        count += len(sentence.split())
    return " ".join(sentences)


def mix(
    num_requests: int, long_every: int, doc_tokens: int, seed: int = 0, with_long: bool = True
) -> list[MixRequest]:
    """The requests in order: every `long_every`-th (1-based) a document when `with_long`, else left
    out, so the short requests ask the same questions in the same order either way. Their system
    messages differ between the two (and between seeds), so that a server that ran one set cannot
    serve the other's prompts from its prefix cache."""
    run = "B" if with_long else "A"
    codes = random.Random(f"{seed}-{run}")
    docs = random.Random(f"{seed}-documents")
    shorts = iter(chat_prompts(num_requests, seed=seed))
    out = []
    for i in range(num_requests):
        session = f"Session {run}{seed}-{i:04d}-{codes.getrandbits(32):08x}"
        system = {"role": "system", "content": f"{session}. You are a helpful assistant."}
        if long_every and (i + 1) % long_every == 0:
            if with_long:
                text = document(docs, int(doc_tokens / TOKENS_PER_WORD))
                user = {"role": "user", "content": f"Summarize this report in three sentences.\n\n{text}"}
                out.append(MixRequest([system, user], long=True))
            continue
        out.append(MixRequest([system, *next(shorts)], long=False))
    return out


def pct(values: list[float], q: float) -> float | None:
    p = percentile(values, q)
    return None if p is None else round(1000 * p, 1)


def summarize(requests: list[MixRequest], records: list[RequestRecord], wall_s: float) -> dict:
    pairs = list(zip(requests, records, strict=True))
    ok = [(q, r) for q, r in pairs if r.ok]
    errors: dict[str, int] = {}
    for _, r in pairs:
        if not r.ok:
            errors[r.status] = errors.get(r.status, 0) + 1
    short_ttft = [r.ttft_s for q, r in ok if not q.long and r.ttft_s is not None]
    long_ttft = [r.ttft_s for q, r in ok if q.long and r.ttft_s is not None]
    output = sum(r.output_tokens for _, r in ok)
    prompt = sum(r.prompt_tokens or 0 for _, r in ok)
    long_prompts = [r.prompt_tokens for q, r in ok if q.long and r.prompt_tokens]
    return {
        "num_requests": len(pairs),
        "num_long": sum(1 for q in requests if q.long),
        "num_ok": len(ok),
        "errors_by_status": errors,
        "sample_errors": sorted({f"{r.status}: {r.error}" for _, r in pairs if r.error})[:3],
        "wall_s": round(wall_s, 3),
        "short_ttft_ms": {"p50": pct(short_ttft, 50), "p99": pct(short_ttft, 99)},
        "long_ttft_ms": {"p50": pct(long_ttft, 50), "p99": pct(long_ttft, 99)},
        "itl_ms": {
            "p50": pct([g for _, r in ok for g in r.itl_s], 50),
            "p99": pct([g for _, r in ok for g in r.itl_s], 99),
        },
        "short_itl_p99_ms": pct([g for q, r in ok if not q.long for g in r.itl_s], 99),
        "output_tokens": output,
        "prompt_tokens": prompt,
        "long_prompt_tokens": [min(long_prompts), max(long_prompts)] if long_prompts else None,
        "output_tokens_per_s": round(output / wall_s, 1) if wall_s > 0 else None,
        "total_tokens_per_s": round((output + prompt) / wall_s, 1) if wall_s > 0 else None,
    }


async def run_mix(cfg: LoadConfig, requests: list[MixRequest], warmup: list[MixRequest]) -> dict:
    url = f"{cfg.base_url.rstrip('/')}/chat/completions"
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(cfg.timeout_s, connect=30.0)) as client:
        model = await resolve_model(client, cfg)
        if warmup:
            await closed_loop(
                client, url, [build_body(cfg, model, q.messages) for q in warmup], headers, cfg.concurrency
            )
        bodies = [build_body(cfg, model, q.messages) for q in requests]
        start = time.perf_counter()
        records = await closed_loop(client, url, bodies, headers, cfg.concurrency)
        wall_s = time.perf_counter() - start
    return summarize(requests, records, wall_s) | {"model": model}


def server_runs(spec: ServerSpec, args: argparse.Namespace, log_dir: Path) -> dict:
    """Launch `spec` (unless it is already running), then per repeat: without, then with the documents."""
    cfg = dataclasses.replace(
        LoadConfig(
            base_url=spec.base_url,
            concurrency=args.concurrency,
            num_requests=args.num_requests,
            max_tokens=args.max_tokens,
            api_key=args.api_key,
        ),
        **spec.load_options,
    )
    runs: dict[str, list[dict]] = {"without": [], "with": []}

    def measure(pgid: int | None) -> None:
        for i in range(args.repeat):
            for name in ("without", "with"):
                seed = args.seed + 100 * i  # fresh, unique prompts for each repeat
                requests = mix(args.num_requests, args.long_every, args.doc_tokens, seed, name == "with")
                # Warm-up: short requests of another seed (never a prefix of a measured one).
                warmup = mix(args.warmup, 0, 0, seed + 50) if args.warmup else []
                quiet = settle(args)
                meter = CpuMeter(pgid)
                meter.start()
                summary = asyncio.run(run_mix(cfg, requests, warmup))
                summary.update(busy_before=quiet, cpu=meter.stop().as_dict())
                print(f"[long_mix] {spec.label} {name}: {json.dumps(summary)}", file=sys.stderr, flush=True)
                runs[name].append(summary)

    try:
        if spec.argv:
            with launched(spec, log_dir) as proc:
                measure(proc.pid)
        else:
            measure(None)
    except Exception as exc:  # a peer that cannot start is reported, not fatal
        return {"error": f"{type(exc).__name__}: {exc}"[-1500:], **runs}
    return runs


def _median_run(runs: list[dict]) -> dict | None:
    good = [r for r in runs if r.get("num_ok")]
    if not good:
        return None
    return sorted(good, key=lambda r: r["short_ttft_ms"]["p99"] or 0.0)[len(good) // 2]


def _f(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.1f}x" if a and b else "-"


def report(results: dict[str, dict], header: str) -> str:
    lines = [
        header,
        "",
        "| system | short TTFT p50 / p99 ms, no long prompts | with them | p99 ratio | inter-token p99 ms, "
        "no long / with | ratio | long-prompt TTFT p50 ms | output tok/s no long / with | total tok/s "
        "with | document tokens (usage) | others' CPU share | errors |",
        "|---|---|---|---:|---|---:|---:|---|---:|---|---|---|",
    ]
    for label, runs in results.items():
        base, mixed = _median_run(runs.get("without", [])), _median_run(runs.get("with", []))
        if base is None or mixed is None:
            lines.append(
                f"| {label} | - | - | - | - | - | - | - | - | - | - | {runs.get('error', 'no result')} |"
            )
            continue
        others = ", ".join(
            f"{100 * r['cpu']['others_busy']:.0f}%" for r in runs["without"] + runs["with"] if "cpu" in r
        )
        errors = sum(sum(r["errors_by_status"].values()) for r in runs["without"] + runs["with"])
        lines.append(
            f"| {label} "
            f"| {_f(base['short_ttft_ms']['p50'])} / {_f(base['short_ttft_ms']['p99'])} "
            f"| {_f(mixed['short_ttft_ms']['p50'])} / {_f(mixed['short_ttft_ms']['p99'])} "
            f"| {_ratio(mixed['short_ttft_ms']['p99'], base['short_ttft_ms']['p99'])} "
            f"| {_f(base['itl_ms']['p99'])} / {_f(mixed['itl_ms']['p99'])} "
            f"| {_ratio(mixed['itl_ms']['p99'], base['itl_ms']['p99'])} "
            f"| {_f(mixed['long_ttft_ms']['p50'])} "
            f"| {_f(base['output_tokens_per_s'], 1)} / {_f(mixed['output_tokens_per_s'], 1)} "
            f"| {_f(mixed['total_tokens_per_s'], 1)} "
            f"| {'-'.join(str(n) for n in mixed['long_prompt_tokens'] or ()) or '-'} "
            f"| {others or '-'} | {errors} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--long-every", type=int, default=10, help="every N-th request is a document")
    parser.add_argument("--doc-tokens", type=int, default=1500, help="approximate tokens per document")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=1, help="load runs per server (median reported)")
    parser.add_argument("--warmup", type=int, default=4, help="untimed short requests before each run")
    parser.add_argument("--dtype", default="bfloat16", help="batchgate's --dtype")
    parser.add_argument("--batchgate", action="store_true", help="start `batchgate serve` and measure it")
    parser.add_argument("--batchgate-url", default=None, help="measure an already running batchgate (…/v1)")
    parser.add_argument("--batchgate-args", default="", help="extra flags for `batchgate serve`")
    parser.add_argument("--llama-server", default=None, metavar="PATH", help="llama-server binary to start")
    parser.add_argument("--llama-args", default="", help="extra flags for llama-server")
    parser.add_argument("--vllm", action="store_true", help="start vLLM's CPU build (--vllm-script)")
    parser.add_argument(
        "--vllm-script", default=DEFAULT_VLLM_SCRIPT, help="the peer script that installs and serves vLLM CPU"
    )
    parser.add_argument("--vllm-args", default="", help="extra flags for vLLM's api_server")
    parser.add_argument("--endpoint", action="append", default=[], help="LABEL=URL of another running server")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--threads", type=int, default=None, help="llama-server -t (default: all CPUs)")
    parser.add_argument("--wait-quiet", type=float, default=0.25, help="see bench.compare (1: don't wait)")
    parser.add_argument("--wait-timeout", type=float, default=120.0)
    parser.add_argument("--out-dir", default=None, help="default: bench/results/long-mix-<UTC time>")
    args = parser.parse_args(argv)

    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path(args.out_dir or REPO / "bench" / "results" / f"long-mix-{stamp}")
    out_dir.mkdir(parents=True, exist_ok=True)
    # Context per sequence: a document, its answer, and room for the chat template.
    context = args.doc_tokens + args.max_tokens + 512
    specs: list[ServerSpec] = []
    if args.batchgate:
        specs.append(batchgate_spec(args.dtype, args.concurrency, shlex.split(args.batchgate_args)))
    if args.batchgate_url:
        specs.append(ServerSpec("batchgate serve", [], args.batchgate_url, args.batchgate_url))
    if args.llama_server:
        specs.append(
            llama_server_spec(
                args.llama_server,
                bundled_gguf(),
                args.concurrency,
                args.threads or os.cpu_count() or 1,
                ctx_size=args.concurrency * context,  # -c is shared by the -np slots
                extra_args=shlex.split(args.llama_args),
            )
        )
    if args.vllm:
        specs.append(
            vllm_cpu_spec(
                args.vllm_script,
                hf_folder(),
                args.concurrency,
                context,
                extra_args=shlex.split(args.vllm_args),
            )
        )
    for label, _, url in (e.partition("=") for e in args.endpoint):
        specs.append(ServerSpec(label, [], url, url))
    if not specs:
        parser.error("nothing to measure: give --batchgate, --llama-server, --vllm or --endpoint")

    code = code_version()
    results: dict[str, dict] = {}
    for spec in specs:
        print(f"[long_mix] {spec.label}: {' '.join(spec.argv) or spec.base_url}", file=sys.stderr, flush=True)
        results[spec.label] = server_runs(spec, args, out_dir / "logs")

    info = machine()
    header = (
        f"## long-prompt mix {stamp}\n\n{args.num_requests} chat requests, {args.concurrency} concurrent, "
        f"{args.max_tokens} output tokens each (EOS ignored), greedy; every {args.long_every}th a "
        f"~{args.doc_tokens}-token document; no shared prefixes; machine: {info['cpu']}, "
        f"{info['cpus']} CPUs; repeat {args.repeat}; code: {code}"
    )
    text = report(results, header)
    (out_dir / "long_mix.md").write_text(text + "\n")
    (out_dir / "long_mix.json").write_text(
        json.dumps({"args": vars(args), "machine": info, "code": code, "results": results}, indent=2)
    )
    print(text)
    print(f"\nwrote {out_dir / 'long_mix.md'} and long_mix.json")


if __name__ == "__main__":
    main()
