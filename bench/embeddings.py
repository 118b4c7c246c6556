"""Embeddings load generator and side-by-side comparison (issue 13's workload).

    python -m bench.embeddings                      # batchgate + the offline bound, full sweep
    python -m bench.embeddings --infinity           # + the infinity-emb server (its peer script)
    python -m bench.embeddings --seconds 3 --concurrency 1,16 --inputs 1   # a quick sanity run
    python -m bench.embeddings latency --url http://127.0.0.1:8000 --lengths 14,102,202   # 1 client

`latency` (issue 13's 1-client target: served latency within 1.2x of one unbatched model call):
one client, one input per request, per input length (exact token counts, [CLS]/[SEP] included)
and taking turns in blocks (`--rounds`, so drift on a shared machine hits all alike): each `--url`
(repeatable, `label=URL` names it; none: a server is started) through httpx and through a bare
http.client connection (the client's floor), and in this process, with the same torch thread
count as a default server, the references on the same token ids: our encoder's `embed([ids])`
(and `tokenize` + `embed`) and sentence-transformers' `encode([text])`. Prints p50/p99 of
`--requests` calls each and the ratios of each p50 to the two references' p50. For a server that
reports it (batchgate's /metrics), also the mean of its own model calls during that length's
turns, against the means of the in-process `embed` and of the served raw calls: a served time
splits into the server's model call and the rest (HTTP, handler, thread hand-offs). The
in-process `embed` runs back to back in a hot loop; the server's call follows an idle gap and a
wake-up, and is often a few tenths of a millisecond slower.

For each server and each (concurrency, inputs per request) in the sweep, a closed loop:
`concurrency` clients each send a request of `inputs` texts, wait for the answer, send the next,
for `--seconds`. Texts are 8..256 tokens long (uniform, special tokens included, built from
single-token words of the model's vocabulary, so each has an exact length). Reported per point:
inputs/s, tokens/s and request latency p50/p99.

Peers, in the same invocation:
- the offline bound: sentence-transformers' `encode` in this process on the same texts, at its
  best batch size (of 8..256), with the server stopped: what this machine can do with no serving;
- one unbatched model call (our encoder, batch of one) per input length, for the 1-client check;
- infinity-emb (`--infinity`), through /work/shared/peers/infinity-emb.sh (install it first).

Writes a JSON of every point and, with matplotlib, a PNG of throughput against p50 latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.servers import REPO, ServerSpec, free_port, launched

MODEL = "all-MiniLM-L6-v2"
INFINITY_SCRIPT = Path("/work/shared/peers/infinity-emb.sh")


@dataclass
class Point:
    server: str
    concurrency: int
    inputs: int
    num_requests: int
    num_errors: int
    inputs_per_s: float
    tokens_per_s: float
    p50_ms: float
    p99_ms: float


def make_texts(num: int, seed: int = 0, min_tokens: int = 8, max_tokens: int = 256) -> list[tuple[str, int]]:
    """`num` (text, tokens) pairs, lengths uniform in [min_tokens, max_tokens] with [CLS]/[SEP]."""
    from engine.embeddings.model import bundled_embedding_path

    vocab = (bundled_embedding_path() / "vocab.txt").read_text().split("\n")
    words = [w for w in vocab if w.isalpha() and w.isascii() and len(w) > 2]
    rng = random.Random(seed)
    return [
        (" ".join(rng.choice(words) for _ in range(n - 2)), n)
        for n in (rng.randint(min_tokens, max_tokens) for _ in range(num))
    ]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def closed_loop(
    base_url: str, model: str, texts: list[tuple[str, int]], concurrency: int, inputs: int, seconds: float
) -> tuple[int, int, int, list[float]]:
    """(requests, errors, tokens, latencies in s) of `concurrency` clients for `seconds`."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    latencies: list[float] = []
    counts = {"requests": 0, "errors": 0, "tokens": 0}
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        stop_at = time.perf_counter() + seconds

        async def worker(w: int) -> None:
            rng = random.Random(w)
            while time.perf_counter() < stop_at:
                batch = [texts[rng.randrange(len(texts))] for _ in range(inputs)]
                body = {"model": model, "input": [t for t, _ in batch], "encoding_format": "base64"}
                start = time.perf_counter()
                r = await client.post("/embeddings", json=body)
                latencies.append(time.perf_counter() - start)
                counts["requests"] += 1
                if r.status_code != 200:
                    counts["errors"] += 1
                else:
                    counts["tokens"] += sum(n for _, n in batch)

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return counts["requests"], counts["errors"], counts["tokens"], latencies


