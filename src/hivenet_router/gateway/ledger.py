"""Tenant wallets in PostgreSQL: balances, holds and an append-only ledger.

Every router of a site uses the same database; every change of money is one SQL function
call (gateway/migrations/), so the invariants hold across routers: a wallet's balance is
the sum of its ledger rows, its `held` the sum of its holds, and a charge is written once
per admitted request whatever retries it.

Fail-open: a call that fails or takes longer than `timeout` marks the ledger down (one
warning per outage). While down, requests go on without a balance check and their charges
wait in the local pending store (gateway/pending.py); `run()` reconnects with backoff,
applies the migrations, bills what is pending, and expires holds whose router died.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import itertools
import logging
import re
import secrets
import sqlite3
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any, Final, TypeVar
from urllib.parse import unquote, urlsplit

# asyncpg ships no type information; its few calls here are typed at their use.
import asyncpg  # type: ignore[import-untyped]

from hivenet_router.gateway.pending import Charge, PendingStore
from hivenet_router.observability.wallet_metrics import WalletSnapshot

log = logging.getLogger("hivenet.router")
_T = TypeVar("_T")

LOCK_KEY: Final = 0x68697665_6E657457  # pg_advisory_xact_lock key of the migrations
RETRY_MIN, RETRY_MAX = 0.25, 4.0  # reconnect backoff, seconds
CONNECT_TIMEOUT: Final = 10.0  # connecting and migrating at most (a lock may be waited on)
TICK: Final = 5.0  # the background loop's pace when nothing wakes it
EXPIRE_EVERY: Final = 60.0
BATCH: Final = 200  # pending charges billed per round
REFUSALS: Final = ("insufficient", "no_wallet", "currency", "no_price")
ERROR_KINDS: Final = ("connect", "timeout", "query", "schema", "pending")
DB_ERRORS: Final = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError)
_MIGRATION_NAME = re.compile(r"^(\d{3})_([a-z0-9_]+)\.sql$")


class LedgerUnavailable(Exception):
    """The database did not answer (or not in time); the caller decides what fails open."""


class SchemaTooNew(Exception):
    def __init__(self, found: int, known: int) -> None:
        super().__init__(f"schema version {found} is newer than this router knows ({known})")
        self.found = found
        self.known = known


@dataclass(frozen=True, slots=True)
class Wallet:
    tenant: str
    currency: str
    balance: Decimal
    held: Decimal

    @property
    def available(self) -> Decimal:
        return self.balance - self.held


@dataclass(frozen=True, slots=True)
class HoldResult:
    """'held'; 'skipped' (ledger down, nothing asked) or 'unknown' (the call failed: a hold
    may exist, the settle removes it); or a refusal: 'no_wallet', 'currency' (detail: the
    wallet's currency), 'insufficient' (detail: what is available)."""

    status: str
    detail: str = ""

    @property
    def refused(self) -> bool:
        return self.status in ("no_wallet", "currency", "insufficient")

    @property
    def unbilled(self) -> bool:
        return self.status in ("skipped", "unknown")


@dataclass(frozen=True, slots=True)
class Reconciliation:
    ok: bool
    tenants: int
    mismatches: list[dict[str, str]]


@dataclass(slots=True)
class LedgerStats:
    unbilled: int = 0
    charges: int = 0
    holds_expired: int = 0
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REFUSALS, 0))
    errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ERROR_KINDS, 0))


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


def _kind(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, OSError | asyncpg.InterfaceError | asyncpg.CannotConnectNowError):
        return "connect"
    return "query"


