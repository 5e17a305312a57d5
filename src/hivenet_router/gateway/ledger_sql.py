"""The ledger's connection to PostgreSQL: a pool whose every call is bounded, how a failed
call is classified, and the schema migrations (the DSN's check and redaction are in
ledger_dsn.py, which a router without wallets can import without asyncpg).

Every call waits for one of `size` slots (a saturated pool is `LedgerBusy`, not an
outage), then acquires a connection, runs its query and gives the connection back, within
a timeout of its own. A connection whose call failed other than by its own data, or timed
out, is terminated rather than given back: asyncpg would otherwise wait, unbounded, for a
cancel request that a hung server never answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

# asyncpg ships no type information; its few calls here are typed at their use.
import asyncpg  # type: ignore[import-untyped]

from hivenet_router.gateway.ledger_dsn import dsn_secrets, redact
from hivenet_router.gateway.pending import Charge

_T = TypeVar("_T")
Query = Callable[[Any], Awaitable[_T]]

LOCK_KEY: Final = 0x68697665_6E657457  # pg_advisory_xact_lock key of the migrations
RELEASE_TIMEOUT: Final = 1.0  # giving a healthy connection back; past it, it is terminated
_MIGRATION_NAME = re.compile(r"^(\d{3})_([a-z0-9_]+)\.sql$")

# Errors that belong to the call's own data (a NUL in a text, a number out of its column's
# range, a constraint): the database is fine, retrying the same call fails the same way.
REJECTED: Final = (
    asyncpg.DataError,
    asyncpg.IntegrityConstraintViolationError,
    asyncpg.ProgramLimitExceededError,
)
_CONNECTION: Final = (
    OSError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.exceptions.OperatorInterventionError,
)


class LedgerUnavailable(Exception):
    """The database did not answer (or not in time); the caller decides what fails open.
    `kind` is the metric label: connect, timeout, query, busy or rejected."""

    def __init__(self, message: str, kind: str = "query") -> None:
        super().__init__(message)
        self.kind = kind


class LedgerBusy(LedgerUnavailable):
    """Every connection was in use until the deadline: the database answers, but not this
    many calls at once. Not an outage."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "busy")


class LedgerRejected(LedgerUnavailable):
    """The database refused this call for its own data; the ledger itself is fine."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "rejected")


def failure_kind(exc: BaseException) -> str:
    if isinstance(exc, REJECTED):
        return "rejected"
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, _CONNECTION):
        return "connect"
    return "query"


# -- what goes into a charge ----------------------------------------------------------------

TEXT_MAX: Final = 200  # a model name or request ID, as written to the ledger
TOKENS_MAX: Final = 2**31 - 1  # the ledger's token columns are integer


def clean_text(value: str) -> str:
    """A client's text made storable: no NUL, no lone surrogate, bounded."""
    return value.replace("\x00", "")[:TEXT_MAX].encode("utf-8", "replace").decode("utf-8")


def _tokens(count: int) -> int:
    return max(0, min(int(count), TOKENS_MAX))


def settle_args(charge: Charge) -> tuple[Any, ...]:
    return (
        charge.charge_id,
        clean_text(charge.request_id),
        charge.tenant,
        charge.currency,
        charge.amount,
        clean_text(charge.model) if charge.record else None,  # a release writes no row
        _tokens(charge.input_tokens),
        _tokens(charge.output_tokens),
        charge.record,
    )


# Many settles in one statement (one round trip, one transaction). The wallets are locked in
# the order of their tenant, as the database sorts them (wallet_expire_holds sorts alike), so
# two routers settling overlapping tenants wait for each other and never deadlock; the
# sorted subquery fixes the order in which wallet_settle runs.
SETTLE_MANY: Final = (
    "SELECT s.n, wallet_settle(s.c, s.r, s.t, s.cur, s.a, s.m, s.i, s.o, s.rec) AS status "
    "FROM (SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], "
    "$5::numeric[], $6::text[], $7::integer[], $8::integer[], $9::boolean[]) "
    "WITH ORDINALITY AS b(c, r, t, cur, a, m, i, o, rec, n) ORDER BY b.t, b.n OFFSET 0) s"
)


async def settle_many(conn: Any, charges: list[Charge]) -> list[str]:
    """Settle `charges` in one statement: all or none (a charge refused for its data fails
    the lot). Returns each charge's status, in the order given."""
    columns = [list(column) for column in zip(*(settle_args(c) for c in charges), strict=True)]
    rows = await conn.fetch(SETTLE_MANY, *columns)
    statuses = [""] * len(charges)
    for row in rows:
        statuses[int(row["n"]) - 1] = str(row["status"])
    return statuses


HOLD: Final = "SELECT wallet_hold($1, $2, $3, $4, $5)"
# Many holds in one statement, the wallets locked in the order of their tenant (as above).
HOLD_MANY: Final = (
    "SELECT s.n, wallet_hold(s.c, s.r, s.t, s.cur, s.a) AS status "
    "FROM (SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], "
    "$5::numeric[]) WITH ORDINALITY AS b(c, r, t, cur, a, n) ORDER BY b.t, b.n OFFSET 0) s"
)


async def hold_one(conn: Any, args: tuple[Any, ...]) -> str:
    return str(await conn.fetchval(HOLD, *args))


