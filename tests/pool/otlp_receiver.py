"""A tiny OTLP/HTTP (protobuf) receiver for tests: collects spans and log records from any process."""

from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    attributes: dict[str, Any]
    events: list[str] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace id, span id) of each link


@dataclass
class ReceivedLog:
    service: str
    event_name: str
    body: Any
    attributes: dict[str, Any]
    time_unix_nano: int


class OTLPReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.logs: list[ReceivedLog] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path == "/v1/traces":
                    receiver._add(ExportTraceServiceRequest.FromString(body))
                    reply = ExportTraceServiceResponse().SerializeToString()
                elif self.path == "/v1/logs":
                    receiver._add_logs(ExportLogsServiceRequest.FromString(body))
                    reply = ExportLogsServiceResponse().SerializeToString()
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _add(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(
                        ReceivedSpan(
                            service=str(resource.get("service.name", "")),
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            kind=s.kind,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            events=[e.name for e in s.events],
                            links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                        )
                    )
        with self._lock:
            self.spans.extend(spans)

    def _add_logs(self, request: ExportLogsServiceRequest) -> None:
        logs = []
        for rl in request.resource_logs:
            resource = {a.key: _value(a.value) for a in rl.resource.attributes}
            for sl in rl.scope_logs:
                for r in sl.log_records:
                    logs.append(
                        ReceivedLog(
                            service=str(resource.get("service.name", "")),
                            event_name=r.event_name,
                            body=_value(r.body),
                            attributes={a.key: _value(a.value) for a in r.attributes},
                            time_unix_nano=r.time_unix_nano,
                        )
                    )
        with self._lock:
            self.logs.extend(logs)

    def _poll(self, items: list[Any], predicate: Any, timeout_s: float, what: str) -> list[Any]:
        """Poll (bounded) until `predicate(a copy of items)` is true; returns that copy."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                got = list(items)
            if predicate(got):
                return got
            assert time.monotonic() < deadline, f"{what} not received in {timeout_s}s: {got!r:.2000}"
            time.sleep(0.05)

    def wait_for_logs(self, predicate: Any, timeout_s: float = 30.0) -> list[ReceivedLog]:
        return self._poll(self.logs, predicate, timeout_s, "log records")

    def wait_for(self, predicate: Any, timeout_s: float = 30.0) -> list[ReceivedSpan]:
        return self._poll(self.spans, predicate, timeout_s, "spans")

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
