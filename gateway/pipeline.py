"""The one request pipeline: every model endpoint, every backend, one path from start to end.

    read body -> parse (400) -> authenticate (401) -> resolve the model (404) -> [stateful
      endpoints: resolve stored state (404)] -> backend.plan: model checks, tokens (400; 503
      while loading) -> admit (429) -> plan.execute [and store the answer; or, `background`,
      run on without the client] -> respond or stream -> close: settle usage, release the hold,
      end the span, count the tokens

Authentication comes before the model is looked up, so an anonymous caller learns nothing of
what the server serves. What an endpoint adds is only its request model and span (gateway/
endpoints.py); what a backend adds is how it runs the request (gateway/backend.py). The
pipeline owns the request's lifetime: `Lifetime.close()` runs once on every path (a whole
response, an error, a client gone before or during the answer, a backend failing before the
first byte or mid-stream), and releases everything: the backend's resources first, then the
tenant's hold, settled with the tokens used (none when no answer was produced).

The settlement is sent, not waited for (tenancy.redis_limiter): a whole answer's bytes and a
stream's `[DONE]` go out after it is on its way, so whatever this gateway admits or reads after
the client has its answer sees it (docs/OPERATIONS.md, "Settlement and what a client sees").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Mapping
from typing import TYPE_CHECKING, Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway import admission
from gateway.backend import APIRequest, Body, Call, Endpoint, Plan, Reply, State, Usage, Work, new_id
from gateway.body import read_json, unless_disconnected
from gateway.drain import Drain, deadline_error
from gateway.errors import OPENAI, APIError, Dialect, ErrorKind
from gateway.events import UsageEvent, build_sinks
from gateway.metrics import Metrics
from gateway.registry import ModelRegistry
from gateway.reports import Report, Reports
from gateway.settings import Settings
from gateway.sse import EventStreamResponse
from gateway.telemetry import ChatSpan

if TYPE_CHECKING:
    from tenancy.service import Tenancy

logger = logging.getLogger("batchgate.gateway")

# What a client that left gets in the access log (nginx's "client closed request").
CLIENT_CLOSED_REQUEST = 499


class Pipeline:
    """Runs one endpoint's requests against the registry's backends (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        registry: ModelRegistry,
        tenancy: Tenancy | None,
        metrics: Metrics,
        drain: Drain,
        state: State | None = None,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.tenancy = tenancy
        self.metrics = metrics
        self.drain = drain
        self.reports = Reports()  # usage kept for gateways in front (pool mode; gateway/reports.py)
        self.events = build_sinks(settings.usage_events_file, settings.usage_events_exporter)
        self.state = state

    async def authenticate(
        self, headers: Mapping[str, str], user: str | None, dialect: Dialect = OPENAI
    ) -> admission.Caller:
        """A gateway in front of this replica already authenticated and admitted the request (its
        internal token says so); else the tenant of the API key (where the request's protocol
        takes it: `dialect`), or the open caller."""
        internal = admission.internal_caller(self.settings.internal_token, headers, user)
        if internal is not None:
            return internal
        return await admission.authenticate(self.tenancy, dialect.authorization(headers), user)

    async def _admitted(
        self,
        endpoint: Endpoint,
        req: APIRequest,
        body: dict[str, Any],
        caller: admission.Caller,
        http: Request | None,
        request_id: str | None = None,
        cached: Mapping[str, tuple[dict[str, Any], ...]] | None = None,
        batch: bool | None = None,
    ) -> Lifetime:
        """Resolve, plan and admit one parsed request: its lifetime, to execute then close
        (`batch`: settled at the batch price; by default when there is no `http` connection)."""
        served = await self.registry.resolve(req.model, endpoint, caller)
        request_id = request_id or new_id(endpoint.id_prefix)
        work = Work(endpoint, req, _as_served(body, served.name), caller, served.name, request_id, cached)
        state = self.state if endpoint.stateful else None
        try:
            if state is not None:
                await state.prepare(work)
            plan = await served.backend.plan(work)
        except APIError as exc:
            self._refused(exc)
            raise
        if state is not None:
            plan = state.wrap(work, plan)
        batch = http is None if batch is None else batch
        lifetime = Lifetime(self, work, plan, endpoint.span(work), http, batch)
        await lifetime.admit()
        return lifetime

    async def start_turn(
        self,
        endpoint: Endpoint,
        body: dict[str, Any],
        caller: admission.Caller,
        cached: Mapping[str, tuple[dict[str, Any], ...]] | None = None,
    ) -> tuple[Lifetime, Reply]:
        """One turn of a WebSocket (gateway/responses/websocket.py): `handle`'s path for a body
        that came in a frame from an authenticated `caller`, at the interactive price. The caller
        sends the reply, then settles (`settle_if_final`) and closes the lifetime, once, on every
        path; APIError for a turn refused before it ran (nothing is held then)."""
        req = endpoint.parse(body)
        lifetime = await self._admitted(endpoint, req, body, caller, None, cached=cached, batch=False)
        try:
            return lifetime, await lifetime.call_plan()
        except APIError as exc:
            self._refused(exc)
            lifetime.span.error(exc)
            await lifetime.close()
            raise
        except BaseException:
            await lifetime.close()
            raise

    async def answer(
        self,
        endpoint: Endpoint,
        body: dict[str, Any],
        caller: admission.Caller,
        request_id: str,
        *,
        cached: Mapping[str, tuple[dict[str, Any], ...]] | None = None,
        batch: bool = True,
    ) -> Body:
        """One request with no client connection (a Batch API line; a compaction's summary,
        `batch` False): the same path as `handle`, settled at the batch price unless not `batch`,
        answered whole (`stream` is refused before this); APIError for what a client would have
        been answered with an error."""
        req = endpoint.parse(body)
        lifetime = await self._admitted(endpoint, req, body, caller, None, request_id, cached, batch)
        try:
            reply = await lifetime.call_plan()
            if not isinstance(reply, Body):
                raise APIError(ErrorKind.INTERNAL, "A batch line was answered with a stream.")
            return reply
        except APIError as exc:
            self._refused(exc)
            lifetime.span.error(exc)
            raise
        finally:
            await lifetime.close()

    async def handle(self, endpoint: Endpoint, http: Request) -> Response:
        body = await read_json(http, self.settings.max_body_bytes)
        req = endpoint.parse(body)
        caller = await self.authenticate(http.headers, req.user, endpoint.dialect)
        lifetime = await self._admitted(endpoint, req, body, caller, http)
        work, span = lifetime.call.work, lifetime.span
        handed_over = False
        try:
            state = self.state if endpoint.stateful else None
            if state is not None and state.in_background(work):
                handed_over = True  # the background run closes the lifetime when it ends
                return await state.run_in_background(work, lifetime.plan, lifetime.call, lifetime.close)
            reply = await unless_disconnected(http, lifetime.call_plan())
            if reply is None:
                logger.info("%s: client disconnected before the answer; ended", work.request_id)
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            # Header names are case-insensitive: merge them lower-cased (a replica's own request id,
            # the id of the response it made, wins over ours).
            headers = _merge({"x-request-id": work.request_id}, reply.headers, lifetime.headers)
            if isinstance(reply, Body):
                if isinstance(reply.payload, bytes):
                    return Response(
                        reply.payload, reply.status, headers=headers, media_type="application/json"
                    )
                return JSONResponse(reply.payload, reply.status, headers=headers)
            dialect = endpoint.dialect
            response = EventStreamResponse(
                reply.frames,
                keep_alive_s=self.settings.keep_alive_s,
                headers=headers,
                on_close=lifetime.close,
                before_done=lifetime.settle_if_final,
                keep_alive_first=not reply.ready,
                stop=self.drain,
                stop_frame=reply.stop_frame or (lambda: dialect.error_event(deadline_error())),
                end_frame=dialect.end_frame,
                stop_end_frame=dialect.end_frame if dialect.end_after_error else b"",
            )
            handed_over = True  # the response closes the lifetime when the stream ends
            return response
        except APIError as exc:
            self._refused(exc)
            span.error(exc)
            exc.headers = _merge({"x-request-id": work.request_id}, lifetime.headers, exc.headers)
            raise
        finally:
            if not handed_over:
                await lifetime.close()

    async def count(self, endpoint: Endpoint, http: Request) -> int:
        """The prompt tokens a request would hold here, as `handle` plans it, without running it:
        a gateway in front asks (`POST /v1/internal/count`) so that a hard budget holds the exact
        prompt, not its estimate. Only for a gateway (its internal token), and only for
        endpoints without stored state."""
        closed = admission.has_tenants(self.tenancy)
        admission.check_internal(self.settings.internal_token, http.headers, closed=closed)
        body = await read_json(http, self.settings.max_body_bytes)
        req = endpoint.parse(body)
        caller = await self.authenticate(http.headers, req.user, endpoint.dialect)
        served = await self.registry.resolve(req.model, endpoint)
        request_id = new_id(endpoint.id_prefix)
        work = Work(endpoint, req, _as_served(body, served.name), caller, served.name, request_id)
        plan = await served.backend.plan(work)
        return plan.num_prompt_tokens

    def _refused(self, exc: APIError) -> None:
        if exc.refusal is not None:
            self.metrics.refused(exc.refusal)


def _as_served(body: dict[str, Any], name: str) -> dict[str, Any]:
    """The body a replica gets: the model a name's alias resolved to (gateway/registry.py)."""
    return body if body.get("model") == name else {**body, "model": name}


def _merge(*layers: Mapping[str, str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for layer in layers:
        out.update((k.lower(), v) for k, v in layer.items())
    return out


class Lifetime:
    """One request from admission to its end: the tenant's hold, the backend's call, the span.
    `batch`: a Batch API line (no connection; settled at the batch price)."""

    def __init__(
        self, pipeline: Pipeline, work: Work, plan: Plan, span: ChatSpan, http: Request | None, batch: bool
    ) -> None:
        self._pipeline = pipeline
        self.plan = plan
        self.span = span
        self._batch = batch
        self._held: admission.Admission | None = None
        self._settled: tuple[int, int, int] | None = None  # (prompt, completion, cached) settled
        self._closed = False
        self._started_at = time.time()
        self.headers: dict[str, str] = {}
        self.call = Call(work, Usage(plan.num_prompt_tokens), span, http, pipeline.settings.keep_alive_s)

    @property
    def work(self) -> Work:
        return self.call.work

    async def admit(self) -> None:
        work = self.call.work
        caller = work.caller
        try:
            self._held = await admission.admit(
                None if caller.internal else self._pipeline.tenancy,
                caller,
                num_prompt_tokens=self.plan.num_prompt_tokens,
                max_num_tokens=self.plan.max_num_tokens,
                request_id=work.request_id,
                model=work.model,
                batch=self._batch,
            )
        except APIError as exc:
            self._pipeline._refused(exc)
            if exc.budget is not None:
                self._pipeline.metrics.budget_refused(caller.plan, *exc.budget)
            self.span.event("gen_ai.admission", **{"batchgate.admitted": False})
            self.span.error(exc)
            self.span.end(
                response_id=work.request_id, input_tokens=self.plan.num_prompt_tokens, output_tokens=0
            )
            raise
        self.span.event("gen_ai.admission", **{"batchgate.admitted": True})
        self.headers = dict(self._held.headers)

    def call_plan(self) -> Awaitable[Reply]:
        return self.plan.execute(self.call)

    @property
    def served(self) -> bool:
        """Whether the request is charged: it was answered and generated (counting does not)."""
        return self.call.usage.served and not self.call.work.endpoint.count_only

    def settle(self) -> tuple[int, int, int]:
        """Send the hold's settlement with the tokens used as they stand (all refunded when
        nothing was served), once; the (prompt, completion, cached) tokens settled."""
        if self._settled is None:
            usage = self.call.usage
            # Counting generates nothing: its hold is refunded whole, however it was answered.
            served = self.served
            num_prompt = usage.num_prompt_tokens if served else 0
            num_completion = usage.num_completion_tokens if served else 0
            num_cached = min(usage.num_cached_tokens, num_prompt) if served else 0
            self._settled = (num_prompt, num_completion, num_cached)
            if self._held is not None:
                if served:
                    self._held.record(
                        num_prompt_tokens=num_prompt,
                        num_completion_tokens=num_completion,
                        num_cached_tokens=num_cached,
                    )
                self._held.settle()
        return self._settled

    def settle_if_final(self) -> None:
        """At a stream's `[DONE]`: settle now if the usage is final (else `close` settles, after
        the backend's release has corrected it)."""
        if self.call.usage.final:
            self.settle()

    async def close(self) -> None:
        """Release everything, once: the backend's resources, then the hold settled (if
        `settle` has not been already: a stream's `[DONE]`), the token metrics and the span."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            await self.call.release()
            num_prompt, num_completion, num_cached = self.settle()
            usage = self.call.usage
            caller = self.call.work.caller
            if self._held is not None:
                cost = self._held.cost(num_prompt, num_cached, num_completion)
                self._pipeline.metrics.count_spend(caller.plan, cost)
                if self._pipeline.events is not None and caller.tenant is not None:
                    self._pipeline.events.write(
                        UsageEvent(
                            request_id=self.call.work.request_id,
                            tenant=caller.tenant.name,
                            key_id=caller.key_id,
                            model=self.call.work.model,
                            input_tokens=num_prompt,
                            cached_tokens=num_cached,
                            output_tokens=num_completion,
                            cost_micros=cost,
                            status="served" if self.served else "not_served",
                            started_at=self._started_at,
                            ended_at=time.time(),
                            user=self.call.work.request.user,
                        )
                    )
            if caller.internal and caller.upstream_request_id:
                report = Report(num_prompt, num_cached, num_completion)
                self._pipeline.reports.put(caller.upstream_request_id, report)
            self._pipeline.metrics.count_tokens(caller.plan, num_prompt, num_completion)
            self.span.end(
                response_id=usage.response_id or self.call.work.request_id,
                input_tokens=num_prompt,
                output_tokens=num_completion,
            )
