"""The pure admission arithmetic (no store, no clock)."""

from __future__ import annotations

import pytest

from tenancy.bucket import (
    CONCURRENCY_RETRY_S,
    BucketState,
    Limits,
    Reason,
    Step,
    admission_step,
    refilled,
    refund,
    remaining,
    seconds_to_full,
    wait_for,
)
from tenancy.limiter import Decision, format_duration

LIMITS = Limits(tokens_per_minute=600, requests_per_minute=60, max_concurrent_requests=2)


def test_missing_bucket_is_full() -> None:
    assert refilled(None, now=5.0, capacity=600, rate_per_s=10) == 600


def test_refill_is_continuous_and_capped() -> None:
    state = BucketState(level=100, updated_at=10.0)
    assert refilled(state, 10.5, 600, 10) == pytest.approx(105)
    assert refilled(state, 60.0, 600, 10) == 600  # 100 + 500 = 600 exactly
    assert refilled(state, 1e6, 600, 10) == 600  # never above capacity


def test_clock_going_backwards_refills_nothing_and_drains_nothing() -> None:
    assert refilled(BucketState(level=100, updated_at=10.0), 9.0, 600, 10) == 100


def test_wait_and_reset_arithmetic() -> None:
    assert wait_for(level=40, amount=100, rate_per_s=10) == pytest.approx(6.0)
    assert wait_for(level=100, amount=100, rate_per_s=10) == 0
    assert seconds_to_full(level=540, capacity=600, rate_per_s=10) == pytest.approx(6.0)
    assert refund(level=590, amount=50, capacity=600) == 600
    assert refund(level=100, amount=-30, capacity=600) == 100  # over-use takes nothing extra
    assert remaining(99.9999999999) == 100 and remaining(99.5) == 99 and remaining(-3) == 0


def step(
    tokens: int, tokens_level: float | None = None, requests_level: float | None = None, leases: int = 0
) -> Step:
    tok = None if tokens_level is None else BucketState(tokens_level, 0.0)
    req = None if requests_level is None else BucketState(requests_level, 0.0)
    return admission_step(
        now=0.0, tokens=tokens, limits=LIMITS, token_bucket=tok, request_bucket=req, num_leases=leases
    )


def test_admission_takes_tokens_and_one_request() -> None:
    result = step(100)
    assert result.admitted and result.reason is Reason.OK
    assert (result.token_level, result.request_level) == (500, 59)


def test_refusal_reports_the_longest_wait() -> None:
    tokens_short = step(100, tokens_level=40)  # 60 tokens at 10/s -> 6 s
    assert tokens_short.reason is Reason.TOKENS and tokens_short.retry_after_s == pytest.approx(6.0)
    requests_short = step(100, requests_level=0.5)  # half a request at 1/s -> 0.5 s
    assert requests_short.reason is Reason.REQUESTS and requests_short.retry_after_s == pytest.approx(0.5)
    both = step(100, tokens_level=95, requests_level=0)  # tokens 0.5 s, requests 1 s
    assert both.reason is Reason.REQUESTS and both.retry_after_s == pytest.approx(1.0)
    busy = step(100, leases=2)
    assert (busy.reason, busy.retry_after_s) == (Reason.CONCURRENCY, CONCURRENCY_RETRY_S)
    assert not busy.admitted and busy.token_level == 600  # nothing taken


def test_reservation_above_capacity_is_never_admissible() -> None:
    result = step(601)
    assert (result.admitted, result.reason, result.retry_after_s) == (False, Reason.TOO_LARGE, 0.0)
    assert step(600).admitted


def test_negative_reservation_is_a_bug() -> None:
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        step(-1)


def test_limits_validate() -> None:
    with pytest.raises(ValueError, match="max_concurrent_requests must be >= 1"):
        Limits(10, 10, 0)


def test_headers_follow_openai_names_and_formats() -> None:
    refused = Decision(
        admitted=False,
        reason=Reason.TOKENS,
        retry_after_s=6.02,
        limit_requests=60,
        limit_tokens=600,
        remaining_requests=59,
        remaining_tokens=40,
        reset_requests_s=1.0,
        reset_tokens_s=56.0,
        requested_tokens=100,
    )
    assert refused.headers() == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-limit-tokens": "600",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-remaining-tokens": "40",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-reset-tokens": "56s",
        "retry-after": "7",
        "retry-after-ms": "6020",
    }
    assert "limit 600, remaining 40, requested 100" in refused.message()
    unlimited = Decision(admitted=False, reason=Reason.TOO_LARGE, limit_tokens=600, requested_tokens=900)
    assert "retry-after" not in unlimited.headers()
    assert "Request too large" in unlimited.message()


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.0, "0ms"), (0.0201, "21ms"), (1.0, "1s"), (8.64, "8.64s"), (360.0, "6m0s"), (61.5, "1m1.5s")],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
