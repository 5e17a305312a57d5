"""Stored responses in PostgreSQL (the ledger's database, `--ledger-dsn`): one table shared
by every router of a site, so a conversation continues on whichever router a client
reaches. The same behaviour as the SQLite store (store.py); asyncpg is imported only by a
router that has a DSN.

A read the database cannot answer in time is a `503 backend_unavailable` (the client may
retry), also while it is down at the router's start; a write that fails is logged, and
the response it would have kept reads as absent once its in-memory copy is gone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.responses.store import SWEEP_EVERY, SWEEP_TARGET, Key, ResponseStore, log

T = TypeVar("T")
POOL_SIZE = 4
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS hivenet_responses (tenant TEXT NOT NULL, id TEXT NOT NULL,"
    " created DOUBLE PRECISION NOT NULL, size INTEGER NOT NULL, data BYTEA NOT NULL,"
    " PRIMARY KEY (tenant, id));"
    " CREATE INDEX IF NOT EXISTS hivenet_responses_created ON hivenet_responses (created)"
)


class PgResponses(ResponseStore):
    def __init__(
        self,
        dsn: str,
        ttl: float,
        max_bytes: int,
        timeout: float,
        wall: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(ttl, max_bytes, wall)
        self._dsn = dsn
        self._timeout = timeout
        self._pool: Any = None
        self._ready = False  # the table is known to exist
        self._total = 0
        self._swept = 0.0
        # Writes one at a time, in the order kept (tasks take an asyncio lock first come,
        # first served), so a sweep never races the inserts it counts.
        self._writing = asyncio.Lock()

    async def open(self) -> None:
        """Make the pool, then the table and a first sweep if the database answers; if it
        does not, the router starts all the same (as the ledger does) and the table is made
        by the first call that reaches it. Raises OSError for a DSN that cannot be used."""
        import asyncpg  # type: ignore[import-untyped]  # noqa: PLC0415 (only with a DSN)

        try:
            self._pool = await asyncpg.create_pool(
                self._dsn, min_size=0, max_size=POOL_SIZE, command_timeout=self._timeout
            )
        except Exception as exc:  # a malformed DSN is a ValueError: said, never quoted
            raise OSError(f"the response store's database: {type(exc).__name__}") from None
        try:
            await self._sweep()
        except ApiError:
            log.warning("the response store's database does not answer yet; continuing")

    async def _close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            try:
                async with asyncio.timeout(self._timeout):
                    await pool.close()
            except Exception:
                pool.terminate()

    async def _call(self, query: Callable[[Any], Awaitable[T]]) -> T:
        pool = self._pool
        if pool is None:
            raise ApiError(ErrorCode.BACKEND_UNAVAILABLE, "the response store is closed")
        try:
            async with asyncio.timeout(self._timeout):
                async with pool.acquire() as conn:
                    if not self._ready:
                        await conn.execute(_SCHEMA)
                        self._ready = True
                    return await query(conn)
        except (asyncio.CancelledError, ApiError):
            raise
        except Exception as exc:
            log.warning("the response store's database failed: %s", type(exc).__name__)
            raise ApiError(
                ErrorCode.BACKEND_UNAVAILABLE, "the response store is unavailable; retry"
            ) from None

    def _write(self, key: Key, created: float, data: bytes) -> asyncio.Future[None]:
        return asyncio.ensure_future(self._in_turn(key, created, data))

    async def _in_turn(self, key: Key, created: float, data: bytes) -> None:
        async with self._writing:
            await self._insert(key, created, data)

    async def _insert(self, key: Key, created: float, data: bytes) -> None:
        if len(data) > self.max_bytes:
            log.warning("response %s (%d bytes) is over the store's bound", key[1], len(data))
            return
        await self._call(
            lambda conn: conn.execute(
                "INSERT INTO hivenet_responses (tenant, id, created, size, data)"
                " VALUES ($1, $2, $3, $4, $5) ON CONFLICT (tenant, id) DO UPDATE"
                " SET created = $3, size = $4, data = $5",
                *key,
                created,
                len(data),
                data,
            )
        )
        self._total += len(data)
        if self._total > self.max_bytes or self.wall() - self._swept > SWEEP_EVERY:
            await self._sweep()

    async def _read(self, key: Key) -> bytes | None:
        row = await self._call(
            lambda conn: conn.fetchval(
                "SELECT data FROM hivenet_responses WHERE tenant = $1 AND id = $2", *key
            )
        )
        return bytes(row) if row is not None else None

    async def _erase(self, key: Key) -> None:
        await self._call(
            lambda conn: conn.execute(
                "DELETE FROM hivenet_responses WHERE tenant = $1 AND id = $2", *key
            )
        )

    async def _sweep(self) -> None:
        """Delete the expired records, then, over the size bound, the oldest until the rest
        take at most SWEEP_TARGET of it (every router of the site sweeps the one table)."""
        self._swept = self.wall()
        target = int(self.max_bytes * SWEEP_TARGET)

        async def sweep(conn: Any) -> int:
            await conn.execute(
                "DELETE FROM hivenet_responses WHERE created <= $1", self._swept - self.ttl
            )
            total: int = await conn.fetchval("SELECT COALESCE(SUM(size), 0) FROM hivenet_responses")
            if total <= self.max_bytes:
                return total
            freed: int = await conn.fetchval(
                "WITH ordered AS (SELECT tenant, id, size,"
                " SUM(size) OVER (ORDER BY created, id) AS running FROM hivenet_responses),"
                " gone AS (DELETE FROM hivenet_responses r USING ordered o"
                " WHERE r.tenant = o.tenant AND r.id = o.id AND o.running - o.size < $1"
                " RETURNING r.size) SELECT COALESCE(SUM(size), 0) FROM gone",
                total - target,
            )
            return total - freed

        self._total = await self._call(sweep)
