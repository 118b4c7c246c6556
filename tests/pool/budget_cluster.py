"""Gateways over one real redis-server and real replicas, with prices and budgets: what the budget
exactness tests (tests/pool/test_budgets_pool.py) and benches (bench/budget_exactness.py,
bench/ledger_mixed.py) start and measure.

    replicas (tiny model)  <-  gateways (--tenants with prices, --admin-key-hash, --redis-url)

Tenants are made through the admin API of one gateway and used on all of them."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tenancy.billing import Price, micros_of
from tenancy.keys import hash_key
from tests.pool.conftest import INTERNAL_TOKEN, Process, replica_args, start, wait_ready

ADMIN_KEY = "bg-pool-admin"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
# USD per 1M tokens of each replica's model, in order (a second replica gets the dearer one):
# whole micro-dollars per token, so that a spend exact to the micro-dollar is exact to the token.
PRICES = ((1.0, 0.5, 4.0), (3.0, 1.5, 12.0))
PLAN = """
[plans.paid]
priority = "paid"
tokens_per_minute = 100000000
requests_per_minute = 1000000
max_concurrent_requests = 1000
queue_deadline_seconds = 120

[tenants.seed]  # the file needs one; the tests' tenants are made through the admin API
plan = "paid"
"""


@dataclass
class BudgetCluster:
    gateways: list[Process]
    replicas: list[Process]
    models: list[str]  # one per replica (each serves its own name)
    prices: dict[str, Price] = field(default_factory=dict)
    events_files: list[Path] = field(default_factory=list)  # each gateway's usage events

    def stop(self) -> None:
        for p in [*self.gateways, *self.replicas]:
            p.stop()

    def admin(
        self, method: str, path: str, body: Any = None, gateway: int = 0, query: Any = None
    ) -> httpx.Response:
        return httpx.request(
            method, self.gateways[gateway].url + path, json=body, params=query, headers=ADMIN, timeout=30
        )

    def tenant(self, name: str, budgets: dict[str, Any]) -> str:
        """A tenant of the paid plan with `budgets`, made through the admin API; its raw key."""
        made = self.admin("PUT", f"/admin/tenants/{name}", {"plan": "paid", **budgets})
        assert made.status_code == 200, made.text
        issued = self.admin("POST", f"/admin/tenants/{name}/keys")
        assert issued.status_code == 201, issued.text
        key = str(issued.json()["key"])
        deadline = time.monotonic() + 1.0  # every gateway serves it within a second (its poll)
        for g in self.gateways:
            while (
                httpx.get(g.url + "/v1/usage", headers={"authorization": f"Bearer {key}"}).status_code != 200
            ):
                assert time.monotonic() < deadline, f"{g.name} does not know tenant {name}'s key after 1 s"
                time.sleep(0.02)
        return key

    def budget_state(self, tenant: str) -> list[dict[str, Any]]:
        """The tenant's budgets once every gateway's answers so far are settled: a gateway's read
        comes after the settlements it sent before it (docs/OPERATIONS.md), so the last of one
        read on each gateway sees them all."""
        for g in range(len(self.gateways)):
            state = self.admin("GET", f"/admin/tenants/{tenant}", gateway=g)
            assert state.status_code == 200, state.text
        return list(state.json()["budgets"])

    def exact_prompt(self, body: dict[str, Any], path: str = "/v1/chat/completions") -> int:
        """The replica's own count of a request's prompt (what a hard budget holds)."""
        counted = httpx.post(
            self.replicas[0].url + "/v1/internal/count",
            json=body,
            headers={"x-batchgate-internal": INTERNAL_TOKEN, "x-batchgate-path": path},
            timeout=30,
        )
        assert counted.status_code == 200, counted.text
        return int(counted.json()["prompt_tokens"])

    def cost(self, model: str, usage: dict[str, Any]) -> int:
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return self.prices[model].cost(usage["prompt_tokens"], cached, usage["completion_tokens"])


def start_budget_cluster(
    workdir: Path,
    model_dir: Path,
    redis_url: str,
    *,
    num_gateways: int = 2,
    num_replicas: int = 1,
    replica_extra: Sequence[str] = (),
) -> BudgetCluster:
    """Replicas of the tiny model (`tiny-0`, `tiny-1`: each serves its own name, at its own
    price) and gateways over them; each gateway writes its usage events to its own file."""
    replicas = [
        start(
            f"replica{i}",
            [*replica_args(model_dir), *replica_extra, "--served-model-name", f"tiny-{i}"],
            workdir,
        )
        for i in range(num_replicas)
    ]
    gateways: list[Process] = []
    try:
        wait_ready(replicas)
        models = [f"tiny-{i}" for i in range(num_replicas)]
        prices = "".join(
            f'[prices."{m}"]\ninput = {p[0]}\ncached_input = {p[1]}\noutput = {p[2]}\n\n'
            for m, p in zip(models, PRICES, strict=False)
        )
        tenants = workdir / "tenants.toml"
        tenants.write_text(prices + PLAN)
        upstreams = [a for r in replicas for a in ("--upstream", r.url)]
        for i in range(num_gateways):
            args = [
                *upstreams,
                "--internal-token",
                INTERNAL_TOKEN,
                "--tenants",
                str(tenants),
                "--redis-url",
                redis_url,
                "--admin-key-hash",
                hash_key(ADMIN_KEY),
                "--health-interval",
                "0.2",
                "--route-affinity-tokens",
                "0",
                "--usage-events-file",
                str(workdir / f"events-{i}.jsonl"),
            ]
            gateways.append(start(f"gateway{i}", args, workdir))
        wait_ready(gateways)
        _wait_models(gateways, models)
    except BaseException:
        for p in [*gateways, *replicas]:
            p.stop()
        raise
    table = {
        m: Price(micros_of(p[0], "input"), micros_of(p[1], "cached_input"), micros_of(p[2], "output"))
        for m, p in zip(models, PRICES, strict=False)
    }
    events = [workdir / f"events-{i}.jsonl" for i in range(num_gateways)]
    return BudgetCluster(gateways, replicas, models, table, events)


def _wait_models(gateways: list[Process], models: list[str], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5) as http:
        for g in gateways:
            # /ready names every model; /v1/models needs a tenant key, and none exists yet
            while set(http.get(g.url + "/ready").json().get("models") or []) < set(models):
                assert time.monotonic() < deadline, f"{g.name} does not list {models}"
                time.sleep(0.05)


def chat_body(model: str, max_tokens: int, stream: bool = False, content: str = "hi") -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass
class Exactness:
    """One exactness run: what came back, and what the ledger says."""

    num_requests: int
    accepted: list[dict[str, Any]]  # the usage of each 200
    refusals: list[tuple[int, str]]  # (status, error code) of each other answer
    budget: int
    used: int
    reserved: int
    expected: int  # the accepted requests' usage times the prices
    seconds: float

    @property
    def ok(self) -> bool:
        return (
            self.used == self.expected <= self.budget
            and self.reserved == 0
            and all(r == (429, "insufficient_quota") for r in self.refusals)
        )

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.num_requests,
            "accepted": len(self.accepted),
            "refused": len(self.refusals),
            "refusal_kinds": dict(Counter(f"{s} {c}" for s, c in self.refusals)),
            "budget_micros": self.budget,
            "settled_micros": self.used,
            "expected_micros": self.expected,
            "drift_micros": self.used - self.expected,
            "reserved_after": self.reserved,
            "seconds": round(self.seconds, 2),
            "ok": self.ok,
        }


def run_exactness(
    cluster: BudgetCluster, tenant: str, num_requests: int, room_for: int = 10, max_tokens: int = 8
) -> Exactness:
    """`num_requests` at once (all in flight together) from one tenant, spread over the gateways,
    whose money budget holds `room_for` worst cases and a half. The worst case is the hold: the
    prompt as the replica counts it plus max_tokens, at the model's prices."""
    model = cluster.models[0]
    worst = cluster.prices[model].cost(cluster.exact_prompt(chat_body(model, max_tokens)), 0, max_tokens)
    budget = room_for * worst + worst // 2
    key = cluster.tenant(tenant, {"budget_usd": budget / 1_000_000, "budget_window": "monthly"})

    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=num_requests, max_keepalive_connections=num_requests)
        clients = [
            httpx.AsyncClient(
                base_url=g.url, headers={"authorization": f"Bearer {key}"}, timeout=300, limits=limits
            )
            for g in cluster.gateways
        ]
        try:
            return list(
                await asyncio.gather(
                    *(
                        clients[i % len(clients)].post(
                            "/v1/chat/completions", json=chat_body(model, max_tokens)
                        )
                        for i in range(num_requests)
                    )
                )
            )
        finally:
            for c in clients:
                await c.aclose()

    started = time.monotonic()
    responses = asyncio.run(run())
    seconds = time.monotonic() - started
    accepted = [r.json()["usage"] for r in responses if r.status_code == 200]
    refusals = [(r.status_code, _code(r)) for r in responses if r.status_code != 200]
    (state,) = cluster.budget_state(tenant)
    expected = sum(cluster.cost(model, u) for u in accepted)
    return Exactness(
        num_requests,
        accepted,
        refusals,
        budget,
        int(state["used"]),
        int(state["reserved"]),
        expected,
        seconds,
    )


