"""Each limit against the bound the docs state for it, on a site of N routers.

- Request rate (docs/site.md, tests/site_checker.py invariant 2): in any 60 s window the
  site admits at most L + L*T/60 + one round's share per other router + 1.
- Input and output token rates (docs/admission.md B4, docs/site.md): the same window
  bound, plus the debt exact usage may put a bucket into, at most one bucket (L) deep. The
  tokens are the engines' own counts, by request.
- Daily budget (docs/site.md): a site can pass it by up to (N - 1) times what was left at
  the last round, so at most N * L in all; the tokens are what the meter charged (the
  ledger, plus the charges lost at a router kill).
- Wallet (docs/wallets.md): below zero by at most one request's worst case, except while
  the ledger is down (fail-open): then also by what the requests sent during the outage
  (from the kill until every router has the ledger back) were charged.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from decimal import Decimal

from tests.accounting.fleet import DEFAULT_MAX_TOKENS, PRICE_IN, PRICE_OUT, ROUTERS, Fleet
from tests.accounting.sources import Sources
from tests.accounting.traffic import Result
from tests.accounting.verify import Verdict
from tests.site_checker import Answer, worst_window

WINDOW = 60.0


def window_bound(limit: int, elapsed: float, debt: int) -> int:
    elapsed = min(max(elapsed, 0.0), WINDOW)
    share = math.ceil(limit * (ROUTERS - 1) / ROUTERS)
    return limit + math.ceil(limit * elapsed / WINDOW) + share + debt


def worst_tokens(events: Sequence[tuple[float, float, int]], limit: int) -> tuple[int, int]:
    """(used, bound) of the 60 s window of served requests that comes closest to its bound."""
    done = sorted(e for e in events if e[2] > 0)
    best = (0, window_bound(limit, 0.0, limit))
    for index, (start, _end, _amount) in enumerate(done):
        inside = [e for e in done[index:] if e[1] <= start + WINDOW]
        if not inside:
            continue
        used = sum(e[2] for e in inside)
        bound = window_bound(limit, max(e[1] for e in inside) - start, limit)
        if used - bound > best[0] - best[1]:
            best = (used, bound)
    return best


def _engine_tokens(src: Sources, rid: str, output: bool) -> int:
    lines = src.engine.get(rid, [])
    return sum(e.completion if output else e.prompt for e in lines)


def worst_case(result: Result) -> Decimal:
    """The most one request can cost (docs/wallets.md): every prompt byte a token, 4 a
    message, and the declared output times n or the policy's default bound; 16 bytes of
    slack for what the router counts beside the prompt text."""
    call = result.call
    tokens_in = len(call.prompt.encode()) + 4 + 16
    tokens_out = (call.max_tokens or DEFAULT_MAX_TOKENS) * call.n
    return tokens_in * PRICE_IN + tokens_out * PRICE_OUT


def _outage(fleet: Fleet) -> list[tuple[float, float]]:
    return [(a, b) for name, a, b in fleet.faults if name.startswith("postgresql")]


def judge_limits(fleet: Fleet, results: Sequence[Result], src: Sources, v: Verdict) -> None:
    by_tenant: dict[str, list[Result]] = defaultdict(list)
    for result in results:
        by_tenant[result.call.tenant.name].append(result)
    outages = _outage(fleet)
    for tenant in fleet.tenants:
        mine = by_tenant[tenant.name]
        figures: dict[str, tuple[int, int, int]] = {}  # limit: (used, limit, bound)
        answers = [
            Answer(tenant.name, r.started, r.finished, r.status, 0, str(r.call.router), r.code)
            for r in mine
        ]
        admitted, bound = worst_window(answers, tenant.rpm, ROUTERS)
        figures["rpm"] = (admitted, tenant.rpm, bound)
        for name, limit, output in (("itpm", tenant.itpm, False), ("otpm", tenant.otpm, True)):
            events = [
                (r.started, r.finished, _engine_tokens(src, r.call.rid, output)) for r in mine
            ]
            used, bound = worst_tokens(events, limit)
            figures[name] = (used, limit, bound)
        line = v.lines[tenant.name]
        spent = line.ledger + line.lost
        figures["daily"] = (spent, tenant.daily, tenant.daily * ROUTERS)
        unchecked = _wallet(tenant.name, tenant.credit, mine, src, outages, figures)
        for name, (used, limit, bound) in figures.items():
            if used > bound:
                v.bad(f"{tenant.name}: {name} {used} over its bound {bound} (limit {limit})")
        shown = tenant.tight
        if shown not in figures:  # no tight limit: the one nearest its bound
            shown = max(figures, key=lambda k: figures[k][0] / max(figures[k][2], 1))
        used, limit, bound = figures[shown]
        line.worst = f"{shown} {used} of {limit} (bound {bound})"
        if shown == "wallet":
            line.worst += f", {unchecked} of it sent while the ledger was down"


def _wallet(
    tenant: str,
    credit: Decimal,
    mine: Sequence[Result],
    src: Sources,
    outages: Sequence[tuple[float, float]],
    figures: dict[str, tuple[int, int, int]],
) -> int:
    """Spent against credit, in thousandths of a USD (the price of an input token); returns
    the part of the bound that requests sent while the ledger was down add."""
    balance = src.balances.get(tenant, credit)
    one = max((worst_case(r) for r in mine), default=Decimal(0))
    # What the requests sent while the ledger was down were charged (fail-open: no check).
    unchecked = sum(
        (
            row.amount
            for r in mine
            if any(a <= r.started <= b for a, b in outages)
            for row in src.ledger.get(r.call.rid, [])
        ),
        Decimal(0),
    )
    milli = Decimal("0.001")
    figures["wallet"] = (
        int((credit - balance) / milli),
        int(credit / milli),
        int((credit + one + unchecked) / milli),
    )
    return int(unchecked / milli)