async def hold_many(conn: Any, holds: list[tuple[Any, ...]]) -> list[str]:
    """wallet_hold for each row of arguments, in one statement: all or none. Returns each
    one's status, in the order given."""
    columns = [list(column) for column in zip(*holds, strict=True)]
    rows = await conn.fetch(HOLD_MANY, *columns)
    statuses = [""] * len(holds)
    for row in rows:
        statuses[int(row["n"]) - 1] = str(row["status"])
    return statuses


# -- the pool -------------------------------------------------------------------------------


async def _no_session_state(conn: Any) -> None:
    """The pool's reset between calls. The ledger keeps no session state (no SET, LISTEN or
    session lock; its one lock is transaction-scoped), so asyncpg's default reset query,
    one more round trip per call, has nothing to undo."""


def _terminate(conn: Any) -> None:
    """Drop a connection without a word to the server. One that closed itself is already
    back in the pool, and asyncpg refuses to terminate it: nothing left to do then."""
    with contextlib.suppress(Exception):
        conn.terminate()


class Database:
    def __init__(self, dsn: str, size: int, command_timeout: float) -> None:
        self.dsn = dsn
        self.size = size
        self.command_timeout = command_timeout  # asyncpg's own bound, under ours
        self.secrets = dsn_secrets(dsn)
        self._pool: Any = None
        self._slots = asyncio.Semaphore(size)

    def describe(self, exc: BaseException) -> str:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return redact(text, self.secrets)[:300]

    async def open(self) -> None:
        """Make the pool (no connection yet). Raises LedgerUnavailable."""
        if self._pool is not None:
            return
        try:
            self._pool = await asyncpg.create_pool(
                self.dsn,
                min_size=0,
                max_size=self.size,
                command_timeout=self.command_timeout,
                max_inactive_connection_lifetime=60.0,
                reset=_no_session_state,
            )
        except Exception as exc:  # a malformed DSN is a ValueError here: said, not raised
            raise LedgerUnavailable(self.describe(exc), "connect") from None

    async def call(self, query: Query[_T], timeout: float) -> _T:
        """Wait at most `timeout` for a slot (else LedgerBusy), then run `query` on a
        connection within `timeout`, connecting and giving it back included. Raises
        LedgerBusy, LedgerRejected or LedgerUnavailable, never anything else (but
        CancelledError)."""
        pool = self._pool
        if pool is None:
            raise LedgerUnavailable("not connected", "connect")
        try:
            async with asyncio.timeout(timeout):
                await self._slots.acquire()
        except TimeoutError:
            raise LedgerBusy(f"all {self.size} connections in use for {timeout:g}s") from None
        # The call on the connection has a timeout of its own: one that had waited long for
        # its slot must not be left too little time and then count as the database failing.
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            return await self._on_connection(pool, query, deadline)
        finally:
            self._slots.release()

    async def _on_connection(self, pool: Any, query: Query[_T], deadline: float) -> _T:
        conn: Any = None
        try:
            async with asyncio.timeout_at(deadline):
                conn = await pool.acquire()
                return await query(conn)
        except asyncio.CancelledError:
            if conn is not None:
                _terminate(conn)  # left mid-query: what the server still does is unknown
                conn = None
            raise
        except Exception as exc:
            kind = failure_kind(exc)
            if conn is None and kind != "timeout":
                kind = "connect"  # whatever failed, it failed before a connection was had
            if conn is not None and kind != "rejected":
                _terminate(conn)  # timed out or broken: never wait for its cancel request
                conn = None
            if kind == "rejected":
                raise LedgerRejected(self.describe(exc)) from None
            raise LedgerUnavailable(self.describe(exc), kind) from None
        finally:
            if conn is not None:
                await self._give_back(pool, conn)

    async def _give_back(self, pool: Any, conn: Any) -> None:
        try:
            async with asyncio.timeout(RELEASE_TIMEOUT):
                await pool.release(conn)
        except asyncio.CancelledError:
            _terminate(conn)
            raise
        except Exception:  # the connection is lost or stuck: drop it, the pool makes another
            _terminate(conn)

    async def close(self, timeout: float) -> None:
        """Close the pool within `timeout`, else terminate it. Never raises."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        try:
            async with asyncio.timeout(timeout):
                await pool.close()
        except Exception:
            pool.terminate()


# -- migrations -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str


def migrations() -> list[Migration]:
    """The migrations shipped with this code, in order (blocking: reads package files)."""
    found: list[Migration] = []
    for entry in (
        importlib.resources.files("hivenet_router.gateway").joinpath("migrations").iterdir()
    ):
        match = _MIGRATION_NAME.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    if [m.version for m in found] != list(range(1, len(found) + 1)):
        raise RuntimeError("wallet migrations must be numbered 001, 002, ... without gaps")
    return found


async def migrate(conn: Any, known: list[Migration]) -> tuple[int, list[Migration]]:
    """Apply what is missing, in one transaction, under an advisory lock: routers that start
    together wait for the first one instead of racing it. Returns the schema's version and
    what was applied; a version above len(known) means a newer router migrated it and
    nothing was done."""
    applied: list[Migration] = []
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", LOCK_KEY)
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS wallet_migrations (version integer PRIMARY KEY, "
            "name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        current = int(
            await conn.fetchval("SELECT COALESCE(max(version), 0) FROM wallet_migrations")
        )
        if current > len(known):
            return current, applied
        for migration in known[current:]:
            await conn.execute(migration.sql)
            await conn.execute(
                "INSERT INTO wallet_migrations (version, name) VALUES ($1, $2)",
                migration.version,
                migration.name,
            )
            applied.append(migration)
    return len(known), applied
