"""The replica backend: requests relayed over HTTP to remote engine replicas.

    batchgate serve --upstream http://engine-0:8000 --upstream http://engine-1:8000 \\
        --internal-token $TOKEN --tenants tenants.toml --redis-url redis://...

Tenancy (auth, limits, priority) is enforced by the pipeline in front of this backend, once; the
replica is called with the internal token and takes priority, deadline and plan from
`x-batchgate-*` headers (gateway/admission.py). Admission needs a token count before the replica
has seen the prompt: it is estimated here (tiktoken, gateway-side) and settled with the exact
count the replica reports. The replica is told the completion tokens per choice reserved and
keeps within them, so a chat request without `max_tokens` generates no more than the gateway held
for it. Under a hard budget the replica is also told the prompt tokens held (the estimate): an
exact prompt longer than that takes its excess out of the completion tokens (gateway/local/engine_backend.py),
so no request costs more than its hold. A request the client left before the replica's answer (a
stream cut before its final usage chunk, a whole response not yet come) is settled with the
usage the replica kept for it (`/v1/internal/usage/{id}`, gateway/reports.py), so the ledger is
exact in pool mode too.

The request goes to the replica routing picks (gateway/pool/routing.py) among the healthy ones that
serve its model (gateway/pool/replicas.py); for a LoRA adapter, one that holds it or where it is
loaded first (gateway/pool/adapters.py). A replica that fails before the client got its first byte
is retried on another; one that dies mid-stream ends the client's stream with an SSE error event
in its protocol's shape (OpenAI's, then `[DONE]`; Anthropic's, last).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass

import httpx

from gateway import admission
from gateway.anthropic.errors import OVERLOADED_STATUS
from gateway.backend import Body, Call, ModelCard, NotReady, Plan, Reply, Stream, Task, Usage, Work
from gateway.drain import DRAINING_HEADER
from gateway.errors import APIError, Dialect, ErrorKind, Refusal
from gateway.metrics import Metrics
from gateway.pool.adapters import AdapterLoadError, PoolAdapters
from gateway.pool.frames import Observer, UpstreamEnded, no_frames, read_frames, stop_read
from gateway.pool.replicas import ReplicaSet, Upstream
from gateway.pool.routing import affinity_key
from gateway.settings import LoraSpec, Settings
from tenancy.billing import prompt_excess_weight
from tenancy.service import Tenancy
from tenancy.tokens import TokenCounter

logger = logging.getLogger("batchgate.pool")

# The replica keeps a cut stream's usage a moment after the cut; it waits up to 2 s for it.
REPORT_TIMEOUT_S = 3.0
# What another replica may answer instead; Anthropic's protocol sheds with its own 529.
RETRY_STATUSES = (502, 503, 504, OVERLOADED_STATUS)
TASKS = {t.value for t in Task}
# Hop-by-hop and recomputed headers not copied from a replica's response.
_DROP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding", "date", "server"}
# Headers of a replica's event stream that our own EventStreamResponse sets.
_STREAM_HEADERS = {"content-type", "cache-control", "x-accel-buffering"}


@dataclass
class _Sent:
    """One proxied request's bookkeeping on its replica; `release()` is idempotent."""

    upstream: Upstream
    tokens: int
    released: bool = False

    def __post_init__(self) -> None:
        self.upstream.inflight += 1
        self.upstream.inflight_tokens += self.tokens
        self.upstream.num_sent += 1

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.upstream.inflight -= 1
            self.upstream.inflight_tokens -= self.tokens


