"""Charges the ledger could not take yet, kept on local disk until it can.

When PostgreSQL is unreachable, requests go on (fail-open) and their settlements wait here,
in a small SQLite file in the router's store directory, so they survive a restart. The
ledger bills them when the database answers again; a settle is idempotent by its charge
key, so a charge billed and then found here again (the database took it, the answer was
lost) is not billed twice.

SQLite is blocking I/O: every call runs on one worker thread of this store's own, which
also owns the connection, so nothing here touches the event loop's thread.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import TypeVar

FILE_NAME = "ledger-pending.sqlite3"
_T = TypeVar("_T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS pending (
    charge_id     TEXT PRIMARY KEY,
    request_id    TEXT NOT NULL,
    tenant        TEXT NOT NULL,
    currency      TEXT NOT NULL,
    model         TEXT NOT NULL,
    amount        TEXT NOT NULL,   -- a decimal, exactly as charged
    input_tokens  INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    record        INTEGER NOT NULL, -- 0: only release the hold
    dead          TEXT             -- NULL: to bill; else why the ledger refused it
)
"""
_COLUMNS = (
    "charge_id, request_id, tenant, currency, model, amount, input_tokens, output_tokens, record"
)
_INSERT = f"INSERT OR IGNORE INTO pending ({_COLUMNS}, dead) VALUES (?,?,?,?,?,?,?,?,?,?)"  # noqa: S608 (constant columns)


@dataclass(frozen=True, slots=True)
class Charge:
    """One request's settlement: its charge (`record`) or only the release of its hold."""

    charge_id: str  # unique per admitted request: the ledger's idempotency key
    request_id: str
    tenant: str
    currency: str
    model: str
    amount: Decimal
    input_tokens: int = 0
    output_tokens: int = 0
    record: bool = True


def _row(charge: Charge, dead: str | None) -> tuple[object, ...]:
    return (
        charge.charge_id,
        charge.request_id,
        charge.tenant,
        charge.currency,
        charge.model,
        str(charge.amount),
        charge.input_tokens,
        charge.output_tokens,
        int(charge.record),
        dead,
    )


def _charge(row: Sequence[object]) -> Charge:
    key, request, tenant, currency, model, amount, tokens_in, tokens_out, record = row
    return Charge(
        str(key),
        str(request),
        str(tenant),
        str(currency),
        str(model),
        Decimal(str(amount)),
        int(str(tokens_in)),
        int(str(tokens_out)),
        bool(record),
    )


class PendingStore:
    """The unbilled charges on disk, and the dead letters: charges the ledger refused for
    their own data (kept for an operator, never retried). `count` (to bill) and `dead` are
    kept in memory for the metrics, updated by each change."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / FILE_NAME
        self.count = 0
        self.dead = 0
        self._db: sqlite3.Connection | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ledger-pending")

    async def _call(self, work: Callable[[], _T]) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, work)

    async def open(self) -> int:
        """Open (or create) the file; returns how many charges it holds to bill."""
        await self._call(self._need)
        return self.count

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, isolation_level=None)
        try:
            # WAL with a full sync per commit: a charge written here survives a crash of
            # the router and of the machine.
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.execute(_SCHEMA)
            columns = {row[1] for row in db.execute("PRAGMA table_info(pending)")}
            if "dead" not in columns:  # a file of a router before the dead letters
                db.execute("ALTER TABLE pending ADD COLUMN dead TEXT")
            live, dead = db.execute(
                "SELECT count(*) FILTER (WHERE dead IS NULL),"
                " count(*) FILTER (WHERE dead IS NOT NULL) FROM pending"
            ).fetchone()
        except BaseException:
            db.close()
            raise
        self._db, self.count, self.dead = db, int(live), int(dead)

    async def add(self, charges: Sequence[Charge], dead: str | None = None) -> None:
        """Keep `charges` (one transaction), to bill or, with `dead`, as dead letters; a
        charge already here is kept once."""
        if charges:
            added = await self._call(lambda: self._add(charges, dead))
            if dead is None:
                self.count += added
            else:
                self.dead += added

    def _add(self, charges: Sequence[Charge], dead: str | None) -> int:
        db = self._need()
        with db:
            db.execute("BEGIN")
            cursor = db.executemany(_INSERT, [_row(charge, dead) for charge in charges])
        return int(cursor.rowcount)

    async def take(self, limit: int) -> list[Charge]:
        """Up to `limit` charges to bill, oldest first; they stay until `remove`d."""
        return await self._call(lambda: self._take(limit))

    def _take(self, limit: int) -> list[Charge]:
        rows = (
            self._need()
            .execute(
                f"SELECT {_COLUMNS} FROM pending WHERE dead IS NULL ORDER BY rowid LIMIT ?",  # noqa: S608
                (limit,),
            )
            .fetchall()
        )
        return [_charge(row) for row in rows]

    async def remove(self, charge_ids: Sequence[str]) -> None:
        if charge_ids:
            self.count -= await self._call(lambda: self._remove(charge_ids))

    def _remove(self, charge_ids: Sequence[str]) -> int:
        db = self._need()
        with db:
            db.execute("BEGIN")
            cursor = db.executemany(
                "DELETE FROM pending WHERE charge_id = ? AND dead IS NULL",
                [(k,) for k in charge_ids],
            )
        return int(cursor.rowcount)

    async def bury(self, charge_id: str, reason: str) -> None:
        """Make a charge waiting here a dead letter: never billed again, kept to be seen."""
        moved = await self._call(lambda: self._bury(charge_id, reason))
        self.count -= moved
        self.dead += moved

    def _bury(self, charge_id: str, reason: str) -> int:
        db = self._need()
        with db:
            db.execute("BEGIN")
            cursor = db.execute(
                "UPDATE pending SET dead = ? WHERE charge_id = ? AND dead IS NULL",
                (reason, charge_id),
            )
        return int(cursor.rowcount)

    async def dead_letters(self, limit: int) -> list[tuple[Charge, str]]:
        """Up to `limit` dead letters, oldest first, with why each was refused."""
        return await self._call(lambda: self._dead_letters(limit))

    def _dead_letters(self, limit: int) -> list[tuple[Charge, str]]:
        rows = (
            self._need()
            .execute(
                f"SELECT {_COLUMNS}, dead FROM pending WHERE dead IS NOT NULL"  # noqa: S608
                " ORDER BY rowid LIMIT ?",
                (limit,),
            )
            .fetchall()
        )
        return [(_charge(row[:-1]), str(row[-1])) for row in rows]

    def _need(self) -> sqlite3.Connection:
        if self._db is None:
            self._open()
        assert self._db is not None
        return self._db

    async def close(self) -> None:
        try:
            await self._call(self._close)
        finally:
            self._thread.shutdown(wait=False)

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
