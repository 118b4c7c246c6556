"""OpenTelemetry traces, configured by the standard `OTEL_*` variables; off unless asked for.

Tracing is on when `OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
`OTEL_TRACES_EXPORTER` (other than `none`) is set and `OTEL_SDK_DISABLED` is not `true`.
`batchgate serve` then installs a TracerProvider with a BatchSpanProcessor (tuned by
`OTEL_BSP_*`) and the OTLP exporter (http/protobuf; endpoint, headers, timeout from `OTEL_*`),
and the app gets:

- the HTTP server span (opentelemetry-instrumentation-asgi), which also continues an incoming
  W3C `traceparent`, so a replica's spans join the gateway's trace;
- a `chat {model}` (or `text_completion {model}`) span with the GenAI semantic-convention
  attributes, `batchgate.tenant` and `batchgate.priority`, and events `gen_ai.admission`,
  `gen_ai.queue_wait`, `gen_ai.first_token` and `gen_ai.completion`;
- in gateway-only mode, client spans on the calls to replicas (opentelemetry-instrumentation-httpx),
  which carry `traceparent` across the hop.

Prompt text is recorded (`gen_ai.input.messages`) only when
`OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true`; completion text is never recorded.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

PROVIDER_NAME = "batchgate"
_enabled = False
# The span the request spans started here link to (a Batch API run's span), or None.
_batch: contextvars.ContextVar[Any] = contextvars.ContextVar("batchgate_batch_span", default=None)


def wanted(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    return bool(
        exporter
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
        or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    )


def enabled() -> bool:
    return _enabled


def capture_content() -> bool:
    return os.environ.get("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "").strip().lower() == "true"


def setup(environ: Mapping[str, str] | None = None) -> bool:
    """Install the process's TracerProvider when the OTEL_* variables ask for traces; idempotent."""
    global _enabled
    if _enabled:
        return True
    if not wanted(environ):
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError as exc:
        logger.warning("OTEL_* variables are set but OpenTelemetry is not installed (%s); no traces", exc)
        return False
    env = os.environ if environ is None else environ
    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME") or "batchgate"})
    provider = TracerProvider(resource=resource)  # the sampler comes from OTEL_TRACES_SAMPLER
    exporters = [e.strip() for e in (env.get("OTEL_TRACES_EXPORTER") or "otlp").lower().split(",")]
    for name in exporters:
        if name == "otlp":
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif name and name != "none":
            logger.warning("OTEL_TRACES_EXPORTER=%s is not supported here (otlp, console); ignored", name)
    trace.set_tracer_provider(provider)
    _enabled = True
    logger.info("OpenTelemetry tracing on (exporters: %s)", ", ".join(exporters))
    return True


def shutdown() -> None:
    """Flush spans still buffered (called when the server stops)."""
    if not _enabled:
        return
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    flush = getattr(provider, "shutdown", None)
    if flush is not None:
        flush()


def asgi_middleware() -> list[Any]:
    """The server-span middleware for `Starlette(middleware=...)`, when tracing is on."""
    if not _enabled:
        return []
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
    from starlette.middleware import Middleware

    return [Middleware(OpenTelemetryMiddleware, excluded_urls="health,ready,metrics,v1/internal")]


def instrument_client(client: Any) -> None:
    """Client spans and `traceparent` on an httpx.AsyncClient, when tracing is on."""
    if not _enabled:
        return
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor

    HTTPXClientInstrumentor().instrument_client(client)


@contextlib.contextmanager
def batch_span(batch_id: str, tenant: str, endpoint: str) -> Iterator[None]:
    """While inside (and in the tasks started inside), a `batch {id}` span is open, a root of its
    own trace, and each request span starts a new trace with a link to it: one line's trace per
    line, all reachable from the batch's. A no-op when tracing is off."""
    if not _enabled:
        yield
        return
    from opentelemetry import context, trace

    attributes = {"batchgate.batch_id": batch_id, "batchgate.tenant": tenant, "batchgate.endpoint": endpoint}
    tracer = trace.get_tracer("batchgate.gateway")
    span = tracer.start_span(f"batch {batch_id}", context=context.Context(), attributes=attributes)
    token = _batch.set(span)
    try:
        yield
    except BaseException as exc:
        span.set_attribute("error.type", type(exc).__name__)
        raise
    finally:
        _batch.reset(token)
        span.end()


