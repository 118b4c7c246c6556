"""The records of the Batch API, per tenant, behind one interface (`BatchStore`): file metadata,
batch objects, each batch's journal and its runner lease. `SQLiteBatchStore` keeps them in one
SQLite file (`batches.sqlite3` in `--storage-dir`; in memory without one) for a single gateway;
`RedisBatchStore` (gateway/batches/redis_store.py, with `--redis-url`) in Redis for a pool of gateways.

    files   (tenant, id) -> the FileObject (bytes, filename, purpose, created_at, expires_at)
    batches (tenant, id) -> the Batch object as answered, plus who runs it (the API key's id)
    lines   (batch id, custom_id) -> the output or error line written for it, its line number and
            usage: the journal. A line is recorded once (the primary key), so a batch resumed after
            a crash runs only what is not there, and its output has one line per custom_id.

Lists are in creation order (ties by insertion order, SQLite's rowid). Every read names the tenant:
another tenant's id is not there (a 404). Calls run in a worker thread behind one lock; WAL mode.
A SQLite store belongs to one gateway (its storage directory), so its runner lease is always held.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import anyio
import orjson

from gateway.storage import connect

SQLITE_FILE = "batches.sqlite3"

T = TypeVar("T")

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS files (tenant TEXT NOT NULL, id TEXT NOT NULL,"
    " created_at INTEGER NOT NULL, bytes INTEGER NOT NULL, purpose TEXT NOT NULL, body BLOB NOT NULL,"
    " PRIMARY KEY (tenant, id))",
    "CREATE TABLE IF NOT EXISTS batches (tenant TEXT NOT NULL, id TEXT NOT NULL,"
    " created_at INTEGER NOT NULL, key_id TEXT NOT NULL, body BLOB NOT NULL, PRIMARY KEY (tenant, id))",
    "CREATE TABLE IF NOT EXISTS lines (batch_id TEXT NOT NULL, custom_id TEXT NOT NULL,"
    " line INTEGER NOT NULL, failed INTEGER NOT NULL, text BLOB NOT NULL, input_tokens INTEGER NOT NULL,"
    " cached_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL, PRIMARY KEY (batch_id, custom_id))",
    "CREATE TABLE IF NOT EXISTS cancels (batch_id TEXT NOT NULL PRIMARY KEY)",
)
# Rows after a given one in (created_at, id) order, of the same tenant: keyset pagination.
_AFTER = " AND (created_at, rowid) {cmp} (SELECT created_at, rowid FROM {table} WHERE tenant = ? AND id = ?)"

# Statuses a batch does not leave (its runner is done with it).
FINAL_STATUSES = frozenset({"completed", "failed", "expired", "cancelled"})


@dataclass(frozen=True)
class LineResult:
    """One journaled line: its number in the input (1-based), whether it went to the error file,
    the line's JSON text, and the tokens it used."""

    custom_id: str
    line: int
    failed: bool
    text: bytes
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0


@dataclass(frozen=True)
class StoredBatch:
    tenant: str
    key_id: str
    body: dict[str, Any]


Tally = tuple[int, int, int, int, int]  # lines done, of them failed, input, cached, output tokens


class BatchStore(Protocol):
    """The Batch API's records (see the module docstring). Contract: every read names the tenant;
    `put_file` and `put_batch` insert or replace; `record` keeps a custom_id's first result only
    (False for a second); `claim` takes or renews a batch's runner lease for `owner` (False while
    another owner holds it), so at most one gateway runs a batch at a time, and `lease_left` says
    how long another's lease has to run. `shared`: other gateways read and run these batches."""

    shared: bool

    async def put_file(self, tenant: str, body: dict[str, Any]) -> None: ...
    async def get_file(self, tenant: str, file_id: str) -> dict[str, Any] | None: ...
    async def list_files(
        self, tenant: str, *, purpose: str | None, after: str | None, limit: int, ascending: bool
    ) -> list[dict[str, Any]]: ...
    async def delete_file(self, tenant: str, file_id: str) -> bool: ...
    async def file_usage(self, tenant: str) -> tuple[int, int]: ...
    async def put_batch(self, batch: StoredBatch) -> None: ...
    async def get_batch(self, tenant: str, batch_id: str) -> StoredBatch | None: ...
    async def list_batches(self, tenant: str, *, after: str | None, limit: int) -> list[dict[str, Any]]: ...
    async def unfinished(self) -> list[StoredBatch]: ...
    async def record(self, tenant: str, batch_id: str, result: LineResult) -> bool: ...
    async def results(self, tenant: str, batch_id: str) -> list[LineResult]: ...
    async def tally(self, tenant: str, batch_id: str) -> Tally: ...
    async def claim(self, tenant: str, batch_id: str, owner: str, ttl_s: float) -> bool: ...
    async def release(self, tenant: str, batch_id: str, owner: str) -> None: ...
    async def lease_left(self, tenant: str, batch_id: str) -> float: ...
    async def mark_cancel(self, tenant: str, batch_id: str) -> None: ...
    async def cancel_marked(self, tenant: str, batch_id: str) -> bool: ...
    async def aclose(self) -> None: ...


