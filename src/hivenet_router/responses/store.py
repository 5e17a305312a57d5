"""Stored responses: what `store: true` keeps for `previous_response_id` and the GET,
DELETE and input_items routes.

One SQLite file (`responses.sqlite3`) beside the router's history store, on one worker
thread, so the event loop never waits on the disk. Every read and delete names the tenant:
a response stored under another tenant is absent. Records live `ttl` seconds from their
creation (an expired one reads as absent and is deleted by the next sweep), and the file's
records together stay under `max_bytes`: past it the oldest go first.

A record is visible from the moment `keep` is called (a stream keeps its Response before
its last event is sent, so a GET right after the stream finds it), and written behind.
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


class ResponseStore:
    def __init__(
        self,
        directory: Path,
        ttl: float,
        max_bytes: int,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._path = directory / DB_FILE
        self._ttl = ttl
        self._max = max_bytes
        self._wall = wall
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hivenet-responses")
        self._db: sqlite3.Connection | None = None
        self._pending: dict[tuple[str, str], Stored] = {}
        self._writes: set[asyncio.Future[None]] = set()
        self._total = 0
        self._swept = 0.0
        self.records = 0

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def open(self) -> None:
        await self._run(self._open)

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

    def _live(self, record: Stored | None) -> Stored | None:
        if record is None or record.created + self._ttl <= self._wall():
            return None
        return record

    def keep(
        self,
        tenant: str,
        response: dict[str, Any],
        items: list[dict[str, Any]],
        history: list[dict[str, Any]],
    ) -> None:
        """Store a response: visible at once, written behind."""
        record = Stored(tenant, response, items, history, self._wall())
        key = (tenant, response["id"])
        self._pending[key] = record
        data = orjson.dumps(
            {"response": response, "items": items, "history": history, "created": record.created}
        )
        write = asyncio.get_running_loop().run_in_executor(
            self._pool, self._insert, tenant, response["id"], record.created, data
        )
        self._writes.add(write)

        def written(done: asyncio.Future[None]) -> None:
            self._writes.discard(done)
            if self._pending.get(key) is record:
                del self._pending[key]
            if not done.cancelled() and done.exception() is not None:
                log.error("storing response %s failed: %s", key[1], done.exception())

        write.add_done_callback(written)

    async def get(self, tenant: str, response_id: str) -> Stored | None:
        found = self._pending.get((tenant, response_id))
        if found is not None:
            return self._live(found)
        return self._live(await self._run(lambda: self._select(tenant, response_id)))

    async def delete(self, tenant: str, response_id: str) -> bool:
        """Forget a response; False when the tenant has no such response."""
        if await self.get(tenant, response_id) is None:
            return False
        self._pending.pop((tenant, response_id), None)
        await self._run(lambda: self._remove(tenant, response_id))
        return True

    async def close(self) -> None:
        if self._writes:
            await asyncio.wait(set(self._writes), timeout=5.0)
        await self._run(self._close)
        self._pool.shutdown(wait=False)

    # -- on the worker thread -------------------------------------------------------------------

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def _select(self, tenant: str, response_id: str) -> Stored | None:
        if self._db is None:
            return None
        row = self._db.execute(
            "SELECT data FROM responses WHERE tenant = ? AND id = ?", (tenant, response_id)
        ).fetchone()
        if row is None:
            return None
        data = orjson.loads(row[0])
        return Stored(tenant, data["response"], data["items"], data["history"], data["created"])

    def _insert(self, tenant: str, response_id: str, created: float, data: bytes) -> None:
        if self._db is None:
            return
        if len(data) > self._max:
            log.warning("response %s (%d bytes) is over the store's bound", response_id, len(data))
            return
        self._remove(tenant, response_id, commit=False)
        self._db.execute(
            "INSERT INTO responses (tenant, id, created, size, data) VALUES (?, ?, ?, ?, ?)",
            (tenant, response_id, created, len(data), data),
        )
        self._total += len(data)
        self.records += 1
        self._db.commit()
        if self._total > self._max or self._wall() - self._swept > SWEEP_EVERY:
            self._sweep()

    def _remove(self, tenant: str, response_id: str, commit: bool = True) -> None:
        if self._db is None:
            return
        row = self._db.execute(
            "DELETE FROM responses WHERE tenant = ? AND id = ? RETURNING size",
            (tenant, response_id),
        ).fetchone()
        if row is not None:
            self._total -= row[0]
            self.records -= 1
        if commit:
            self._db.commit()

    def _sweep(self) -> None:
        """Delete the expired records, then the oldest while over the size bound."""
        db = self._db
        if db is None:
            return
        self._swept = self._wall()
        db.execute("DELETE FROM responses WHERE created <= ?", (self._swept - self._ttl,))
        total, count = db.execute(
            "SELECT COALESCE(SUM(size), 0), COUNT(*) FROM responses"
        ).fetchone()
        while total > self._max and count:
            rows = db.execute(
                "DELETE FROM responses WHERE rowid IN"
                " (SELECT rowid FROM responses ORDER BY created LIMIT 64) RETURNING size"
            ).fetchall()
            total -= sum(row[0] for row in rows)
            count -= len(rows)
        db.commit()
        self._total, self.records = total, count
