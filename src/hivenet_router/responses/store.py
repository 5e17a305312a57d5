"""Stored responses: what `store: true` keeps for `previous_response_id` and the GET,
DELETE and input_items routes.

Two backends with one behaviour: one SQLite file (`responses.sqlite3`) beside the router's
history store, on one worker thread so the event loop never waits on the disk
(`SqliteResponses`); or, with `--ledger-dsn`, a table in the ledger's PostgreSQL, shared by
every router of a site (`store_pg.PgResponses`). Every read and delete names the tenant: a
response stored under another tenant is absent. Records live `ttl` seconds from their
creation (an expired one reads as absent and is deleted by the next sweep), and together
stay under `max_bytes`: past it the oldest go first.

A record is visible from the moment `keep` is called (a stream keeps its Response before
its last event is sent, so a GET right after the stream finds it), and written behind; a
delete waits for the write of the same record.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import orjson

T = TypeVar("T")
DB_FILE = "responses.sqlite3"
SWEEP_EVERY = 60.0  # seconds between passes that delete expired records
SWEEP_TARGET = 0.9  # share of the size bound a sweep brings the records under
# Seconds the SQLite store gathers rows before writing them together. A write's cost is
# mostly per transaction (the worker's wake-up, the WAL pages a commit writes, cold caches):
# on a router serving ~1,000 stored responses a second the store's thread took about 40 us
# of CPU a row at 20 ms, 15 us at 100 ms. Records are read from memory until written; a
# crash loses at most this much.
BATCH_WINDOW = 0.1
log = logging.getLogger("hivenet.responses")


@dataclass(frozen=True, slots=True)
class Stored:
    """One stored response: the Response, its input items, and the items of the responses
    it continued (so that continuing it needs one read)."""

    tenant: str
    response: dict[str, Any]
    items: list[dict[str, Any]]
    history: list[dict[str, Any]]
    created: float

    def conversation(self) -> list[dict[str, Any]]:
        """The items a response continuing this one starts from."""
        return [*self.history, *self.items, *self.response.get("output", ())]

    def encode(self, response: bytes | None = None) -> bytes:
        """The record's bytes; `response`, the Response's JSON when the caller has it (the
        bytes its client was sent), is not serialized again. The same bytes either way."""
        if response is None:
            response = orjson.dumps(self.response)
        return b"".join(
            (
                b'{"response":',
                response,
                b',"items":',
                orjson.dumps(self.items),
                b',"history":',
                orjson.dumps(self.history),
                b',"created":',
                orjson.dumps(self.created),
                b"}",
            )
        )

    @staticmethod
    def decode(tenant: str, data: bytes) -> Stored:
        d = orjson.loads(data)
        return Stored(tenant, d["response"], d["items"], d["history"], d["created"])


Key = tuple[str, str]  # (tenant, response ID)


class ResponseStore:
    """What both backends share: the records not yet written, expiry on read, the order of
    a write and a delete of one record. A backend writes, reads and erases rows."""

    def __init__(self, ttl: float, max_bytes: int, wall: Callable[[], float]) -> None:
        self.ttl = ttl
        self.max_bytes = max_bytes
        self.wall = wall
        # The records not yet written, as their creation time and bytes: bytes are no
        # objects for the garbage collector to go through (holding each Response's dicts
        # until its write made the stored load collect ~7 us a request).
        self._pending: dict[Key, tuple[float, bytes]] = {}
        self._writes: dict[Key, asyncio.Future[None]] = {}
        self._settling: dict[asyncio.Future[None], list[tuple[Key, bytes]]] = {}

    async def open(self) -> None:
        raise NotImplementedError

    async def _close(self) -> None:
        raise NotImplementedError

    def _write(self, key: Key, created: float, data: bytes) -> asyncio.Future[None]:
        """Start writing a row now (a backend keeps the order of its writes)."""
        raise NotImplementedError

    async def _read(self, key: Key) -> bytes | None:
        raise NotImplementedError

    async def _erase(self, key: Key) -> None:
        raise NotImplementedError

    def keep(
        self,
        tenant: str,
        response: dict[str, Any],
        items: list[dict[str, Any]],
        history: list[dict[str, Any]],
        encoded: bytes | None = None,
    ) -> None:
        """Store a response: visible at once, written behind. `encoded`: the response's
        JSON, when the caller made it already."""
        created = self.wall()
        key = (tenant, response["id"])
        data = Stored(tenant, response, items, history, created).encode(encoded)
        self._pending[key] = (created, data)
        write = self._write(key, created, data)
        self._writes[key] = write
        settling = self._settling.get(write)
        if settling is None:  # one callback a write, for all the rows it carries
            settling = self._settling[write] = []
            write.add_done_callback(self._written)
        settling.append((key, data))

    def _written(self, done: asyncio.Future[None]) -> None:
        failed = None if done.cancelled() else done.exception()
        for key, data in self._settling.pop(done, ()):
            if self._writes.get(key) is done:
                del self._writes[key]
            pending = self._pending.get(key)
            if pending is not None and pending[1] is data:
                del self._pending[key]
            if failed is not None:
                log.error("storing response %s failed: %s", key[1], failed)

    async def get(self, tenant: str, response_id: str) -> Stored | None:
        key = (tenant, response_id)
        pending = self._pending.get(key)
        if pending is not None:
            created, data = pending
            return Stored.decode(tenant, data) if self._live(created) else None
        read = await self._read(key)
        record = Stored.decode(tenant, read) if read is not None else None
        return record if record is not None and self._live(record.created) else None

    def _live(self, created: float) -> bool:
        return created + self.ttl > self.wall()

    async def delete(self, tenant: str, response_id: str) -> bool:
        """Forget a response; False when the tenant has no such response."""
        key = (tenant, response_id)
        if await self.get(tenant, response_id) is None:
            return False
        writing = self._writes.get(key)
        if writing is not None:
            await asyncio.wait([writing])  # its row first, then its deletion
        self._pending.pop(key, None)
        await self._erase(key)
        return True

    async def close(self) -> None:
        if self._writes:
            await asyncio.wait(set(self._writes.values()), timeout=5.0)
        await self._close()


class SqliteResponses(ResponseStore):
    def __init__(
        self,
        directory: Path,
        ttl: float,
        max_bytes: int,
        wall: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(ttl, max_bytes, wall)
        self._path = directory / DB_FILE
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hivenet-responses")
        self._db: sqlite3.Connection | None = None
        self._total = 0
        self._swept = 0.0
        self._batch: list[tuple[Key, float, bytes]] | None = None
        self._batch_done: asyncio.Future[None] | None = None

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def open(self) -> None:
        await self._run(self._open)

    async def _close(self) -> None:
        await self._run(self._disconnect)
        self._pool.shutdown(wait=False)

    def _write(self, key: Key, created: float, data: bytes) -> asyncio.Future[None]:
        # The rows kept within BATCH_WINDOW go to the worker thread together, in one
        # transaction: one hand-over and one commit for all of them (one of each per row
        # cost a Response 270 us of router CPU). The worker's queue keeps writes and
        # deletes in order; until its row is written a record is read from memory.
        if self._batch is None:
            loop = asyncio.get_running_loop()
            self._batch, self._batch_done = [], loop.create_future()
            loop.call_later(BATCH_WINDOW, self._flush)
        self._batch.append((key, created, data))
        assert self._batch_done is not None
        return self._batch_done

    def _flush(self) -> None:
        batch, done = self._batch or [], self._batch_done
        self._batch = self._batch_done = None
        job = asyncio.get_running_loop().run_in_executor(self._pool, self._insert, batch)

        def settle(job: asyncio.Future[None]) -> None:
            if done is None or done.done():
                return
            if job.cancelled():
                done.cancel()
            elif (error := job.exception()) is not None:
                done.set_exception(error)
            else:
                done.set_result(None)

        job.add_done_callback(settle)

    async def _read(self, key: Key) -> bytes | None:
        return await self._run(lambda: self._select(key))

    async def _erase(self, key: Key) -> None:
        await self._run(lambda: self._remove(key))

    # -- on the worker thread -------------------------------------------------------------------

    def _open(self) -> None:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self._path)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute(
            "CREATE TABLE IF NOT EXISTS responses (tenant TEXT NOT NULL, id TEXT NOT NULL,"
            " created REAL NOT NULL, size INTEGER NOT NULL, data BLOB NOT NULL,"
            " PRIMARY KEY (tenant, id))"
        )
        db.execute("CREATE INDEX IF NOT EXISTS responses_created ON responses (created)")
        db.commit()
        self._db = db
        self._sweep()

    def _disconnect(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def _select(self, key: Key) -> bytes | None:
        if self._db is None:
            return None
        row = self._db.execute(
            "SELECT data FROM responses WHERE tenant = ? AND id = ?", key
        ).fetchone()
        return bytes(row[0]) if row is not None else None

    def _insert(self, batch: list[tuple[Key, float, bytes]]) -> None:
        db = self._db
        if db is None:
            return
        rows: list[tuple[str, str, float, int, bytes]] = []
        for (tenant, response_id), created, data in batch:
            if len(data) > self.max_bytes:
                log.warning("response %s (%d bytes) is over the bound", response_id, len(data))
                continue
            rows.append((tenant, response_id, created, len(data), data))
        db.executemany(
            "INSERT OR REPLACE INTO responses (tenant, id, created, size, data)"
            " VALUES (?, ?, ?, ?, ?)",
            rows,
        )
        # Response IDs are new: a replaced row (never expected) is recounted by the next
        # sweep.
        self._total += sum(row[3] for row in rows)
        db.commit()
        if self._total > self.max_bytes or self.wall() - self._swept > SWEEP_EVERY:
            self._sweep()

    def _remove(self, key: Key) -> None:
        if self._db is None:
            return
        row = self._db.execute(
            "DELETE FROM responses WHERE tenant = ? AND id = ? RETURNING size", key
        ).fetchone()
        if row is not None:
            self._total -= row[0]
        self._db.commit()

    def _sweep(self) -> None:
        """Delete the expired records, then, over the size bound, the oldest until the rest
        take at most SWEEP_TARGET of it (so that a full store is not swept on every write)."""
        db = self._db
        if db is None:
            return
        self._swept = self.wall()
        db.execute("DELETE FROM responses WHERE created <= ?", (self._swept - self.ttl,))
        (total,) = db.execute("SELECT COALESCE(SUM(size), 0) FROM responses").fetchone()
        if total > self.max_bytes:
            excess = total - int(self.max_bytes * SWEEP_TARGET)
            victims: list[tuple[int]] = []
            for rowid, size in db.execute("SELECT rowid, size FROM responses ORDER BY created"):
                if excess <= 0:
                    break
                victims.append((rowid,))
                excess -= size
                total -= size
            db.executemany("DELETE FROM responses WHERE rowid = ?", victims)
        db.commit()
        self._total = total
