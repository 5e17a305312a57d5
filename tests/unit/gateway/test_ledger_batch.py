"""Settles sent in batches: one statement for what is queued, only a charge the database
refuses is set aside, two routers settling the same tenants never deadlock, and a batch cut
by a database kill loses nothing."""

from __future__ import annotations

import asyncio
from decimal import Decimal
from pathlib import Path

import asyncpg
import pytest

from hivenet_router.gateway.ledger import Ledger
from hivenet_router.gateway.pending import Charge
from tests.postgres import Postgres
from tests.unit.gateway.test_ledger import running, until

USD = "USD"

pytestmark = pytest.mark.usefixtures("_connect_reads")


def charge(ledger: Ledger, tenant: str, amount: str) -> Charge:
    return Charge(ledger.new_charge_id(), "req", tenant, USD, "m", Decimal(amount), 10, 20)


@pytest.fixture
def statements(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every batch statement sent."""
    sizes: list[int] = []
    real = asyncpg.Connection.fetch

    async def fetch(self: object, query: str, *args: object, **kw: object) -> object:
        if "unnest" in query and "wallet_settle" in query:
            sizes.append(len(args[0]))  # type: ignore[arg-type]
        return await real(self, query, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(asyncpg.Connection, "fetch", fetch)
    return sizes


async def test_charges_queued_together_settle_in_one_statement(
    dsn: str, tmp_path: Path, statements: list[int]
) -> None:
    async with running(dsn, tmp_path) as ledger:
        await ledger.credit("acme", Decimal(100), USD, None)
        held = [charge(ledger, "acme", "1") for _ in range(40)]
        for one in held:
            assert (await ledger.hold(one.charge_id, "r", "acme", USD, Decimal(2))).status == "held"
        for one in held:
            ledger.settle_soon(one)
        ledger.settle_soon(held[0])  # a retry: billed once all the same
        await ledger.idle(5)
        assert statements == [41] and ledger.stats.charges == 40
        wallet = await ledger.wallet("acme")
        assert wallet is not None and (wallet.balance, wallet.held) == (60, 0)
        assert (await ledger.reconcile()).ok


async def test_a_poisoned_charge_is_set_aside_and_the_rest_of_its_batch_billed(
    dsn: str, tmp_path: Path, statements: list[int]
) -> None:
    async with running(dsn, tmp_path) as ledger:
        await ledger.credit("acme", Decimal(10), USD, None)
        good = [charge(ledger, "acme", "0.5") for _ in range(9)]
        bad = Charge("bad-1", "r", "ac\x00me", USD, "m", Decimal(1))  # no text can hold a NUL
        for one in [*good[:4], bad, *good[4:]]:
            ledger.settle_soon(one)
        await ledger.idle(5)
        await until(lambda: ledger.snapshot().pending == 0)
        assert statements == [10]  # the batch was tried, then its charges one by one
        assert ledger.up and ledger.stats.charges == 9 and ledger.snapshot().dead == 1
        assert ledger.stats.errors["rejected"] >= 1 and ledger.stats.errors["query"] == 0
        letters = await ledger.pending.dead_letters(10)
        assert [c.charge_id for c, _ in letters] == ["bad-1"]
        wallet = await ledger.wallet("acme")
        assert wallet is not None and wallet.balance == Decimal("5.5")


async def test_two_routers_settling_the_same_tenants_never_deadlock(
    dsn: str, tmp_path: Path, statements: list[int]
) -> None:
    tenants = [f"t{n}" for n in range(12)]
    async with running(dsn, tmp_path / "a") as first, running(dsn, tmp_path / "b") as second:
        for tenant in tenants:
            await first.credit(tenant, Decimal(1000), USD, None)
        for _ in range(4):  # each router's batches in opposite orders of tenant
            for ledger, order in ((first, tenants), (second, tenants[::-1])):
                for n in range(240):
                    ledger.settle_soon(charge(ledger, order[n // 20], "0.01"))
            await asyncio.gather(first.idle(10), second.idle(10))
        for ledger in (first, second):
            assert ledger.up and ledger.stats.charges == 960
            assert ledger.snapshot().pending == 0
            assert ledger.stats.errors == dict.fromkeys(ledger.stats.errors, 0)
        assert statements == [240] * 8  # batched, not one call per charge
        for tenant in tenants:
            wallet = await first.wallet(tenant)
            assert wallet is not None and wallet.balance == Decimal(1000) - Decimal("1.60")
        assert (await first.reconcile()).ok


async def test_a_batch_cut_by_a_database_kill_keeps_every_charge(
    server: Postgres, dsn: str, tmp_path: Path, statements: list[int]
) -> None:
    async with running(dsn, tmp_path, timeout=3.0) as ledger:
        await ledger.credit("acme", Decimal(10), USD, None)
        blocker = await asyncpg.connect(dsn)
        try:
            # The wallet is locked by another session: the batch waits in the database.
            tx = blocker.transaction()
            await tx.start()
            await blocker.execute("SELECT 1 FROM wallets WHERE tenant = 'acme' FOR UPDATE")
            for _ in range(20):
                ledger.settle_soon(charge(ledger, "acme", "0.25"))
            await until(lambda: statements == [20])
            await asyncio.sleep(0.2)
            server.kill()
        finally:
            blocker.terminate()
        try:
            await ledger.idle(8)
            assert not ledger.up and ledger.snapshot().pending == 20
        finally:
            server.start()
        await until(lambda: ledger.up and ledger.snapshot().pending == 0)
        wallet = await ledger.wallet("acme")
        assert wallet is not None and wallet.balance == Decimal(5)
        assert ledger.stats.charges == 20 and (await ledger.reconcile()).ok