def measure(
    label: str,
    base_url: str,
    model: str,
    texts: list[tuple[str, int]],
    sweep: list[tuple[int, int]],
    seconds: float,
) -> list[Point]:
    points = []
    asyncio.run(closed_loop(base_url, model, texts, 4, 4, 1.0))  # warm-up
    for concurrency, inputs in sweep:
        t0 = time.perf_counter()
        num, errors, tokens, latencies = asyncio.run(
            closed_loop(base_url, model, texts, concurrency, inputs, seconds)
        )
        wall = time.perf_counter() - t0
        ok_inputs = (num - errors) * inputs
        p = Point(
            label,
            concurrency,
            inputs,
            num,
            errors,
            ok_inputs / wall,
            tokens / wall,
            percentile(latencies, 0.5) * 1e3,
            percentile(latencies, 0.99) * 1e3,
        )
        print(json.dumps(asdict(p)), flush=True)
        points.append(p)
    return points


def offline_bound(texts: list[tuple[str, int]], seconds: float) -> dict[str, float]:
    """sentence-transformers `encode` inputs/s at each batch size, and our encoder's single-input
    latency at 16, 128 and 256 tokens (the unbatched call the 1-client latency is compared to)."""
    import torch
    from sentence_transformers import SentenceTransformer

    from engine.embeddings.model import EmbeddingModel, bundled_embedding_path

    st = SentenceTransformer(str(bundled_embedding_path()), device="cpu")
    corpus = [t for t, _ in texts]
    out: dict[str, float] = {"torch_threads": float(torch.get_num_threads())}
    for batch_size in (8, 16, 32, 64, 128, 256):
        st.encode(corpus[:batch_size], batch_size=batch_size)  # warm-up
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            start = done % (len(corpus) - batch_size)
            st.encode(corpus[start : start + batch_size], batch_size=batch_size)
            done += batch_size
        out[f"st_encode_bs{batch_size}_inputs_per_s"] = done / (time.perf_counter() - t0)
    out["st_encode_best_inputs_per_s"] = max(v for k, v in out.items() if k.startswith("st_encode"))
    ours = EmbeddingModel.load(None)
    for n in (16, 128, 256):
        text = (
            next(t for t, length in texts if length == n) if any(length == n for _, length in texts) else None
        )
        ids = ours.tokenize([text])[0] if text else [101] + [2000] * (n - 2) + [102]
        ours.embed([ids])
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            ours.embed([ids])
            times.append(time.perf_counter() - t0)
        out[f"unbatched_call_{n}_tokens_ms"] = statistics.median(times) * 1e3
    return out


def batchgate_spec(extra: list[str]) -> ServerSpec:
    port = free_port()
    exe = Path(sys.executable).with_name("batchgate")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "gateway.cli"]
    argv = cmd + ["serve", "--port", str(port), "--model", "none", "--log-level", "warning", *extra]
    base = f"http://127.0.0.1:{port}"
    return ServerSpec("batchgate serve", argv, f"{base}/v1", f"{base}/ready")


def infinity_spec() -> ServerSpec:
    from engine.embeddings.model import bundled_embedding_path

    port = free_port()
    argv = ["bash", str(INFINITY_SCRIPT), "serve", str(bundled_embedding_path()), str(port)]
    base = f"http://127.0.0.1:{port}"
    return ServerSpec("infinity-emb", argv, f"{base}/v1", f"{base}/v1/models", env={"SERVED_NAME": MODEL})


