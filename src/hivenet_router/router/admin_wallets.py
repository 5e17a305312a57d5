"""Admin routes of the wallets: credit, balance, the ledger's pages, the reconciliation.

Money travels as decimal strings (a JSON number is accepted on the way in, read exactly,
never through a float). Every refusal is the usual error envelope: 400 invalid_parameter
for a bad amount, currency, note, reference or cursor (and for values the database
refuses); 404 not_found for a tenant without a wallet; 503 backend_unavailable while the
database does not answer (or is busy). These calls have their own, longer timeout
(`Ledger.admin_timeout`) and their failures never mark the ledger down for requests.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from datetime import datetime
from decimal import Decimal
from typing import Any, Final, NoReturn

import orjson

from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.gateway.ledger import Ledger, LedgerRejected, LedgerUnavailable, Wallet
from hivenet_router.gateway.ledger_admin import (
    MAX_NOTE,
    MAX_REFERENCE,
    MAX_TENANT,
    text_ok,
    valid_tenant,
)
from hivenet_router.gateway.settings import CURRENCIES
from hivenet_router.http1.messages import Answer, Request, Response
from hivenet_router.router.requests import read_body

Handler = Callable[[Request], Awaitable[Answer]]

MAX_DECIMALS: Final = 9
MAX_CREDIT: Final = Decimal(10) ** 15  # one credit, exclusive: a typo, not a top-up
PAGE_DEFAULT, PAGE_MAX = 50, 500
_DECIMAL_TEXT = re.compile(r"\d{1,16}(\.\d{1,32})?")
_DIGITS = re.compile(r"[0-9]{1,19}")


def _bad(message: str) -> NoReturn:
    raise ApiError(ErrorCode.INVALID_PARAMETER, message)


def _json(value: object, status: int = 200) -> Response:
    return Response(orjson.dumps(value), status)


def _money(value: Decimal) -> str:
    return format(value, "f")


def _view(wallet: Wallet) -> dict[str, Any]:
    return {
        "tenant": wallet.tenant,
        "currency": wallet.currency,
        "balance": _money(wallet.balance),
        "held": _money(wallet.held),
        "available": _money(wallet.available),
    }


def _no_constants(name: str) -> NoReturn:
    _bad(f"amount: {name} is not a number")


def parse_amount(value: object) -> Decimal:
    """A credit: a positive, finite number with at most nine decimals, under 10^15."""
    if isinstance(value, str) and _DECIMAL_TEXT.fullmatch(value):
        amount = Decimal(value)
    elif isinstance(value, Decimal):
        amount = value
    else:
        _bad('amount: must be a positive number or a decimal string such as "12.50"')
    if not amount.is_finite() or amount <= 0:
        _bad("amount: must be above zero")
    if amount >= MAX_CREDIT:  # before normalize(), which overflows on exponents like 1e1000000
        _bad("amount: must be below 10^15 in one credit")
    exponent = amount.as_tuple().exponent
    if isinstance(exponent, int) and exponent < 0:
        exponent = amount.normalize().as_tuple().exponent  # trailing zeros do not count
    if isinstance(exponent, int) and -exponent > MAX_DECIMALS:
        _bad(f"amount: at most {MAX_DECIMALS} decimals")
    return amount


def parse_tenant(request: Request) -> str:
    tenant = request.match_info.get("tenant", "")
    if not valid_tenant(tenant):
        _bad(f"tenant: 1 to {MAX_TENANT} printable characters")
    return tenant


def _text_field(body: dict[str, Any], name: str, limit: int) -> str | None:
    value = body.get(name)
    if value is not None and (
        not isinstance(value, str) or not 1 <= len(value) <= limit or not text_ok(value)
    ):
        _bad(f"{name}: a string of 1 to {limit} characters, without NUL")
    return value


def _credit_body(raw: bytes) -> tuple[Decimal, str | None, str | None, str | None]:
    try:
        body = json.loads(raw, parse_float=Decimal, parse_int=Decimal, parse_constant=_no_constants)
    except (ValueError, RecursionError):
        _bad('the body must be a JSON object: {"amount": "12.50"}')
    if not isinstance(body, dict):
        _bad('the body must be a JSON object: {"amount": "12.50"}')
    unknown = sorted(set(body) - {"amount", "currency", "note", "reference"})
    if unknown:
        _bad(f"unknown field {unknown[0]!r} (amount, currency, note, reference)")
    if "amount" not in body:
        _bad("amount: required")
    amount = parse_amount(body["amount"])
    currency = body.get("currency")
    if currency is not None and (not isinstance(currency, str) or currency not in CURRENCIES):
        _bad("currency: unknown currency (an ISO 4217 code such as USD)")
    note = _text_field(body, "note", MAX_NOTE)
    reference = _text_field(body, "reference", MAX_REFERENCE)
    if reference is not None and not reference.isprintable():
        _bad("reference: printable characters only")
    return amount, currency, note, reference


def _entry(row: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in row.items():
        if isinstance(value, Decimal):
            out[key] = _money(value)
        elif isinstance(value, datetime):
            out[key] = value.isoformat()
        else:
            out[key] = value
    return out


def _page(request: Request) -> tuple[int, int | None]:
    query = request.query
    limit, before = PAGE_DEFAULT, None
    if "limit" in query:
        text = query["limit"]
        if not _DIGITS.fullmatch(text) or not 1 <= int(text) <= PAGE_MAX:
            _bad(f"limit: a whole number from 1 to {PAGE_MAX}")
        limit = int(text)
    if "before" in query:
        text = query["before"]
        if not _DIGITS.fullmatch(text) or not 1 <= int(text) < 2**63:
            _bad("before: the next_before of the previous page")
        before = int(text)
    return limit, before


class WalletApi:
    def __init__(self, ledger: Ledger, body_timeout: float) -> None:
        self.ledger = ledger
        self.body_timeout = body_timeout

    def routes(self) -> list[tuple[str, str, Handler]]:
        # The reconciliation lives under /admin/ledger so that no tenant name is shadowed.
        return [
            ("GET", "/admin/ledger/reconcile", self.reconcile),
            ("POST", "/admin/wallets/{tenant}/credit", self.credit),
            ("GET", "/admin/wallets/{tenant}/ledger", self.entries),
            ("GET", "/admin/wallets/{tenant}", self.balance),
        ]

    async def credit(self, request: Request) -> Response:
        tenant = parse_tenant(request)
        amount, currency, note, reference = _credit_body(
            await read_body(request, self.body_timeout)
        )
        try:
            done = await self.ledger.credit(tenant, amount, currency, note, reference)
        except LedgerRejected as exc:
            _bad(f"the ledger refused these values ({exc})")
        except LedgerUnavailable as exc:
            raise _unavailable(exc) from None
        wallet = done.wallet
        if done.first_amount is not None:  # a retry: the reference was credited before
            if done.first_amount != amount:
                _bad(
                    f"reference: {reference!r} was used for a credit of "
                    f"{_money(done.first_amount)}, not {_money(amount)}"
                )
        elif currency is not None and wallet.currency != currency:
            _bad(f"currency: the wallet of {tenant} is in {wallet.currency}, not {currency}")
        return _json({**_view(wallet), "applied": done.applied})

    async def balance(self, request: Request) -> Response:
        tenant = parse_tenant(request)
        try:
            wallet = await self.ledger.wallet(tenant)
        except LedgerUnavailable as exc:
            raise _unavailable(exc) from None
        if wallet is None:
            raise ApiError(ErrorCode.NOT_FOUND, f"no wallet for tenant {tenant}")
        return _json(_view(wallet))

    async def entries(self, request: Request) -> Response:
        tenant = parse_tenant(request)
        limit, before = _page(request)
        try:
            rows = await self.ledger.entries(tenant, limit, before)
        except LedgerUnavailable as exc:
            raise _unavailable(exc) from None
        if rows is None:
            raise ApiError(ErrorCode.NOT_FOUND, f"no wallet for tenant {tenant}")
        last = rows[-1]["id"] if len(rows) == limit else None
        return _json(
            {
                "tenant": tenant,
                "entries": [_entry(row) for row in rows],
                "next_before": None if last is None else str(last),
            }
        )

    async def reconcile(self, request: Request) -> Response:
        try:
            result = await self.ledger.reconcile()
        except LedgerUnavailable as exc:
            raise _unavailable(exc) from None
        return _json({"ok": result.ok, "tenants": result.tenants, "mismatches": result.mismatches})


def _unavailable(exc: LedgerUnavailable) -> ApiError:
    return ApiError(
        ErrorCode.BACKEND_UNAVAILABLE, f"the wallet ledger does not answer ({exc}); try again"
    )
