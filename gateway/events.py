"""Usage events: one JSON line per settled request, for a billing pipeline to tail.

    --usage-events-file /var/log/batchgate/usage.jsonl

Each admitted request that the gateway settles (tenancy on; not the replicas of a pool, whose
gateway settles) is written once, when it ends, with what the ledger was charged: request id,
tenant, key id, model, input (cached included), cached and output tokens, cost in micro-dollars,
whether it was served, and its start and end (Unix seconds). The file is appended to, line by
line (a reader never sees half a line); rotate it with copytruncate.
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO


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


class UsageEvents:
    """Appends events to a JSON-lines file (one process)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = self.path.open("a", encoding="utf-8", buffering=1)
        self._lock = threading.Lock()

    def write(self, event: UsageEvent) -> None:
        line = json.dumps(asdict(event), separators=(",", ":")) + "\n"
        with self._lock:
            self._file.write(line)

    def close(self) -> None:
        with self._lock:
            self._file.close()
