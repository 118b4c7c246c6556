"""The live page's figures, from the Prometheus metrics the server keeps (GET /metrics).

Latencies are histograms and throughput counters, both cumulative since start: the console keeps
the readings it took (one per refresh, at most one a second, the last ten minutes) and reports
over the last minute what Prometheus would (`histogram_quantile` over the buckets' increase,
`rate` of the counters): TTFT and inter-token latency p50 and p99, tokens and requests per second.
Since-start quantiles come beside them, for a server with no recent traffic.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# (upper bound, cumulative count) per bucket, +Inf last: one histogram's buckets.
Buckets = tuple[tuple[float, float], ...]

TTFT = "batchgate_time_to_first_token_seconds"
ITL = "batchgate_inter_token_latency_seconds"
WINDOW_S, KEEP_S, MIN_GAP_S = 60.0, 600.0, 1.0


@dataclass(frozen=True)
class Reading:
    at: float  # the console's clock (monotonic seconds)
    ttft: Buckets
    itl: Buckets
    tokens_in: float
    tokens_out: float
    requests: float  # generation requests answered, any status


def parse(text: str, at: float) -> Reading:
    """One reading of the /metrics text."""
    histograms: dict[str, list[tuple[float, float]]] = {TTFT: [], ITL: []}
    tokens = {"in": 0.0, "out": 0.0}
    requests = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.name in histograms and sample.name.endswith("_bucket"):
                histograms[family.name].append((float(sample.labels["le"]), sample.value))
            elif sample.name == "batchgate_tokens_total":
                tokens[sample.labels["direction"]] += sample.value
            elif sample.name == "batchgate_requests_total":
                requests += sample.value
    return Reading(
        at,
        tuple(sorted(histograms[TTFT])),
        tuple(sorted(histograms[ITL])),
        tokens["in"],
        tokens["out"],
        requests,
    )


def quantile(q: float, buckets: Buckets) -> float | None:
    """The q-quantile of a histogram's observations, interpolated linearly within the bucket it
    falls in (as Prometheus's histogram_quantile); None without observations. In the +Inf bucket:
    the highest finite bound."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def increase(new: Buckets, old: Buckets) -> Buckets:
    """The buckets' counts gained from `old` to `new` (the same bounds)."""
    if len(new) != len(old):
        return new
    return tuple((bound, count - before) for (bound, count), (_, before) in zip(new, old, strict=True))


@dataclass(frozen=True)
class Summary:
    """`window_s`: the span the recent figures cover (None: no earlier reading yet, so no rates)."""

    window_s: float | None
    num_requests: float | None  # answered within the window
    tokens_in_per_s: float | None
    tokens_out_per_s: float | None
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    ttft_p50_all: float | None
    ttft_p99_all: float | None
    itl_p50_all: float | None
    itl_p99_all: float | None


class Readings:
    """The readings of the last `KEEP_S`, and what they say over the last `WINDOW_S`."""

    def __init__(self) -> None:
        self._kept: deque[Reading] = deque()

    def add(self, reading: Reading) -> Summary:
        """Keep `reading` (unless one was kept within `MIN_GAP_S`), and summarize up to it."""
        while self._kept and reading.at - self._kept[0].at > KEEP_S:
            self._kept.popleft()
        older = [r for r in self._kept if r.at < reading.at]
        baseline = None
        if older:
            # The newest reading at least a window old, else the oldest there is.
            aged = [r for r in older if reading.at - r.at >= WINDOW_S]
            baseline = aged[-1] if aged else older[0]
        if not self._kept or reading.at - self._kept[-1].at >= MIN_GAP_S:
            self._kept.append(reading)
        return summarize(reading, baseline)


def summarize(now: Reading, baseline: Reading | None) -> Summary:
    since = dict(
        ttft_p50_all=quantile(0.5, now.ttft),
        ttft_p99_all=quantile(0.99, now.ttft),
        itl_p50_all=quantile(0.5, now.itl),
        itl_p99_all=quantile(0.99, now.itl),
    )
    if baseline is None:
        return Summary(None, None, None, None, None, None, None, None, **since)
    span = now.at - baseline.at
    ttft, itl = increase(now.ttft, baseline.ttft), increase(now.itl, baseline.itl)
    return Summary(
        window_s=span,
        num_requests=now.requests - baseline.requests,
        tokens_in_per_s=(now.tokens_in - baseline.tokens_in) / span,
        tokens_out_per_s=(now.tokens_out - baseline.tokens_out) / span,
        ttft_p50=quantile(0.5, ttft),
        ttft_p99=quantile(0.99, ttft),
        itl_p50=quantile(0.5, itl),
        itl_p99=quantile(0.99, itl),
        **since,
    )
