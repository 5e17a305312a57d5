"""Tenant wallets in PostgreSQL: balances, holds and an append-only ledger.

Every router of a site uses the same database; every change of money is one SQL function
call (gateway/migrations/), so the invariants hold across routers: a wallet's balance is
the sum of its ledger rows, its `held` the sum of its holds, and a charge is written once
per admitted request whatever retries it.

Fail-open: a request-path call (hold, settle) that fails or takes longer than `timeout`
marks the ledger down (one warning per outage). While down, requests go on without a
balance check and their charges wait in the local pending store (gateway/pending.py);
`run()` reconnects with backoff, applies the migrations, bills what is pending, refreshes
the holds of requests still running and expires those whose router died. Three failures
are not an outage: a saturated pool (`LedgerBusy`: the request is refused, 503), a call
refused for its own data (`LedgerRejected`: that charge becomes a dead letter), and any
failure of an admin or housekeeping call (its caller hears of it, nobody else).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any, Final, TypeVar

from hivenet_router.gateway import ledger_admin
from hivenet_router.gateway.ledger_admin import Credited, Reconciliation, Wallet, valid_tenant
from hivenet_router.gateway.ledger_keep import (
    DISK_TIMEOUT,
    ChargeKeeper,
    LedgerStats,
    SettleQueue,
    TurnGather,
)
from hivenet_router.gateway.ledger_sql import (
    Database,
    LedgerBusy,
    LedgerRejected,
    LedgerUnavailable,
    Migration,
    clean_text,
    hold_many,
    hold_one,
    migrate,
    migrations,
    settle_args,
    settle_many,
)
from hivenet_router.gateway.pending import Charge, PendingStore
from hivenet_router.observability.wallet_metrics import WalletSnapshot

__all__ = [
    "Credited",
    "HoldResult",
    "Ledger",
    "LedgerBusy",
    "LedgerRejected",
    "LedgerStats",
    "LedgerUnavailable",
    "Reconciliation",
    "Wallet",
    "migrations",
]

log = logging.getLogger("hivenet.router")
_T = TypeVar("_T")

RETRY_MIN, RETRY_MAX = 0.2, 10.0  # the background loop's backoff after a failed turn, seconds
CONNECT_TIMEOUT: Final = 10.0  # connecting and migrating at most (a lock may be waited on)
ADMIN_TIMEOUT: Final = 30.0  # admin calls and housekeeping (a reconciliation scans it all)
TICK: Final = 5.0  # the background loop's pace when nothing wakes it
CHORES_EVERY: Final = 60.0  # refresh live holds, expire dead ones
BATCH: Final = 200  # pending charges billed per round
_REJECTIONS_LOGGED: Final = 20  # then one in a thousand


@dataclass(frozen=True, slots=True)
class HoldResult:
    """'held'; 'skipped' (ledger down, nothing asked) or 'unknown' (the call failed: a hold
    may exist, the settle removes it); 'busy' (every connection in use: refuse, 503); or a
    refusal: 'no_wallet', 'currency' (detail: the wallet's currency), 'insufficient'
    (detail: what is available)."""

    status: str
    detail: str = ""

    @property
    def refused(self) -> bool:
        return self.status in ("no_wallet", "currency", "insufficient")

    @property
    def unbilled(self) -> bool:
        return self.status in ("skipped", "unknown")


class Ledger:
    def __init__(
        self,
        dsn: str,
        pending_dir: Path,
        timeout: float,
        *,
        pool_size: int = 10,
        hold_ttl: float = 900.0,
        admin_timeout: float = ADMIN_TIMEOUT,
        chores_every: float = CHORES_EVERY,
    ) -> None:
        self.pending_dir = pending_dir
        self.timeout = timeout  # every call on the request path
        self.admin_timeout = admin_timeout
        self.hold_ttl = hold_ttl  # a hold older than this is released (its router died)
        self.chores_every = chores_every
        self.pending = PendingStore(pending_dir)
        self.stats = LedgerStats()
        self.up = False
        self.schema_version = 0
        command_timeout = max(timeout, admin_timeout, CONNECT_TIMEOUT) + 1.0
        self._db = Database(dsn, pool_size, command_timeout)
        self._migrations: list[Migration] | None = None
        self._prefix = secrets.token_hex(8)  # this process's charge keys: unique per router
        self._seq = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()
        self._live: set[str] = set()  # charge IDs held and not yet settled: refreshed
        self._wake = asyncio.Event()
        self._keeper = ChargeKeeper(self.pending, self.stats, self._wake.set)
        self._settling = SettleQueue(self._settle_batch, self._keep_all, self._tasks)
        self._holding = TurnGather(self._send_holds, abandoned=self._release_abandoned)
        self._warned = False  # an outage was reported: its end will be too
        self._down_since = 0.0
        self._billed_in_outage = 0
        self._schema_error = 0  # the newer version last reported, to say it once
        self._chores_at = 0.0
        self._last_loop_error = ""

    # -- the request path ---------------------------------------------------------------------

    def new_charge_id(self) -> str:
        return f"{self._prefix}-{next(self._seq):x}"

    async def hold(
        self, charge_id: str, request_id: str, tenant: str, currency: str, amount: Decimal
    ) -> HoldResult:
        """Hold `amount` if the wallet has anything left; never raises (fail-open)."""
        if not valid_tenant(tenant):
            return HoldResult("no_wallet")  # a name no wallet can have
        if not self.up:
            return HoldResult("skipped")
        try:
            status = await self._holding(
                (charge_id, clean_text(request_id), tenant, currency, amount)
            )
        except LedgerBusy:
            return HoldResult("busy" if self.up else "skipped")
        except LedgerUnavailable:
            self._live.add(charge_id)
            return HoldResult("unknown")
        # A request that goes away while asking is not released here: the hold may still
        # be on its way, and a release that overtook it would leave it held until it
        # expired. _holding releases it once its batch is answered (_release_abandoned).
        head, _, detail = str(status).partition(":")
        if head == "held":
            self._live.add(charge_id)
        return HoldResult(head, detail)

    def _release_abandoned(self, args: tuple[Any, ...]) -> None:
        """A hold asked by a request that went away, its batch now answered: give it back
        (if it was not taken, the release finds nothing and writes nothing)."""
        charge_id, request_id, tenant, currency, _ = args
        self.settle_soon(
            Charge(charge_id, request_id, tenant, currency, "", Decimal(0), record=False)
        )

    async def _send_holds(self, batch: list[tuple[Any, ...]]) -> list[str | Exception]:
        """The holds asked in one turn, in one statement. One refused for its data fails
        the lot: they are then asked one by one, and only it fails."""
        if len(batch) > 1:
            with contextlib.suppress(LedgerRejected):
                return list(await self._request(lambda conn: hold_many(conn, batch)))
        results: list[str | Exception] = []
        for args in batch:
            try:
                results.append(await self._request(functools.partial(hold_one, args=args)))
            except LedgerUnavailable as exc:
                if len(batch) == 1:
                    raise
                results.append(exc)
        return results

    def settle_soon(self, charge: Charge) -> None:
        """Settle in the background (close hooks must not wait on the database), batched
        (ledger_keep.SettleQueue); a charge the ledger cannot take now goes to the pending
        store."""
        self._live.discard(charge.charge_id)
        self._settling.put(charge)

    async def _settle_batch(self, batch: list[Charge]) -> None:
        """One statement for the lot. A charge refused for its data fails it: the lot is
        settled one by one, so that only that charge is set aside; an unreachable ledger
        keeps them all."""
        if len(batch) > 1 and self.up:
            try:
                statuses = await self._settle_many(batch)
            except LedgerRejected:
                statuses = []
            except asyncio.CancelledError:
                self._keep_all(batch)
                raise
            except Exception as exc:
                if not isinstance(exc, LedgerUnavailable):  # a bug rather than the database
                    log.error("ledger: settling a batch: %s", self._db.describe(exc))
                self._keep_all(batch)
                return
            for charge, status in zip(batch, statuses, strict=False):
                self._counted(charge, status)
            if statuses:
                return
        for done, charge in enumerate(batch):
            try:
                await self._settle_or_keep(charge)
            except asyncio.CancelledError:
                self._keep_all(batch[done + 1 :])
                raise

    async def _settle_many(self, batch: list[Charge]) -> list[str]:
        """Like _request, but a rejection is not counted: the charge settled alone is."""
        try:
            return await self._db.call(lambda conn: settle_many(conn, batch), self.timeout)
        except LedgerRejected:
            raise
        except LedgerBusy as exc:
            self.stats.errors[exc.kind] += 1
            raise
        except LedgerUnavailable as exc:
            self._failed(exc)
            raise

    async def _settle_or_keep(self, charge: Charge) -> None:
        try:
            if self.up:
                try:
                    await self.settle(charge)
                    return
                except LedgerRejected as exc:
                    await self._reject(charge, exc, on_disk=False)
                    return
                except LedgerUnavailable:
                    pass
            self._keep(charge)
        except asyncio.CancelledError:
            self._keep(charge)  # shutting down: the charge is not lost
            raise
        except Exception as exc:  # a bug rather than the database: keep the charge all the same
            log.error("ledger: settling %s: %s", charge.charge_id, self._db.describe(exc))
            self._keep(charge)

    async def settle(self, charge: Charge) -> str:
        """One settle in the database: 'settled', 'duplicate', 'released' or 'currency:X'.
        Raises LedgerUnavailable (LedgerRejected: this charge can never be taken)."""
        args = settle_args(charge)
        status = str(
            await self._request(
                lambda conn: conn.fetchval(
                    "SELECT wallet_settle($1, $2, $3, $4, $5, $6, $7, $8, $9)", *args
                )
            )
        )
        self._counted(charge, status)
        return status

    def _counted(self, charge: Charge, status: str) -> None:
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

    async def _reject(self, charge: Charge, exc: LedgerRejected, *, on_disk: bool) -> None:
        """A charge the database refuses for its own data: never retried (it would block
        every charge behind it), kept on disk as a dead letter for an operator."""
        rejected = self.stats.errors["rejected"]
        if rejected <= _REJECTIONS_LOGGED or rejected % 1000 == 0:
            log.error(
                "ledger refused the charge %s of %s (request %s): %s; kept as a dead letter in %s",
                charge.charge_id,
                charge.tenant,
                clean_text(charge.request_id),
                exc,
                self.pending.path,
            )
        if charge.record:  # give its hold back now rather than at its expiry
            with contextlib.suppress(LedgerUnavailable):
                await self.settle(replace(charge, amount=Decimal(0), record=False))
        reason = str(exc)[:300] or "rejected"
        if on_disk:
            await self.pending.bury(charge.charge_id, reason)
        else:
            self._keep(charge, reason)

    # -- the pending store ----------------------------------------------------------------------

    def _keep(self, charge: Charge, dead: str | None = None) -> None:
        self._keeper.keep(charge, dead)

    def _keep_all(self, charges: list[Charge]) -> None:
        for charge in charges:
            self._keeper.keep(charge)

    async def _bill_pending(self) -> bool:
        """Bill what waits on disk, a batch at a time, until it is empty or the ledger fails
        (False). A charge the ledger refuses for its data is set aside, never retried."""
        while self.up and self.pending.count:
            batch = await self.pending.take(BATCH)
            if not batch:
                break
            done: list[str] = []
            try:
                for charge in batch:
                    try:
                        await self.settle(charge)
                    except LedgerRejected as exc:
                        await self._reject(charge, exc, on_disk=True)
                        continue
                    done.append(charge.charge_id)
            except LedgerUnavailable:
                return False
            finally:
                await self.pending.remove(done)
                self._billed_in_outage += len(done)
        if self._warned and self.up and not self.pending.count and not self._keeper.waiting:
            log.warning(
                "ledger back after %.1fs: %d pending charges billed",
                time.monotonic() - self._down_since,
                self._billed_in_outage,
            )
            self._warned = False
        return self.up

    # -- calls and their failures -----------------------------------------------------------

    async def _request(self, query: Callable[[Any], Awaitable[_T]]) -> _T:
        """A call of the request path: a failure of the database marks it down."""
        try:
            return await self._db.call(query, self.timeout)
        except (LedgerBusy, LedgerRejected) as exc:
            self.stats.errors[exc.kind] += 1
            raise
        except LedgerUnavailable as exc:
            self._failed(exc)
            raise

    async def _admin(self, query: Callable[[Any], Awaitable[_T]]) -> _T:
        """An admin or housekeeping call: its own timeout, and its failure is its caller's
        alone. While the ledger is known down it fails as fast as the request path."""
        try:
            return await self._db.call(query, self.admin_timeout if self.up else self.timeout)
        except LedgerUnavailable as exc:
            self.stats.errors[exc.kind] += 1
            raise

    def _failed(self, exc: LedgerUnavailable) -> None:
        self.stats.errors[exc.kind] += 1
        if not self._warned:  # one warning per outage; its end is said once billed up
            log.warning(
                "ledger unreachable (%s): requests go on unbilled and their charges wait in "
                "%s until it answers",
                exc,
                self.pending.path,
            )
            self._down_since = time.monotonic()
            self._billed_in_outage = 0
            self._warned = True
        self.up = False
        self._wake.set()

    # -- the background loop ----------------------------------------------------------------

    async def run(self) -> None:
        """Connect, apply migrations, bill pending charges, refresh and expire holds;
        reconnect with backoff whenever the database fails. Runs until cancelled: anything
        else that goes wrong in a turn is logged and the next turn backs off."""
        await self._open_pending()
        delay = RETRY_MIN
        while True:
            ok = False
            try:
                ok = await self._turn()
            except Exception as exc:
                self._loop_failed(exc)
            if ok:
                delay = RETRY_MIN
                await self._sleep(TICK)
            else:
                await asyncio.sleep(delay)  # never woken early: failures must not spin it
                delay = min(delay * 2, RETRY_MAX)

    async def _open_pending(self) -> None:
        try:
            found = await self.pending.open()
        except Exception as exc:
            self.stats.errors["pending"] += 1
            log.error("cannot open the pending charges in %s: %s", self.pending.path, exc)
            return
        if found:
            log.warning(
                "%d unbilled charges found in %s: billed once the ledger answers",
                found,
                self.pending.path,
            )

    async def _turn(self) -> bool:
        if not self.up and not await self._connect():
            return False
        if not await self._bill_pending():
            return False
        if time.monotonic() >= self._chores_at:
            self._chores_at = time.monotonic() + self.chores_every
            await self._refresh_holds()
            await self._expire()
        return self.up

    def _loop_failed(self, exc: Exception) -> None:
        text = self._db.describe(exc)
        if text != self._last_loop_error:  # the same failure again is not news
            self._last_loop_error = text
            log.error("ledger: background turn failed (%s); retrying with backoff", text)

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()
        self._wake.clear()

    async def _connect(self) -> bool:
        if self._migrations is None:
            self._migrations = await asyncio.to_thread(migrations)
        known = self._migrations
        try:
            await self._db.open()
            version, applied = await self._db.call(
                lambda conn: migrate(conn, known), max(self.timeout, CONNECT_TIMEOUT)
            )
        except LedgerUnavailable as exc:
            self._failed(exc)
            return False
        for migration in applied:
            log.info("ledger: applied migration %03d_%s", migration.version, migration.name)
        if version > len(known):
            self.stats.errors["schema"] += 1
            if self._schema_error != version:
                self._schema_error = version
                log.error(
                    "ledger schema version %d is newer than this router knows (%d): upgrade "
                    "this router; wallets go on fail-open",
                    version,
                    len(known),
                )
            return False
        self.schema_version = version
        self.up = True
        if not self._warned:
            log.info("ledger connected (schema version %d)", version)
        return True

    async def _refresh_holds(self) -> None:
        """Keep the holds of requests still running (a long stream) from expiring."""
        live = list(self._live)
        if live:
            age = timedelta(seconds=self.hold_ttl / 3)
            await self._chore(
                "refresh holds",
                lambda conn: conn.fetchval("SELECT wallet_refresh_holds($1, $2)", live, age),
            )

    async def _expire(self) -> None:
        age = timedelta(seconds=self.hold_ttl)
        count = await self._chore(
            "expire holds", lambda conn: conn.fetchval("SELECT wallet_expire_holds($1)", age)
        )
        if count:
            self.stats.holds_expired += int(count)
            log.warning("ledger: released %d holds older than %gs", count, self.hold_ttl)

    async def _chore(self, name: str, query: Callable[[Any], Awaitable[_T]]) -> _T | None:
        try:
            return await self._admin(query)
        except LedgerUnavailable as exc:
            log.warning("ledger: cannot %s (%s); tried again in %gs", name, exc, self.chores_every)
            return None

    # -- shutdown -------------------------------------------------------------------------------

    async def idle(self, timeout: float) -> bool:
        """Wait until no settle is in flight and nothing waits to be written to disk."""
        async with asyncio.timeout(timeout):
            while self._tasks or self._keeper.writer is not None:
                writer = self._keeper.writer
                await asyncio.gather(
                    *self._tasks, *([writer] if writer else []), return_exceptions=True
                )
        return True

    async def close(self) -> None:
        """Finish the settles in flight (within `timeout`), keep what is still unbilled on
        disk (within DISK_TIMEOUT: what cannot be written is logged and counted as lost)
        and close the pool. Bounded, and never raises."""
        try:
            await self._finish_settles()
            await self._finish_disk()
        except Exception as exc:  # the router's shutdown goes on whatever happens here
            log.error("ledger: closing: %s", self._db.describe(exc))
        finally:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(DISK_TIMEOUT):
                    await self.pending.close()
            self.up = False
            await self._db.close(self.timeout)

    async def _finish_settles(self) -> None:
        # Holds still on their way first: the releases of those whose requests went away
        # are queued when they are answered, and must be among the settles finished here.
        await self._holding.wait(self.timeout)
        tasks = list(self._tasks)
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=self.timeout)
            for task in late:
                task.cancel()  # each keeps its charge (in memory, then on disk below)
            await asyncio.gather(*late, return_exceptions=True)

    async def _finish_disk(self) -> None:
        await self._keeper.finish(self.timeout)
        if self.pending.count:
            log.warning(
                "%d unbilled charges kept in %s for the next start",
                self.pending.count,
                self.pending.path,
            )

    # -- the admin API ------------------------------------------------------------------------

    async def credit(
        self,
        tenant: str,
        amount: Decimal,
        currency: str | None,
        note: str | None,
        reference: str | None = None,
    ) -> Credited:
        """Add `amount`; opens the wallet at its first credit. A currency other than the
        wallet's, or a reference used before, changes nothing (`applied` is false).
        Raises LedgerUnavailable (LedgerRejected: the database refused the values)."""
        return await self._admin(
            lambda conn: ledger_admin.credit(conn, tenant, amount, currency, note, reference)
        )

    async def wallet(self, tenant: str) -> Wallet | None:
        return await self._admin(lambda conn: ledger_admin.wallet(conn, tenant))

    async def entries(
        self, tenant: str, limit: int, before: int | None
    ) -> list[dict[str, Any]] | None:
        """A page of the tenant's ledger, newest first, rows with `id < before`; None when
        the tenant has no wallet."""
        return await self._admin(lambda conn: ledger_admin.entries(conn, tenant, limit, before))

    async def reconcile(self) -> Reconciliation:
        return await self._admin(ledger_admin.reconcile)

    def snapshot(self) -> WalletSnapshot:
        stats = self.stats
        return WalletSnapshot(
            up=self.up,
            pending=self.pending.count + self._keeper.waiting,
            unbilled=stats.unbilled,
            charges=stats.charges,
            holds_expired=stats.holds_expired,
            refused=dict(stats.refused),
            errors=dict(stats.errors),
            dead=self.pending.dead + self._keeper.waiting_dead,
            lost=stats.lost,
        )