def _code(response: httpx.Response) -> str:
    try:
        error = response.json()["error"]
        if error.get("code") != "insufficient_quota":
            return f"{error.get('code')}: {error.get('message')}"
        return str(error["code"])
    except (ValueError, KeyError, TypeError):
        return response.text[:80]


def dump(result: dict[str, Any]) -> str:
    return json.dumps(result, indent=2, sort_keys=True)


# The mixed run: what each request does (weights out of 100).
MIX = (
    ("whole", 28),  # a whole response
    ("stream", 28),  # a stream read to its end (its usage chunk asked for)
    ("cut_stream", 16),  # a stream the client closes after a few chunks
    ("cut_whole", 6),  # a whole response the client gives up on
    ("bad_param", 7),  # refused before admission (400 at the gateway)
    ("bad_model", 5),  # refused before admission (404)
    ("fails_upstream", 10),  # admitted, then refused by the replica (a prompt past its context)
)
MIX_TENANTS = {
    "mix-usd": {"budget_usd": 1000.0, "budget_window": "monthly"},
    "mix-tokens": {"budget_tokens": 10**12, "budget_window": "daily"},
    "mix-open": {},
}


@dataclass
class Mixed:
    """One mixed run: what the clients saw, what the ledger and the events say."""

    sent: int
    outcomes: dict[str, int]
    reported: list[tuple[str, int, int, int]]  # (model, input, cached, output) of each whole answer
    ledger: dict[str, dict[str, int]]  # by model: num_model_requests, input_tokens, ...
    events: list[dict[str, Any]]
    replica_tokens: dict[str, tuple[int, int]]  # by model: (in, out) the replica counted
    seconds: float

    def checks(self, prices: dict[str, Price]) -> dict[str, bool]:
        by_model: dict[str, dict[str, int]] = {}
        for e in self.events:
            row = by_model.setdefault(
                e["model"],
                {
                    "num_model_requests": 0,
                    "input_tokens": 0,
                    "input_cached_tokens": 0,
                    "output_tokens": 0,
                    "cost_micros": 0,
                },
            )
            row["num_model_requests"] += 1
            row["input_tokens"] += e["input_tokens"]
            row["input_cached_tokens"] += e["cached_tokens"]
            row["output_tokens"] += e["output_tokens"]
            row["cost_micros"] += e["cost_micros"]
        served = sorted(
            (e["model"], e["input_tokens"], e["cached_tokens"], e["output_tokens"])
            for e in self.events
            if e["status"] == "served"
        )
        remaining = list(served)
        reported_in_events = True
        for r in self.reported:
            if r in remaining:
                remaining.remove(r)
            else:
                reported_in_events = False
        return {
            "events_one_per_request": len({e["request_id"] for e in self.events}) == len(self.events),
            "ledger_equals_events": by_model == self.ledger,
            "every_reported_usage_is_an_event": reported_in_events,
            "ledger_equals_replicas_count": all(
                (
                    self.ledger.get(m, {}).get("input_tokens", 0),
                    self.ledger.get(m, {}).get("output_tokens", 0),
                )
                == counted
                for m, counted in self.replica_tokens.items()
            ),
            "costs_are_the_prices_to_the_token": all(
                e["cost_micros"]
                == prices[e["model"]].cost(e["input_tokens"], e["cached_tokens"], e["output_tokens"])
                for e in self.events
            ),
        }

    def summary(self, prices: dict[str, Price]) -> dict[str, Any]:
        totals = {
            k: sum(row.get(k, 0) for row in self.ledger.values())
            for k in ("num_model_requests", "input_tokens", "output_tokens", "cost_micros")
        }
        replica = {"input_tokens": sum(v[0] for v in self.replica_tokens.values()),
                   "output_tokens": sum(v[1] for v in self.replica_tokens.values())}  # fmt: skip
        return {
            "sent": self.sent,
            "outcomes": dict(sorted(self.outcomes.items())),
            "ledger": totals,
            "replicas_counted": replica,
            "drift_tokens": abs(totals["input_tokens"] - replica["input_tokens"])
            + abs(totals["output_tokens"] - replica["output_tokens"]),
            "events": len(self.events),
            "seconds": round(self.seconds, 1),
            "checks": self.checks(prices),
        }


