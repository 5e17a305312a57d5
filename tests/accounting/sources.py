"""The independent sources the checker reads once the traffic has stopped and the site is
quiet: each simulator's own usage log, the ledger's rows in PostgreSQL, every router's
audit records, and `GET /admin/usage` / `/admin/sync` / `/admin/ledger/reconcile`."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson

from tests.accounting.fleet import Fleet
from tests.procs import sync_view, wait_until

PREFIX = "acc0acc0-"  # the X-Request-ID of every request the traffic sent


@dataclass(frozen=True)
class EngineLine:
    request_id: str
    prompt: int
    completion: int
    outcome: str  # stop, length, abort
    sim: int

    @property
    def complete(self) -> bool:
        return self.outcome != "abort"


@dataclass(frozen=True)
class Row:
    request_id: str
    tenant: str
    tokens_in: int
    tokens_out: int
    amount: Decimal  # charged, positive


@dataclass
class Sources:
    engine: dict[str, list[EngineLine]] = field(default_factory=lambda: defaultdict(list))
    ledger: dict[str, list[Row]] = field(default_factory=lambda: defaultdict(list))
    audit: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    holds: list[tuple[str, str, Decimal]] = field(default_factory=list)  # request, tenant, amount
    balances: dict[str, Decimal] = field(default_factory=dict)
    usage: dict[str, int] = field(default_factory=dict)  # /admin/usage, site-wide, per tenant
    usage_agree: bool = True  # every router answered the same totals
    reconcile: dict[str, Any] = field(default_factory=dict)
    sync_in_use: dict[str, int] = field(default_factory=dict)  # router: credits in use
    held: dict[str, dict[str, float]] = field(default_factory=dict)  # router: gauges not 0


def _lines(path: Path) -> list[bytes]:
    """Whole lines of a file a writer thread may still append to."""
    if not path.exists():
        return []
    *whole, _rest = path.read_bytes().split(b"\n")
    return [line for line in whole if line]


def _stable_count(paths: list[Path]) -> None:
    """Wait until the files stop growing: their writers run off the event loop."""
    last: list[int] = []

    def same() -> bool:
        now = [len(_lines(p)) for p in paths]
        done = now == last
        last[:] = now
        return done

    wait_until(same, timeout=20, interval=0.5)


def read_engine(fleet: Fleet, into: Sources) -> None:
    _stable_count(fleet.usage_logs)
    for sim, path in enumerate(fleet.usage_logs):
        for raw in _lines(path):
            line = orjson.loads(raw)
            rid = str(line["request_id"])
            into.engine[rid].append(
                EngineLine(
                    rid,
                    int(line["prompt_tokens"]),
                    int(line["completion_tokens"]),
                    str(line["outcome"]),
                    sim,
                )
            )


def read_audit(fleet: Fleet, into: Sources) -> None:
    _stable_count(fleet.audit_logs)
    for path in fleet.audit_logs:
        for raw in _lines(path):
            record = orjson.loads(raw)
            rid = str(record.get("request_id", ""))
            if rid.startswith(PREFIX):
                into.audit[rid].append(record)


def _rows(fleet: Fleet, sql: str) -> list[list[str]]:
    text = fleet.pg.psql(sql)
    return [line.split("|") for line in text.splitlines() if line]


def read_ledger(fleet: Fleet, into: Sources) -> None:
    for rid, tenant, tokens_in, tokens_out, amount in _rows(
        fleet,
        "SELECT coalesce(request_id, ''), tenant, coalesce(input_tokens, 0),"
        " coalesce(output_tokens, 0), -amount FROM ledger WHERE kind = 'charge'",
    ):
        if rid.startswith(PREFIX):
            into.ledger[rid].append(
                Row(rid, tenant, int(tokens_in), int(tokens_out), Decimal(amount))
            )
    for rid, tenant, amount in _rows(
        fleet, "SELECT coalesce(request_id, ''), tenant, amount FROM holds"
    ):
        into.holds.append((rid, tenant, Decimal(amount)))
    for tenant, balance in _rows(fleet, "SELECT tenant, balance FROM wallets"):
        into.balances[tenant] = Decimal(balance)
    answer = fleet.admin(0, "GET", "/admin/ledger/reconcile")
    into.reconcile = answer.json() if answer.status_code == 200 else {"status": answer.text}


def read_usage(fleet: Fleet, into: Sources) -> None:
    """Every router's /admin/usage (they must agree); the routers' sync views and gauges."""
    seen: list[dict[str, int]] = []
    for index in range(len(fleet.routers)):
        body = fleet.admin(index, "GET", "/admin/usage").json()
        assert body.get("scope") == "site", body
        seen.append({b["tenant"]: int(b["tokens_used"]) for b in body["budgets"]})
    into.usage = seen[0]
    into.usage_agree = all(s == seen[0] for s in seen)
    for router in fleet.routers:
        view = sync_view(router)
        name = str(view["router_id"])
        into.sync_in_use[name] = sum(int(w["in_use"]) for w in view["wallets"].values())


def wait_usage_settled(fleet: Fleet, timeout: float = 30.0) -> None:
    """/admin/usage stops changing and every router answers the same: the routers' rounds
    (and the re-reads that heal a write lost in the failover) are done."""
    last: list[object] = []

    def settled() -> bool:
        views = []
        for index in range(len(fleet.routers)):
            body = fleet.admin(index, "GET", "/admin/usage").json()
            views.append(sorted((b["tenant"], b["tokens_used"]) for b in body["budgets"]))
        now = views[0] if all(v == views[0] for v in views) else None
        done = now is not None and [now] == last
        last[:] = [now]
        return done

    wait_until(settled, timeout=timeout, interval=1.0)


def read_all(fleet: Fleet) -> Sources:
    sources = Sources()
    read_engine(fleet, sources)
    read_audit(fleet, sources)
    read_ledger(fleet, sources)
    wait_usage_settled(fleet)
    read_usage(fleet, sources)
    return sources
