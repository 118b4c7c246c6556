"""Gateway-only mode: no local model; proxy generation to engine replicas over HTTP.

    batchgate serve --upstream http://engine-0:8000 --upstream http://engine-1:8000 \\
        --internal-token $TOKEN --tenants tenants.toml --redis-url redis://...

Tenancy (auth, limits, priority) is enforced here, once; the replica is called with the internal
token and takes priority, deadline and plan from `x-batchgate-*` headers (gateway/admission.py).

Routing: per model (each replica's /v1/models), to the healthy replica with the least outstanding
work: the tokens it reports waiting and running (GET /v1/internal/stats, polled every
`--health-interval` seconds together with /ready) plus the tokens this gateway has in flight there
(prompt estimate + max_tokens of each request it sent). With prefix affinity (bounded-load
rendezvous hashing): each request has a preferred order of replicas, from a hash of its tenant and
the start of its prompt (the first message, or the prompt's first 512 characters), and goes to the
first in that order whose load is within `--route-affinity-tokens` of the least loaded. So requests
sharing a system prompt meet the KV blocks that replica's prefix cache holds for it, while no
replica takes more than that margin above the rest. With `--long-prompt-upstream` replicas, prompts
of more than `--long-prompt-threshold` tokens go to those and the others to the `--upstream` ones
(length-aware pools: a long prefill on a replica serving chat turns stalls their streams), each set
taking the other's prompts when none of its own replicas is healthy. A replica failing its poll, or a call, or
answering that it drains (/ready 503, or a 503 marked `x-batchgate-draining`), gets no new
requests until a poll finds it ready again; a replica marked down is polled again after 0.1 s,
then at a doubling interval up to `--health-interval`, and when a request finds no healthy
replica left, the marked-down ones are probed at once (concurrently, 0.5 s each) before it is
answered 503: a replica back from a short freeze is not left idle until its next poll. A replica
that fails before the client got its first byte is retried on another; one that dies mid-stream
ends the client's stream with an SSE error event in OpenAI's shape, then `[DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import admission, embeddings, protocol, telemetry
from gateway.body import read_json, unless_disconnected
from gateway.drain import DRAINING_HEADER, Drain, deadline_frame
from gateway.errors import APIError, ErrorKind, sse_error_event
from gateway.metrics import Metrics
from gateway.openapi import build_openapi
from gateway.settings import Settings
from gateway.sse import DONE, EventStreamResponse

logger = logging.getLogger("batchgate.pool")

# Reserved against the tenant when a chat request names no max_tokens (no model here to say how
# much context is left); settlement refunds what was not used.
DEFAULT_CHAT_MAX_TOKENS = 1024
RETRY_STATUSES = (502, 503, 504)
# A replica marked down is polled again after this, then at a doubling interval up to the
# health interval: one back from a short freeze or a restart gets requests again within ~that.
DOWN_POLL_FIRST_S = 0.1
# When no healthy replica is left for a request, the marked-down ones are probed at once, each
# within this, before the request is answered 503.
REPROBE_TIMEOUT_S = 0.5
# Hop-by-hop and recomputed headers not copied from a replica's response.
_DROP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding", "date", "server"}


@dataclass
class Upstream:
    url: str
    healthy: bool = False
    models: tuple[str, ...] = ()
    reported_tokens: int = 0  # waiting + running tokens, as the replica last reported them
    inflight: int = 0  # requests this gateway has open there
    inflight_tokens: int = 0  # their prompt estimates + max_tokens
    num_sent: int = 0
    last_error: str | None = None
    created: dict[str, int] = field(default_factory=dict)
    long_prompts: bool = False  # one of the replicas reserved for prompts over the threshold
    marked_down: asyncio.Event = field(default_factory=asyncio.Event)  # wakes its poller

    @property
    def load(self) -> int:
        return self.reported_tokens + self.inflight_tokens


class Pool:
    """The replicas, their health and load, and the HTTP client that reaches them."""

    def __init__(
        self,
        urls: tuple[str, ...],
        internal_token: str | None,
        interval_s: float,
        long_prompt_urls: tuple[str, ...] = (),
        long_prompt_threshold: int = 0,
    ) -> None:
        self.upstreams = [Upstream(u) for u in urls] + [
            Upstream(u, long_prompts=True) for u in long_prompt_urls
        ]
        self.long_prompt_threshold = long_prompt_threshold
        self.internal_token = internal_token
        self.interval_s = interval_s
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=2.0, read=None, write=30.0, pool=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        telemetry.instrument_client(self.client)  # client spans + traceparent, when tracing is on
        self._poll_client = httpx.AsyncClient(timeout=httpx.Timeout(max(interval_s, 1.0)))
        self._task: asyncio.Task[None] | None = None
        self._reprobing: asyncio.Future[None] | None = None
        self.polled = asyncio.Event()  # set after the first round of polls

    def internal_headers(self) -> dict[str, str]:
        return {admission.INTERNAL_HEADER: self.internal_token} if self.internal_token else {}

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    async def aclose(self) -> None:
        for task in (self._task, self._reprobing):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.client.aclose()
        await self._poll_client.aclose()

    async def _loop(self) -> None:
        await self.refresh()
        self.polled.set()
        await asyncio.gather(*(self._watch(u) for u in self.upstreams))

    async def _watch(self, up: Upstream) -> None:
        """Poll one replica: every interval while healthy; soon after it is marked down, then
        backing off (see DOWN_POLL_FIRST_S)."""
        delay = DOWN_POLL_FIRST_S
        while True:
            if up.healthy:
                delay = DOWN_POLL_FIRST_S
                up.marked_down.clear()
                with anyio.move_on_after(self.interval_s):
                    await up.marked_down.wait()
                if not up.healthy:
                    await asyncio.sleep(delay)
            else:
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.interval_s)
            await self._poll(up)

    async def refresh(self) -> None:
        await asyncio.gather(*(self._poll(u) for u in self.upstreams))

    async def reprobe(self) -> None:
        """Poll every marked-down replica now, concurrently, each within REPROBE_TIMEOUT_S; callers
        arriving while a round runs share it."""
        if self._reprobing is None or self._reprobing.done():
            down = [u for u in self.upstreams if not u.healthy]
            self._reprobing = asyncio.ensure_future(self._probe_all(down))
        await asyncio.shield(self._reprobing)

    async def _probe_all(self, upstreams: list[Upstream]) -> None:
        await asyncio.gather(*(self._poll(u, REPROBE_TIMEOUT_S) for u in upstreams))

    async def _poll(self, up: Upstream, timeout_s: float | None = None) -> None:
        try:
            with anyio.fail_after(timeout_s):
                await self._check(up)
        except Exception as exc:  # noqa: BLE001 - any failure marks the replica down
            self.mark_down(up, f"{type(exc).__name__}: {exc}")

    async def _check(self, up: Upstream) -> None:
        ready = await self._poll_client.get(up.url + "/ready")
        if ready.status_code != 200:
            raise RuntimeError(f"/ready answered {ready.status_code} {ready.text[:200]}")
        headers = self.internal_headers()
        models = await self._poll_client.get(up.url + "/v1/models", headers=headers)
        models.raise_for_status()
        stats = await self._poll_client.get(up.url + "/v1/internal/stats", headers=headers)
        stats.raise_for_status()
        s = stats.json()
        cards = models.json()["data"]
        up.models = tuple(str(m["id"]) for m in cards)
        up.created = {str(m["id"]): int(m.get("created", 0)) for m in cards}
        up.reported_tokens = int(s.get("num_waiting_tokens", 0)) + int(s.get("num_running_tokens", 0))
        if not up.healthy:
            logger.info("upstream %s is healthy (models: %s)", up.url, ", ".join(up.models))
        up.healthy = True
        up.last_error = None

    def mark_down(self, up: Upstream, why: str) -> None:
        if up.healthy or up.last_error is None:  # log transitions, not every failed poll
            logger.warning("upstream %s is down: %s", up.url, why)
        up.healthy = False
        up.last_error = why
        up.marked_down.set()

    def healthy(self) -> list[Upstream]:
        return [u for u in self.upstreams if u.healthy]

    def models(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for u in self.healthy():
            for m in u.models:
                out.setdefault(m, u.created.get(m, 0))
        return out

    def pick(
        self,
        model: str,
        exclude: set[str],
        affinity: bytes = b"",
        slack_tokens: int = 0,
        num_prompt_tokens: int = 0,
    ) -> Upstream | None:
        """The least-loaded candidate; with an `affinity` key, the candidate that key ranks first
        among those whose load is at most `slack_tokens` above the least. Candidates: the healthy
        replicas serving `model`, not in `exclude`, of the set for the prompt's length (replicas
        for long prompts when it has more than `long_prompt_threshold` tokens, else the others)
        when that set has any, else of either set."""
        candidates = [u for u in self.healthy() if model in u.models and u.url not in exclude]
        if not candidates:
            return None
        if any(u.long_prompts for u in self.upstreams):
            long = num_prompt_tokens > self.long_prompt_threshold
            candidates = [u for u in candidates if u.long_prompts == long] or candidates
        best = min(u.load for u in candidates)
        if affinity and slack_tokens > 0:
            near = [u for u in candidates if u.load <= best + slack_tokens]
            return max(near, key=lambda u: _rendezvous(affinity, u.url))
        return random.choice([u for u in candidates if u.load == best])


def _rendezvous(key: bytes, url: str) -> bytes:
    return hashlib.blake2b(key + b"\0" + url.encode(), digest_size=8).digest()


def affinity_key(caller: admission.Caller, body: dict[str, Any]) -> bytes:
    """What requests that could share cached prompt blocks have in common: the tenant (the prefix
    cache's namespace) and the start of the prompt."""
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        lead: Any = messages[0]
    else:
        prompt = body.get("prompt")
        # A batch of prompts (strings or token lists): its first; else the prompt (text or ids).
        batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
        lead = prompt[0] if batch else prompt
    text = (lead if isinstance(lead, str) else json.dumps(lead, sort_keys=True, default=str))[:512]
    return caller.cache_salt.encode() + b"\0" + text.encode()


@dataclass
class _Call:
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


class ProxyGateway:
    def __init__(self, settings: Settings, tenancy: Any | None, owns_tenancy: bool) -> None:
        self.settings = settings
        self.tenancy = tenancy
        self.owns_tenancy = owns_tenancy
        self.pool = Pool(
            settings.upstreams,
            settings.internal_token,
            settings.health_interval_s,
            settings.long_prompt_upstreams,
            settings.long_prompt_threshold,
        )
        self.metrics = Metrics()
        self.drain = Drain()
        self.metrics.state.draining = lambda: self.drain.draining
        self.metrics.state.redis_up = lambda: getattr(self.tenancy, "redis_up", None)
        self.metrics.state.upstreams = lambda: (len(self.pool.healthy()), len(self.pool.upstreams))
        self._counter: Any = None

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.pool.start()
        try:
            async with admission.watching(self.tenancy):
                yield
        finally:
            await self.pool.aclose()
            if self.owns_tenancy and self.tenancy is not None:
                await self.tenancy.aclose()

    # -- probes and metadata -----------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        if self.drain.draining:
            return JSONResponse({"status": "unavailable", "detail": "draining"}, 503)
        healthy = self.pool.healthy()
        if not healthy:
            return JSONResponse({"status": "unavailable", "detail": "no healthy upstream"}, 503)
        check = getattr(self.tenancy, "ready", None)
        if check is not None and not await check():
            return JSONResponse({"status": "unavailable", "detail": "the rate limiter is unreachable"}, 503)
        return JSONResponse(
            {"status": "ready", "upstreams": len(healthy), "models": sorted(self.pool.models())}
        )

    def _card(self, model: str, created: int) -> dict[str, Any]:
        return {"id": model, "object": "model", "created": created, "owned_by": "batchgate"}

    async def list_models(self, request: Request) -> Response:
        models = self.pool.models()
        return JSONResponse({"object": "list", "data": [self._card(m, c) for m, c in sorted(models.items())]})

    async def get_model(self, request: Request) -> Response:
        model = request.path_params["model"]
        models = self.pool.models()
        self._check_model(model, models)
        return JSONResponse(self._card(model, models[model]))

    async def openapi(self, request: Request) -> Response:
        models = sorted(self.pool.models())
        return JSONResponse(build_openapi(models[0] if models else None, None))

    async def upstreams(self, request: Request) -> Response:
        admission.check_internal(self.settings.internal_token, request.headers)
        return JSONResponse(
            [
                {
                    "url": u.url,
                    "healthy": u.healthy,
                    "models": list(u.models),
                    "long_prompts": u.long_prompts,
                    "reported_tokens": u.reported_tokens,
                    "inflight": u.inflight,
                    "num_sent": u.num_sent,
                    "last_error": u.last_error,
                }
                for u in self.pool.upstreams
            ]
        )

    async def _models(self, model: str) -> dict[str, int]:
        """The models the healthy replicas serve; if none serves `model` while some replica is
        marked down, those are probed first (it may be back before its next poll)."""
        models = self.pool.models()
        if model not in models and len(self.pool.healthy()) < len(self.pool.upstreams):
            await self.pool.reprobe()
            models = self.pool.models()
        return models

    def _check_model(self, model: str, models: dict[str, int]) -> None:
        if not models:
            self.metrics.refused("unavailable")
            raise APIError(ErrorKind.UNAVAILABLE, "No healthy upstream replica.", retry_after_s=1.0)
        if model not in models:
            raise APIError(
                ErrorKind.MODEL_NOT_FOUND,
                f"The model `{model}` does not exist or you do not have access to it.",
                param="model",
            )

    # -- generation --------------------------------------------------------------------------

    def _count(self) -> Any:
        if self._counter is None:
            from tenancy.tokens import TokenCounter

            self._counter = TokenCounter()
        return self._counter

    async def chat_completions(self, request: Request) -> Response:
        body = await read_json(request, self.settings.max_body_bytes)
        req = protocol.parse_chat_request(body)
        self._check_model(req.model, await self._models(req.model))
        caller = await admission.authenticate(self.tenancy, request.headers.get("authorization"), req.user)
        messages = body["messages"]
        num_prompt = await anyio.to_thread.run_sync(self._count().count_messages, messages)
        max_tokens = req.requested_max_tokens or DEFAULT_CHAT_MAX_TOKENS
        span = _span("chat", req, caller, messages)
        return await self._proxy(
            request,
            "/v1/chat/completions",
            body,
            caller,
            num_prompt,
            max_tokens * req.num_choices,
            bool(req.stream),
            span,
        )

    async def completions(self, request: Request) -> Response:
        body = await read_json(request, self.settings.max_body_bytes)
        req = protocol.parse_completion_request(body)
        self._check_model(req.model, await self._models(req.model))
        caller = await admission.authenticate(self.tenancy, request.headers.get("authorization"), req.user)

        def count() -> int:
            counter = self._count()
            return sum(len(p) if isinstance(p, tuple) else counter.count(p) for p in req.prompt)

        num_prompt = await anyio.to_thread.run_sync(count)
        max_tokens = (req.requested_max_tokens or 16) * req.num_choices * len(req.prompt)
        span = _span("text_completion", req, caller, list(req.prompt))
        return await self._proxy(
            request, "/v1/completions", body, caller, num_prompt, max_tokens, bool(req.stream), span
        )

    async def create_embeddings(self, request: Request) -> Response:
        """Relayed to a replica that lists the model (gateway/embeddings.py has the endpoint)."""
        body = await read_json(request, self.settings.max_body_bytes)
        req = embeddings.parse_embeddings_request(body)
        caller = await admission.authenticate(self.tenancy, request.headers.get("authorization"), req.user)
        self._check_model(req.model, self.pool.models())
        num_prompt = await anyio.to_thread.run_sync(embeddings.count_proxied_tokens, req, self._count())
        span = embeddings.span(req.model, caller, req)
        relayed = self._proxy(
            request, "/v1/embeddings", body, caller, num_prompt, 0, False, span, prompt_routing=False
        )
        # A client that leaves closes the call to the replica, which then drops its inputs.
        response = await embeddings.unless_disconnected(request, relayed)
        return Response(status_code=499) if response is None else response

    async def _proxy(
        self,
        request: Request,
        path: str,
        body: dict[str, Any],
        caller: admission.Caller,
        num_prompt: int,
        max_tokens: int,
        stream: bool,
        span: telemetry.ChatSpan,
        *,
        prompt_routing: bool = True,
    ) -> Response:
        """Admit, relay to a replica, settle. `prompt_routing`: route by the prompt (prefix
        affinity, long-prompt replicas); off for embeddings, whose inputs share no KV cache and are
        each short."""
        request_id = f"gw-{random.getrandbits(64):016x}"  # the lease id; never client-chosen
        try:
            held = await admission.admit(
                self.tenancy,
                caller,
                num_prompt_tokens=num_prompt,
                max_num_tokens=max_tokens,
                request_id=request_id,
            )
        except APIError as exc:
            self.metrics.refused("rate_limit" if exc.kind is ErrorKind.RATE_LIMITED else "unavailable")
            span.event("gen_ai.admission", **{"batchgate.admitted": False})
            span.error(exc)
            span.end(response_id=None, input_tokens=num_prompt, output_tokens=0)
            raise
        span.event("gen_ai.admission", **{"batchgate.admitted": True})
        usage = _Usage(num_prompt, span)
        handed_over = False
        call: _Call | None = None
        upstream_response: httpx.Response | None = None
        first: bytes | asyncio.Future[bytes] | None = None
        try:
            headers = {
                "content-type": "application/json",
                admission.PRIORITY_HEADER: "free" if caller.priority.name == "FREE" else "paid",
                admission.PLAN_HEADER: caller.plan,
                admission.FAIRNESS_HEADER: caller.name,
                **self.pool.internal_headers(),
            }
            if caller.queue_deadline_s is not None:
                headers[admission.DEADLINE_HEADER] = repr(float(caller.queue_deadline_s))
            # Settlement and metrics need the replica's exact token count, which a stream only
            # carries when asked: ask for it always, and keep it from a client that did not.
            hide_usage = stream and not (body.get("stream_options") or {}).get("include_usage")
            if hide_usage:
                options = {**(body.get("stream_options") or {}), "include_usage": True}
                body = {**body, "stream_options": options}
            content = json.dumps(body, ensure_ascii=False).encode()
            started = time.perf_counter()
            with span.use():
                _inject_trace_context(headers)
                # Watch the connection until the first byte: a client that leaves while its
                # request is queued on the replica ends the call there (and frees its lease) now.
                sent = await unless_disconnected(
                    request,
                    self._send(
                        path,
                        body["model"],
                        content,
                        headers,
                        num_prompt + max_tokens,
                        stream,
                        affinity_key(caller, body)
                        if prompt_routing and self.settings.route_affinity_tokens
                        else b"",
                        num_prompt if prompt_routing else 0,
                    ),
                )
            if sent is None:
                logger.info("%s: client disconnected before the first byte; call ended", request_id)
                return Response(status_code=499)
            call, upstream_response, first, frames = sent
            out_headers = {
                k: v for k, v in upstream_response.headers.items() if k.lower() not in _DROP_HEADERS
            }
            out_headers.update(held.headers)
            if not isinstance(first, asyncio.Future):
                payload = first
                if upstream_response.status_code == 200:
                    usage.observe_body(payload)
                else:
                    span.set("error.type", str(upstream_response.status_code))
                    if upstream_response.status_code in RETRY_STATUSES:
                        self.metrics.refused("overload")
                return Response(payload, upstream_response.status_code, headers=out_headers)
            response_to_close = upstream_response
            call_to_release = call
            first_frame = first

            async def on_close() -> None:
                first_frame.cancel()  # the relay may never have started (client gone at once)
                await response_to_close.aclose()
                call_to_release.release()
                _settle(held, usage)
                self.metrics.count_tokens(caller.plan, usage.prompt, usage.completion)
                span.end(
                    response_id=usage.response_id, input_tokens=usage.prompt, output_tokens=usage.completion
                )
                await held.close()

            out_headers.pop("content-type", None)
            out_headers.pop("cache-control", None)
            out_headers.pop("x-accel-buffering", None)
            response = EventStreamResponse(
                self._relay(upstream_response, frames, first, usage, started, hide_usage),
                keep_alive_s=self.settings.keep_alive_s,
                headers=out_headers,
                on_close=on_close,
                keep_alive_first=not first.done(),  # headers now; the first frame follows
                stop=self.drain,
                stop_frame=deadline_frame(),
            )
            handed_over = True
            return response
        except APIError as exc:
            span.error(exc)
            raise
        finally:
            if not handed_over:
                if isinstance(first, asyncio.Future):
                    first.cancel()
                if upstream_response is not None:
                    await upstream_response.aclose()
                if call is not None:
                    call.release()
                _settle(held, usage)
                self.metrics.count_tokens(caller.plan, usage.prompt, usage.completion)
                span.end(
                    response_id=usage.response_id, input_tokens=usage.prompt, output_tokens=usage.completion
                )
                await held.close()

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
    ) -> tuple[_Call, httpx.Response, bytes | asyncio.Future[bytes], AsyncIterator[bytes]]:
        """Send to the least-loaded healthy replica, failing over until one answers.

        Returns the call, the response, and: for a 200 stream, the future of its first SSE frame
        (awaited up to keep_alive_s here, so a replica that dies before that is retried elsewhere;
        a slower first frame is awaited by the relay behind a keep-alive); otherwise the whole body.
        """
        tried: set[str] = set()
        last: tuple[_Call, httpx.Response, bytes, AsyncIterator[bytes]] | None = None
        reprobed = False
        while True:
            up = self.pool.pick(
                model, tried, affinity, self.settings.route_affinity_tokens, num_prompt_tokens
            )
            if up is None and not reprobed and last is None:
                reprobed = True
                await self.pool.reprobe()
                continue
            if up is None:
                if last is not None:
                    return last
                self.metrics.refused("unavailable")
                raise APIError(
                    ErrorKind.UNAVAILABLE,
                    "No healthy upstream replica could take the request.",
                    retry_after_s=1.0,
                )
            tried.add(up.url)
            call = _Call(up, tokens)
            response: httpx.Response | None = None
            first: asyncio.Future[bytes] | None = None
            try:
                req = self.pool.client.build_request("POST", up.url + path, content=content, headers=headers)
                response = await self.pool.client.send(req, stream=True)
                if response.status_code == 200 and stream:
                    frames = _frames(response)
                    first = asyncio.ensure_future(frames.__anext__())
                    done, _ = await asyncio.wait({first}, timeout=self.settings.keep_alive_s)
                    if done:
                        first.result()  # a replica that failed already: try another
                    return call, response, first, frames
                payload = await response.aread()
                await response.aclose()
                if response.status_code in RETRY_STATUSES:
                    if response.headers.get(DRAINING_HEADER):
                        self.pool.mark_down(up, "draining")
                    if last is not None:
                        last[0].release()
                    last = (call, response, payload, _no_frames())
                    continue
                return call, response, payload, _no_frames()
            except (httpx.HTTPError, _UpstreamEnded, StopAsyncIteration) as exc:
                call.release()
                if response is not None:
                    await response.aclose()
                self.pool.mark_down(up, f"{type(exc).__name__}: {exc}")
                logger.warning("upstream %s failed before the first byte; trying another", up.url)
            except BaseException:
                call.release()
                if first is not None:
                    first.cancel()
                if response is not None:
                    await response.aclose()
                raise

    async def _relay(
        self,
        response: httpx.Response,
        frames: AsyncIterator[bytes],
        first: asyncio.Future[bytes],
        usage: _Usage,
        started: float,
        hide_usage: bool,
    ) -> AsyncIterator[bytes]:
        """The replica's frames to the client, observed for usage and latency; `hide_usage` drops
        the usage-only chunk that the gateway asked for on the client's behalf."""
        last_token: float | None = None
        try:
            frame = await first
            while True:
                if frame == DONE:
                    yield DONE
                    return
                if usage.observe(frame):
                    now = time.perf_counter()
                    if last_token is None:
                        self.metrics.ttft.observe(now - started)
                        self.metrics.queue_time.observe(now - started)
                        usage.span.first_token(now - started)
                    else:
                        self.metrics.itl.observe(now - last_token)
                    last_token = now
                if not (hide_usage and usage.usage_only):
                    yield frame
                frame = await frames.__anext__()
        except (httpx.HTTPError, _UpstreamEnded, StopAsyncIteration) as exc:
            logger.warning("upstream %s failed mid-stream: %r", response.request.url, exc)
            usage.span.set("error.type", "upstream_failed_mid_stream")
            yield sse_error_event(
                APIError(
                    ErrorKind.UNAVAILABLE,
                    "The engine replica serving this request failed mid-stream; retry the request.",
                )
            )
            yield DONE
        finally:
            first.cancel()
            await frames.aclose()