def _replica_tokens(url: str) -> tuple[int, int]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    found = {"in": 0.0, "out": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "batchgate_tokens_total" and s.labels.get("direction") in found:
                found[s.labels["direction"]] += s.value
    return int(found["in"]), int(found["out"])


def _ledger(cluster: BudgetCluster, tenants: Sequence[str], since: int) -> dict[str, dict[str, int]]:
    params = {"start_time": since, "bucket_width": "1h", "group_by": "project_id,model"}
    body = cluster.admin("GET", "/v1/organization/usage/completions", query=params).json()
    out: dict[str, dict[str, int]] = {}
    for bucket in body["data"]:
        for r in bucket["results"]:
            if r["project_id"] not in tenants:
                continue
            row = out.setdefault(
                r["model"],
                {
                    "num_model_requests": 0,
                    "input_tokens": 0,
                    "input_cached_tokens": 0,
                    "output_tokens": 0,
                    "cost_micros": 0,
                },
            )
            for k in row:
                row[k] += r[k]
    return out


def run_mixed(
    cluster: BudgetCluster,
    num_requests: int,
    restart_redis: Any = None,
    concurrency: int = 16,
    seed: int = 0,
    settle_timeout_s: float = 60.0,
) -> Mixed:
    """`num_requests` of the MIX over every tenant of MIX_TENANTS, both models and every gateway,
    `concurrency` at a time; `restart_redis()` (blocking) is called once half were sent."""
    import random

    rng = random.Random(seed)
    since = int(time.time()) - 3600
    keys = {name: cluster.tenant(f"{name}-{seed}", budgets) for name, budgets in MIX_TENANTS.items()}
    tenants = [f"{name}-{seed}" for name in MIX_TENANTS]
    kinds = [k for k, w in MIX for _ in range(w)]
    before = {m: _replica_tokens(r.url) for m, r in zip(cluster.models, cluster.replicas, strict=True)}
    outcomes: dict[str, int] = {}
    reported: list[tuple[str, int, int, int]] = []

    def note(outcome: str) -> None:
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    async def one(i: int, http: httpx.AsyncClient) -> None:
        kind = rng.choice(kinds)
        model = rng.choice(cluster.models)
        key = keys[rng.choice(list(keys))]
        gateway = cluster.gateways[i % len(cluster.gateways)].url
        headers = {"authorization": f"Bearer {key}"}
        body = chat_body(
            model, rng.randint(1, 6), stream=kind in ("stream", "cut_stream"), content=f"req {i}"
        )
        if kind == "bad_param":
            body["temperature"] = 9
        elif kind == "bad_model":
            body["model"] = "no-such-model"
        elif kind == "fails_upstream":
            body["messages"][0]["content"] = "word " * 600  # past the replica's 512-token context
        url = gateway + "/v1/chat/completions"
        try:
            if kind in ("stream", "cut_stream"):
                async with http.stream("POST", url, json=body, headers=headers) as r:
                    if r.status_code != 200:
                        await r.aread()
                        note(f"{kind} {r.status_code}")
                        return
                    stop_after = rng.randint(1, 3) if kind == "cut_stream" else None
                    seen, usage = 0, None
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        seen += 1
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                        if stop_after is not None and seen >= stop_after:
                            break
                    if usage is not None:
                        reported.append(_reported(model, usage))
                        note(f"{kind} done")
                    else:
                        note(f"{kind} cut")
                return
            timeout = httpx.Timeout(60, read=rng.uniform(0.01, 0.3)) if kind == "cut_whole" else None
            extra = {"timeout": timeout} if timeout is not None else {}
            r = await http.post(url, json=body, headers=headers, **extra)
            if r.status_code == 200:
                reported.append(_reported(model, r.json()["usage"]))
            note(f"{kind} {r.status_code}")
        except httpx.ReadTimeout:
            note(f"{kind} left")

    async def run() -> None:
        limits = httpx.Limits(max_connections=concurrency * 2)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            queue = list(range(num_requests))
            restarted = False

            async def worker() -> None:
                nonlocal restarted
                while queue:
                    i = queue.pop(0)
                    if restart_redis is not None and not restarted and i >= num_requests // 2:
                        restarted = True
                        await asyncio.to_thread(restart_redis)
                    await one(i, http)

            await asyncio.gather(*(worker() for _ in range(concurrency)))

    started = time.monotonic()
    asyncio.run(run())
    seconds = time.monotonic() - started

    def events() -> list[dict[str, Any]]:
        files = cluster.events_files
        lines = [json.loads(line) for f in files if f.exists() for line in f.read_text().splitlines()]
        return [e for e in lines if e["tenant"] in tenants]

    # Settlements kept through the Redis restart land when their retry comes: wait (bounded).
    deadline = time.monotonic() + settle_timeout_s
    while True:
        got = events()
        ledger = _ledger(cluster, tenants, since)
        if sum(r["num_model_requests"] for r in ledger.values()) == len(got) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    after = {m: _replica_tokens(r.url) for m, r in zip(cluster.models, cluster.replicas, strict=True)}
    replica_tokens = {m: (after[m][0] - before[m][0], after[m][1] - before[m][1]) for m in cluster.models}
    return Mixed(num_requests, outcomes, reported, ledger, got, replica_tokens, seconds)


def _reported(model: str, usage: dict[str, Any]) -> tuple[str, int, int, int]:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return (model, usage["prompt_tokens"], cached, usage["completion_tokens"])