class ReplicaBackend:
    """Every model the `--upstream` replicas serve, relayed to them."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        tenancy: Tenancy | None = None,
        loras: Sequence[LoraSpec] = (),
    ) -> None:
        """`loras`: the adapters declared for the pool (gateway/pool/adapters.py)."""
        self.settings = settings
        self.metrics = metrics
        self.tenancy = tenancy  # its prices and budgets say how a prompt excess is paid for
        self.replicas = ReplicaSet(
            settings.upstreams,
            settings.internal_token,
            settings.health_interval_s,
            settings.long_prompt_upstreams,
            settings.long_prompt_threshold,
        )
        self.adapters = PoolAdapters(self.replicas, loras)
        self._counter: TokenCounter | None = None

    async def start(self) -> None:
        await self.replicas.start()

    async def aclose(self) -> None:
        await self.replicas.aclose()

    def models(self) -> list[ModelCard]:
        """The replicas' models, each adapter with its owner, and the declared adapters that no
        replica holds yet (loaded on demand)."""
        cards = []
        adapters = self.adapters
        for model, created in sorted(self.replicas.models().items()):
            if adapters.hidden(model):
                continue
            task = self.replicas.task_of(model)
            cards.append(
                ModelCard(model, created, Task(task) if task in TASKS else None, adapters.owner(model))
            )
        for name in adapters.loadable():
            cards.append(ModelCard(name, adapters.created, Task.GENERATE, adapters.owner(name)))
        return cards

    async def find(self, model: str) -> bool:
        """Whether a healthy replica serves `model`; if none does while some replica is marked
        down, those are probed first (one may be back before its next poll). An adapter is never
        found here: `models()` lists it to those who may use it."""
        if self.adapters.is_adapter(model):
            return False
        if model in self.replicas.models():
            return True
        if len(self.replicas.healthy()) < len(self.replicas.upstreams):
            await self.replicas.reprobe()
        return model in self.replicas.models()

    def problem(self) -> str | None:
        return None  # replicas come and go; the gateway itself stays alive

    async def not_ready(self) -> NotReady | None:
        if not self.replicas.healthy():
            return NotReady("unavailable", "no healthy upstream", "No healthy upstream replica.", 1.0)
        return None

    # -- requests ----------------------------------------------------------------------------

    def _count(self) -> TokenCounter:
        if self._counter is None:
            self._counter = TokenCounter()
        return self._counter

    async def plan(self, work: Work) -> Plan:
        if work.endpoint.relay_hold is None:
            raise RuntimeError(f"{work.endpoint.path} is not relayed")
        hold = await work.endpoint.relay_hold(work, self._count())
        num_prompt, max_tokens = hold.num_prompt_tokens, hold.max_tokens
        if work.endpoint.countable and self._budget_weight(work):
            num_prompt = await self._exact_prompt(work) or num_prompt

        async def execute(call: Call) -> Reply:
            return await self._execute(call, num_prompt + max_tokens, hold.max_tokens_per_choice)

        return Plan(num_prompt, max_tokens, execute)

    async def _execute(self, call: Call, tokens: int, max_tokens_per_choice: int = 0) -> Reply:
        work = call.work
        caller = work.caller
        body = work.body
        headers = {
            "content-type": "application/json",
            admission.PRIORITY_HEADER: caller.priority.name.lower(),
            admission.PLAN_HEADER: caller.plan,
            admission.FAIRNESS_HEADER: caller.name,
            **self.replicas.internal_headers(),
        }
        if max_tokens_per_choice:
            headers[admission.MAX_TOKENS_HEADER] = str(max_tokens_per_choice)
            headers.update(self._prompt_hold(work, call.usage.num_prompt_tokens))
        headers[admission.REQUEST_ID_HEADER] = work.request_id
        if caller.queue_deadline_s is not None:
            headers[admission.DEADLINE_HEADER] = repr(float(caller.queue_deadline_s))
        # Settlement and metrics need the replica's exact token count, which a stream only
        # carries when asked: ask for it always, and keep it from a client that did not.
        hide_usage = (
            work.stream
            and not work.endpoint.usage_in_stream
            and not (body.get("stream_options") or {}).get("include_usage")
        )
        if hide_usage:
            headers[admission.USAGE_HEADER] = "1"
        content = json.dumps(body, ensure_ascii=False).encode()
        routed = work.endpoint.task is Task.GENERATE  # embeddings share no KV cache and are short
        observer = Observer(call.usage, call.span)
        started = time.perf_counter()
        # The replica a request is on while no answer came back (the client may leave meanwhile).
        unanswered: list[Upstream] = []

        async def settle_unanswered() -> None:
            if unanswered:
                await self._read_report(unanswered[-1], work.request_id, call.usage)

        call.on_close(settle_unanswered)
        with call.span.use():
            _inject_trace_context(headers)
            sent, response, first, frames = await self._send(
                work.endpoint.upstream_path,
                work.model,
                content,
                headers,
                tokens,
                work.stream,
                affinity_key(caller, body) if routed and self.settings.route_affinity_tokens else b"",
                call.usage.num_prompt_tokens if routed else 0,
                unanswered,
            )
            unanswered.clear()  # answered: the response (or its stream's close) settles it

        async def close() -> None:
            if isinstance(first, asyncio.Task):
                await stop_read(first)  # the relay may never have started (client gone at once)
            await response.aclose()
            sent.release()
            if isinstance(first, asyncio.Task) and not observer.reported:
                await self._read_report(sent.upstream, work.request_id, call.usage)

        call.on_close(close)
        out_headers = {k: v for k, v in response.headers.items() if k.lower() not in _DROP_HEADERS}
        if not isinstance(first, asyncio.Task):
            if response.status_code == 200:
                observer.observe_body(first)
            else:
                call.span.set("error.type", str(response.status_code))
                if response.status_code in RETRY_STATUSES:
                    self.metrics.refused(Refusal.OVERLOAD)
            return Body(first, response.status_code, out_headers)
        for name in _STREAM_HEADERS:
            out_headers.pop(name, None)
        return Stream(
            self._relay(response, frames, first, observer, started, hide_usage, work.endpoint.dialect),
            ready=first.done(),  # else headers now, a keep-alive, and the first frame follows
            headers=out_headers,
        )

    async def _send(
        self,
        path: str,
        model: str,
        content: bytes,
        headers: dict[str, str],
        tokens: int,
        stream: bool,
        affinity: bytes = b"",
        num_prompt_tokens: int = 0,
        unanswered: list[Upstream] | None = None,
    ) -> tuple[_Sent, httpx.Response, bytes | asyncio.Task[bytes], AsyncGenerator[bytes, None]]:
        """Send to the least-loaded healthy replica, failing over until one answers; while one
        has the request, it is the last of `unanswered`.

        Returns the call, the response, and: for a 200 stream, the future of its first SSE frame
        (awaited up to keep_alive_s here, so a replica that dies before that is retried elsewhere;
        a slower first frame is awaited by the relay behind a keep-alive); otherwise the whole body.
        """
        tried: set[str] = set()
        last: tuple[_Sent, httpx.Response, bytes, AsyncGenerator[bytes, None]] | None = None
        reprobed = False
        client = self.replicas.client
        adapter = self.adapters.route(model)
        refused: AdapterLoadError | None = None  # the last replica that could not load the adapter
        try:
            while True:
                up = self.replicas.pick(
                    model, tried, affinity, self.settings.route_affinity_tokens, num_prompt_tokens, adapter
                )
                if up is None and not reprobed and last is None:
                    reprobed = True
                    await self.replicas.reprobe()
                    continue
                if up is None:
                    if last is not None:
                        result, last = last, None
                        return result
                    if refused is not None:
                        raise refused.for_request(model)
                    raise APIError(
                        ErrorKind.UNAVAILABLE,
                        "No healthy upstream replica could take the request.",
                        retry_after_s=1.0,
                    )
                tried.add(up.url)
                if adapter is not None and adapter.warmth(up) == 0:
                    try:
                        await self.adapters.ensure(up, model)
                    except AdapterLoadError as exc:
                        refused = exc
                        continue
                    except httpx.HTTPError as exc:
                        self.replicas.mark_down(up, f"{type(exc).__name__}: {exc}")
                        continue
                if unanswered is not None:
                    unanswered.append(up)
                sent = _Sent(up, tokens)
                response: httpx.Response | None = None
                first: asyncio.Task[bytes] | None = None
                try:
                    req = client.build_request("POST", up.url + path, content=content, headers=headers)
                    response = await client.send(req, stream=True)
                    if response.status_code == 200 and stream:
                        frames = read_frames(response)
                        first = asyncio.ensure_future(frames.__anext__())
                        done, _ = await asyncio.wait({first}, timeout=self.settings.keep_alive_s)
                        if done:
                            first.result()  # a replica that failed already: try another
                        return sent, response, first, frames
                    payload = await response.aread()
                    await response.aclose()
                    if response.status_code in RETRY_STATUSES:
                        if response.headers.get(DRAINING_HEADER):
                            self.replicas.mark_down(up, "draining")
                        if last is not None:
                            last[0].release()
                        last = (sent, response, payload, no_frames())
                        continue
                    return sent, response, payload, no_frames()
                except (httpx.HTTPError, UpstreamEnded, StopAsyncIteration) as exc:
                    sent.release()
                    if unanswered:
                        unanswered.pop()  # it failed: nothing ran there to pay for
                    if response is not None:
                        await response.aclose()
                    self.replicas.mark_down(up, f"{type(exc).__name__}: {exc}")
                    logger.warning("upstream %s failed before the first byte; trying another", up.url)
                except BaseException:
                    sent.release()
                    if first is not None:
                        await stop_read(first)
                    if response is not None:
                        await response.aclose()
                    raise
        finally:
            if last is not None:  # an answer kept for failover, not returned
                last[0].release()

    def _budget_weight(self, work: Work) -> int:
        """0 when no hard budget holds the request; else how many completion tokens pay for a
        prompt token past the hold (tenancy.billing.prompt_excess_weight)."""
        tenant = work.caller.tenant
        if self.tenancy is None or tenant is None:
            return 0

        budgets = self.tenancy.budgets_of(tenant) + tuple(work.caller.key_budgets)
        return prompt_excess_weight(budgets, self.tenancy.config.price(work.model))

    async def _exact_prompt(self, work: Work) -> int | None:
        """The prompt's exact token count from a replica that serves the model (its tokenizer and
        chat template), for a hard budget's hold; None (the estimate stays) if none can say."""
        up = self.replicas.pick(work.model, set())
        if up is None:
            return None
        try:
            response = await self.replicas.client.post(
                up.url + "/v1/internal/count",
                content=json.dumps(work.body, ensure_ascii=False).encode(),
                headers={
                    "content-type": "application/json",
                    admission.PATH_HEADER: work.endpoint.path,
                    **self.replicas.internal_headers(),
                },
                timeout=REPORT_TIMEOUT_S,
            )
            if response.status_code == 200:
                return int(response.json()["prompt_tokens"])
            logger.info(
                "%s: %s could not count the prompt (%s)", work.request_id, up.url, response.status_code
            )
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            logger.warning(
                "%s: %s could not count the prompt (%r); held the estimate", work.request_id, up.url, exc
            )
        return None

    def _prompt_hold(self, work: Work, num_prompt_tokens: int) -> dict[str, str]:
        """The headers that keep a replica within a hard budget's hold on its prompt count."""
        weight = self._budget_weight(work)
        if not weight:
            return {}
        return {
            admission.PROMPT_TOKENS_HEADER: str(max(num_prompt_tokens, 1)),
            admission.PROMPT_WEIGHT_HEADER: str(weight),
        }

    async def _read_report(self, upstream: Upstream, request_id: str, usage: Usage) -> None:
        """Settle a request its client left before the replica's usage (a stream cut before its
        usage chunk, a whole response not yet come) with what the replica says it used; the
        estimate (one token per chunk seen) stays when the replica cannot say (it died, or is
        old)."""
        try:
            response = await self.replicas.client.get(
                f"{upstream.url}/v1/internal/usage/{request_id}",
                headers=self.replicas.internal_headers(),
                timeout=REPORT_TIMEOUT_S,
            )
            if response.status_code != 200:
                raise ValueError(f"status {response.status_code}")
            report = response.json()
            if not usage.served and not (report["prompt_tokens"] or report["completion_tokens"]):
                return  # nothing ran there: nothing to pay
            usage.served = True
            usage.num_prompt_tokens = int(report["prompt_tokens"])
            usage.num_cached_tokens = int(report.get("cached_tokens", 0))
            usage.num_completion_tokens = int(report["completion_tokens"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            # Not served: the client left before the replica began (nothing to pay, nothing lost).
            log = logger.warning if usage.served else logger.info
            log("%s: no usage report from %s (%s); settled with the estimate", request_id, upstream.url, exc)

    async def _relay(
        self,
        response: httpx.Response,
        frames: AsyncGenerator[bytes, None],
        first: asyncio.Task[bytes],
        observer: Observer,
        started: float,
        hide_usage: bool,
        dialect: Dialect,
    ) -> AsyncIterator[bytes]:
        """The replica's frames to the client, observed for usage and latency, up to the last one
        its protocol's stream has (`dialect`); `hide_usage` drops the usage-only chunk that the
        gateway asked for on the client's behalf."""
        last_token: float | None = None
        try:
            # Shielded: a client that leaves cancels this generator, not the read in flight (see _stop).
            frame = await asyncio.shield(first)
            observer.usage.served = True  # the replica answers: what it used is charged from now on
            while True:
                if dialect.is_last(frame):
                    observer.observe(frame)
                    yield frame
                    return
                if observer.observe(frame):
                    now = time.perf_counter()
                    if last_token is None:
                        self.metrics.ttft.observe(now - started)
                        self.metrics.queue_time.observe(now - started)
                        observer.span.first_token(now - started)
                    else:
                        self.metrics.itl.observe(now - last_token)
                    last_token = now
                if not (hide_usage and observer.usage_only):
                    yield frame
                frame = await frames.__anext__()
        except (httpx.HTTPError, UpstreamEnded, StopAsyncIteration) as exc:
            logger.warning("upstream %s failed mid-stream: %r", response.request.url, exc)
            observer.span.set("error.type", "upstream_failed_mid_stream")
            yield dialect.error_event(
                APIError(
                    ErrorKind.UNAVAILABLE,
                    "The engine replica serving this request failed mid-stream; retry the request.",
                )
            )
            if dialect.end_after_error:
                yield dialect.end_frame
        finally:
            await stop_read(first)
            await frames.aclose()


def _inject_trace_context(headers: dict[str, str]) -> None:
    """W3C traceparent for the replica, when OpenTelemetry is on (see gateway/telemetry.py)."""
    try:
        from opentelemetry import propagate
    except ImportError:
        return
    propagate.inject(headers)
