"""Prometheus metrics: one `CollectorRegistry` per app (never the global one), served at /metrics.

Latency histograms and request/token counters are recorded as requests flow; engine gauges
(running/waiting by priority, KV use, batch size) and engine counters (preemptions, deadline
refusals, step failures) are read from `engine.stats()` at scrape time, and the engine's liveness
from `engine.health()` (only in a process that serves a local engine: not in gateway-only mode).
Label values come from bounded sets only: priority `paid`/`free`/`batch`, plan `paid`/`free`/`open`, status
class `2xx`..`5xx`, refusal reasons and step stages from fixed lists; never a key, a tenant name or
any other client-controlled string.

    batchgate_time_to_first_token_seconds      histogram
    batchgate_inter_token_latency_seconds      histogram
    batchgate_e2e_request_latency_seconds      histogram
    batchgate_queue_time_seconds               histogram (submit -> first output, approximate)
    batchgate_requests_running{priority}       gauge
    batchgate_requests_waiting{priority}       gauge (the Helm chart's KEDA query)
    batchgate_kv_cache_usage_ratio             gauge
    batchgate_batch_size                       gauge (last engine step)
    batchgate_preemptions_total                counter
    batchgate_prefix_cache_queries_total       counter (prompt tokens looked up at admission)
    batchgate_prefix_cache_hits_total          counter (of those, found cached: hit rate = hits / queries)
    batchgate_spec_decode_drafts_total         counter (drafts verified by speculative decoding)
    batchgate_spec_decode_draft_tokens_total   counter (their tokens)
    batchgate_spec_decode_accepted_tokens_total counter (of those, accepted: acceptance = accepted / draft)
    batchgate_spec_decode_accepted_per_draft   histogram (accepted tokens per verified draft)
    batchgate_refusals_total{reason}           counter (rate_limit, budget, deadline, overload, unavailable)
    batchgate_tokens_total{direction,plan}     counter (direction in|out)
    batchgate_spend_micros_total{plan}         counter (micro-dollars settled at the configured prices)
    batchgate_budget_soft_crossings_total{plan,metric} counter (a budget's soft threshold crossed;
                                               once per window and budget; metric usd|tokens)
    batchgate_budget_refusals_total{plan,metric,scope} counter (requests a hard budget refused;
                                               scope tenant|key)
    batchgate_budget_used{plan,metric}         gauge (tenants' budgets: used in their current window,
                                               summed by plan; usd in micro-dollars; read from the
                                               store at most every BUDGET_GAUGE_TTL_S at scrape time)
    batchgate_budget_limit{plan,metric}        gauge (their limits, summed: used / limit is the plan's use)
    batchgate_budget_use_max_ratio{plan,metric} gauge (the highest tenant's used / limit in the plan)
    batchgate_requests_total{code}             counter (chat, completions, embeddings; by status class)
    batchgate_engine_up                        gauge (1: the engine loop runs; 0: dead, shut down or loading)
    batchgate_engine_stalled_seconds           gauge (since the engine's last step while work waits; 0 idle)
    batchgate_engine_step_failures_total{stage} counter (stage: forward, sampling, output, schedule)
    batchgate_response_state_lookup_seconds    histogram (resolving previous_response_id or conversation)
    batchgate_responses_websocket_turns_total  counter (Responses turns run over a WebSocket)
    batchgate_responses_compactions_total      counter (histories compacted server-side: context_management)
    batchgate_responses_websockets_open        gauge (Responses WebSockets open now)
    batchgate_embedding_batch_inputs           histogram (inputs per embedding model call)
    batchgate_embedding_batch_tokens           histogram (padded tokens per embedding model call)
    batchgate_embedding_queue_wait_seconds     histogram (per input: arrival -> its model call)
    batchgate_embedding_model_seconds          histogram (per embedding model call)
    batchgate_draining                         gauge (1 from SIGTERM until exit, see gateway/drain.py)
    batchgate_redis_up                         gauge (1 Redis reachable, 0 not; only with Redis)
    batchgate_batch_lines_total{status}        counter (Batch API lines ended: completed, failed, expired,
                                               cancelled, insufficient_quota)
    batchgate_batch_lines_in_flight            gauge (Batch API lines running now)
    batchgate_batch_lines_queued               gauge (lines of running batches not yet started)
    batchgate_upstreams                        gauge (gateway-only mode: replicas configured)
    batchgate_upstreams_healthy                gauge (gateway-only mode: of those, routed to now)
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.embeddings.policy import BatchRecord
from engine.types import EngineStats, RequestOutput, StepStage
from gateway.errors import Refusal
from gateway.telemetry import ChatSpan

logger = logging.getLogger("batchgate.gateway")

if TYPE_CHECKING:
    from engine.client import EngineClient, EngineStream

PRIORITIES = ("paid", "free", "batch")
PLANS = ("paid", "free", "open")
REFUSAL_REASONS = tuple(r.value for r in Refusal)
BUDGET_METRICS = ("usd", "tokens")
BUDGET_SCOPES = ("tenant", "key")
# The budget gauges read every tenant's budgets from the store; a scrape reuses a read this recent.
BUDGET_GAUGE_TTL_S = 10.0
CODE_CLASSES = ("2xx", "3xx", "4xx", "5xx")
BATCH_LINE_STATUSES = ("completed", "failed", "expired", "cancelled", "insufficient_quota")
# The endpoints that run a model: counted by status, waited for and refused by a drain.
MODEL_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/generate", "/v1/embeddings", "/v1/messages")
STEP_STAGES = tuple(stage.value for stage in StepStage)
# What a scrape reads for the engine when there is none (gateway-only mode, or while it loads).
_NO_ENGINE = EngineStats(0, 0, 0, 0, 0, 0.0, 0, 0, 0)  # every count 0

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_BATCH_INPUT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 100, 128, 256, 512)
_BATCH_TOKEN_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
_LOOKUP_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1, 0.5)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class _EngineCollector(Collector):
    """Gauges and engine-side counters read from `engine.stats()` and `engine.health()` at scrape
    time; `engine_of` None: no local engine (gateway-only mode), so no liveness series."""

    def __init__(self, metrics: Metrics, engine_of: Callable[[], EngineClient | None] | None) -> None:
        self._metrics = metrics
        self._engine_of = engine_of

    def collect(self) -> Iterable[Metric]:
        engine = self._engine_of() if self._engine_of is not None else None
        stats = engine.stats() if engine is not None else None
        shown = stats or _NO_ENGINE
        families: list[Metric] = []
        for name, doc, by_priority in (
            ("batchgate_requests_running", "Requests running in the engine", shown.running_by_priority),
            (
                "batchgate_requests_waiting",
                "Requests waiting to start in the engine",
                shown.waiting_by_priority,
            ),
        ):
            family = GaugeMetricFamily(name, doc, labels=["priority"])
            for priority in PRIORITIES:
                family.add_metric([priority], by_priority.get(priority, 0))
            families.append(family)
        num_used_blocks = shown.num_total_blocks - shown.num_free_blocks
        families += [
            _gauge(
                "batchgate_kv_cache_usage_ratio",
                "Fraction of KV-cache blocks in use",
                num_used_blocks / (shown.num_total_blocks or 1),
            ),
            _gauge("batchgate_batch_size", "Sequences in the last engine step", shown.last_batch_size),
            _count("batchgate_preemptions", "Sequences preempted by the engine", shown.num_preemptions),
            _count(
                "batchgate_prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache at admission",
                shown.prefix_cache_queried_tokens,
            ),
            _count(
                "batchgate_prefix_cache_hits",
                "Prompt tokens found in the prefix cache",
                shown.prefix_cache_hit_tokens,
            ),
            _count(
                "batchgate_spec_decode_drafts", "Drafts verified by speculative decoding", shown.spec_drafts
            ),
            _count(
                "batchgate_spec_decode_draft_tokens",
                "Draft tokens verified by speculative decoding",
                shown.spec_draft_tokens,
            ),
            _count(
                "batchgate_spec_decode_accepted_tokens",
                "Draft tokens accepted (equal to what decoding without the draft gives)",
                shown.spec_accepted_tokens,
            ),
            _accepted_per_draft(shown.spec_accepted_per_draft, shown.spec_accepted_tokens),
        ]
        refusals = CounterMetricFamily("batchgate_refusals", "Requests refused, by reason", labels=["reason"])
        counts = dict(self._metrics.refusals)
        # The engine's own deadline refusals (at arrival and in the queue) are "deadline".
        counts["deadline"] += sum(shown.refusals_by_reason.values())
        for reason in REFUSAL_REASONS:
            refusals.add_metric([reason], counts[reason])
        families.append(refusals)
        if self._engine_of is not None:
            families += _liveness(engine, stats)
        return families


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    """A gauge family of one unlabelled value, read at scrape time."""
    family = GaugeMetricFamily(name, doc)
    family.add_metric([], value)
    return family


def _count(name: str, doc: str, value: float) -> CounterMetricFamily:
    """A counter family of one unlabelled value, read at scrape time."""
    family = CounterMetricFamily(name, doc)
    family.add_metric([], value)
    return family


def _accepted_per_draft(histogram: tuple[int, ...], total: int) -> HistogramMetricFamily:
    """Verified drafts by how many of their tokens were accepted (bucket le=i: at most i)."""
    buckets: list[tuple[str, float]] = []
    running = 0
    for accepted, drafts in enumerate(histogram):
        running += drafts
        buckets.append((str(accepted), running))
    buckets.append(("+Inf", running))
    family = HistogramMetricFamily(
        "batchgate_spec_decode_accepted_per_draft", "Draft tokens accepted per verified draft"
    )
    family.add_metric([], buckets, total)
    return family


def _liveness(engine: EngineClient | None, stats: EngineStats | None) -> list[Metric]:
    """Whether the engine loop runs, how long it has been stuck, and its contained step failures."""
    health = engine.health() if engine is not None else None
    up = _gauge(
        "batchgate_engine_up",
        "1 while the engine loop runs; 0 dead, stopped or loading",
        1 if health is not None and health.alive else 0,
    )
    stalled = _gauge(
        "batchgate_engine_stalled_seconds",
        "Seconds since the engine's last step while work waits (0 when idle)",
        health.stalled_s if health is not None else 0.0,
    )
    failures = CounterMetricFamily(
        "batchgate_engine_step_failures",
        "Engine step failures contained (the sequences concerned ended with an error), by stage",
        labels=["stage"],
    )
    by_stage = stats.step_failures_by_stage if stats is not None else {}
    for stage in STEP_STAGES:
        failures.add_metric([stage], by_stage.get(stage, 0))
    return [up, stalled, failures]


class _GatewayCollector(Collector):
    """Gauges of the gateway's own state, read at scrape time from `Metrics.state`."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        state = self._metrics.state
        draining = 1 if state.draining() else 0
        out: list[Metric] = [
            _gauge("batchgate_draining", "1 while the server drains before exiting", draining)
        ]
        redis_up = state.redis_up()
        if redis_up is not None:
            up = 1 if redis_up else 0
            out.append(_gauge("batchgate_redis_up", "1 if the last call reached Redis, else 0", up))
        upstreams = state.upstreams()
        if upstreams is not None:
            healthy, total = upstreams
            out += [
                _gauge("batchgate_upstreams", "Engine replicas configured", total),
                _gauge("batchgate_upstreams_healthy", "Engine replicas healthy (routed to)", healthy),
            ]
        use = state.budget_use
        if use is not None:
            families = [
                GaugeMetricFamily(name, doc, labels=["plan", "metric"])
                for name, doc in (
                    ("batchgate_budget_used", "Tenants' budgets used in their window, summed by plan"),
                    ("batchgate_budget_limit", "Tenants' budget limits, summed by plan"),
                    ("batchgate_budget_use_max_ratio", "The highest tenant's budget used / limit, by plan"),
                )
            ]
            for plan in PLANS:
                for metric in BUDGET_METRICS:
                    row = use.get((plan, metric), BudgetUse())
                    for family, value in zip(families, (row.used, row.limit, row.max_ratio), strict=True):
                        family.add_metric([plan, metric], value)
            out += families
        return out


