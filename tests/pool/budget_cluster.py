"""Gateways over one real redis-server and real replicas, with prices and budgets: what the budget
exactness tests (tests/pool/test_budgets_pool.py) and benches (bench/budget_exactness.py,
bench/ledger_mixed.py) start and measure.

    replicas (tiny model)  <-  gateways (--tenants with prices, --admin-key-hash, --redis-url)

Tenants are made through the admin API of one gateway and used on all of them."""

from __future__ import annotations

import asyncio
import json
import time
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

    def stop(self) -> None:
        for p in [*self.gateways, *self.replicas]:
            p.stop()

    def admin(self, method: str, path: str, body: Any = None, gateway: int = 0) -> httpx.Response:
        return httpx.request(
            method, self.gateways[gateway].url + path, json=body, headers=ADMIN, timeout=30
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
            while httpx.get(g.url + "/v1/usage", headers={"authorization": f"Bearer {key}"}).status_code != 200:
                assert time.monotonic() < deadline, f"{g.name} does not know tenant {name}'s key after 1 s"
                time.sleep(0.02)
        return key

    def budget_state(self, tenant: str) -> list[dict[str, Any]]:
        return list(self.admin("GET", f"/admin/tenants/{tenant}").json()["budgets"])

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
    gateway_args: Sequence[str] = (),
    replica_extra: Sequence[str] = (),
) -> BudgetCluster:
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
                *gateway_args,
            ]
            gateways.append(start(f"gateway{i}", [a.replace("{i}", str(i)) for a in args], workdir))
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
    return BudgetCluster(gateways, replicas, models, table)


def _wait_models(gateways: list[Process], models: list[str], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5) as http:
        for g in gateways:
            while {m["id"] for m in http.get(g.url + "/v1/models").json()["data"]} < set(models):
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
            "refusal_kinds": sorted({f"{s} {c}" for s, c in self.refusals}),
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
                        clients[i % len(clients)].post("/v1/chat/completions", json=chat_body(model, max_tokens))
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
        num_requests, accepted, refusals, budget, int(state["used"]), int(state["reserved"]), expected, seconds
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
