"""Stored responses and conversations, per tenant, behind one small interface: SQLite on one
machine, Redis in a pool (gateway/responses/redis_store.py).

    ResponseStore.put(tenant, id, record) / put_linked(tenant, id, record, parent)
                 get(tenant, id) / chain(tenant, id) / delete(tenant, id) / aclose()

A `StoredResponse` is what a later turn needs: the response object as it was answered, this turn's
input items (ids assigned, as `input_items` lists them) and the conversation before it. Every read
and write names the tenant: another tenant's id is simply not there (a 404, never a 403).

Two formats (`--responses-store-format`), both read by this release:

- 1, the previous release's: each record holds the whole conversation before it, so a chain of
  N turns stores O(N^2) bytes. The previous release reads only this one.
- 2: a record holds only its own items (`"v": 2`, this turn's input and output, and in
  `added_history` any history that is not its parent's conversation, such as a compacted one, or
  all of it without a parent) and names its `parent`, the
  response it continued. A lookup reads the chain, newest first, in one round trip or query; bytes
  grow linearly. A parent deleted or evicted while records link to it is hidden (a 404 for its
  own id) but kept, with a count of the records that link to it, until the last of them goes.
  A conversation links the same way to its latest stored response, its `head`
  (`StoredConversation`), and a response created with `conversation` links to that head as its
  parent: a conversation's items are stored once, in its responses' records. (52b05c6 wrote such
  a response naming its conversation's items instead, `conversation_history`; those records are
  still read, through `StoredResponse.with_conversation`, and no record links to one.)

Both bound each tenant on its own (its plan's `responses_max_stored`, else
`--responses-max-stored`: gateway/bounds.py), evicting that tenant's least recently used records
first, so no tenant's writes evict another's; each eviction is counted
(`batchgate_response_store_evictions_total`). The bound counts the records a tenant can read; a
hidden part is an ancestor of one of them (a response, or a conversation's head), so the items
kept are at most those format 1 keeps for the same records (which holds each ancestor's items in
every descendant, and a conversation's in its record), each hidden part adding its own response
fields (about a quarter of a tool-call turn's bytes: docs/BENCHMARKS.md).

`SQLiteStore`: one file in `--storage-dir` (`responses.sqlite3`), or in memory without one. Writes
run in a worker thread; a read runs on the caller's thread, on a connection of its own that a
writer never blocks (WAL), and its use is written with the next write.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import anyio
import orjson

from gateway.responses.request import InConversation, Parent
from gateway.storage import connect

SQLITE_FILE = "responses.sqlite3"


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    history: list[dict[str, Any]]  # the whole conversation before this turn, however stored
    # A background run's lease (epoch seconds; gateway/responses/background.py): None when none runs.
    lease_until: float | None = None
    parent: Parent | None = None  # format 2's link; None: the history is stored whole
    version: int = 1  # the format it was read in (a record can link to a parent of format 2 only)
    # Format 2's link to the conversation its history is; `history` lacks those items until
    # `with_conversation` puts them back.
    in_conversation: InConversation | None = None

    @property
    def response_id(self) -> str:
        return str(self.response["id"])

    def conversation(self) -> list[dict[str, Any]]:
        """The items a continuation of this response starts with: history, input, output."""
        return [*self.history, *self.input_items, *self.response.get("output", ())]

    def with_conversation(self, items: list[dict[str, Any]] | None) -> StoredResponse | None:
        """This record with the history it links to put back, from its conversation's `items`
        now (None: the conversation is gone): those through its `through` item, or, that one
        deleted since, those before this turn's own first input item. None when neither is there."""
        link = self.in_conversation
        if link is None or link.through is None:
            return self
        ids = [item.get("id") for item in items or ()]
        first_own = self.input_items[0].get("id") if self.input_items else None
        for anchor, past in ((link.through, 1), (first_own, 0)):
            if anchor is not None and anchor in ids:
                end = ids.index(anchor) + past
                return dataclasses.replace(self, history=[*(items or ())[:end], *self.history])
        return None

    def dumps(self, version: int = 1) -> bytes:
        """The record in format `version`: 1 holds the whole history (and no parent), 2 the
        history after its parent's conversation."""
        record: dict[str, Any] = {"response": self.response, "input_items": self.input_items}
        if version == 1:
            record["history"] = self.history
        else:  # under another name than format 1's, so the previous release fails, not misreads
            skip = self.parent.num_items if self.parent is not None else 0
            record = {"v": 2, "parent": self.parent and self.parent.response_id, **record}
            link = self.in_conversation if self.parent is None else None
            if link is not None:  # the history is the conversation's items: named, not stored
                # (no `added_history`: a reader of format 2 without links fails, not reads none)
                record["conversation_history"] = {"id": link.conversation_id, "through": link.through}
            else:
                record["added_history"] = self.history[skip:]
            before = self.parent.response if self.parent is not None else None
            if before is not None:  # the settings echoed (tools, instructions...) stored once
                record["response"] = {
                    k: v
                    for k, v in self.response.items()
                    if k in _OWN or k not in before or not _same(before[k], v)
                }
                record["inherits"] = True  # the fields it lacks are its parent's
                dropped = [k for k in before if k not in self.response]
                if dropped:
                    record["dropped"] = dropped
        if self.lease_until is not None:
            record["lease_until"] = self.lease_until
        return orjson.dumps(record)

    @classmethod
    def loads(cls, raw: bytes) -> StoredResponse:
        """A record that names no parent (format 1, or a root of format 2)."""
        record = cls.from_chain([raw])
        if record is None:
            raise ValueError("a record with a parent is read with its chain (ResponseStore.chain)")
        return record

    @classmethod
    def from_chain(cls, chain: Sequence[bytes]) -> StoredResponse | None:
        """The response from its record and its ancestors' (newest first, as `chain` reads them);
        None when an ancestor is missing (which the stores' links prevent)."""
        records = [orjson.loads(raw) for raw in chain]
        if records[-1].get("parent") is not None:
            return None
        if any(record.get("conversation_history") for record in records[1:]):
            return None  # a conversation's history is no parent's (the state stores its child whole)
        items: list[dict[str, Any]] = []
        for older, newer in zip(records[:0:-1], records[-2::-1], strict=True):  # oldest first
            if newer.get("parent") != older["response"]["id"]:
                return None
            items += [*_added(older), *older["input_items"], *older["response"].get("output", ())]
        response = _response(records)
        if response is None:
            return None
        data = records[0]
        parent = None if data.get("parent") is None else Parent(data["parent"], len(items))
        link = data.get("conversation_history")
        return cls(
            response,
            data["input_items"],
            items + _added(data),
            data.get("lease_until"),
            parent,
            int(data.get("v", 1)),
            None if link is None else InConversation(link["id"], link["through"]),
        )


