"""Load generator for any OpenAI-compatible chat completions endpoint (streaming, async httpx).

    python -m bench.loadgen --base-url http://127.0.0.1:8000/v1 --concurrency 32 --num-requests 64 \
        --max-tokens 64
    python -m bench.loadgen --base-url ... --rate 4 --num-requests 200      # open loop, Poisson arrivals

Closed loop (default): `--concurrency` workers each send one request, wait for its last byte, send
the next, until `--num-requests` were sent. Open loop (`--rate R`): requests arrive as a Poisson
process of R requests/s regardless of how fast they are served (no cap on outstanding requests).

Each request streams (`stream: true`) and asks for usage in the last chunk
(`stream_options.include_usage`); `ignore_eos: true` is sent as an extra body field (batchgate, vLLM
and llama.cpp's server accept it) so every request generates exactly `max_tokens` tokens.

Measured per request, from the moment it is sent:
- TTFT: until the first chunk carrying generated text;
- e2e: until the stream ends; TPOT: (e2e - TTFT) / (output tokens - 1);
- inter-token latency (ITL): gaps between consecutive text-carrying chunks (a server that packs k
  tokens in one chunk shows one gap for them; TPOT is the per-token figure);
- output tokens: `usage.completion_tokens` when the server sends usage, else the number of
  text-carrying chunks (reported as `token_count_source`).
Output tokens/s = all output tokens / wall time from the first send to the last byte.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

from bench.prompts import chat_prompts


@dataclass
class LoadConfig:
    base_url: str = "http://127.0.0.1:8000/v1"
    model: str | None = None  # None: the first model that GET /models lists, else "default"
    api_key: str | None = None
    concurrency: int = 32
    num_requests: int = 64
    rate: float | None = None  # requests/s, open loop; None: closed loop with `concurrency` workers
    max_tokens: int = 64
    temperature: float = 0.0
    ignore_eos: bool = True
    include_usage: bool = True
    extra_body: dict = field(default_factory=dict)
    prompt_lengths: str = "natural"
    seed: int = 0
    warmup: int = 0  # untimed requests sent (at `concurrency`) before the measured run
    timeout_s: float = 600.0


@dataclass
class RequestRecord:
    ok: bool
    status: str  # "200", "429", "exception:ReadTimeout", "stream_error"...
    start: float
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    usage_seen: bool = False
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]) of `values`; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


async def resolve_model(client: httpx.AsyncClient, cfg: LoadConfig) -> str:
    if cfg.model:
        return cfg.model
    try:
        resp = await client.get(f"{cfg.base_url.rstrip('/')}/models", timeout=10)
        data = resp.json().get("data") or []
        if resp.status_code == 200 and data:
            return str(data[0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        pass
    return "default"


def build_body(cfg: LoadConfig, model: str, messages: list[dict[str, str]]) -> dict:
    body: dict = {
        "model": model,
        "messages": messages,
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
    }
    if cfg.include_usage:
        body["stream_options"] = {"include_usage": True}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    body.update(cfg.extra_body)
    return body


async def send_one(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> RequestRecord:
    start = time.perf_counter()
    rec = RequestRecord(ok=False, status="?", start=start)
    last_token_at: float | None = None
    num_chunks_with_text = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            rec.status = str(resp.status_code)
            if resp.status_code != 200:
                rec.error = (await resp.aread()).decode(errors="replace")[:300]
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments (": keep-alive"), "event:" lines
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                try:
                    chunk = json.loads(payload)
                except ValueError:
                    continue
                if "error" in chunk and not chunk.get("choices"):
                    rec.status = "stream_error"
                    rec.error = json.dumps(chunk["error"])[:300]
                    return rec
                now = time.perf_counter()
                text = ""
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    text += delta.get("content") or delta.get("reasoning_content") or ""
                if text:
                    num_chunks_with_text += 1
                    if last_token_at is None:
                        rec.ttft_s = now - start
                    else:
                        rec.itl_s.append(now - last_token_at)
                    last_token_at = now
                usage = chunk.get("usage")
                if usage:
                    rec.usage_seen = True
                    rec.output_tokens = int(usage.get("completion_tokens") or 0)
                    if usage.get("prompt_tokens") is not None:
                        rec.prompt_tokens = int(usage["prompt_tokens"])
        rec.e2e_s = time.perf_counter() - start
        if not rec.usage_seen:
            rec.output_tokens = num_chunks_with_text
        rec.ok = True
    except httpx.HTTPError as exc:
        rec.status = f"exception:{type(exc).__name__}"
        rec.error = str(exc)[:300]
    return rec


async def run_load(cfg: LoadConfig) -> dict:
    """Run one load test and return its summary (see `summarize`)."""
    conversations = chat_prompts(cfg.num_requests + cfg.warmup, seed=cfg.seed, lengths=cfg.prompt_lengths)
    warmup_convs, convs = conversations[: cfg.warmup], conversations[cfg.warmup :]
    url = f"{cfg.base_url.rstrip('/')}/chat/completions"
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(cfg.timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = await resolve_model(client, cfg)
        bodies = [build_body(cfg, model, m) for m in convs]
        if warmup_convs:
            await closed_loop(
                client, url, [build_body(cfg, model, m) for m in warmup_convs], headers, cfg.concurrency
            )
        wall_start = time.perf_counter()
        if cfg.rate is None:
            records = await closed_loop(client, url, bodies, headers, cfg.concurrency)
        else:
            records = await open_loop(client, url, bodies, headers, cfg.rate, cfg.seed)
        wall_s = time.perf_counter() - wall_start
    return summarize(cfg, model, records, wall_s)


async def closed_loop(
    client: httpx.AsyncClient, url: str, bodies: list[dict], headers: dict, concurrency: int
) -> list[RequestRecord]:
    records: list[RequestRecord | None] = [None] * len(bodies)
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < len(bodies):
            i = next_index
            next_index += 1
            records[i] = await send_one(client, url, bodies[i], headers)

    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(bodies))))))
    return [r for r in records if r is not None]


async def open_loop(
    client: httpx.AsyncClient, url: str, bodies: list[dict], headers: dict, rate: float, seed: int
) -> list[RequestRecord]:
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    rng = random.Random(seed)
    tasks = []
    next_at = time.perf_counter()
    for body in bodies:
        delay = next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send_one(client, url, body, headers)))
        next_at += rng.expovariate(rate)
    return list(await asyncio.gather(*tasks))


def summarize(cfg: LoadConfig, model: str, records: list[RequestRecord], wall_s: float) -> dict:
    ok = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.status] = errors.get(r.status, 0) + 1
    output_tokens = sum(r.output_tokens for r in ok)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    tpot = [
        (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)
        for r in ok
        if r.e2e_s is not None and r.ttft_s is not None and r.output_tokens > 1
    ]
    itl = [gap for r in ok for gap in r.itl_s]
    ms = 1000.0

    def pct(values: list[float], q: float) -> float | None:
        p = percentile(values, q)
        return None if p is None else round(p * ms, 2)

    sample_errors = sorted({f"{r.status}: {r.error}" for r in records if r.error})[:5]
    return {
        "config": {k: v for k, v in asdict(cfg).items() if k != "api_key"},
        "model": model,
        "mode": "closed" if cfg.rate is None else "open",
        "num_requests": len(records),
        "num_ok": len(ok),
        "errors_by_status": errors,
        "sample_errors": sample_errors,
        "num_short": sum(1 for r in ok if r.output_tokens < cfg.max_tokens),
        "token_count_source": "usage" if ok and all(r.usage_seen for r in ok) else "chunks",
        "wall_s": round(wall_s, 3),
        "output_tokens": output_tokens,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "output_tokens_per_s": round(output_tokens / wall_s, 2) if wall_s > 0 else None,
        "requests_per_s": round(len(ok) / wall_s, 3) if wall_s > 0 else None,
        "ttft_ms": {"p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99)},
        "tpot_ms": {"p50": pct(tpot, 50), "p99": pct(tpot, 99)},
        "itl_ms": {"p50": pct(itl, 50), "p99": pct(itl, 99)},
        "e2e_ms": {"p50": pct(e2e, 50), "p99": pct(e2e, 99)},
    }


def run(cfg: LoadConfig) -> dict:
    return asyncio.run(run_load(cfg))


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(summary: dict, label: str | None = None) -> str:
    cfg = summary["config"]
    load = f"rate {cfg['rate']}/s" if summary["mode"] == "open" else f"concurrency {cfg['concurrency']}"
    head = f"{label + ': ' if label else ''}{cfg['base_url']} model={summary['model']} {load}"
    errors = ", ".join(f"{k}: {v}" for k, v in summary["errors_by_status"].items()) or "none"
    rows = [
        ("requests ok / total", f"{summary['num_ok']} / {summary['num_requests']}  (errors: {errors})"),
        (
            "output tokens",
            f"{summary['output_tokens']} ({summary['token_count_source']}), short: {summary['num_short']}",
        ),
        ("wall time", f"{summary['wall_s']:.2f} s"),
        ("output tokens/s", _fmt(summary["output_tokens_per_s"])),
        ("requests/s", _fmt(summary["requests_per_s"], 2)),
        ("TTFT ms p50/p90/p99", " / ".join(_fmt(summary["ttft_ms"][k]) for k in ("p50", "p90", "p99"))),
        ("TPOT ms p50/p99", " / ".join(_fmt(summary["tpot_ms"][k]) for k in ("p50", "p99"))),
        ("ITL ms p50/p99", " / ".join(_fmt(summary["itl_ms"][k]) for k in ("p50", "p99"))),
        ("e2e ms p50/p99", " / ".join(_fmt(summary["e2e_ms"][k]) for k in ("p50", "p99"))),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [head] + [f"  {k.ljust(width)}  {v}" for k, v in rows]
    lines += [f"  error sample: {e}" for e in summary["sample_errors"]]
    return "\n".join(lines)


def add_load_args(parser: argparse.ArgumentParser) -> None:
    """Arguments shared by loadgen, sweep and compare (everything but the endpoint and the load level)."""
    parser.add_argument("--model", default=None, help="model name sent (default: first of GET /models)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    parser.add_argument("--no-usage", action="store_true", help="do not send stream_options.include_usage")
    parser.add_argument("--extra-body", default="{}", help="JSON object merged into every request body")
    parser.add_argument(
        "--prompt-lengths",
        default="natural",
        help="natural | fixed:N | uniform:LO:HI | lognormal:MEDIAN:SIGMA (words)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=0, help="untimed requests sent first")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s")


def config_from_args(
    args: argparse.Namespace, base_url: str, concurrency: int, num_requests: int, rate: float | None = None
) -> LoadConfig:
    extra = json.loads(args.extra_body)
    if not isinstance(extra, dict):
        raise SystemExit("--extra-body must be a JSON object")
    return LoadConfig(
        base_url=base_url,
        model=args.model,
        api_key=args.api_key,
        concurrency=concurrency,
        num_requests=num_requests,
        rate=rate,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        ignore_eos=not args.no_ignore_eos,
        include_usage=not args.no_usage,
        extra_body=extra,
        prompt_lengths=args.prompt_lengths,
        seed=args.seed,
        warmup=args.warmup,
        timeout_s=args.timeout,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals, requests/s")
    add_load_args(parser)
    parser.add_argument("--output", default=None, help="write the JSON summary to this file")
    parser.add_argument("--json", action="store_true", help="print the JSON summary instead of the table")
    args = parser.parse_args(argv)
    cfg = config_from_args(args, args.base_url, args.concurrency, args.num_requests, args.rate)
    summary = run(cfg)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2) if args.json else format_table(summary))
    if summary["num_ok"] == 0:
        sys.exit(1)


if __name__ == "__main__":
    main()
