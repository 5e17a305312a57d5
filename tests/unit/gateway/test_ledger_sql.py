"""The ledger's calls against a real PostgreSQL when the database misbehaves: any failure
is fail-open, a hung server costs a call its timeout, a saturated pool is not an outage,
and a malformed DSN never ends the ledger's loop (the DSN's own checks: test_ledger_dsn.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest

from hivenet_router.gateway.ledger import Ledger
from hivenet_router.gateway.pending import Charge
from tests.postgres import Blackhole, Postgres
from tests.unit.gateway.test_ledger import running, until

USD = "USD"


pytestmark = pytest.mark.usefixtures("_connect_reads")


async def test_a_malformed_dsn_does_not_end_the_background_loop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = Ledger("postgresql://billing:s3cret@db:notaport/w", tmp_path, 0.5)
    task = asyncio.create_task(ledger.run())
    try:
        await until(lambda: ledger.stats.errors["connect"] >= 2)
        assert not task.done()
        ledger.settle_soon(Charge(ledger.new_charge_id(), "r", "acme", USD, "m", Decimal(1)))
        await ledger.idle(5)
        assert ledger.snapshot().pending == 1  # kept for when a corrected DSN reaches it
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await ledger.close()
    assert caplog.text.count("ledger unreachable") == 1 and "s3cret" not in caplog.text


async def test_an_unexpected_client_error_fails_open_and_the_charge_waits(
    dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """asyncpg raises more than its documented errors (InternalClientError after a server
    died mid-protocol): it must never reach the request, or lose a charge."""
    real = asyncpg.Connection.fetchval
    broken = True

    async def fetchval(self: Any, query: str, *args: Any, **kw: Any) -> Any:
        if broken and "wallet_" in query:
            raise asyncpg.InternalClientError("cannot switch to state 12")
        return await real(self, query, *args, **kw)

    async with running(dsn, tmp_path) as ledger:
        await ledger.credit("acme", Decimal(10), USD, None)
        monkeypatch.setattr(asyncpg.Connection, "fetchval", fetchval)
        key = ledger.new_charge_id()
        held = await ledger.hold(key, "r", "acme", USD, Decimal(1))
        assert held.status == "unknown" and held.unbilled and not ledger.up
        ledger.settle_soon(Charge(key, "r", "acme", USD, "m", Decimal("0.5")))
        await ledger.idle(5)
        assert ledger.snapshot().pending == 1
        broken = False
        await until(lambda: ledger.up and ledger.snapshot().pending == 0)
        wallet = await ledger.wallet("acme")
        assert wallet is not None and (wallet.balance, wallet.held) == (Decimal("9.5"), 0)
    assert caplog.text.count("ledger unreachable") == 1


async def test_a_hung_database_costs_a_call_its_timeout_not_more(
    server: Postgres, dsn: str, tmp_path: Path
) -> None:
    async with Blackhole(server, urlsplit(dsn).path.lstrip("/")) as hole:
        ledger = Ledger(hole.dsn, tmp_path, 0.5)
        task = asyncio.create_task(ledger.run())
        try:
            await until(lambda: ledger.up)
            await ledger.credit("acme", Decimal(10), USD, None)
            assert (
                await ledger.hold(ledger.new_charge_id(), "r", "acme", USD, Decimal(1))
            ).status == "held"
            hole.freeze()
            started = time.monotonic()
            held = await ledger.hold(ledger.new_charge_id(), "r", "acme", USD, Decimal(1))
            took = time.monotonic() - started
            assert held.status == "unknown" and took < 1.5, took  # the timeout is 0.5 s
            started = time.monotonic()
            assert (await ledger.hold("k", "r", "acme", USD, Decimal(1))).status == "skipped"
            assert time.monotonic() - started < 0.1
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            started = time.monotonic()
            await ledger.close()
            assert time.monotonic() - started < 3


async def test_a_burst_on_a_healthy_database_is_refused_never_let_through(
    dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """More holds at once than the pool serves within the timeout: the ones that wait too
    long are 'busy' (the stage answers 503), none goes on unbilled, nothing is down."""
    worst = Decimal("0.3")
    caplog.set_level(logging.INFO, "hivenet.router")
    ledger = Ledger(dsn, tmp_path, 0.2, pool_size=1)
    task = asyncio.create_task(ledger.run())
    try:
        await until(lambda: ledger.up)
        await ledger.credit("acme", Decimal(1), USD, None)
        keys = [ledger.new_charge_id() for _ in range(1500)]
        # The pool's one connection is taken first, as a long call would take it, so the
        # burst finds it saturated on any machine (a fast one once served every hold in
        # time); it is given back once the first hold has been refused as busy.
        slots = ledger._db._slots
        await slots.acquire()
        # One hold per event-loop turn, as requests arrive: holds of one turn share a
        # statement, so asked all in one turn they would never saturate the pool.
        holds = []
        for key in keys:
            holds.append(asyncio.create_task(ledger.hold(key, "r", "acme", USD, worst)))
            await asyncio.sleep(0)
        done, _ = await asyncio.wait(holds, return_when=asyncio.FIRST_COMPLETED)
        assert {task.result().status for task in done} == {"busy"}
        slots.release()
        results = await asyncio.gather(*holds)
        statuses = {r.status for r in results}
        assert statuses <= {"held", "insufficient", "busy"} and "busy" in statuses, statuses
        admitted = [k for k, r in zip(keys, results, strict=True) if r.status == "held"]
        assert len(admitted) <= 4 and ledger.up
        for key in admitted:
            await ledger.settle(Charge(key, "r", "acme", USD, "m", worst))
        wallet = await ledger.wallet("acme")
        assert wallet is not None and wallet.balance >= -worst and wallet.held == 0
        assert ledger.stats.errors["busy"] >= 1 and ledger.stats.unbilled == 0
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await ledger.close()
    assert "ledger unreachable" not in caplog.text