@dataclass
class BudgetUse:
    """One plan's budgets of one metric, summed over its tenants."""

    used: int = 0
    limit: int = 0
    max_ratio: float = 0.0


@dataclass
class GatewayState:
    """Where the gateway gauges read from; each role sets what it has (None: no such gauge)."""

    draining: Callable[[], bool] = lambda: False
    redis_up: Callable[[], bool | None] = lambda: None
    upstreams: Callable[[], tuple[int, int] | None] = lambda: None  # (healthy, total)
    # With budgets: refreshed before a scrape by `read_budget_use` (None: no budget gauges).
    budget_use: dict[tuple[str, str], BudgetUse] | None = None
    read_budget_use: Callable[[], Awaitable[dict[tuple[str, str], BudgetUse]]] | None = None
    budget_use_read_at: float = float("-inf")


def _plan(plan: str) -> str:
    """A plan's label: its name when it is one of PLANS, else "open" (labels come from bounded sets)."""
    return plan if plan in PLANS else "open"


def _histogram(
    registry: CollectorRegistry, name: str, doc: str, buckets: Sequence[float] = _LATENCY_BUCKETS
) -> Histogram:
    return Histogram(name, doc, buckets=buckets, registry=registry)


def _counter(registry: CollectorRegistry, name: str, doc: str, **labels: Sequence[str]) -> Counter:
    """A counter whose every series (each combination of the labels' values) exists at 0 from the start."""
    counter = Counter(name, doc, list(labels), registry=registry)
    if labels:
        for values in itertools.product(*labels.values()):
            counter.labels(*values)
    return counter


