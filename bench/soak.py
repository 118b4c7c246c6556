"""Soak: minutes of mixed traffic with client cancellations; does anything grow or go missing?

    python -m bench.soak                                   # starts `batchgate serve --kv-cache-memory 1GiB`
    python -m bench.soak --minutes 3 --concurrency 8       # a short sanity run
    python -m bench.soak --url http://127.0.0.1:8000 --pid 1234 --internal-token "$TOKEN"

`--concurrency` workers each send one request after another for `--minutes`: chat and
completions, streamed and not, short prompts and longer ones (some sharing a long system prompt, so
the prefix cache is used, some unique, so it churns), with a share (`--cancel-share`) cancelled by
the client at a random point (before the headers, or after a few chunks).

It reports:
- the server's RSS, sampled every `--sample-s` seconds: after the first `--warmup-s` (default one
  minute) and at the end, the growth in % and the slope over the rest (MiB/min);
- requests sent, answered (by status), errored and cancelled, and the count of 5xx;
- "answered exactly once": every request that was not cancelled got either one complete response
  (a JSON body with choices; or a stream with a finish_reason and `data: [DONE]`) or one
  OpenAI-shaped error (a 4xx/5xx body, or one error event then `[DONE]`), never both, never a cut;
- at the end, once idle: nothing running or waiting, no waiting tokens, every KV block free (blocks
  that only the prefix cache holds count as free), from /v1/internal/stats (needs the internal
  token, which the soak sets on a server it starts) or else /metrics.

Exit status 0 when every check passes (RSS growth within `--max-rss-growth-pct`, no 5xx, every
request answered exactly once, idle at the end), 1 otherwise. A JSON summary goes to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import secrets
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil

from bench.prompts import _FILLER, chat_prompts
from bench.servers import REPO, ServerSpec, free_port, launched

MIB = 1024 * 1024
# A system prompt of ~1.2k tokens shared by a share of the requests: their prefix-cache hits.
SHARED_SYSTEM = "You are a careful assistant. Background notes follow.\n\n" + _FILLER * 12


@dataclass
class Outcome:
    """One request as the client saw it."""

    kind: str  # e.g. chat/stream/long
    status: int | None = None  # HTTP status; None when cancelled before the headers
    cancelled: bool = False
    complete: bool = False  # one complete response
    errored: bool = False  # one OpenAI-shaped error (status or stream event)
    problem: str = ""  # why it was neither, or both

    @property
    def exactly_once(self) -> bool:
        return self.cancelled or (self.complete != self.errored and not self.problem)


@dataclass
class SoakConfig:
    url: str = ""  # empty: start a server
    pid: int | None = None  # the server's pid for RSS (a started server's own)
    minutes: float = 10.0
    concurrency: int = 32
    warmup_s: float = 60.0
    sample_s: float = 5.0
    cancel_share: float = 0.1
    long_share: float = 0.3
    stream_share: float = 0.5
    max_tokens: tuple[int, int] = (4, 48)
    kv_cache_memory: str = "1GiB"
    server_args: list[str] = field(default_factory=list)
    internal_token: str | None = None
    api_key: str | None = None
    max_rss_growth_pct: float = 1.0
    idle_timeout_s: float = 60.0
    seed: int = 0


class Soak:
    def __init__(
        self, cfg: SoakConfig, base_url: str, pid: int | None, model: str, kv_budget: int = 0
    ) -> None:
        self.cfg = cfg
        self.base_url = base_url.rstrip("/")
        self.pid = pid
        self.model = model
        self.rng = random.Random(cfg.seed)
        self.prompts = [c[0]["content"] for c in chat_prompts(672, seed=cfg.seed)]
        self.outcomes: list[Outcome] = []
        self.rss: list[tuple[float, int]] = []
        self.kv_rss: list[int] = []  # resident bytes of the KV cache's mappings, per RSS sample
        self.kv_budget = kv_budget
        self.headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}

    # -- one request ---------------------------------------------------------------------------

    def _body(self) -> tuple[str, str, dict, Outcome]:
        rng = self.rng
        chat = rng.random() < 0.6
        stream = rng.random() < self.cfg.stream_share
        length = "short"
        question = rng.choice(self.prompts)
        system = None
        if rng.random() < self.cfg.long_share:
            if rng.random() < 0.5:
                length, system = "shared", SHARED_SYSTEM
            else:  # unique long text: new blocks for the prefix cache to hold and evict
                length = "unique"
                words = _FILLER.split()
                rng.shuffle(words)
                question = " ".join(words * rng.randint(2, 8)) + "\n\n" + question
        body: dict = {
            "model": self.model,
            "max_tokens": rng.randint(*self.cfg.max_tokens),
            "temperature": rng.choice([0.0, 0.8]),
            "stream": stream,
        }
        if chat:
            messages = [{"role": "user", "content": question}]
            if system:
                messages.insert(0, {"role": "system", "content": system})
            body["messages"] = messages
            path = "/v1/chat/completions"
        else:
            body["prompt"] = (system + "\n\n" if system else "") + question
            path = "/v1/completions"
        if stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        kind = f"{'chat' if chat else 'completions'}/{'stream' if stream else 'json'}/{length}"
        return path, kind, body, Outcome(kind)

    async def _send(self, http: httpx.AsyncClient) -> Outcome:
        path, kind, body, out = self._body()
        cancel = self.rng.random() < self.cfg.cancel_share
        # Cancel after this many stream chunks, or (non-streamed) after this many seconds.
        cancel_after_chunks = self.rng.randint(0, 8)
        cancel_after_s = self.rng.uniform(0.01, 1.5)
        try:
            if body["stream"]:
                await self._stream(http, path, body, out, cancel_after_chunks if cancel else None)
            elif cancel:
                try:
                    await asyncio.wait_for(self._json(http, path, body, out), cancel_after_s)
                except TimeoutError:
                    out.cancelled = True
            else:
                await self._json(http, path, body, out)
        except httpx.HTTPError as exc:
            out.problem = f"transport: {type(exc).__name__}: {exc}"[:200]
        return out

    async def _json(self, http: httpx.AsyncClient, path: str, body: dict, out: Outcome) -> None:
        r = await http.post(path, json=body, headers=self.headers)
        out.status = r.status_code
        try:
            data = r.json()
        except ValueError:
            out.problem = f"{r.status_code} with a body that is not JSON"
            return
        if r.status_code == 200:
            choices = data.get("choices") or []
            out.complete = bool(choices) and all(c.get("finish_reason") for c in choices)
            if not out.complete:
                out.problem = "200 without finished choices"
        else:
            out.errored = isinstance(data.get("error"), dict) and "message" in data["error"]
            if not out.errored:
                out.problem = f"{r.status_code} without an OpenAI error body"

    async def _stream(
        self, http: httpx.AsyncClient, path: str, body: dict, out: Outcome, cancel_after: int | None
    ) -> None:
        async with http.stream("POST", path, json=body, headers=self.headers) as r:
            out.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                try:
                    data = r.json()
                    out.errored = isinstance(data.get("error"), dict)
                except ValueError:
                    pass
                if not out.errored:
                    out.problem = f"{r.status_code} without an OpenAI error body"
                return
            num_chunks = finished = errors = 0
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line.removeprefix("data: ")
                if payload == "[DONE]":
                    done = True
                    break
                num_chunks += 1
                chunk = json.loads(payload)
                if "error" in chunk:
                    errors += 1
                finished += sum(1 for c in chunk.get("choices") or [] if c.get("finish_reason"))
                if cancel_after is not None and num_chunks >= cancel_after and not finished:
                    out.cancelled = True
                    return  # leaving the block closes the connection mid-stream
        if not done:
            out.problem = "stream cut before [DONE]"
        elif errors > 1 or (errors and finished):
            out.problem = f"{errors} error events and {finished} finished choices"
        elif errors:
            out.errored = True
        elif finished == 1:
            out.complete = True
        else:
            out.problem = f"[DONE] after {finished} finished choices"

    # -- the run -------------------------------------------------------------------------------

    async def _worker(self, http: httpx.AsyncClient, until: float) -> None:
        while time.monotonic() < until:
            self.outcomes.append(await self._send(http))

    async def _sample(self, start: float, until: float) -> None:
        proc = psutil.Process(self.pid) if self.pid else None
        while proc is not None:
            with contextlib.suppress(psutil.Error, OSError):
                rss = proc.memory_info().rss
                kv = kv_cache_rss(proc.pid, self.kv_budget) if self.kv_budget else None
                self.rss.append((time.monotonic() - start, rss))
                if kv is not None:
                    self.kv_rss.append(kv)
            if time.monotonic() >= until:
                return
            await asyncio.sleep(self.cfg.sample_s)

    async def run(self) -> dict:
        limits = httpx.Limits(max_connections=self.cfg.concurrency + 8)
        timeout = httpx.Timeout(connect=10.0, read=300.0, write=30.0, pool=30.0)
        async with httpx.AsyncClient(base_url=self.base_url, limits=limits, timeout=timeout) as http:
            start = time.monotonic()
            until = start + self.cfg.minutes * 60
            sampler = asyncio.ensure_future(self._sample(start, until))
            await asyncio.gather(*(self._worker(http, until) for _ in range(self.cfg.concurrency)))
            await sampler
            wall_s = time.monotonic() - start
            idle = await self._wait_idle(http)
        return self.summary(wall_s, idle)

    async def _wait_idle(self, http: httpx.AsyncClient) -> dict:
        """The engine's state once idle (or after `idle_timeout_s`): running, waiting, waiting
        tokens and KV blocks in use, from /v1/internal/stats, else /metrics."""
        deadline = time.monotonic() + self.cfg.idle_timeout_s
        while True:
            state = await self._engine_state(http)
            if not any(state.get(k) for k in ("running", "waiting", "waiting_tokens", "blocks_in_use")):
                return state
            if time.monotonic() > deadline:
                return state
            await asyncio.sleep(0.5)

    async def _engine_state(self, http: httpx.AsyncClient) -> dict:
        if self.cfg.internal_token:
            r = await http.get(
                "/v1/internal/stats", headers={"x-batchgate-internal": self.cfg.internal_token}
            )
            if r.status_code == 200:
                s = r.json()
                return {
                    "source": "/v1/internal/stats",
                    "running": s["num_running"],
                    "waiting": s["num_waiting"],
                    "waiting_tokens": s["num_waiting_tokens"],
                    "blocks_in_use": s["num_total_blocks"] - s["num_free_blocks"],
                }
        from prometheus_client.parser import text_string_to_metric_families

        values: dict[str, float] = Counter()
        for family in text_string_to_metric_families((await http.get("/metrics")).text):
            for sample in family.samples:
                values[sample.name] += sample.value
        return {
            "source": "/metrics",
            "running": values["batchgate_requests_running"],
            "waiting": values["batchgate_requests_waiting"],
            "blocks_in_use_ratio": values["batchgate_kv_cache_usage_ratio"],
            "blocks_in_use": values["batchgate_kv_cache_usage_ratio"] > 0,
        }

    def summary(self, wall_s: float, idle: dict) -> dict:
        outs = self.outcomes
        statuses = Counter(str(o.status) if o.status is not None else "none" for o in outs)
        problems = [o for o in outs if not o.exactly_once]
        rss = self._rss_summary()
        checks = {
            "no_5xx": sum(1 for o in outs if o.status is not None and o.status >= 500) == 0,
            "answered_exactly_once": not problems,
            "idle_at_end": not any(
                idle.get(k) for k in ("running", "waiting", "waiting_tokens", "blocks_in_use")
            ),
        }
        if rss.get("growth_pct") is not None:
            checks["rss_growth"] = rss["growth_pct"] <= self.cfg.max_rss_growth_pct
        return {
            "config": {**asdict(self.cfg), "url": self.base_url},
            "wall_s": round(wall_s, 1),
            "sent": len(outs),
            "complete": sum(o.complete for o in outs),
            "errored": sum(o.errored for o in outs),
            "cancelled": sum(o.cancelled for o in outs),
            "by_status": dict(sorted(statuses.items())),
            "num_5xx": sum(1 for o in outs if o.status is not None and o.status >= 500),
            "by_kind": dict(sorted(Counter(o.kind for o in outs).items())),
            "not_exactly_once": [
                {"kind": o.kind, "status": o.status, "problem": o.problem} for o in problems[:20]
            ],
            "num_not_exactly_once": len(problems),
            "rss": rss,
            "idle": idle,
            "checks": checks,
            "ok": all(checks.values()),
        }

    def _rss_summary(self) -> dict:
        if not self.rss:
            return {"note": "no server pid: RSS not sampled (pass --pid)"}
        after = [(t, v) for t, v in self.rss if t >= self.cfg.warmup_s]
        first = self.rss[0][1]
        out: dict = {
            "samples": len(self.rss),
            "start_mib": round(first / MIB, 1),
            "end_mib": round(self.rss[-1][1] / MIB, 1),
        }
        out["series_mib"] = [(round(t), round(v / MIB, 1)) for t, v in self.rss]
        if self.kv_rss:
            out["kv_series_mib"] = [round(v / MIB, 1) for v in self.kv_rss]
            out["outside_kv_series_mib"] = [
                round((v - k) / MIB, 1) for (_, v), k in zip(self.rss, self.kv_rss, strict=True)
            ]
        if len(after) >= 2:
            t0, v0 = after[0]
            t1, v1 = after[-1]
            out["after_warmup_mib"] = round(v0 / MIB, 1)
            out["growth_pct"] = round(100.0 * (v1 - v0) / v0, 2)
            # Least-squares slope over the samples after warm-up: less noisy than two points.
            n = len(after)
            mt = sum(t for t, _ in after) / n
            mv = sum(v for _, v in after) / n
            var = sum((t - mt) ** 2 for t, _ in after)
            slope = sum((t - mt) * (v - mv) for t, v in after) / var if var else 0.0
            out["slope_mib_per_min"] = round(slope * 60 / MIB, 2)
        return out


def kv_cache_rss(pid: int, budget: int) -> int:
    """Resident bytes of the server's KV cache on the CPU: the mappings of one size whose count
    times size is within 10% under `budget` (one key and one value tensor per layer, each its own
    mapping; see engine/device/kv_cache.py `zeroed_cache`). 0 if no such group is found."""
    sizes: dict[int, list[int]] = {}
    size = rss = -1
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if not head.endswith(":"):  # a mapping's header line: "start-end perms offset ..."
                if size > 0:
                    sizes.setdefault(size, []).append(rss)
                size = rss = -1
            elif head == "Size:":
                size = int(line.split()[1]) * 1024
            elif head == "Rss:":
                rss = int(line.split()[1]) * 1024
    if size > 0:
        sizes.setdefault(size, []).append(rss)
    for size, residents in sizes.items():
        if len(residents) >= 2 and 0.9 * budget <= size * len(residents) <= budget * 1.01:
            return sum(residents)
    return 0


def _format(s: dict) -> str:
    rss = s["rss"]
    lines = [
        f"soak: {s['wall_s']:.0f} s at {s['config']['concurrency']} concurrent against {s['config']['url']}",
        f"  sent {s['sent']}: complete {s['complete']}, errored {s['errored']}, cancelled {s['cancelled']}; "
        f"by status {s['by_status']}; 5xx {s['num_5xx']}",
        f"  answered exactly once: {s['sent'] - s['num_not_exactly_once']}/{s['sent']}"
        + (f" (first problems: {s['not_exactly_once'][:3]})" if s["num_not_exactly_once"] else ""),
    ]
    if "growth_pct" in rss:
        lines.append(
            f"  RSS: start {rss['start_mib']} MiB, after warm-up {rss['after_warmup_mib']} MiB, end "
            f"{rss['end_mib']} MiB: {rss['growth_pct']:+.2f}% ({rss['slope_mib_per_min']:+.2f} MiB/min)"
        )
        if "kv_series_mib" in rss:
            kv, other = rss["kv_series_mib"], rss["outside_kv_series_mib"]
            lines.append(
                f"  of which the KV cache's mappings: {kv[0]} -> {kv[-1]} MiB; "
                f"the rest: {other[0]} -> {other[-1]} MiB"
            )
    else:
        lines.append(f"  RSS: {rss}")
    lines.append(f"  at the end: {s['idle']}")
    lines.append(f"  checks: {s['checks']} -> {'PASS' if s['ok'] else 'FAIL'}")
    return "\n".join(lines)


async def _resolve_model(base_url: str, headers: dict, timeout_s: float = 600.0) -> str:
    """The served model's id, once the server is ready (a server may still be loading)."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        while (await http.get("/ready")).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{base_url} not ready after {timeout_s:.0f} s")
            await asyncio.sleep(1.0)
        return str((await http.get("/v1/models", headers=headers)).json()["data"][0]["id"])