class SQLiteBatchStore:
    """See the module docstring. `path` None: in memory (lost at exit)."""

    shared = False

    def __init__(self, path: Path | None) -> None:
        self._lock = threading.Lock()
        self._db = connect(path)
        with self._lock, self._db:
            for statement in _SCHEMA:
                self._db.execute(statement)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        def locked() -> T:
            with self._lock, self._db:
                return fn(*args)

        return await anyio.to_thread.run_sync(locked)

    # -- files ---------------------------------------------------------------------------------

    async def put_file(self, tenant: str, body: dict[str, Any]) -> None:
        await self._run(
            self._db.execute,
            "INSERT INTO files VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (tenant, id) DO UPDATE SET"
            " bytes = excluded.bytes, purpose = excluded.purpose, body = excluded.body",
            (tenant, body["id"], body["created_at"], body["bytes"], body["purpose"], orjson.dumps(body)),
        )

    async def get_file(self, tenant: str, file_id: str) -> dict[str, Any] | None:
        def get() -> dict[str, Any] | None:
            row = self._db.execute(
                "SELECT body FROM files WHERE tenant = ? AND id = ?", (tenant, file_id)
            ).fetchone()
            return None if row is None else dict(orjson.loads(row[0]))

        return await self._run(get)

    async def list_files(
        self, tenant: str, *, purpose: str | None, after: str | None, limit: int, ascending: bool
    ) -> list[dict[str, Any]]:
        """Up to `limit` files by creation time (then id), after the file `after` in that order."""
        return await self._list("files", tenant, after, limit, ascending, purpose)

    async def delete_file(self, tenant: str, file_id: str) -> bool:
        def delete() -> bool:
            cursor = self._db.execute("DELETE FROM files WHERE tenant = ? AND id = ?", (tenant, file_id))
            return cursor.rowcount > 0

        return await self._run(delete)

    async def file_usage(self, tenant: str) -> tuple[int, int]:
        """The tenant's files: how many, and their bytes."""

        def used() -> tuple[int, int]:
            row = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM files WHERE tenant = ?", (tenant,)
            ).fetchone()
            return int(row[0]), int(row[1])

        return await self._run(used)

    # -- batches -------------------------------------------------------------------------------

    async def put_batch(self, batch: StoredBatch) -> None:
        body = batch.body
        await self._run(
            self._db.execute,
            "INSERT INTO batches VALUES (?, ?, ?, ?, ?)"
            " ON CONFLICT (tenant, id) DO UPDATE SET body = excluded.body",
            (batch.tenant, body["id"], body["created_at"], batch.key_id, orjson.dumps(body)),
        )

    async def get_batch(self, tenant: str, batch_id: str) -> StoredBatch | None:
        def get() -> StoredBatch | None:
            row = self._db.execute(
                "SELECT key_id, body FROM batches WHERE tenant = ? AND id = ?", (tenant, batch_id)
            ).fetchone()
            return None if row is None else StoredBatch(tenant, row[0], dict(orjson.loads(row[1])))

        return await self._run(get)

    async def list_batches(self, tenant: str, *, after: str | None, limit: int) -> list[dict[str, Any]]:
        """Newest first, as OpenAI lists them."""
        return await self._list("batches", tenant, after, limit, ascending=False)

    async def _list(
        self,
        table: str,
        tenant: str,
        after: str | None,
        limit: int,
        ascending: bool,
        purpose: str | None = None,
    ) -> list[dict[str, Any]]:
        """Up to `limit` bodies of `tenant`'s rows of `table` by creation time (then row), after the
        row `after` in that order; with `purpose`, only rows of it (files)."""
        order, cmp = ("ASC", ">") if ascending else ("DESC", "<")

        def list_() -> list[dict[str, Any]]:
            where, args = "tenant = ?", [tenant]
            if purpose:
                where += " AND purpose = ?"
                args.append(purpose)
            if after:
                where += _AFTER.format(cmp=cmp, table=table)
                args += [tenant, after]
            rows = self._db.execute(
                f"SELECT body FROM {table} WHERE {where} ORDER BY created_at {order}, rowid {order} LIMIT ?",
                (*args, limit),
            ).fetchall()
            return [dict(orjson.loads(r[0])) for r in rows]

        return await self._run(list_)

    async def unfinished(self) -> list[StoredBatch]:
        """Every batch whose runner is not done (oldest first): what a gateway resumes at start."""

        def list_() -> list[StoredBatch]:
            rows = self._db.execute(
                "SELECT tenant, key_id, body FROM batches ORDER BY created_at, rowid"
            ).fetchall()
            batches = [StoredBatch(r[0], r[1], dict(orjson.loads(r[2]))) for r in rows]
            return [b for b in batches if b.body["status"] not in FINAL_STATUSES]

        return await self._run(list_)

    # -- the journal ---------------------------------------------------------------------------

    async def record(self, tenant: str, batch_id: str, result: LineResult) -> bool:
        """Journal one line's result; False if its custom_id already has one (kept as it was)."""

        def insert() -> bool:
            cursor = self._db.execute(
                "INSERT OR IGNORE INTO lines VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    batch_id,
                    result.custom_id,
                    result.line,
                    int(result.failed),
                    result.text,
                    result.input_tokens,
                    result.cached_tokens,
                    result.output_tokens,
                ),
            )
            return cursor.rowcount > 0

        return await self._run(insert)

    async def results(self, tenant: str, batch_id: str) -> list[LineResult]:
        """The batch's journaled lines, in input order."""

        def read() -> list[LineResult]:
            rows = self._db.execute(
                "SELECT custom_id, line, failed, text, input_tokens, cached_tokens, output_tokens "
                "FROM lines WHERE batch_id = ? ORDER BY line",
                (batch_id,),
            ).fetchall()
            return [LineResult(r[0], r[1], bool(r[2]), bytes(r[3]), r[4], r[5], r[6]) for r in rows]

        return await self._run(read)

    async def tally(self, tenant: str, batch_id: str) -> Tally:
        """(lines done, of them failed, input, cached and output tokens) of the batch's journal."""

        def count() -> Tally:
            row = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(failed), 0), COALESCE(SUM(input_tokens), 0), "
                "COALESCE(SUM(cached_tokens), 0), COALESCE(SUM(output_tokens), 0) "
                "FROM lines WHERE batch_id = ?",
                (batch_id,),
            ).fetchone()
            return int(row[0]), int(row[1]), int(row[2]), int(row[3]), int(row[4])

        return await self._run(count)

    # -- the runner lease and cancel marks (one gateway: the lease is always its own) ------------

    async def claim(self, tenant: str, batch_id: str, owner: str, ttl_s: float) -> bool:
        return True

    async def release(self, tenant: str, batch_id: str, owner: str) -> None:
        return None

    async def lease_left(self, tenant: str, batch_id: str) -> float:
        return 0.0

    async def mark_cancel(self, tenant: str, batch_id: str) -> None:
        await self._run(self._db.execute, "INSERT OR IGNORE INTO cancels VALUES (?)", (batch_id,))

    async def cancel_marked(self, tenant: str, batch_id: str) -> bool:
        def marked() -> bool:
            row = self._db.execute("SELECT 1 FROM cancels WHERE batch_id = ?", (batch_id,)).fetchone()
            return row is not None

        return await self._run(marked)

    async def aclose(self) -> None:
        with self._lock:
            self._db.close()