class ChatSpan:
    """The GenAI span of one request; every method is a no-op when tracing is off."""

    def __init__(
        self,
        operation: str,
        model: str,
        *,
        max_tokens: int | None,
        temperature: float | None,
        top_p: float | None,
        tenant: str,
        priority: str,
        messages: Sequence[Any] | None = None,
    ) -> None:
        self._span: Any = None
        self._ended = False
        self.finish_reasons: dict[int, str] = {}
        self.first_token_seen = False
        if not _enabled:
            return
        from opentelemetry import trace

        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": PROVIDER_NAME,
            "gen_ai.request.model": model,
            "batchgate.tenant": tenant,
            "batchgate.priority": priority,
        }
        if max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = int(max_tokens)
        if temperature is not None:
            attributes["gen_ai.request.temperature"] = float(temperature)
        if top_p is not None:
            attributes["gen_ai.request.top_p"] = float(top_p)
        if messages is not None and capture_content():
            attributes["gen_ai.input.messages"] = json.dumps(list(messages), ensure_ascii=False, default=str)
        tracer = trace.get_tracer("batchgate.gateway")
        batch = _batch.get()
        if batch is None:
            self._span = tracer.start_span(
                f"{operation} {model}", kind=trace.SpanKind.INTERNAL, attributes=attributes
            )
        else:  # a batch line: a trace of its own, linked to the batch's span
            from opentelemetry import context

            self._span = tracer.start_span(
                f"{operation} {model}",
                context=context.Context(),
                kind=trace.SpanKind.INTERNAL,
                attributes=attributes,
                links=[trace.Link(batch.get_span_context())],
            )

    @property
    def recording(self) -> bool:
        return self._span is not None

    def use(self) -> Any:
        """A context manager making this span current (for child spans, e.g. httpx calls)."""
        if self._span is None:
            import contextlib

            return contextlib.nullcontext()
        from opentelemetry import trace

        return trace.use_span(self._span, end_on_exit=False)

    def event(self, name: str, **attributes: Any) -> None:
        if self._span is not None:
            self._span.add_event(name, attributes=attributes)

    def first_token(self, queue_s: float) -> None:
        if self.first_token_seen:
            return
        self.first_token_seen = True
        self.event("gen_ai.queue_wait", **{"batchgate.queue_time_s": queue_s})
        self.event("gen_ai.first_token", **{"batchgate.time_to_first_token_s": queue_s})

    def finish_reason(self, index: int, reason: str | None) -> None:
        if reason:
            self.finish_reasons[index] = reason

    def set(self, name: str, value: Any) -> None:
        if self._span is not None and value is not None:
            self._span.set_attribute(name, value)

    def error(self, exc: BaseException) -> None:
        if self._span is None:
            return
        from opentelemetry.trace import Status, StatusCode

        code = getattr(exc, "kind", None)
        self._span.set_attribute("error.type", str(getattr(code, "value", type(exc).__name__)))
        self._span.set_status(Status(StatusCode.ERROR, str(exc)[:200]))

    def end(self, *, response_id: str | None, input_tokens: int, output_tokens: int) -> None:
        if self._span is None or self._ended:
            return
        self._ended = True
        span = self._span
        if response_id:
            span.set_attribute("gen_ai.response.id", response_id)
        if self.finish_reasons:
            span.set_attribute(
                "gen_ai.response.finish_reasons",
                [self.finish_reasons[i] for i in sorted(self.finish_reasons)],
            )
        span.set_attribute("gen_ai.usage.input_tokens", int(input_tokens))
        span.set_attribute("gen_ai.usage.output_tokens", int(output_tokens))
        span.add_event("gen_ai.completion", attributes={"gen_ai.usage.output_tokens": int(output_tokens)})
        span.end()
