"""The live page's figures (gateway/console/live.py) from the metrics the server keeps: quantiles as
Prometheus's histogram_quantile computes them, over the last minute's increase, and rates; and
the console's session store (gateway/console/sessions.py) on its own clock."""

from __future__ import annotations

import math

import pytest
from prometheus_client import generate_latest

from gateway.console import live
from gateway.console.sessions import MAX_SESSIONS, Sessions
from gateway.metrics import Metrics


def _reading(metrics: Metrics, at: float) -> live.Reading:
    return live.parse(generate_latest(metrics.registry).decode(), at)


def test_quantile_interpolates_within_the_bucket_as_prometheus_does() -> None:
    buckets = ((0.1, 0.0), (0.2, 50.0), (0.4, 100.0), (math.inf, 100.0))
    assert live.quantile(0.5, buckets) == 0.2  # the 50th observation ends the (0.1, 0.2] bucket
    assert live.quantile(0.25, buckets) == pytest.approx(0.15)  # halfway through it
    assert live.quantile(0.99, buckets) == pytest.approx(0.2 + 0.2 * 49 / 50)
    assert live.quantile(0.5, ((0.1, 0.0), (math.inf, 0.0))) is None  # no observation
    assert live.quantile(0.99, ((0.1, 1.0), (math.inf, 4.0))) == 0.1  # in +Inf: the highest bound


def test_the_last_minute_is_the_increase_since_a_reading_a_minute_old() -> None:
    metrics = Metrics()
    readings = live.Readings()
    for _ in range(10):
        metrics.ttft.observe(2.0)  # slow, long ago
    first = readings.add(_reading(metrics, 0.0))
    assert first.window_s is None and first.ttft_p50 is None  # no rate from one reading
    assert first.ttft_p50_all is not None and 1.0 < first.ttft_p50_all <= 2.5
    metrics.count_tokens("paid", 300, 600)
    for _ in range(10):
        metrics.ttft.observe(0.03)
    later = readings.add(_reading(metrics, 30.0))
    assert later.window_s == 30.0 and later.tokens_out_per_s == 20.0 and later.tokens_in_per_s == 10.0
    assert later.ttft_p50 is not None and 0.025 < later.ttft_p50 <= 0.05  # only the recent ones
    assert later.ttft_p50_all is not None and later.ttft_p50_all <= 0.05  # half of twenty are fast
    # A reading kept a minute later is the baseline from then on: the slow ones are gone, and so
    # are the fast ones once they are older than the window.
    quiet = readings.add(_reading(metrics, 95.0))
    assert quiet.window_s == 65.0 and quiet.ttft_p50 is None and quiet.tokens_out_per_s == 0.0


def test_readings_closer_than_a_second_are_not_kept_twice() -> None:
    metrics = Metrics()
    readings = live.Readings()
    readings.add(_reading(metrics, 0.0))
    readings.add(_reading(metrics, 0.5))
    assert readings.add(_reading(metrics, 1.0)).window_s == 1.0  # from the first, the second not kept


def test_sessions_are_held_by_hash_and_bounded() -> None:
    now = [0.0]
    sessions = Sessions(idle_s=10, max_s=100, clock=lambda: now[0])
    session_id, session = sessions.open("bg-key")
    assert session_id not in repr(sessions._open)  # noqa: SLF001 - what the store holds
    assert sessions.find(session_id) is session and sessions.find("forged") is None
    for _ in range(MAX_SESSIONS):
        sessions.open("bg-key")
    assert len(sessions) == MAX_SESSIONS and sessions.find(session_id) is None  # the oldest went
    now[0] = 10
    sessions.open("bg-key")
    assert len(sessions) == 1  # the expired ones went with the next login
