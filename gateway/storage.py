"""The storage directory's SQLite files: one way to open them, shared by every embedded store
(stored responses, batch records, LoRA adapter records)."""

from __future__ import annotations

import sqlite3
from pathlib import Path


def connect(path: Path | None) -> sqlite3.Connection:
    """An embedded store's SQLite file (its directory created; WAL, so readers never wait on a
    writer), or an in-memory database; used from worker threads behind the store's own lock."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(str(path) if path is not None else ":memory:", check_same_thread=False)
    with db:
        db.execute("PRAGMA journal_mode=WAL")
    return db
