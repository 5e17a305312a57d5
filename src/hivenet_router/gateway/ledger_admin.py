"""The ledger's administrative queries (credit, balance, a page of entries, the
reconciliation) and the limits on the texts that go into it.

These run on a connection the ledger lends (gateway/ledger_sql.py), under the admin
timeout, and never count as the ledger failing for the request path.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Final

MAX_TENANT: Final = 128
MAX_NOTE: Final = 500
MAX_REFERENCE: Final = 128


def text_ok(value: str) -> bool:
    """Storable in a PostgreSQL text: no NUL, and valid UTF-8 (no lone surrogate)."""
    if "\x00" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def valid_tenant(tenant: str) -> bool:
    """A tenant that can own a wallet: 1 to MAX_TENANT printable characters."""
    return 1 <= len(tenant) <= MAX_TENANT and tenant.isprintable() and text_ok(tenant)


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
class Credited:
    """A credit's outcome: `applied` false when the wallet is in another currency, or when
    its reference was used before (`first_amount` is then that credit's amount)."""

    wallet: Wallet
    applied: bool
    first_amount: Decimal | None = None


@dataclass(frozen=True, slots=True)
class Reconciliation:
    ok: bool
    tenants: int
    mismatches: list[dict[str, str]]


async def credit(
    conn: Any,
    tenant: str,
    amount: Decimal,
    currency: str | None,
    note: str | None,
    reference: str | None,
) -> Credited:
    row = await conn.fetchrow(
        "SELECT * FROM wallet_credit($1, $2, $3, $4, $5)",
        tenant,
        currency,
        amount,
        note,
        reference,
    )
    wallet = Wallet(tenant, str(row["currency"]), row["balance"], row["held"])
    return Credited(wallet, bool(row["applied"]), row["first_amount"])


async def wallet(conn: Any, tenant: str) -> Wallet | None:
    row = await conn.fetchrow(
        "SELECT currency, balance, held FROM wallets WHERE tenant = $1", tenant
    )
    if row is None:
        return None
    return Wallet(tenant, str(row["currency"]), row["balance"], row["held"])


async def entries(
    conn: Any, tenant: str, limit: int, before: int | None
) -> list[dict[str, Any]] | None:
    """A page of the tenant's ledger, newest first, rows with `id < before`; None when the
    tenant has no wallet."""
    if not await conn.fetchval("SELECT EXISTS (SELECT 1 FROM wallets WHERE tenant = $1)", tenant):
        return None
    rows = await conn.fetch(
        "SELECT id, kind, amount, balance_after, currency, charge_id, request_id, model,"
        " input_tokens, output_tokens, note, reference, created_at FROM ledger"
        " WHERE tenant = $1 AND ($2::bigint IS NULL OR id < $2)"
        " ORDER BY id DESC LIMIT $3",
        tenant,
        before,
        limit,
    )
    return [dict(row) for row in rows]


async def reconcile(conn: Any) -> Reconciliation:
    """wallet_reconcile() over one consistent snapshot, with the number of wallets."""
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        rows = await conn.fetch("SELECT * FROM wallet_reconcile()")
        tenants = int(await conn.fetchval("SELECT count(*) FROM wallets"))
    mismatches = [
        {name: "" if value is None else str(value) for name, value in row.items()} for row in rows
    ]
    return Reconciliation(not mismatches, tenants, mismatches)