# A response's fields that are its own every turn, never taken from its parent's.
_OWN = ("id", "created_at", "completed_at", "output", "usage", "previous_response_id")


def _response(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first record's response object whole (records newest first): its own fields, then
    those it lacks from the nearest older record that has them, up to one stored whole, in that
    one's (the skeleton's) order; None when the chain ends first."""
    whole = dict(records[0]["response"])
    dropped: set[str] = set()
    i = 0
    while records[i].get("inherits"):
        dropped.update(records[i].get("dropped", ()))
        i += 1
        if i == len(records):
            return None
        older = records[i]["response"]
        for key in older.keys() - whole.keys() - dropped:
            whole[key] = older[key]
    order = records[i]["response"]
    return {**{k: whole[k] for k in order if k in whole}, **whole}


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON (1 and 1.0, or True and 1, are not)."""
    return a == b and orjson.dumps(a) == orjson.dumps(b)


def _added(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The history a record holds: all of it (format 1), or what follows its parent's (2), or
    none where it names its conversation's (read back by `StoredResponse.with_conversation`)."""
    if record.get("v", 1) == 1:
        history: list[dict[str, Any]] = record["history"]
        return history
    if "conversation_history" in record:
        return []
    added: list[dict[str, Any]] = record["added_history"]
    return added


@dataclass(frozen=True)
class StoredConversation:
    """A conversation (`/v1/conversations`): its object (id, created_at, metadata) and its items.

    In format 2 a conversation whose latest turn is a stored response names that response (`head`)
    instead of holding the items through its turn: its items are the head's conversation (read with
    its chain) and then `tail`, the items added since. A record with no head holds its items whole,
    as format 1 does."""

    conversation: dict[str, Any]
    items: list[dict[str, Any]]  # all of them, however stored
    head: Parent | None = None  # the stored response whose conversation is items[:head.num_items]

    @property
    def conversation_id(self) -> str:
        return str(self.conversation["id"])

    def dumps(self, version: int = 1) -> bytes:
        """The record: the items whole (format 1, or no head), or the head and the tail (2)."""
        if version == 1 or self.head is None:
            return orjson.dumps({"conversation": self.conversation, "items": self.items})
        # No `items`: a reader that knows no heads fails (a 503), it does not read an empty one.
        tail = self.items[self.head.num_items :]
        return orjson.dumps(
            {"v": 2, "conversation": self.conversation, "head": self.head.response_id, "tail": tail}
        )

    def size(self) -> int:
        """Its bytes held whole (what its bounds count, however it is stored)."""
        return len(self.dumps(1))

    @classmethod
    def from_chain(cls, chain: Sequence[bytes]) -> StoredConversation | None:
        """The conversation from its record and, where it names a head, the head's chain (as
        `ResponseStore.chain` reads them); None when the head's chain is broken (which the
        stores' links prevent)."""
        data = orjson.loads(chain[0])
        if "items" in data:
            return cls(data["conversation"], data["items"])
        head = StoredResponse.from_chain(chain[1:]) if len(chain) > 1 else None
        if head is None or head.response_id != data["head"]:
            return None
        before = head.conversation()
        return cls(
            data["conversation"], [*before, *data["tail"]], Parent(data["head"], len(before), head.response)
        )


class ResponseStore(Protocol):
    """Records (stored responses and conversations, `StoredResponse.dumps()` and
    `StoredConversation.dumps()`) by tenant and id; ids are unique across kinds (`resp_`, `conv_`).
    Contract: `get` of an id another tenant stored is None; `put` keeps the store within its bound
    (evicting the least recently used); all methods are safe to call concurrently from the event
    loop."""

    async def put(self, tenant: str, key: str, record: bytes) -> None:
        """A record the previous release reads too (format 1, conversations, marks)."""
        ...

    async def put_linked(self, tenant: str, key: str, record: bytes, parent: str | None) -> bool:
        """A record of format 2 that continues `parent` (None: none): `parent` and its ancestors
        are kept as long as this record is. False, and nothing written, when `parent` is gone."""
        ...

    async def get(self, tenant: str, key: str) -> bytes | None: ...

    async def chain(self, tenant: str, key: str) -> list[bytes] | None:
        """The record at `key` and its ancestors' records, newest first, in one read."""
        ...

    async def delete(self, tenant: str, key: str) -> bool: ...

    async def num_stored(self, tenant: str) -> int:
        """The tenant's records now (for /v1/usage): those it can read, not hidden parents."""
        ...

    async def aclose(self) -> None: ...


Bound = Callable[[str], int]  # a tenant's most records (its plan's responses_max_stored)


async def load_response(store: ResponseStore, tenant: str, response_id: str) -> StoredResponse | None:
    """The stored response `response_id` of `tenant`, in either format, with its whole history."""
    chain = await store.chain(tenant, response_id)
    return None if not chain else StoredResponse.from_chain(chain)


async def save_response(store: ResponseStore, tenant: str, record: StoredResponse, version: int) -> None:
    """Store `record` in format `version`; in format 2 linked to its parent where that is still
    stored, else with its whole history (a parent evicted since it was read)."""
    key = record.response_id
    if version == 1:
        await store.put(tenant, key, record.dumps(1))
    elif record.parent is None or not await store.put_linked(
        tenant, key, record.dumps(2), record.parent.response_id
    ):
        await store.put_linked(tenant, key, dataclasses.replace(record, parent=None).dumps(2), None)


class SQLiteStore:
    """The embedded store (see the module docstring). `path` None: in memory (lost at exit).
    `max_num_responses`: each tenant's bound, unless `bound` says a tenant's own.

    A row's `parent` is the record it links to, `refs` the rows that link to it, and `hidden` says
    it was deleted or evicted while `refs` > 0 (kept only for them)."""

    def __init__(
        self,
        path: Path | None,
        max_num_responses: int,
        on_evict: Callable[[int], None] = lambda n: None,
        bound: Bound | None = None,
    ) -> None:
        if max_num_responses < 1:
            raise ValueError(f"max_num_responses must be at least 1, got {max_num_responses}")
        self.max_num_responses = max_num_responses
        self._bound: Bound = bound or (lambda tenant: max_num_responses)
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self._db = connect(path)
        # Reads: a point read takes less time than a hop to a worker thread and back. A file has
        # a reader connection of its own (WAL: a writer never blocks it); in memory, the one db.
        self._reader, self._read_lock = (connect(path), threading.Lock()) if path else (self._db, self._lock)
        # Reads not yet written to `used`: the next write applies them first (so the LRU order is
        # right when it evicts); a crash forgets only the recency of reads since the last write.
        self._used: dict[tuple[str, str], float] = {}
        self._used_lock = threading.Lock()
        # In WAL mode, synchronous NORMAL commits without an fsync each (the WAL is synced at
        # checkpoints), so a write does not wait on the disk; a crash of the process loses nothing.
        self._db.execute("PRAGMA synchronous=NORMAL")
        with self._lock, self._db:
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS responses (tenant TEXT NOT NULL, id TEXT NOT NULL, "
                "used REAL NOT NULL, record BLOB NOT NULL, PRIMARY KEY (tenant, id))"
            )
            # Format 2's links, added to a file the previous release made (which ignores them).
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(responses)")}
            for column, declared in [
                ("parent", "TEXT"),
                ("refs", "INTEGER NOT NULL DEFAULT 0"),
                ("hidden", "INTEGER NOT NULL DEFAULT 0"),
            ]:
                if column not in columns:
                    self._db.execute(f"ALTER TABLE responses ADD COLUMN {column} {declared}")
            # Eviction picks a tenant's least recently used: by tenant, then use.
            self._db.execute("DROP INDEX IF EXISTS responses_used")
            self._db.execute("CREATE INDEX IF NOT EXISTS responses_tenant_used ON responses (tenant, used)")

    def count(self) -> int:
        """Every tenant's records, hidden parents included."""
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    def _count(self, tenant: str) -> int:
        with self._read_lock:
            rows = self._reader.execute(
                "SELECT COUNT(*) FROM responses WHERE tenant = ? AND hidden = 0", (tenant,)
            ).fetchall()
        return int(rows[0][0])

    async def num_stored(self, tenant: str) -> int:
        return await anyio.to_thread.run_sync(self._count, tenant)

    def _write_used(self) -> None:
        """Apply the pending reads' times (inside a write's lock and transaction)."""
        with self._used_lock:
            used, self._used = self._used, {}
        if used:
            self._db.executemany(
                "UPDATE responses SET used = ? WHERE tenant = ? AND id = ?",
                [(t, tenant, key) for (tenant, key), t in used.items()],
            )

    def _unlink(self, tenant: str, parent: str | None) -> None:
        """One record less links to `parent`: a hidden one with none left goes, and so on up."""
        while parent is not None:
            self._db.execute(
                "UPDATE responses SET refs = refs - 1 WHERE tenant = ? AND id = ?", (tenant, parent)
            )
            row = self._db.execute(
                "SELECT parent FROM responses WHERE tenant = ? AND id = ? AND hidden = 1 AND refs <= 0",
                (tenant, parent),
            ).fetchone()
            if row is None:
                return
            self._db.execute("DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, parent))
            parent = row[0]

    def _drop(self, tenant: str, key: str) -> None:
        """Delete or evict `key`: hidden while records link to it, else gone (with its links)."""
        row = self._db.execute(
            "SELECT parent, refs FROM responses WHERE tenant = ? AND id = ?", (tenant, key)
        ).fetchone()
        if row is None:
            return
        if row[1] > 0:
            self._db.execute("UPDATE responses SET hidden = 1 WHERE tenant = ? AND id = ?", (tenant, key))
            return
        self._db.execute("DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, key))
        self._unlink(tenant, row[0])

    def _put(self, tenant: str, key: str, record: bytes, parent: str | None = None) -> bool:
        bound = max(1, self._bound(tenant))
        with self._lock, self._db:
            self._write_used()
            row = self._db.execute(
                "SELECT parent FROM responses WHERE tenant = ? AND id = ?", (tenant, key)
            ).fetchone()
            before = row[0] if row is not None else None
            if parent is not None and parent != before:
                linked = self._db.execute(
                    "UPDATE responses SET refs = refs + 1 WHERE tenant = ? AND id = ?", (tenant, parent)
                )
                if linked.rowcount == 0:
                    return False  # evicted or deleted (and unlinked) since it was read
            # A record written again (a background run's) keeps the records that link to it.
            self._db.execute(
                "INSERT INTO responses (tenant, id, used, record, parent) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT (tenant, id) DO UPDATE SET used = excluded.used, "
                "record = excluded.record, parent = excluded.parent, hidden = 0",
                (tenant, key, time.time(), record, parent),
            )
            if before is not None and before != parent:
                self._unlink(tenant, before)
            excess = self._count_visible(tenant) - bound
            if excess > 0:  # this tenant's least recently used, never another tenant's
                old = self._db.execute(
                    "SELECT id FROM responses WHERE tenant = ? AND hidden = 0 ORDER BY used LIMIT ?",
                    (tenant, excess),
                ).fetchall()
                for (old_key,) in old:
                    self._drop(tenant, old_key)
        if excess > 0:
            self._on_evict(excess)
        return True

    def _count_visible(self, tenant: str) -> int:
        (num,) = self._db.execute(
            "SELECT COUNT(*) FROM responses WHERE tenant = ? AND hidden = 0", (tenant,)
        ).fetchone()
        return int(num)

    def _read(self, sql: str, args: tuple[str, ...]) -> list[Any]:
        with self._read_lock:  # fetchall: the statement ends, so no read transaction stays open
            return self._reader.execute(sql, args).fetchall()

    def _touch(self, tenant: str, key: str) -> None:
        with self._used_lock:
            self._used[(tenant, key)] = time.time()

    def _get(self, tenant: str, key: str) -> bytes | None:
        rows = self._read(
            "SELECT record FROM responses WHERE tenant = ? AND id = ? AND hidden = 0", (tenant, key)
        )
        if not rows:
            return None
        self._touch(tenant, key)
        return bytes(rows[0][0])

    def _chain(self, tenant: str, key: str) -> list[bytes] | None:
        rows = self._read(_CHAIN_SQL, (tenant, key, tenant))
        if not rows:
            return None
        self._touch(tenant, key)
        return [bytes(row[0]) for row in rows]

    def _delete(self, tenant: str, response_id: str) -> bool:
        with self._lock, self._db:
            found = self._db.execute(
                "SELECT 1 FROM responses WHERE tenant = ? AND id = ? AND hidden = 0", (tenant, response_id)
            ).fetchone()
            if found is not None:
                self._drop(tenant, response_id)
        return found is not None

    async def put(self, tenant: str, key: str, record: bytes) -> None:
        await anyio.to_thread.run_sync(self._put, tenant, key, record)

    async def put_linked(self, tenant: str, key: str, record: bytes, parent: str | None) -> bool:
        return await anyio.to_thread.run_sync(self._put, tenant, key, record, parent)

    async def get(self, tenant: str, key: str) -> bytes | None:
        return self._get(tenant, key)

    async def chain(self, tenant: str, key: str) -> list[bytes] | None:
        return self._chain(tenant, key)

    async def delete(self, tenant: str, response_id: str) -> bool:
        return await anyio.to_thread.run_sync(self._delete, tenant, response_id)

    async def aclose(self) -> None:
        with self._lock:
            with self._db:
                self._write_used()
            self._db.close()
        if self._reader is not self._db:
            with self._read_lock:
                self._reader.close()


# A record the tenant can read, then each parent in turn (hidden or not), newest first.
_CHAIN_SQL = """
WITH RECURSIVE chain (depth, parent, record) AS (
    SELECT 0, parent, record FROM responses WHERE tenant = ? AND id = ? AND hidden = 0
    UNION ALL
    SELECT chain.depth + 1, r.parent, r.record FROM chain
    JOIN responses AS r ON r.tenant = ? AND r.id = chain.parent
    WHERE chain.depth < 100000  -- links never loop; a bound all the same
)
SELECT record FROM chain ORDER BY depth
"""