class Metrics:
    """The app's metrics; `engine_of()` returns the local engine (None while it loads). Without
    `engine_of` (gateway-only mode) the engine gauges read 0 and there are no liveness series."""

    def __init__(self, engine_of: Callable[[], EngineClient | None] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = _histogram(
            r, "batchgate_time_to_first_token_seconds", "Seconds from submit to the first output token"
        )
        self.itl = _histogram(
            r,
            "batchgate_inter_token_latency_seconds",
            "Seconds between consecutive outputs of one choice",
            _TOKEN_BUCKETS,
        )
        self.e2e = _histogram(
            r,
            "batchgate_e2e_request_latency_seconds",
            "Seconds from request arrival to the end of the response (model endpoints)",
        )
        self.queue_time = _histogram(
            r,
            "batchgate_queue_time_seconds",
            "Seconds a request waited before it started (approximated by submit -> first output)",
        )
        self.tokens = _counter(
            r,
            "batchgate_tokens",
            "Tokens in (prompt) and out (completion), by plan",
            direction=("in", "out"),
            plan=PLANS,
        )
        self.requests = _counter(
            r, "batchgate_requests", "Generation requests answered, by status class", code=CODE_CLASSES
        )
        self.spend = _counter(
            r, "batchgate_spend_micros", "Micro-dollars settled at the configured prices, by plan", plan=PLANS
        )
        self.soft_crossings = _counter(
            r,
            "batchgate_budget_soft_crossings",
            "Budgets whose soft threshold a settlement crossed (once per window), by plan and metric",
            plan=PLANS,
            metric=BUDGET_METRICS,
        )
        self.budget_refusals = _counter(
            r,
            "batchgate_budget_refusals",
            "Requests a hard budget refused (429 insufficient_quota), by plan, metric and scope",
            plan=PLANS,
            metric=BUDGET_METRICS,
            scope=BUDGET_SCOPES,
        )
        self.response_evictions = _counter(
            r,
            "batchgate_response_store_evictions",
            "Stored responses evicted (least recently used first) to keep the store within its bound",
        )
        self.state_lookup = _histogram(
            r,
            "batchgate_response_state_lookup_seconds",
            "Seconds a Responses request spent resolving its previous_response_id or conversation",
            _LOOKUP_BUCKETS,
        )
        self.compactions = _counter(
            r, "batchgate_responses_compactions", "Histories compacted server-side (context_management)"
        )
        self.websocket_turns = _counter(
            r, "batchgate_responses_websocket_turns", "Responses turns run over a WebSocket (response.create)"
        )
        self.websockets_open = Gauge(
            "batchgate_responses_websockets_open", "Responses WebSockets open now", registry=r
        )
        self.batch_lines = _counter(
            r, "batchgate_batch_lines", "Batch API lines ended, by status", status=BATCH_LINE_STATUSES
        )
        self.batch_in_flight = Gauge(
            "batchgate_batch_lines_in_flight", "Batch API lines running now", registry=r
        )
        self.batch_queued = Gauge(
            "batchgate_batch_lines_queued", "Lines of running batches not yet started", registry=r
        )
        self.embedding_batch_inputs = _histogram(
            r, "batchgate_embedding_batch_inputs", "Inputs per embedding model call", _BATCH_INPUT_BUCKETS
        )
        self.embedding_batch_tokens = _histogram(
            r,
            "batchgate_embedding_batch_tokens",
            "Padded tokens (inputs x the longest) per embedding model call",
            _BATCH_TOKEN_BUCKETS,
        )
        self.embedding_queue_wait = _histogram(
            r,
            "batchgate_embedding_queue_wait_seconds",
            "Seconds each embedding input waited from arrival to its model call",
        )
        self.embedding_model_time = _histogram(
            r, "batchgate_embedding_model_seconds", "Seconds per embedding model call"
        )
        self.refusals: dict[str, int] = {reason: 0 for reason in REFUSAL_REASONS}
        r.register(_EngineCollector(self, engine_of))
        self.state = GatewayState()
        r.register(_GatewayCollector(self))

    def refused(self, reason: Refusal) -> None:
        self.refusals[reason.value] += 1

    def evicted(self, num_responses: int) -> None:
        self.response_evictions.inc(num_responses)

    def count_tokens(self, plan: str, num_in: int, num_out: int) -> None:
        plan = _plan(plan)
        if num_in:
            self.tokens.labels("in", plan).inc(num_in)
        if num_out:
            self.tokens.labels("out", plan).inc(num_out)

    def count_spend(self, plan: str, micros: int) -> None:
        if micros:
            self.spend.labels(_plan(plan)).inc(micros)

    def soft_crossed(self, plan: str, metric: str) -> None:
        if metric in BUDGET_METRICS:
            self.soft_crossings.labels(_plan(plan), metric).inc()

    def budget_refused(self, plan: str, metric: str, scope: str) -> None:
        if metric in BUDGET_METRICS and scope in BUDGET_SCOPES:
            self.budget_refusals.labels(_plan(plan), metric, scope).inc()

    def observe_embedding_batch(self, record: BatchRecord) -> None:
        """One embedding model call (an engine.embeddings.policy.BatchRecord); batcher thread."""
        self.embedding_batch_inputs.observe(record.num_inputs)
        self.embedding_batch_tokens.observe(record.num_padded_tokens)
        self.embedding_model_time.observe(record.model_s)
        for wait in record.queue_wait_s:
            self.embedding_queue_wait.observe(wait)

    def request_done(self, status: int, seconds: float) -> None:
        code = f"{min(max(status // 100, 2), 5)}xx"
        self.requests.labels(code).inc()
        self.e2e.observe(seconds)

    async def endpoint(self, request: Request) -> Response:
        state = self.state
        if (
            state.read_budget_use is not None
            and time.monotonic() - state.budget_use_read_at >= BUDGET_GAUGE_TTL_S
        ):
            try:
                state.budget_use = await state.read_budget_use()
                state.budget_use_read_at = time.monotonic()
            except Exception:  # noqa: BLE001 - a store away keeps the last reading
                logger.warning(
                    "budget gauges: could not read the budgets; kept the last reading", exc_info=True
                )
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class MetricsMiddleware:
    """ASGI middleware: status class and end-to-end latency of each generation request."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in MODEL_PATHS:
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]

        async def send_and_watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            self.metrics.request_done(status[0], time.perf_counter() - start)


class TimedStream:
    """Wraps one engine stream: TTFT and queue time at its first output, inter-token gaps after."""

    def __init__(self, stream: EngineStream, metrics: Metrics, span: ChatSpan | None = None) -> None:
        self._stream = stream
        self._span = span
        self._metrics = metrics
        self._submitted = time.perf_counter()
        self._last: dict[int, float] = {}
        self._first = True
        self.request_id = stream.request_id

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        out = await self._stream.__anext__()
        now = time.perf_counter()
        if out.new_token_ids:
            if self._first:
                self._first = False
                self._metrics.ttft.observe(now - self._submitted)
                self._metrics.queue_time.observe(now - self._submitted)
                if self._span is not None:
                    self._span.first_token(now - self._submitted)
            last = self._last.get(out.index)
            if last is not None:
                self._metrics.itl.observe(now - last)
            self._last[out.index] = now
        if self._span is not None and out.finish_reason is not None:
            self._span.finish_reason(out.index, out.finish_reason.value)
        return out

    async def aclose(self) -> None:
        await self._stream.aclose()