def plot(points: list[Point], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for server in dict.fromkeys(p.server for p in points):
        for inputs in sorted({p.inputs for p in points}):
            line = [p for p in points if p.server == server and p.inputs == inputs]
            if line:
                ax.plot(
                    [p.p50_ms for p in line],
                    [p.inputs_per_s for p in line],
                    marker="o",
                    label=f"{server}, {inputs} input(s)/request",
                )
                for p in line:
                    ax.annotate(str(p.concurrency), (p.p50_ms, p.inputs_per_s), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("request latency p50 (ms)")
    ax.set_ylabel("inputs/s")
    ax.set_title("Embeddings, closed loop (labels: concurrent clients)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def exact_text(num_tokens: int) -> str:
    """A text that tokenizes to exactly `num_tokens` tokens ([CLS] and [SEP] included)."""
    return next(t for t, _ in make_texts(1, seed=num_tokens, min_tokens=num_tokens, max_tokens=num_tokens))


def summary(seconds: list[float]) -> dict[str, float]:
    return {
        "p50_ms": statistics.median(seconds) * 1e3,
        "p99_ms": percentile(seconds, 0.99) * 1e3,
        "mean_ms": statistics.fmean(seconds) * 1e3,
    }


class Served:
    """One server, reached two ways: httpx (what bench clients use) and one keep-alive
    http.client connection with the body encoded once (the client's floor: almost nothing
    beyond the socket round trip)."""

    def __init__(self, base_url: str) -> None:
        import http.client
        from urllib.parse import urlsplit

        url = urlsplit(base_url)
        self.http = httpx.Client(base_url=base_url, timeout=60)
        self.conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80, timeout=60)
        self.base_url = base_url
        self.num_tokens = 0

    def via_httpx(self, text: str) -> None:
        r = self.http.post("/v1/embeddings", json={"model": MODEL, "input": text})
        r.raise_for_status()
        self.num_tokens = int(r.json()["usage"]["prompt_tokens"])

    def via_raw(self, body: bytes) -> None:
        import http.client

        try:
            self.conn.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
            resp = self.conn.getresponse()
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            # The server closed the idle keep-alive connection while other probes had their turn
            # (uvicorn: after 5 s); a turn's untimed first calls absorb the reconnect.
            self.conn.close()
            self.conn.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
            resp = self.conn.getresponse()
        resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{self.base_url}: HTTP {resp.status}")

    def model_seconds(self) -> tuple[float, int] | None:
        """The server's own embedding model calls so far (batchgate's /metrics): seconds in all
        and how many; None when the server does not report them."""
        try:
            text = self.http.get("/metrics").text
        except httpx.HTTPError:
            return None
        found: dict[str, float] = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in ("batchgate_embedding_model_seconds_sum", "batchgate_embedding_model_seconds_count"):
                found[name.rsplit("_", 1)[1]] = float(value)
        if len(found) != 2:
            return None
        return found["sum"], int(found["count"])

    def close(self) -> None:
        self.http.close()
        self.conn.close()


class InProcess:
    """The references, in this process: our encoder's `embed([ids])` (and `tokenize` + `embed`),
    and sentence-transformers' `encode([text])` (a batch of one), each timed `requests` times
    after a warm-up."""

    def __init__(self) -> None:
        from sentence_transformers import SentenceTransformer

        from engine.embeddings.model import EmbeddingModel, bundled_embedding_path

        self.ours = EmbeddingModel.load(None)
        self.st = SentenceTransformer(str(bundled_embedding_path()), device="cpu")

    def probes(self, text: str, num_tokens: int) -> dict[str, Callable[[], Any]]:
        ours, st = self.ours, self.st
        ids = ours.tokenize([text])[0]
        assert len(ids) == num_tokens, (num_tokens, len(ids))
        return {
            "in-process embed": lambda: ours.embed([ids]),
            "in-process tokenize+embed": lambda: ours.embed(ours.tokenize([text])),
            "in-process st_encode": lambda: st.encode([text], batch_size=1),
        }


def in_turns(probes: dict[str, Callable[[], Any]], requests: int, rounds: int) -> dict[str, dict[str, float]]:
    """Each probe `requests` times in all: `rounds` rounds in which each probe in turn makes
    `requests / rounds` timed calls after 3 untimed ones. Turns, so that drift on a shared machine
    hits every probe alike; blocks, not one call each, since a process's OpenMP workers spin for
    milliseconds after a forward (libgomp's default) and would slow the next process's call."""
    times: dict[str, list[float]] = {name: [] for name in probes}
    per_turn = max(1, requests // rounds)
    for _ in range(rounds):
        for name, probe in probes.items():
            for i in range(3 + per_turn):
                t0 = time.perf_counter()
                probe()
                if i >= 3:
                    times[name].append(time.perf_counter() - t0)
    return {name: summary(values) for name, values in times.items()}


def latency_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.embeddings latency", description=__doc__)
    ap.add_argument("--url", action="append", default=[], help="a server's base URL (label=URL names it)")
    ap.add_argument("--lengths", default="14,102,202", help="input lengths in tokens, comma-separated")
    ap.add_argument("--requests", type=int, default=100, help="timed requests (and calls) per length")
    ap.add_argument("--rounds", type=int, default=5, help="turns each probe takes per length")
    ap.add_argument(
        "--threads", type=int, default=None, help="torch threads in this process (default: torch's)"
    )
    ap.add_argument("--batchgate-args", default="", help="extra `batchgate serve` flags (no --url)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "embeddings"))
    args = ap.parse_args(argv)
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    lengths = [int(n) for n in args.lengths.split(",")]
    texts = {n: exact_text(n) for n in lengths}
    servers = [tuple(u.split("=", 1)) if "=" in u else (u, u) for u in args.url]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[int, dict[str, dict[str, float]]] = {}
    # Per length and server: the mean of its own model calls over that length's turns (from its
    # /metrics), so the served time splits into the server's model call and everything else.
    server_model_ms: dict[int, dict[str, float]] = {}
    refs = InProcess()

    def measure_all(urls: list[tuple[str, str]]) -> None:
        clients = [(label, Served(url)) for label, url in urls]
        try:
            for n in lengths:
                probes = refs.probes(texts[n], n)
                body = json.dumps({"model": MODEL, "input": texts[n]}).encode()
                for label, c in clients:
                    probes[f"{label} httpx"] = lambda c=c, t=texts[n]: c.via_httpx(t)
                    probes[f"{label} raw"] = lambda c=c, b=body: c.via_raw(b)
                before = {label: c.model_seconds() for label, c in clients}
                results[n] = in_turns(probes, args.requests, args.rounds)
                for label, c in clients:
                    start, end = before[label], c.model_seconds()
                    if start is not None and end is not None and end[1] > start[1]:
                        mean = (end[0] - start[0]) / (end[1] - start[1]) * 1e3
                        server_model_ms.setdefault(n, {})[label] = mean
                for label, c in clients:
                    assert c.num_tokens == n, (label, n, c.num_tokens)  # the server counted the same
        finally:
            for _, c in clients:
                c.close()

    if servers:
        measure_all(servers)  # type: ignore[arg-type]
    else:
        spec = batchgate_spec(args.batchgate_args.split())
        with launched(spec, out / "logs"):
            measure_all([("batchgate", spec.base_url.removesuffix("/v1"))])
    threads = torch.get_num_threads()
    print(f"\n1 client, 1 input per request, {args.requests} requests per length; torch threads {threads}")
    head = f"{'tokens':>6} {'what':<28} {'p50 ms':>8} {'p99 ms':>8} {'/embed':>7} {'/st':>7}"
    print(head)
    for n in lengths:
        ref, st_ref = results[n]["in-process embed"]["p50_ms"], results[n]["in-process st_encode"]["p50_ms"]
        for what, v in results[n].items():
            print(
                f"{n:>6} {what:<28} {v['p50_ms']:>8.2f} {v['p99_ms']:>8.2f} "
                f"{v['p50_ms'] / ref:>6.2f}x {v['p50_ms'] / st_ref:>6.2f}x"
            )
        # The server reports only a sum and a count: means, compared with means.
        ref_mean = results[n]["in-process embed"]["mean_ms"]
        for label, mean in server_model_ms.get(n, {}).items():
            raw = results[n][f"{label} raw"]["mean_ms"]
            print(
                f"{n:>6} {label + ' model call':<28} mean {mean:.2f} ms: {mean / ref_mean:.2f}x the "
                f"in-process embed's mean; {label} raw's mean is {raw / mean:.2f}x it"
            )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    result = {
        "p50_p99_ms": results,
        "server_model_call_mean_ms": server_model_ms,
        "torch_threads": threads,
        "requests": args.requests,
        "urls": args.url,
    }
    path = out / f"latency-{stamp}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["latency"]:
        return latency_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,16,64,128")
    ap.add_argument("--inputs", default="1,32", help="inputs per request, comma-separated")
    ap.add_argument("--seconds", type=float, default=20.0, help="per sweep point")
    ap.add_argument("--infinity", action="store_true", help="also run infinity-emb (its peer script)")
    ap.add_argument("--no-offline", action="store_true", help="skip the offline bound")
    ap.add_argument("--batchgate-args", default="", help="extra `batchgate serve` flags")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "embeddings"))
    args = ap.parse_args(argv)
    sweep = [(int(c), int(i)) for i in args.inputs.split(",") for c in args.concurrency.split(",")]
    texts = make_texts(2000)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    points: list[Point] = []
    spec = batchgate_spec(args.batchgate_args.split())
    with launched(spec, logs):
        points += measure("batchgate", spec.base_url, MODEL, texts, sweep, args.seconds)
    if args.infinity:
        if not INFINITY_SCRIPT.exists():
            print(f"infinity-emb: {INFINITY_SCRIPT} is missing; not run", file=sys.stderr)
        else:
            spec = infinity_spec()
            try:
                with launched(spec, logs):
                    points += measure("infinity-emb", spec.base_url, MODEL, texts, sweep, args.seconds)
            except RuntimeError as exc:
                print(f"infinity-emb did not run: {exc}", file=sys.stderr)
    bound = {} if args.no_offline else offline_bound(texts, min(args.seconds, 10.0))
    print(json.dumps(bound), flush=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    result = {"points": [asdict(p) for p in points], "offline": bound, "cpus": os.cpu_count()}
    (out / f"embeddings-{stamp}.json").write_text(json.dumps(result, indent=1))
    try:
        plot(points, out / f"embeddings-{stamp}.png")
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
