"""gateway.telemetry: off unless OTEL_* asks; the GenAI span's attributes; content only on opt-in."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway import telemetry


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
    ],
)
def test_tracing_is_on_only_when_asked(env: dict[str, str], expected: bool) -> None:
    assert telemetry.wanted(env) is expected


def test_disabled_span_is_a_no_op() -> None:
    assert not telemetry.enabled()
    span = telemetry.ChatSpan(
        "chat", "m", max_tokens=1, temperature=None, top_p=None, tenant="t", priority="paid"
    )
    assert not span.recording
    span.event("x")
    span.first_token(0.1)
    with span.use():
        pass
    span.end(response_id="id", input_tokens=1, output_tokens=1)
    assert telemetry.asgi_middleware() == []


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(telemetry, "_enabled", True)
    monkeypatch.setattr("opentelemetry.trace.get_tracer", lambda name, *a, **k: provider.get_tracer(name))
    return exporter


@pytest.mark.parametrize("capture", [False, True])
def test_chat_span_attributes_and_content_opt_in(
    exporter: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch, capture: bool
) -> None:
    if capture:
        monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "true")
    else:
        monkeypatch.delenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", raising=False)
    span = telemetry.ChatSpan(
        "chat",
        "tiny",
        max_tokens=7,
        temperature=0.2,
        top_p=0.5,
        tenant="acme",
        priority="free",
        messages=[{"role": "user", "content": "top secret"}],
    )
    span.event("gen_ai.admission")
    span.first_token(0.01)
    span.finish_reason(0, "stop")
    span.end(response_id="chatcmpl-1", input_tokens=3, output_tokens=5)
    (finished,) = exporter.get_finished_spans()
    a = dict(finished.attributes)
    assert finished.name == "chat tiny"
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "batchgate"
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"], a["gen_ai.request.top_p"]) == (
        7,
        0.2,
        0.5,
    )
    assert a["gen_ai.response.id"] == "chatcmpl-1"
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("stop",)
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (3, 5)
    assert (a["batchgate.tenant"], a["batchgate.priority"]) == ("acme", "free")
    names = [e.name for e in finished.events]
    assert names == ["gen_ai.admission", "gen_ai.queue_wait", "gen_ai.first_token", "gen_ai.completion"]
    assert ("top secret" in a.get("gen_ai.input.messages", "")) is capture