def run(cfg: SoakConfig, log_dir: Path) -> dict:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    if cfg.url:
        model = asyncio.run(_resolve_model(cfg.url, headers))
        return asyncio.run(Soak(cfg, cfg.url, cfg.pid, model).run())
    cfg.internal_token = cfg.internal_token or secrets.token_hex(16)
    port = free_port()
    argv = [
        sys.executable, "-m", "gateway.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--kv-cache-memory", cfg.kv_cache_memory, "--internal-token", cfg.internal_token,
        "--log-level", "warning", *cfg.server_args,
    ]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    spec = ServerSpec("batchgate soak", argv, f"{base}/v1", f"{base}/ready")
    with launched(spec, log_dir) as proc:
        model = asyncio.run(_resolve_model(base, headers))
        from gateway.settings import parse_bytes

        return asyncio.run(Soak(cfg, base, proc.pid, model, parse_bytes(cfg.kv_cache_memory)).run())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default="", help="a running server's base URL (default: start one)")
    p.add_argument("--pid", type=int, default=None, help="with --url: the server's pid, to sample its RSS")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--warmup-s", type=float, default=60.0, help="RSS growth is measured from here on")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--cancel-share", type=float, default=0.1)
    p.add_argument("--long-share", type=float, default=0.3)
    p.add_argument("--stream-share", type=float, default=0.5)
    p.add_argument("--kv-cache-memory", default="1GiB", help="for a server the soak starts")
    p.add_argument("--server-arg", action="append", default=[], help="extra `batchgate serve` argument")
    p.add_argument("--internal-token", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-rss-growth-pct", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "soak.json")
    a = p.parse_args(argv)
    cfg = SoakConfig(
        url=a.url, pid=a.pid, minutes=a.minutes, concurrency=a.concurrency, warmup_s=a.warmup_s,
        sample_s=a.sample_s, cancel_share=a.cancel_share, long_share=a.long_share,
        stream_share=a.stream_share, kv_cache_memory=a.kv_cache_memory, server_args=a.server_arg,
        internal_token=a.internal_token, api_key=a.api_key, max_rss_growth_pct=a.max_rss_growth_pct,
        seed=a.seed,
    )  # fmt: skip
    summary = run(cfg, a.out.parent)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(summary, indent=2))
    print(_format(summary))
    print(f"  summary: {a.out}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
