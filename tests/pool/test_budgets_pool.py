"""Budgets in pool mode: two real gateways over one real redis-server and one real replica (the
tiny model), tenants made through the admin API. The hold is exact across gateways, a request
the client left pays what the replica generated, and a prompt the gateway under-estimated never
costs more than its hold."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.admission import MAX_TOKENS_HEADER, PROMPT_TOKENS_HEADER, PROMPT_WEIGHT_HEADER
from tenancy.tokens import TokenCounter
from tests.conftest_redis import RedisProcess
from tests.pool.budget_cluster import BudgetCluster, chat_body, run_exactness, run_mixed, start_budget_cluster
from tests.pool.conftest import INTERNAL_TOKEN


@pytest.fixture(scope="module")
def redis_aof(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """This module's own redis-server, with persistence (AOF), which the mixed run restarts."""
    server = RedisProcess(tmp_path_factory.mktemp("budget-redis"), persistent=True)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def budget_cluster(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, redis_aof: RedisProcess
) -> Iterator[BudgetCluster]:
    """Two gateways over two replicas (`tiny-0` and the dearer `tiny-1`) and one Redis."""
    workdir = tmp_path_factory.mktemp("budget-pool")
    cluster = start_budget_cluster(workdir, tiny_model_dir, redis_aof.url, num_replicas=2)
    try:
        yield cluster
    finally:
        cluster.stop()


def test_sixty_at_once_over_two_gateways_never_overshoot_and_settle_to_the_token(
    budget_cluster: BudgetCluster,
) -> None:
    """Room for ten requests' worst case and a half, sixty at once over both gateways: the
    settled spend never exceeds the budget, every refusal is insufficient_quota, and the spend is
    the accepted requests' usage times the prices, to the micro-dollar (bench/budget_exactness.py
    runs the same at 500)."""
    result = run_exactness(budget_cluster, "capped60", 60)
    summary = result.summary()
    # Ten worst cases fit; a request settles below its worst case (shorter output, cached
    # prompt tokens at the cached price), so the refund can let one or two more in.
    assert 1 <= len(result.accepted) <= 12, summary
    assert result.refusals and result.ok, summary


