"""Per-agent universal history (and, with the persistent quota backend, daily token totals),
kept in SQLite so a known peer ID starts warm and budgets survive a restart.

One connection, owned by one worker thread: every call runs there, so the event loop never
waits on the disk and SQLite never sees two threads. Records older than the TTL expire.

One process at a time: rows are keyed by peer ID alone, so two routers on one directory
(--reuse-port processes started from the same place) would overwrite each other's counts,
and one's reset would delete the other's open database. An exclusive lock on a file beside
the database, held while the store is open, refuses the second.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import os
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import orjson

T = TypeVar("T")
DB_FILE = "hivenet.sqlite3"
LOCK_FILE = DB_FILE + ".lock"  # never deleted: a reset must not free another's lock


class StoreInUse(OSError):
    """Another process (or another store of this one) holds the directory's lock."""


@dataclass(frozen=True, slots=True)
class AgentHistory:
    peer_id: str
    successes: int = 0
    failures: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    disconnects: int = 0
    health_failures: int = 0
    backend_failures: int = 0
    rejected: int = 0
    srtt_ms: float | None = None
    rttvar_ms: float | None = None


@dataclass(frozen=True, slots=True)
class StoreStats:
    """What the store holds, for operators (GET /admin/storage)."""

    backend: str
    path: str
    history_records: int
    quota_records: int
    file_bytes: int
    wal_bytes: int
    ttl_days: int
    last_expiry: float | None  # wall time of the last pass that expired old records


class HistoryStore(Protocol):
    async def load(self, peer_id: str) -> AgentHistory | None: ...

    async def save(self, items: list[AgentHistory]) -> None: ...

    async def clear(self) -> None:
        """Forget every agent's history (daily token totals stay)."""
        ...

    async def stats(self) -> StoreStats | None: ...

    async def close(self) -> None: ...


class MemoryHistory:
    """For tests and for routers started without a disk path."""

    def __init__(self) -> None:
        self._items: dict[str, AgentHistory] = {}

    async def load(self, peer_id: str) -> AgentHistory | None:
        return self._items.get(peer_id)

    async def save(self, items: list[AgentHistory]) -> None:
        for item in items:
            self._items[item.peer_id] = item

    async def clear(self) -> None:
        self._items.clear()

    async def stats(self) -> StoreStats | None:
        return None  # nothing on disk to describe

    async def close(self) -> None:
        pass


def reset(directory: Path) -> None:
    """Delete this router's database files in `directory` (and nothing else there). Only
    while holding the directory's lock (SqliteHistory.open(reset=True) does)."""
    for name in (DB_FILE, DB_FILE + "-wal", DB_FILE + "-shm"):
        (directory / name).unlink(missing_ok=True)


