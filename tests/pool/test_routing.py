"""Length-aware routing: the pick function over a fake pool (no HTTP), and its settings."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from gateway.cli import _flag_value, build_parser
from gateway.pool.replicas import ReplicaSet as Pool
from gateway.pool.replicas import Upstream
from gateway.settings import Settings, option_specs

SHORT = ("http://s0:1", "http://s1:2")
LONG = ("http://l0:3", "http://l1:4")


@pytest.fixture
def pool() -> Iterator[Pool]:
    p = Pool(SHORT, None, 1.0, long_prompt_urls=LONG, long_prompt_threshold=1000)
    for u in p.upstreams:
        u.healthy, u.models = True, ("m",)
    try:
        yield p
    finally:
        asyncio.run(p.aclose())


def by_url(pool: Pool, url: str) -> Upstream:
    return next(u for u in pool.upstreams if u.url == url)


def picks(pool: Pool, num_prompt_tokens: int, n: int = 40, **kwargs: object) -> set[str]:
    chosen = set()
    for _ in range(n):
        up = pool.pick("m", set(), num_prompt_tokens=num_prompt_tokens, **kwargs)  # type: ignore[arg-type]
        assert up is not None
        chosen.add(up.url)
    return chosen


def test_prompts_over_the_threshold_go_to_the_long_prompt_replicas(pool: Pool) -> None:
    assert picks(pool, 1001) == set(LONG)  # least loaded among them: ties spread over both
    assert picks(pool, 1000) == set(SHORT)
    assert picks(pool, 12) == set(SHORT)
    # Even when the other set is much less loaded: the sets are kept apart, load picks within one.
    for url in SHORT:
        by_url(pool, url).reported_tokens = 100_000
    assert picks(pool, 12) == set(SHORT)
    by_url(pool, SHORT[0]).reported_tokens = 0
    assert picks(pool, 12) == {SHORT[0]}
    by_url(pool, LONG[1]).reported_tokens = 5
    assert picks(pool, 5000) == {LONG[0]}


def test_prefix_affinity_stays_within_the_length_set(pool: Pool) -> None:
    assert picks(pool, 5000, affinity=b"tenant\0system prompt", slack_tokens=4096) <= set(LONG)
    assert picks(pool, 50, affinity=b"tenant\0system prompt", slack_tokens=4096) <= set(SHORT)


def test_a_set_without_a_healthy_replica_falls_back_to_the_other(pool: Pool) -> None:
    for url in LONG:
        by_url(pool, url).healthy = False
    assert picks(pool, 5000) == set(SHORT)
    for url in LONG:
        by_url(pool, url).healthy = True
    for url in SHORT:
        pool.mark_down(by_url(pool, url), "test")
    assert picks(pool, 10) == set(LONG)
    for url in LONG:
        by_url(pool, url).healthy = False
    assert pool.pick("m", set(), num_prompt_tokens=10) is None


def test_failover_tries_the_own_set_first_then_the_other(pool: Pool) -> None:
    first = pool.pick("m", set(), num_prompt_tokens=5000)
    assert first is not None and first.url in LONG
    second = pool.pick("m", {first.url}, num_prompt_tokens=5000)
    assert second is not None and second.url in LONG and second is not first
    third = pool.pick("m", {first.url, second.url}, num_prompt_tokens=5000)
    assert third is not None and third.url in SHORT


def test_a_set_that_does_not_serve_the_model_falls_back_to_the_other(pool: Pool) -> None:
    for url in LONG:
        by_url(pool, url).models = ("other",)
    assert picks(pool, 5000) == set(SHORT)
    assert pool.pick("other", set(), num_prompt_tokens=10) in [by_url(pool, u) for u in LONG]


def test_without_long_prompt_replicas_length_does_not_matter() -> None:
    p = Pool(SHORT, None, 1.0)
    for u in p.upstreams:
        u.healthy, u.models = True, ("m",)
    assert picks(p, 10**6) == set(SHORT)
    asyncio.run(p.aclose())


def test_long_prompt_flags_and_variables() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--upstream",
            "http://a:1",
            "--long-prompt-upstream",
            "http://b:2/",
            "--long-prompt-upstream",
            "http://c:3",
            "--long-prompt-threshold",
            "2048",
        ]
    )
    flags = {s.name: _flag_value(s, getattr(args, s.name)) for s in option_specs()}
    settings = Settings.load(flags, {})
    assert settings.long_prompt_upstreams == ("http://b:2", "http://c:3")
    assert settings.long_prompt_threshold == 2048
    env = {
        "BATCHGATE_UPSTREAMS": "http://a:1",
        "BATCHGATE_LONG_PROMPT_UPSTREAMS": "http://b:2, http://c:3",
        "BATCHGATE_LONG_PROMPT_THRESHOLD": "512",
    }
    settings = Settings.load({}, env)
    assert settings.long_prompt_upstreams == ("http://b:2", "http://c:3")
    assert settings.long_prompt_threshold == 512
    assert Settings().long_prompt_threshold == 1024 and Settings().long_prompt_upstreams == ()


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"long_prompt_upstreams": ("http://b:2",)}, "needs upstreams"),
        ({"upstreams": ("http://a:1",), "long_prompt_upstreams": ("http://a:1",)}, "both"),
        ({"upstreams": ("http://a:1",), "long_prompt_threshold": 0}, "long_prompt_threshold"),
    ],
)
def test_bad_long_prompt_settings_are_refused(values: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Settings(**values)
