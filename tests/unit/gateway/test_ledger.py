"""The ledger against a real PostgreSQL: migrations, holds, idempotent settles, the pending
store across an outage and a restart, stale holds, the reconciliation."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import sqlite3
from collections.abc import AsyncIterator, Callable
from decimal import Decimal
from pathlib import Path

import asyncpg
import pytest

from hivenet_router.gateway.ledger import Ledger, LedgerRejected, LedgerUnavailable, migrations
from hivenet_router.gateway.pending import Charge, PendingStore
from tests.postgres import Postgres

USD = "USD"


pytestmark = pytest.mark.usefixtures("_connect_reads")


async def until(check: Callable[[], object], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def running(
    dsn: str, directory: Path, timeout: float = 2.0, hold_ttl: float = 900.0
) -> AsyncIterator[Ledger]:
    ledger = Ledger(dsn, directory, timeout, hold_ttl=hold_ttl)
    task = asyncio.create_task(ledger.run())
    try:
        await until(lambda: ledger.up)
        yield ledger
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await ledger.close()


async def sql(dsn: str, query: str, *args: object) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return list(await conn.fetch(query, *args))
    finally:
        await conn.close()


def charge(ledger: Ledger, tenant: str, amount: str, record: bool = True) -> Charge:
    return Charge(ledger.new_charge_id(), "req", tenant, USD, "m", Decimal(amount), 10, 20, record)


async def test_migrations_apply_once_and_two_routers_starting_together_do_not_race(
    dsn: str, tmp_path: Path
) -> None:
    known = len(await asyncio.to_thread(migrations))
    async with (
        running(dsn, tmp_path / "a") as first,
        running(dsn, tmp_path / "b") as second,
    ):
        assert first.schema_version == second.schema_version == known
    async with running(dsn, tmp_path / "c") as again:  # a restart finds nothing to apply
        assert again.schema_version == known
    rows = await sql(dsn, "SELECT version FROM wallet_migrations")
    assert [row["version"] for row in rows] == list(range(1, known + 1))


async def test_a_schema_newer_than_the_code_keeps_wallets_fail_open(
    dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with running(dsn, tmp_path):
        pass
    await sql(dsn, "INSERT INTO wallet_migrations (version, name) VALUES (99, 'future')")
    known = len(await asyncio.to_thread(migrations))
    ledger = Ledger(dsn, tmp_path, 2.0)
    task = asyncio.create_task(ledger.run())
    try:
        await until(lambda: ledger.stats.errors["schema"] >= 1)
        assert not ledger.up
        held = await ledger.hold("k", "r", "acme", USD, Decimal(1))
        assert held.status == "skipped" and held.unbilled
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await ledger.close()
    assert f"schema version 99 is newer than this router knows ({known})" in caplog.text


async def test_hold_refuses_an_empty_missing_or_foreign_wallet(dsn: str, tmp_path: Path) -> None:
    async with running(dsn, tmp_path) as ledger:
        assert (await ledger.hold("k1", "r", "nobody", USD, Decimal(1))).status == "no_wallet"
        await ledger.credit("euro", Decimal(5), "EUR", None)
        foreign = await ledger.hold("k2", "r", "euro", USD, Decimal(1))
        assert (foreign.status, foreign.detail) == ("currency", "EUR")
        await ledger.credit("acme", Decimal("0.5"), None, "first")
        big = await ledger.hold("k3", "r", "acme", USD, Decimal(2))
        assert (big.status, big.detail) == ("held", "0.5")
        # At most what was available is held (migration 004): the router lowers the
        # request's bound to what 0.5 pays for, and the wallet never shows less than
        # nothing available while the request runs. Nothing is left for a second one.
        short = await ledger.hold("k4", "r", "acme", USD, Decimal(1))
        assert (short.status, short.detail) == ("insufficient", "0.0")
        wallet = await ledger.wallet("acme")
        assert wallet is not None and (wallet.balance, wallet.held) == (Decimal("0.5"), 0.5)


async def test_a_settle_charges_once_however_often_it_is_retried(dsn: str, tmp_path: Path) -> None:
    async with running(dsn, tmp_path) as ledger:
        await ledger.credit("acme", Decimal(10), USD, None)
        one = charge(ledger, "acme", "1.25")
        assert (await ledger.hold(one.charge_id, "req", "acme", USD, Decimal(3))).status == "held"
        results = await asyncio.gather(*(ledger.settle(one) for _ in range(5)))
        assert sorted(results) == ["duplicate"] * 4 + ["settled"]
        wallet = await ledger.wallet("acme")
        assert wallet is not None and (wallet.balance, wallet.held) == (Decimal("8.75"), 0)
        rows = await ledger.entries("acme", 10, None)
        assert [(r["kind"], r["amount"], r["balance_after"]) for r in rows] == [
            ("charge", Decimal("-1.25"), Decimal("8.75")),
            ("credit", Decimal(10), Decimal(10)),
        ]
        assert (await ledger.reconcile()).ok
        assert ledger.stats.charges == 1


async def test_a_release_gives_the_hold_back_without_a_ledger_row(dsn: str, tmp_path: Path) -> None:
    async with running(dsn, tmp_path) as ledger:
        await ledger.credit("acme", Decimal(1), USD, None)
        gone = charge(ledger, "acme", "0", record=False)
        await ledger.hold(gone.charge_id, "req", "acme", USD, Decimal(5))
        assert await ledger.settle(gone) == "released"
        assert await ledger.settle(gone) == "released"  # again: nothing more to release
        wallet = await ledger.wallet("acme")
        assert wallet is not None and (wallet.balance, wallet.held) == (1, 0)
        assert len(await ledger.entries("acme", 10, None)) == 1  # the credit only


async def test_a_request_gone_while_its_hold_is_on_the_way_gets_it_back(
    dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release waits for the hold: one sent at once could reach the database first,
    find nothing, and leave the hold to block the wallet until it expired."""
    real = asyncpg.Connection.fetchval

    async def slow_holds(self: object, query: str, *args: object, **kw: object) -> object:
        if "wallet_hold" in query:
            await asyncio.sleep(0.3)  # the hold is still on its way when its caller leaves
        return await real(self, query, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(asyncpg.Connection, "fetchval", slow_holds)
    async with running(dsn, tmp_path) as ledger:
        await ledger.credit("acme", Decimal(10), USD, None)
        asking = asyncio.create_task(
            ledger.hold(ledger.new_charge_id(), "req", "acme", USD, Decimal(4))
        )
        await asyncio.sleep(0.1)
        asking.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asking
        await asyncio.sleep(0.5)  # the hold lands, then its release
        await ledger.idle(5)
        wallet = await ledger.wallet("acme")
        assert wallet is not None and (wallet.balance, wallet.held) == (10, 0)
        rows = await sql(dsn, "SELECT count(*) AS n FROM holds")
        assert rows[0]["n"] == 0


async def test_concurrent_holds_overdraw_by_at_most_one_worst_case(
    dsn: str, tmp_path: Path
) -> None:
    worst = Decimal("0.3")
    async with running(dsn, tmp_path) as ledger:
        await ledger.credit("acme", Decimal(1), USD, None)
        keys = [ledger.new_charge_id() for _ in range(40)]
        held = await asyncio.gather(*(ledger.hold(key, "r", "acme", USD, worst) for key in keys))
        admitted = [key for key, h in zip(keys, held, strict=True) if h.status == "held"]
        assert len(admitted) == 4  # 1.0 -> 0.7 -> 0.4 -> 0.1 -> -0.2: the fourth was the last
        for key in admitted:
            await ledger.settle(Charge(key, "r", "acme", USD, "m", worst))
        wallet = await ledger.wallet("acme")
        assert wallet is not None and wallet.balance == Decimal("-0.2") >= -worst
        assert wallet.held == 0 and (await ledger.reconcile()).ok


async def test_charges_wait_on_disk_while_the_database_is_down_and_are_billed_once(
    server: Postgres, dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "hivenet.router")
    async with running(dsn, tmp_path, timeout=0.5) as ledger:
        await ledger.credit("acme", Decimal(10), USD, None)
        held = charge(ledger, "acme", "1")
        await ledger.hold(held.charge_id, "req", "acme", USD, Decimal(2))
        server.kill()
        try:
            ledger.settle_soon(held)  # fails: goes to disk
            await ledger.idle(5)
            late = [charge(ledger, "acme", "0.5") for _ in range(3)]
            for one in late:
                ledger.settle_soon(one)
            await ledger.idle(5)
            assert not ledger.up and ledger.snapshot().pending == 4
            assert (await ledger.hold("k", "r", "acme", USD, Decimal(1))).status == "skipped"
        finally:
            server.start()
        await until(lambda: ledger.up and ledger.snapshot().pending == 0)
        wallet = await ledger.wallet("acme")
        assert wallet is not None and (wallet.balance, wallet.held) == (Decimal("7.5"), 0)
        assert (await ledger.reconcile()).ok
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("ledger unreachable" in w for w in warnings) == 1  # once per outage
    assert sum("4 pending charges billed" in w for w in warnings) == 1


async def test_pending_charges_survive_a_restart(dsn: str, tmp_path: Path) -> None:
    # A router that never reached its database: the charge is kept on disk at shutdown.
    away = Ledger("postgresql://u:hunter2@127.0.0.1:1/db", tmp_path, 0.2)
    task = asyncio.create_task(away.run())
    await until(lambda: away.stats.errors["connect"] >= 1)
    away.settle_soon(Charge(away.new_charge_id(), "r", "newco", USD, "m", Decimal("0.25")))
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await away.close()
    store = PendingStore(tmp_path)
    assert await store.open() == 1
    await store.close()
    # The next start bills it; the tenant had no wallet: one opens, below zero.
    async with running(dsn, tmp_path) as ledger:
        await until(lambda: ledger.snapshot().pending == 0)
        wallet = await ledger.wallet("newco")
        assert wallet is not None and wallet.balance == Decimal("-0.25")
        assert (await ledger.reconcile()).ok


async def test_an_unreachable_dsn_is_warned_once_without_its_password(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = Ledger("postgresql://u:hunter2@127.0.0.1:1/db", tmp_path, 0.2)
    task = asyncio.create_task(ledger.run())
    try:
        await until(lambda: ledger.stats.errors["connect"] >= 2)
        with pytest.raises(LedgerUnavailable):
            await ledger.credit("acme", Decimal(1), USD, None)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await ledger.close()
    assert "hunter2" not in caplog.text
    assert caplog.text.count("ledger unreachable") == 1


async def test_stale_holds_expire(dsn: str, tmp_path: Path) -> None:
    async with running(dsn, tmp_path, hold_ttl=0.05) as ledger:
        await ledger.credit("acme", Decimal(1), USD, None)
        await ledger.hold("dead-router-1", "r", "acme", USD, Decimal(3))
    await asyncio.sleep(0.1)
    async with running(dsn, tmp_path, hold_ttl=0.05) as ledger:  # expires at its start
        await until(lambda: ledger.stats.holds_expired == 1)
        wallet = await ledger.wallet("acme")
        assert wallet is not None and wallet.held == 0
        assert (await ledger.reconcile()).ok


async def test_the_ledger_pages_newest_first_and_is_append_only(dsn: str, tmp_path: Path) -> None:
    async with running(dsn, tmp_path) as ledger:
        for n in range(1, 6):
            await ledger.credit("acme", Decimal(n), USD, f"credit {n}")
        first = await ledger.entries("acme", 2, None)
        assert [row["note"] for row in first] == ["credit 5", "credit 4"]
        rest = await ledger.entries("acme", 10, first[-1]["id"])
        assert [row["note"] for row in rest] == ["credit 3", "credit 2", "credit 1"]
        with pytest.raises(asyncpg.RaiseError, match="append-only"):
            await sql(dsn, "UPDATE ledger SET amount = 0")


async def test_the_reconciliation_finds_a_wallet_edited_outside_the_ledger(
    dsn: str, tmp_path: Path
) -> None:
    async with running(dsn, tmp_path) as ledger:
        await ledger.credit("acme", Decimal(3), USD, None)
        await ledger.credit("other", Decimal(3), USD, None)
        assert (await ledger.reconcile()).ok
        await sql(dsn, "UPDATE wallets SET balance = balance + 1 WHERE tenant = 'acme'")
        result = await ledger.reconcile()
        assert not result.ok and result.tenants == 2
        assert [m["tenant"] for m in result.mismatches] == ["acme"]
        assert result.mismatches[0]["ledger_sum"] == "3"


async def test_a_charge_with_odd_values_is_billed_cleaned(dsn: str, tmp_path: Path) -> None:
    """A model name with NUL passes the body parser, usage can exceed the token columns:
    the charge is still billed, cleaned, and the ledger stays up."""
    async with running(dsn, tmp_path) as ledger:
        await ledger.credit("acme", Decimal(10), USD, None)
        odd = Charge(ledger.new_charge_id(), "r\x00", "acme", USD, "m\x00" + "x" * 500,
                     Decimal(1), 3_000_000_000, -5)  # fmt: skip
        assert await ledger.settle(odd) == "settled" and ledger.up
        row = (await ledger.entries("acme", 1, None) or [])[0]
        assert row["model"] == "m" + "x" * 199 and row["request_id"] == "r"
        assert (row["input_tokens"], row["output_tokens"]) == (2**31 - 1, 0)


async def test_a_charge_the_database_refuses_is_set_aside_and_the_rest_billed(
    dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Charges kept while the ledger was away, the first one unbillable (a tenant name the
    # database cannot store): it must not hold back the ones behind it.
    store = PendingStore(tmp_path)
    await store.open()
    bad = Charge("bad-1", "r", "ac\x00me", USD, "m", Decimal(1))
    await store.add(
        [bad, *(Charge(f"ok-{n}", "r", "acme", USD, "m", Decimal("0.1")) for n in range(20))]
    )
    await store.close()
    async with running(dsn, tmp_path) as ledger:
        await until(lambda: ledger.snapshot().pending == 0)
        assert ledger.up and ledger.snapshot().dead == 1
        assert ledger.stats.errors["rejected"] >= 1 and ledger.stats.charges == 20
        letters = await ledger.pending.dead_letters(10)
        assert [(c.charge_id, "CharacterNotInRepertoire" in why) for c, why in letters] == [
            ("bad-1", True)
        ]
        wallet = await ledger.wallet("acme")
        assert wallet is not None and wallet.balance == Decimal(-2)
        assert (await ledger.hold("k", "r", "acme", USD, Decimal(1))).status == "insufficient"
    assert "ledger unreachable" not in caplog.text and "dead letter" in caplog.text


async def test_a_ledger_failing_every_settle_backs_off_and_warns_once(
    dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The database answers every connect but fails every settle: the background loop
    retries with growing pauses, never in a tight loop, and the outage is said once. The
    pauses are lower bounds only: a slow machine makes them longer, never shorter."""
    real = asyncpg.Connection.fetchval
    loop = asyncio.get_running_loop()
    attempts: list[float] = []

    async def fetchval(self: object, query: str, *args: object, **kw: object) -> object:
        if "wallet_settle" in query:
            attempts.append(loop.time())
            raise asyncpg.InternalClientError("cannot switch to state 12")
        return await real(self, query, *args, **kw)  # type: ignore[arg-type]

    async with running(dsn, tmp_path) as ledger:
        monkeypatch.setattr(asyncpg.Connection, "fetchval", fetchval)
        ledger.settle_soon(charge(ledger, "acme", "1"))
        await until(lambda: len(attempts) >= 4, timeout=60)
        # The first try is the settle's own; the charge then waits on disk and the
        # background loop tries it at once, then after pauses of 0.2 and 0.4 s (and more).
        gaps = [later - earlier for earlier, later in itertools.pairwise(attempts)][1:3]
        slack = 0.01  # the event loop's clock may wake a timer this much early
        assert all(gap >= pause - slack for gap, pause in zip(gaps, (0.2, 0.4), strict=True)), gaps
        assert ledger.snapshot().pending == 1
    assert caplog.text.count("ledger unreachable") == 1


async def test_the_background_loop_survives_a_failing_pending_store(
    dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = PendingStore(tmp_path)
    await store.open()
    await store.add([Charge("kept-1", "r", "acme", USD, "m", Decimal("0.5"))])
    await store.close()
    real = PendingStore.take
    failures = 2

    async def take(self: PendingStore, limit: int) -> list[Charge]:
        nonlocal failures
        if failures:
            failures -= 1
            raise sqlite3.OperationalError("disk I/O error")
        return await real(self, limit)

    monkeypatch.setattr(PendingStore, "take", take)
    async with running(dsn, tmp_path) as ledger:
        await until(lambda: ledger.snapshot().pending == 0)
        wallet = await ledger.wallet("acme")
        assert wallet is not None and wallet.balance == Decimal("-0.5")
    assert caplog.text.count("background turn failed (OperationalError: disk I/O error)") == 1


async def test_closing_with_a_disk_that_refuses_is_bounded_and_counts_the_loss(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "file").write_text("")  # the store's directory cannot be made under a file
    ledger = Ledger("postgresql://u:p@127.0.0.1:1/db", tmp_path / "file" / "store", 0.5)
    task = asyncio.create_task(ledger.run())
    await until(lambda: ledger.stats.errors["connect"] >= 1)
    ledger.settle_soon(Charge(ledger.new_charge_id(), "r", "acme", USD, "m", Decimal("0.5")))
    await asyncio.sleep(0.2)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    async with asyncio.timeout(8):
        await ledger.close()  # returns, and raises nothing
    assert ledger.snapshot().lost == 1
    assert "1 unbilled charges lost" in caplog.text


async def test_the_hold_of_a_running_request_is_refreshed_a_dead_one_expires(
    dsn: str, tmp_path: Path
) -> None:
    async with running(dsn, tmp_path / "a") as dead_router:
        await dead_router.credit("acme", Decimal(10), USD, None)
        await dead_router.hold("dead-1", "r", "acme", USD, Decimal(3))
    ledger = Ledger(dsn, tmp_path / "b", 2.0, hold_ttl=1.0, chores_every=0.1)
    task = asyncio.create_task(ledger.run())
    try:
        await until(lambda: ledger.up)
        live = ledger.new_charge_id()
        assert (await ledger.hold(live, "r", "acme", USD, Decimal(2))).status == "held"
        await until(lambda: ledger.stats.holds_expired == 1)
        await asyncio.sleep(1.5)  # the live hold is older than hold_ttl by now
        rows = await sql(dsn, "SELECT charge_id FROM holds")
        assert [row["charge_id"] for row in rows] == [live]
        ledger.settle_soon(Charge(live, "r", "acme", USD, "m", Decimal(1)))
        await ledger.idle(5)
        wallet = await ledger.wallet("acme")
        assert wallet is not None and (wallet.balance, wallet.held) == (9, 0)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await ledger.close()


async def test_a_credit_with_a_reference_is_applied_once(dsn: str, tmp_path: Path) -> None:
    async with running(dsn, tmp_path) as ledger:
        first = await ledger.credit("acme", Decimal(5), USD, "invoice 118", "inv-118")
        again = await ledger.credit("acme", Decimal(5), USD, "invoice 118", "inv-118")
        assert first.applied and not again.applied and again.first_amount == 5
        assert again.wallet.balance == 5
        other = await ledger.credit("other", Decimal(1), USD, None, "inv-118")  # per tenant
        assert other.applied
        retries = await asyncio.gather(
            *(ledger.credit("acme", Decimal(2), USD, None, "inv-119") for _ in range(5))
        )
        assert sum(r.applied for r in retries) == 1
        wallet = await ledger.wallet("acme")
        assert wallet is not None and wallet.balance == 7
        assert (await ledger.reconcile()).ok


async def test_admin_failures_never_take_the_ledger_down(dsn: str, tmp_path: Path) -> None:
    ledger = Ledger(dsn, tmp_path, 2.0, admin_timeout=0.000_001)
    task = asyncio.create_task(ledger.run())
    try:
        await until(lambda: ledger.up)
        with pytest.raises(LedgerUnavailable):
            await ledger.reconcile()  # past its (here absurd) timeout
        assert ledger.up
        ledger.admin_timeout = 5.0
        with pytest.raises(LedgerRejected):
            await ledger.credit("acme", Decimal(1), USD, "note\x00")
        assert ledger.up and await ledger.entries("acme", 10, None) is None
        await ledger.credit("acme", Decimal(1), USD, None)
        assert (await ledger.hold("k", "r", "acme", USD, Decimal(1))).status == "held"
        assert await ledger.entries("acme", 10, None) is not None
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await ledger.close()