def _lock(directory: Path) -> int:
    """Take the directory's lock without waiting; return its descriptor (closing it, or the
    process ending in any way, releases it). Raises StoreInUse when another holds it."""
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        by = f" (pid {holder})" if holder.isdigit() else ""
        raise StoreInUse(
            f"the store in {directory} is open in another process{by}; {path} is its lock"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    # Who holds it, for the message the next one gets; the lock, not this text, decides, so
    # a full disk that refuses the note does not refuse the store.
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


class SqliteHistory:
    def __init__(self, directory: Path, ttl_days: int, wall: Callable[[], float] = time.time):
        self._path = directory / DB_FILE
        self._ttl = ttl_days * 86400.0
        self._wall = wall
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hivenet-store")
        self._db: sqlite3.Connection | None = None
        self._lock: int | None = None
        self._expired_at: float | None = None

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def open(self, *, reset: bool = False) -> None:
        """Lock the directory, then (with `reset`) delete the database files, then open
        them. Raises StoreInUse, OSError or sqlite3.Error; the lock is released then."""
        await self._run(lambda: self._open(reset))

    def _open(self, reset_first: bool) -> None:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = _lock(self._path.parent)
        try:
            if reset_first:
                reset(self._path.parent)
            self._connect()
        except BaseException:
            if self._db is not None:
                self._db.close()
                self._db = None
            self._unlock()
            raise

    def _unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def _connect(self) -> None:
        db = sqlite3.connect(self._path)
        try:
            self._schema(db)
        except BaseException:
            db.close()
            raise
        self._db = db  # set first: a failed expiry pass still closes it (see _open)
        self._expire()

    @staticmethod
    def _schema(db: sqlite3.Connection) -> None:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute(
            "CREATE TABLE IF NOT EXISTS universal_history ("
            " peer_id TEXT PRIMARY KEY, data BLOB NOT NULL, updated_at REAL NOT NULL)"
        )
        db.execute(
            "CREATE TABLE IF NOT EXISTS quota_tpd ("
            " bucket TEXT NOT NULL, day TEXT NOT NULL, used INTEGER NOT NULL,"
            " PRIMARY KEY (bucket, day))"
        )
        db.commit()

    def _expire(self) -> None:
        if self._ttl and self._db is not None:
            self._db.execute(
                "DELETE FROM universal_history WHERE updated_at < ?", (self._wall() - self._ttl,)
            )
            self._db.commit()
            self._expired_at = self._wall()

    async def load(self, peer_id: str) -> AgentHistory | None:
        return await self._run(lambda: self._load(peer_id))

    def _load(self, peer_id: str) -> AgentHistory | None:
        assert self._db is not None
        row = self._db.execute(
            "SELECT data, updated_at FROM universal_history WHERE peer_id = ?", (peer_id,)
        ).fetchone()
        if row is None or (self._ttl and row[1] < self._wall() - self._ttl):
            return None
        fields = {f.name for f in dataclasses.fields(AgentHistory)}
        data = {k: v for k, v in orjson.loads(row[0]).items() if k in fields}
        return AgentHistory(**{**data, "peer_id": peer_id})

    async def save(self, items: list[AgentHistory]) -> None:
        if items:
            await self._run(lambda: self._save(items))

    def _save(self, items: list[AgentHistory]) -> None:
        assert self._db is not None
        now = self._wall()
        self._db.executemany(
            "INSERT INTO universal_history (peer_id, data, updated_at) VALUES (?, ?, ?) "
            "ON CONFLICT(peer_id) DO UPDATE SET data = excluded.data, "
            "updated_at = excluded.updated_at",
            [(item.peer_id, orjson.dumps(dataclasses.asdict(item)), now) for item in items],
        )
        self._db.commit()
        self._expire()

    async def load_tokens(self, day: str) -> dict[str, int]:
        """Daily token totals of `day` (a UTC date), by budget key."""

        def read() -> dict[str, int]:
            assert self._db is not None
            rows = self._db.execute("SELECT bucket, used FROM quota_tpd WHERE day = ?", (day,))
            return {bucket: int(used) for bucket, used in rows}

        return await self._run(read)

    async def save_tokens(self, day: str, totals: dict[str, int]) -> None:
        def write() -> None:
            assert self._db is not None
            self._db.executemany(
                "INSERT INTO quota_tpd (bucket, day, used) VALUES (?, ?, ?) "
                "ON CONFLICT(bucket, day) DO UPDATE SET used = excluded.used",
                [(bucket, day, used) for bucket, used in totals.items()],
            )
            # Yesterday is kept for the restart that straddles midnight; older days go.
            self._db.execute("DELETE FROM quota_tpd WHERE day < date(?, '-1 day')", (day,))
            self._db.commit()

        await self._run(write)

    async def clear(self) -> None:
        def wipe() -> None:
            assert self._db is not None
            self._db.execute("DELETE FROM universal_history")
            self._db.commit()

        await self._run(wipe)

    async def stats(self) -> StoreStats:
        def count() -> StoreStats:
            assert self._db is not None
            history = self._db.execute("SELECT COUNT(*) FROM universal_history").fetchone()[0]
            quota = self._db.execute("SELECT COUNT(*) FROM quota_tpd").fetchone()[0]
            sizes = []
            for path in (self._path, self._path.with_name(DB_FILE + "-wal")):
                try:
                    sizes.append(path.stat().st_size)
                except OSError:
                    sizes.append(0)
            return StoreStats(
                "sqlite",
                str(self._path),
                int(history),
                int(quota),
                sizes[0],
                sizes[1],
                int(self._ttl // 86400),
                self._expired_at,
            )

        return await self._run(count)

    async def close(self) -> None:
        def shut() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None
            self._unlock()  # after the database is closed: the next owner finds it whole

        await self._run(shut)
        # The worker is idle now (its last job was awaited): let it end without joining it
        # on the event loop.
        self._pool.shutdown(wait=False)