class _UpstreamEnded(Exception):
    """The replica's stream ended without `[DONE]`."""


async def _frames(response: httpx.Response) -> AsyncIterator[bytes]:
    """Complete SSE frames (`data: ...\\n\\n`) from a replica's stream; comments are dropped."""
    lines: list[str] = []
    async for line in response.aiter_lines():
        if line == "":
            if lines:
                yield ("\n".join(lines) + "\n\n").encode()
                lines = []
            continue
        if line.startswith(":"):
            continue  # keep-alive; ours are sent by our own EventStreamResponse
        lines.append(line)
    raise _UpstreamEnded("the stream ended without [DONE]")


async def _no_frames() -> AsyncIterator[bytes]:
    return
    yield b""


class _Usage:
    """Tokens, response id and finish reasons, read from what the replica sends back."""

    def __init__(self, num_prompt: int, span: telemetry.ChatSpan) -> None:
        self.prompt = num_prompt
        self.completion = 0
        self.response_id: str | None = None
        self.span = span
        self._reported = False
        self.usage_only = False  # the last frame observed carried usage and no choices

    def observe_body(self, payload: bytes) -> None:
        try:
            body = json.loads(payload)
            self.response_id = str(body.get("id")) if body.get("id") else None
            for choice in body.get("choices") or ():
                self.span.finish_reason(int(choice.get("index", 0)), choice.get("finish_reason"))
            u = body["usage"]
            self.prompt = int(u["prompt_tokens"])
            self.completion = int(u.get("completion_tokens", 0))  # embeddings have none
        except (ValueError, KeyError, TypeError, AttributeError):
            pass

    def observe(self, frame: bytes) -> bool:
        """Account one data frame; True if it carried generated text."""
        try:
            event = json.loads(frame[len(b"data: ") :])
        except ValueError:
            return False
        if not isinstance(event, dict):
            return False
        if self.response_id is None and event.get("id"):
            self.response_id = str(event["id"])
        u = event.get("usage")
        self.usage_only = isinstance(u, dict) and not event.get("choices")
        if isinstance(u, dict):
            self.prompt = int(u.get("prompt_tokens", self.prompt))
            self.completion = int(u.get("completion_tokens", self.completion))
            self._reported = True
        carried = False
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if choice.get("finish_reason"):
                self.span.finish_reason(int(choice.get("index", 0)), str(choice["finish_reason"]))
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("tool_calls") or choice.get("text"):  # tool calls count too
                carried = True
                if not self._reported:
                    self.completion += 1  # one token per chunk: an estimate, corrected by usage
        return carried


def _settle(held: admission.Admission, usage: _Usage) -> None:
    held.record(num_prompt_tokens=usage.prompt, num_completion_tokens=usage.completion)


def _inject_trace_context(headers: dict[str, str]) -> None:
    """W3C traceparent for the replica, when OpenTelemetry is on (see gateway/telemetry.py)."""
    try:
        from opentelemetry import propagate
    except ImportError:
        return
    propagate.inject(headers)


def _span(operation: str, req: Any, caller: admission.Caller, messages: Any) -> telemetry.ChatSpan:
    return telemetry.ChatSpan(
        operation,
        req.model,
        max_tokens=req.requested_max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        tenant=caller.name,
        priority=caller.priority.name.lower(),
        messages=messages,
    )


def create_proxy_app(
    settings: Settings, tenancy: Any | None = None, *, owns_tenancy: bool = False
) -> Starlette:
    from gateway.app import build_starlette

    gateway = ProxyGateway(settings, tenancy, owns_tenancy)
    return build_starlette(gateway, Route("/v1/internal/upstreams", gateway.upstreams, methods=["GET"]))