def tokens(url: str, direction: str) -> float:
    """A server's batchgate_tokens_total in `direction`, over its other labels."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "batchgate_tokens_total" and s.labels.get("direction") == direction
    )


def test_a_whole_response_the_client_left_pays_what_the_replica_generated(
    budget_cluster: BudgetCluster,
) -> None:
    """A non-stream request whose client gives up before the answer: the gateway reads what the
    replica generated for it and settles that (it used to settle 0 in pool mode)."""
    key = budget_cluster.tenant("leaver", {"budget_tokens": 10**9, "budget_window": "none"})
    replica = budget_cluster.replicas[0].url
    out_before = tokens(replica, "out")
    body = chat_body(budget_cluster.models[0], 400, content="a long answer please")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            budget_cluster.gateways[0].url + "/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {key}"},
            timeout=httpx.Timeout(30, read=0.3),
        )
    # The replica sees the gateway leave and keeps the usage; the gateway reads it and settles.
    deadline = 30.0
    start = time.monotonic()
    while True:
        (state,) = budget_cluster.budget_state("leaver")
        generated = tokens(replica, "out") - out_before
        if state["used"] and generated and state["reserved"] == 0:
            break
        assert time.monotonic() - start < deadline, (state, generated)
        time.sleep(0.05)
    prompt = state["used"] - generated
    assert generated >= 1 and prompt > 0, (state, generated)
    rows = budget_cluster.admin("GET", "/v1/organization/usage/completions?group_by=project_id").json()
    mine = [r for b in rows["data"] for r in b["results"] if r["project_id"] == "leaver"]
    assert sum(r["output_tokens"] for r in mine) == generated
    assert sum(r["input_tokens"] for r in mine) == prompt


def test_a_replica_keeps_a_short_prompt_estimate_within_its_hold(budget_cluster: BudgetCluster) -> None:
    """Told the prompt tokens a hard budget held, a replica takes an exact prompt's excess (times
    the weight) out of the completion tokens, and refuses one with no completion token left."""
    url = budget_cluster.replicas[0].url + "/v1/chat/completions"
    body = chat_body(budget_cluster.models[0], 50, content="1234567890 " * 8)
    internal = {"x-batchgate-internal": INTERNAL_TOKEN, MAX_TOKENS_HEADER: "50"}
    exact = httpx.post(url, json=body, headers=internal, timeout=60).json()["usage"]
    assert exact["completion_tokens"] == 50
    p = exact["prompt_tokens"]
    held = {**internal, PROMPT_TOKENS_HEADER: str(p - 20)}
    cut = httpx.post(url, json=body, headers=held, timeout=60).json()["usage"]
    assert (cut["prompt_tokens"], cut["completion_tokens"]) == (p, 30)  # p + 30 == (p - 20) + 50
    weighted = httpx.post(url, json=body, headers={**held, PROMPT_WEIGHT_HEADER: "2"}, timeout=60)
    assert weighted.json()["usage"]["completion_tokens"] == 10
    no_room = httpx.post(url, json=body, headers={**internal, PROMPT_TOKENS_HEADER: str(p - 60)}, timeout=60)
    assert no_room.status_code == 429 and no_room.json()["error"]["code"] == "insufficient_quota"
    assert no_room.headers["x-should-retry"] == "false"


def test_a_hard_budget_holds_the_prompt_as_the_replica_counts_it(budget_cluster: BudgetCluster) -> None:
    """Digits and the chat template's system prompt: the gateway's tiktoken estimate is short of
    the model's own count. A token budget of the estimate's hold refuses the request (held at the
    replica's exact count, it cannot fit; it used to run and overshoot); a budget of the exact
    hold runs it and settles exactly that."""
    model = budget_cluster.models[0]
    body = chat_body(model, 40, content="1234567890 " * 8)
    estimate = TokenCounter().count_messages(body["messages"])
    exact = budget_cluster.exact_prompt(body)
    assert exact > estimate  # the estimate is short: the case this guards
    key = budget_cluster.tenant("digits", {"budget_tokens": estimate + 40, "budget_window": "none"})
    auth = {"authorization": f"Bearer {key}"}
    url = budget_cluster.gateways[1].url + "/v1/chat/completions"

    def ask() -> httpx.Response:
        return httpx.post(url, json=body, headers=auth, timeout=60)

    start = time.monotonic()
    while (refused := ask()).status_code == 401:  # the other gateway sees the new key within 1 s
        assert time.monotonic() - start < 1.0
        time.sleep(0.02)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "insufficient_quota"
    raised = {"plan": "paid", "budget_tokens": exact + 40, "budget_window": "none"}
    assert budget_cluster.admin("PUT", "/admin/tenants/digits", raised, gateway=1).status_code == 200
    answer = ask()
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (exact, 40)
    (state,) = budget_cluster.budget_state("digits")
    assert state["used"] == exact + 40 == state["limit"] and state["reserved"] == 0


def test_a_mixed_run_settles_to_the_token_through_a_redis_restart(
    budget_cluster: BudgetCluster, redis_aof: RedisProcess
) -> None:
    """Whole and streamed answers, streams and whole answers the client left, requests refused
    before admission and by the replica after it, two models at two prices, and Redis restarted
    halfway: the ledger equals the usage events (one per admitted request) and the replicas' own
    token counts, every reported usage is settled as reported, each cost is the prices to the
    token (bench/ledger_mixed.py runs it at 10,000)."""
    result = run_mixed(budget_cluster, 240, restart_redis=redis_aof.restart)
    summary = result.summary(budget_cluster.prices)
    assert all(summary["checks"].values()) and summary["drift_tokens"] == 0, summary
    kinds = {o.split()[0] for o in result.outcomes}
    assert {"whole", "stream", "cut_stream", "bad_param", "bad_model", "fails_upstream"} <= kinds, summary
    assert any(o.endswith(" cut") for o in result.outcomes), summary  # streams really were cut
    assert summary["ledger"]["output_tokens"] > 0 and len(budget_cluster.models) == 2
