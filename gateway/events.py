"""Usage events: one record per settled request, for a billing pipeline: JSON lines in a file
to tail, and/or OpenTelemetry log records sent over OTLP/HTTP.

    --usage-events-file /var/log/batchgate/usage.jsonl
    --usage-events-exporter otlp      # OTEL_EXPORTER_OTLP_(LOGS_)ENDPOINT, as the traces

Each admitted request that the gateway settles (tenancy on; not the replicas of a pool, whose
gateway settles) is written once, when it ends, with what the ledger was charged: request id,
tenant, key id, model, input (cached included), cached and output tokens, cost in micro-dollars,
whether it was served, and its start and end (Unix seconds); and, where the request named its
end user (OpenAI's `user`, Anthropic's `metadata.user_id`), `user`. The file is appended to, line
by line (a reader never sees half a line); rotate it with copytruncate.
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO

EVENT_NAME = "batchgate.usage"


@dataclass(frozen=True)
class UsageEvent:
    request_id: str
    tenant: str
    key_id: str
    model: str
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    cost_micros: int
    status: str  # "served" (charged what it used) or "not_served" (refunded whole)
    started_at: float
    ended_at: float
    user: str | None = None  # the end user the request named; left out of the record when none

    def fields(self) -> dict[str, Any]:
        """The record's fields, `user` only where there is one."""
        fields = asdict(self)
        if self.user is None:
            del fields["user"]
        return fields


class UsageEvents:
    """Appends events to a JSON-lines file (one process)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = self.path.open("a", encoding="utf-8", buffering=1)
        self._lock = threading.Lock()

    def write(self, event: UsageEvent) -> None:
        line = json.dumps(event.fields(), separators=(",", ":")) + "\n"
        with self._lock:
            self._file.write(line)

    def close(self) -> None:
        with self._lock:
            self._file.close()


class UsageSink(Protocol):
    def write(self, event: UsageEvent) -> None: ...

    def close(self) -> None: ...


class OTLPUsageEvents:
    """Sends events as OpenTelemetry log records through the OTLP/HTTP exporter (the traces'
    transport: endpoint, headers and timeout from the `OTEL_EXPORTER_OTLP_*` variables)."""

    def __init__(self, service_name: str = "batchgate") -> None:
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
        from opentelemetry.sdk._logs import LoggerProvider
        from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
        from opentelemetry.sdk.resources import Resource

        self._provider = LoggerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_log_record_processor(BatchLogRecordProcessor(OTLPLogExporter()))
        self._logger = self._provider.get_logger(EVENT_NAME)

    def write(self, event: UsageEvent) -> None:
        fields = event.fields()
        self._logger.emit(
            timestamp=int(event.ended_at * 1e9),
            body=json.dumps(fields, separators=(",", ":")),
            attributes={f"batchgate.{k}": v for k, v in fields.items()},
            event_name=EVENT_NAME,
        )

    def close(self) -> None:
        self._provider.shutdown()  # flushes what is batched


class Sinks:
    """Every configured sink, written in turn."""

    def __init__(self, sinks: list[UsageSink]) -> None:
        self.sinks = sinks

    def write(self, event: UsageEvent) -> None:
        for sink in self.sinks:
            sink.write(event)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def build_sinks(events_file: str | None, exporter: str, environ: Any = None) -> Sinks | None:
    """The sinks `--usage-events-file` and `--usage-events-exporter` ask for; None for none."""
    import os

    env = os.environ if environ is None else environ
    sinks: list[UsageSink] = []
    if events_file:
        sinks.append(UsageEvents(events_file))
    if exporter == "otlp":
        sinks.append(OTLPUsageEvents(env.get("OTEL_SERVICE_NAME") or "batchgate"))
    return Sinks(sinks) if sinks else None