class Ledger:
    def __init__(
        self,
        dsn: str,
        pending_dir: Path,
        timeout: float,
        *,
        pool_size: int = 10,
        hold_ttl: float = 900.0,
    ) -> None:
        self.dsn = dsn
        self.pending_dir = pending_dir
        self.timeout = timeout
        self.pool_size = pool_size
        self.hold_ttl = hold_ttl  # a hold older than this is released (its router died)
        self.pending = PendingStore(pending_dir)
        self.stats = LedgerStats()
        self.up = False
        self.schema_version = 0
        self._pool: asyncpg.Pool | None = None
        self._migrations: list[Migration] | None = None
        self._prefix = secrets.token_hex(8)  # this process's charge keys: unique per router
        self._seq = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()
        self._to_disk: list[Charge] = []
        self._flusher: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._warned = False  # an outage was reported: its end will be too
        self._down_since = 0.0
        self._billed_in_outage = 0
        self._schema_error = 0  # the newer version last reported, to say it once
        self._secret = unquote(urlsplit(dsn).password or "") if "://" in dsn else ""

    # -- the request path ---------------------------------------------------------------------

    def new_charge_id(self) -> str:
        return f"{self._prefix}-{next(self._seq):x}"

    async def hold(
        self, charge_id: str, request_id: str, tenant: str, currency: str, amount: Decimal
    ) -> HoldResult:
        """Hold `amount` if the wallet has anything left; never raises (fail-open)."""
        if not self.up or self._pool is None:
            return HoldResult("skipped")
        try:
            status = await self._call(
                lambda conn: conn.fetchval(
                    "SELECT wallet_hold($1, $2, $3, $4, $5)",
                    charge_id,
                    request_id,
                    tenant,
                    currency,
                    amount,
                )
            )
        except LedgerUnavailable:
            return HoldResult("unknown")
        except asyncio.CancelledError:
            # The request went away while asking: a hold may have been taken. Release it.
            self.settle_soon(
                Charge(charge_id, request_id, tenant, currency, "", Decimal(0), record=False)
            )
            raise
        head, _, detail = str(status).partition(":")
        return HoldResult(head, detail)

    def settle_soon(self, charge: Charge) -> None:
        """Settle in the background (close hooks must not wait on the database); a charge
        the ledger cannot take now goes to the pending store."""
        task = asyncio.get_running_loop().create_task(self._settle_or_keep(charge))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _settle_or_keep(self, charge: Charge) -> None:
        try:
            if self.up and self._pool is not None:
                with contextlib.suppress(LedgerUnavailable):
                    await self.settle(charge)
                    return
        except asyncio.CancelledError:
            self._keep(charge)  # shutting down: the charge is not lost
            raise
        self._keep(charge)

    async def settle(self, charge: Charge) -> str:
        """One settle in the database: 'settled', 'duplicate', 'released' or 'currency:X'.
        Raises LedgerUnavailable."""
        status = str(
            await self._call(
                lambda conn: conn.fetchval(
                    "SELECT wallet_settle($1, $2, $3, $4, $5, $6, $7, $8, $9)",
                    charge.charge_id,
                    charge.request_id,
                    charge.tenant,
                    charge.currency,
                    charge.amount,
                    charge.model,
                    charge.input_tokens,
                    charge.output_tokens,
                    charge.record,
                )
            )
        )
        if status == "settled":
            self.stats.charges += 1
        elif status.startswith("currency:"):
            # Only when let through unchecked, or after a price's currency changed: the
            # charge cannot go to a wallet in another currency. Said, counted, dropped.
            self.stats.errors["query"] += 1
            log.error(
                "wallet of %s is in %s, a charge of %s %s for request %s cannot be billed",
                charge.tenant,
                status[9:],
                charge.amount,
                charge.currency,
                charge.request_id,
            )
        return status

    # -- the pending store ----------------------------------------------------------------------

    def _keep(self, charge: Charge) -> None:
        self._to_disk.append(charge)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        while self._to_disk:
            batch, self._to_disk = self._to_disk, []
            try:
                await self.pending.add(batch)
            except (OSError, sqlite3.Error) as exc:
                self.stats.errors["pending"] += 1
                log.error("cannot keep %d unbilled charges on disk: %s", len(batch), exc)
                self._to_disk[:0] = batch  # still in memory; try again
                await asyncio.sleep(1.0)
        self._wake.set()

    async def _bill_pending(self) -> None:
        """Bill what waits on disk, a batch at a time, until it is empty or the ledger fails."""
        while self.up and self.pending.count:
            batch = await self.pending.take(BATCH)
            done: list[str] = []
            try:
                for charge in batch:
                    await self.settle(charge)
                    done.append(charge.charge_id)
            except LedgerUnavailable:
                return
            finally:
                await self.pending.remove(done)
                self._billed_in_outage += len(done)
        if self._warned and self.up and not self.pending.count and not self._to_disk:
            log.warning(
                "ledger back after %.1fs: %d pending charges billed",
                time.monotonic() - self._down_since,
                self._billed_in_outage,
            )
            self._warned = False

    # -- calls and their failures -----------------------------------------------------------

    async def _call(self, query: Callable[[asyncpg.Connection], Awaitable[_T]]) -> _T:
        pool = self._pool
        if pool is None:
            raise LedgerUnavailable("not connected")
        try:
            async with asyncio.timeout(self.timeout), pool.acquire() as conn:
                return await query(conn)
        except DB_ERRORS as exc:
            self._failed(exc)
            raise LedgerUnavailable(self._describe(exc)) from None

    def _failed(self, exc: BaseException) -> None:
        self.stats.errors[_kind(exc)] += 1
        if self.up or not self._warned:
            log.warning(
                "ledger unreachable (%s): requests go on unbilled and their charges wait in "
                "%s until it answers",
                self._describe(exc),
                self.pending.path,
            )
            if not self._warned:
                self._down_since = time.monotonic()
                self._billed_in_outage = 0
            self._warned = True
        self.up = False
        self._wake.set()

    def _describe(self, exc: BaseException) -> str:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        for secret in (self.dsn, self._secret):
            if secret:
                text = text.replace(secret, "***")
        return text[:300]

    # -- the background loop ----------------------------------------------------------------

    async def run(self) -> None:
        """Connect, apply migrations, bill pending charges, expire stale holds; reconnect with
        backoff whenever the database fails. Runs until cancelled."""
        try:
            found = await self.pending.open()
        except (OSError, sqlite3.Error) as exc:
            self.stats.errors["pending"] += 1
            log.error("cannot open the pending charges in %s: %s", self.pending.path, exc)
        else:
            if found:
                log.warning(
                    "%d unbilled charges found in %s: billed once the ledger answers",
                    found,
                    self.pending.path,
                )
        delay, expire_at = RETRY_MIN, 0.0
        while True:
            if not self.up and not await self._connect():
                self._wake.clear()  # the failure just seen set it: back off all the same
                await self._sleep(delay)
                delay = min(delay * 2, RETRY_MAX)
                continue
            delay = RETRY_MIN
            await self._bill_pending()
            if self.up and time.monotonic() >= expire_at:
                expire_at = time.monotonic() + EXPIRE_EVERY
                await self._expire()
            await self._sleep(TICK)

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()
        self._wake.clear()

    async def _connect(self) -> bool:
        try:
            if self._migrations is None:
                self._migrations = await asyncio.to_thread(migrations)
            async with asyncio.timeout(max(self.timeout, CONNECT_TIMEOUT)):
                if self._pool is None:
                    self._pool = await asyncpg.create_pool(
                        self.dsn,
                        min_size=0,
                        max_size=self.pool_size,
                        timeout=self.timeout,
                        max_inactive_connection_lifetime=60.0,
                    )
                await self._migrate(self._pool, self._migrations)
        except SchemaTooNew as exc:
            self.stats.errors["schema"] += 1
            if self._schema_error != exc.found:
                self._schema_error = exc.found
                log.error("ledger %s: upgrade this router; wallets go on fail-open", exc)
            return False
        except DB_ERRORS as exc:
            self._failed(exc)
            return False
        self.up = True
        if not self._warned:
            log.info("ledger connected (schema version %d)", self.schema_version)
        return True

    async def _migrate(self, pool: asyncpg.Pool, known: list[Migration]) -> None:
        """Apply what is missing, in one transaction, under an advisory lock: routers that
        start together wait for the first one instead of racing it."""
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", LOCK_KEY)
            await conn.execute(
                "CREATE TABLE IF NOT EXISTS wallet_migrations (version integer PRIMARY KEY, "
                "name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
            )
            current = int(
                await conn.fetchval("SELECT COALESCE(max(version), 0) FROM wallet_migrations")
            )
            if current > len(known):
                raise SchemaTooNew(current, len(known))
            for migration in known[current:]:
                await conn.execute(migration.sql)
                await conn.execute(
                    "INSERT INTO wallet_migrations (version, name) VALUES ($1, $2)",
                    migration.version,
                    migration.name,
                )
                log.info("ledger: applied migration %03d_%s", migration.version, migration.name)
        self.schema_version = len(known)

    async def _expire(self) -> None:
        age = timedelta(seconds=self.hold_ttl)
        with contextlib.suppress(LedgerUnavailable):
            count = int(
                await self._call(lambda conn: conn.fetchval("SELECT wallet_expire_holds($1)", age))
            )
            if count:
                self.stats.holds_expired += count
                log.warning("ledger: released %d holds older than %gs", count, self.hold_ttl)

    async def idle(self, timeout: float) -> bool:
        """Wait until no settle is in flight and nothing waits to be written to disk."""
        async with asyncio.timeout(timeout):
            while self._tasks or (self._flusher is not None and not self._flusher.done()):
                await asyncio.gather(
                    *self._tasks,
                    *([self._flusher] if self._flusher else []),
                    return_exceptions=True,
                )
        return True

    async def close(self) -> None:
        """Finish the settles in flight (within `timeout`), keep what is still unbilled on
        disk and close the pool."""
        tasks = list(self._tasks)
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=self.timeout)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        if self._flusher is not None:
            await asyncio.gather(self._flusher, return_exceptions=True)
        try:
            if self._to_disk:
                batch, self._to_disk = self._to_disk, []
                await self.pending.add(batch)
            if self.pending.count:
                log.warning(
                    "%d unbilled charges kept in %s for the next start",
                    self.pending.count,
                    self.pending.path,
                )
        finally:
            await self.pending.close()
            await self._close_pool()

    async def _close_pool(self) -> None:
        pool, self._pool = self._pool, None
        self.up = False
        if pool is None:
            return
        try:
            async with asyncio.timeout(self.timeout):
                await pool.close()
        except (TimeoutError, *DB_ERRORS):
            pool.terminate()

    # -- the admin API ------------------------------------------------------------------------

    async def credit(
        self, tenant: str, amount: Decimal, currency: str | None, note: str | None
    ) -> Wallet:
        """Add `amount`; opens the wallet at its first credit. A currency other than the
        wallet's changes nothing: compare the returned wallet's. Raises LedgerUnavailable."""
        row = await self._call(
            lambda conn: conn.fetchrow(
                "SELECT * FROM wallet_credit($1, $2, $3, $4)", tenant, currency, amount, note
            )
        )
        return Wallet(tenant, row["currency"], row["balance"], row["held"])

    async def wallet(self, tenant: str) -> Wallet | None:
        row = await self._call(
            lambda conn: conn.fetchrow(
                "SELECT currency, balance, held FROM wallets WHERE tenant = $1", tenant
            )
        )
        if row is None:
            return None
        return Wallet(tenant, str(row["currency"]), row["balance"], row["held"])

    async def entries(self, tenant: str, limit: int, before: int | None) -> list[dict[str, Any]]:
        """A page of the tenant's ledger, newest first, rows with `id < before`."""
        rows = await self._call(
            lambda conn: conn.fetch(
                "SELECT id, kind, amount, balance_after, currency, charge_id, request_id, model,"
                " input_tokens, output_tokens, note, created_at FROM ledger"
                " WHERE tenant = $1 AND ($2::bigint IS NULL OR id < $2)"
                " ORDER BY id DESC LIMIT $3",
                tenant,
                before,
                limit,
            )
        )
        return [dict(row) for row in rows]

    async def reconcile(self) -> Reconciliation:
        return await self._call(_reconcile)

    def snapshot(self) -> WalletSnapshot:
        stats = self.stats
        return WalletSnapshot(
            up=self.up,
            pending=self.pending.count + len(self._to_disk),
            unbilled=stats.unbilled,
            charges=stats.charges,
            holds_expired=stats.holds_expired,
            refused=dict(stats.refused),
            errors=dict(stats.errors),
        )


async def _reconcile(conn: asyncpg.Connection) -> Reconciliation:
    """wallet_reconcile() over one consistent snapshot, with the number of wallets."""
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        rows = await conn.fetch("SELECT * FROM wallet_reconcile()")
        tenants = int(await conn.fetchval("SELECT count(*) FROM wallets"))
    mismatches = [
        {name: "" if value is None else str(value) for name, value in row.items()} for row in rows
    ]
    return Reconciliation(not mismatches, tenants, mismatches)
