"""Judge the sources against what the docs promise, per request and per tenant.

A request's **group** is itself, or, for a cacheable request, every request of its tenant
with the same body (they may share one engine call, and with `bill_hits: false` one of them
pays for it: docs/cache.md). A group is **clean** when every client in it read its whole
answer or was refused before any answer; it is **cut** when a client hung up, its stream
broke, or it got no answer (a router or agent killed under it).

1. Billed once (docs/admission.md "One meter", docs/wallets.md): no request has two
   charge rows; in a clean group the ledger's tokens equal the engines' own count of the
   complete generations, to the token, except the charges of requests a router was running
   when it was killed with SIGKILL (docs/wallets.md, "Lost: only the charges of requests in
   flight when a router is killed with SIGKILL"): those are counted as `lost`, and allowed
   only for requests sent to that router process before its kill; so are the generations
   a killed agent's engine finished and never delivered, beside the retry that was (see
   `undelivered`). A cut group is charged
   what the meter counted from the text relayed (docs/admission.md), which is not the
   engine's count: shown beside it, not judged to the token.
2. A request refused for a limit (429, 402) reached no engine and has no charge row. The
   usage a client was shown is the engine's; a stream that did not ask for it shows none.
3. The audit record of a request equals its charge row (tokens and charge); a charged
   request without a record, or the reverse, only on a killed router.
4. `/admin/usage` (site-wide, every router agreeing) equals the ledger per tenant, within
   the tokens of requests at risk on a killed router (what it had not yet synced).
5. No limit passed beyond its documented bound (docs/admission.md, docs/site.md,
   docs/wallets.md); see `limits.py`.
6. Nothing held: gauges, sync credits, and wallet holds other than those of requests a
   killed router was running (released by the 15-minute expiry, docs/wallets.md).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal

from tests.accounting.fleet import PRICE_IN, PRICE_OUT, Fleet
from tests.accounting.sources import EngineLine, Row, Sources
from tests.accounting.traffic import Result

LIMIT_CODES = {402, 429}


@dataclass
class Line:
    """One tenant's row of the table."""

    tenant: str
    tight: str
    requests: int = 0
    answered: int = 0
    engine: int = 0  # tokens the engines generated for it (prompt + completion, all lines)
    ledger: int = 0  # tokens its charge rows bill
    audit: int = 0  # tokens its billed audit records carry
    usage: int = 0  # /admin/usage tokens_used
    lost: int = 0  # engine tokens of complete generations with no charge (router killed)
    cut_engine: int = 0  # cut groups: what the engines generated
    cut_ledger: int = 0  # ... and what was charged (counted from the text)
    limits: Counter[str] = field(default_factory=Counter)
    worst: str = ""  # the limit that came closest to its bound: "otpm 130/2x"


@dataclass
class Verdict:
    lines: dict[str, Line]
    findings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)  # requests whose charge a kill lost

    def bad(self, text: str) -> None:
        if len(self.findings) < 200:
            self.findings.append(text)


def at_risk(fleet: Fleet, result: Result) -> bool:
    """Was this request sent to a router process that was later killed with SIGKILL?"""
    return any(
        life.index == result.call.router
        and life.killed is not None
        and life.began <= result.started <= life.killed
        for life in fleet.lives
    )


def undelivered(fleet: Fleet, result: Result, generated: list[EngineLine]) -> list[EngineLine]:
    """Of a request's complete generations, those an agent killed under it never delivered:
    made by the engine of an agent killed while the request was in flight, when another
    generation (the router's retry on another agent) is there to have been delivered."""
    if len(generated) < 2:
        return []
    killed = {
        agent for agent, at in fleet.agent_kills if result.started <= at <= (result.finished or at)
    }
    lost = [e for e in generated if e.sim in killed]
    return lost if len(lost) < len(generated) else []


def group_key(result: Result) -> str:
    call = result.call
    if not call.cacheable:
        return call.rid
    return f"{call.tenant.name}|{call.shape}|{call.prompt}|{call.max_tokens}|{call.n}"


def billed(row_in: int, row_out: int) -> Decimal:
    return row_in * PRICE_IN + row_out * PRICE_OUT


def judge_billing(fleet: Fleet, results: Sequence[Result], src: Sources, v: Verdict) -> None:
    groups: dict[str, list[Result]] = defaultdict(list)
    for result in results:
        groups[group_key(result)].append(result)
        line = v.lines[result.call.tenant.name]
        line.requests += 1
        line.answered += result.ended == "whole"
        if result.status in LIMIT_CODES:
            line.limits[_limit_name(result)] += 1
        rid = result.call.rid
        rows = src.ledger.get(rid, [])
        if len(rows) > 1:
            v.bad(f"{rid}: {len(rows)} charge rows (billed more than once)")
        for row in rows:
            if row.amount != billed(row.tokens_in, row.tokens_out) and row.amount != 0:
                v.bad(f"{rid}: charged {row.amount} for {row.tokens_in}+{row.tokens_out} tokens")
        engine = src.engine.get(rid, [])
        line.engine += sum(e.prompt + e.completion for e in engine)
        line.ledger += sum(_tokens(r) for r in rows)
        _judge_seen(result, engine, v)
        if result.status in LIMIT_CODES and (engine or rows):
            v.bad(f"{rid}: refused {result.status} {result.code} yet engine={engine} rows={rows}")
    for members in groups.values():
        _judge_group(fleet, members, src, v)


def _judge_seen(result: Result, engine: list[EngineLine], v: Verdict) -> None:
    """The client's own view, a fifth source: the usage it was shown is the engine's, and a
    stream whose client did not ask for usage shows none (docs/admission.md, One meter)."""
    rid, shape = result.call.rid, result.call.shape
    if shape in ("chat_stream", "completion_stream"):
        if result.seen_in or result.seen_out:
            v.bad(f"{rid} ({shape}): usage shown to a client that did not ask for it")
        return
    done = [e for e in engine if e.complete]
    if result.ended != "whole" or result.call.cacheable or len(done) != 1:
        return
    if (result.seen_in, result.seen_out) != (done[0].prompt, done[0].completion):
        v.bad(f"{rid} ({shape}): client shown {result.seen_in}+{result.seen_out}, engine {done[0]}")


def _tokens(row: Row) -> int:
    """The tokens a charge row bills: none for a row of no money (a hit not billed)."""
    return row.tokens_in + row.tokens_out if row.amount != 0 else 0


def _limit_name(result: Result) -> str:
    if result.status == 402:
        return "wallet"
    return result.code or str(result.status)


def _judge_group(fleet: Fleet, members: list[Result], src: Sources, v: Verdict) -> None:
    line = v.lines[members[0].call.tenant.name]
    clean = all(m.ended in ("whole", "refused") for m in members)
    rids = [m.call.rid for m in members]
    engine = sum(e.prompt + e.completion for r in rids for e in src.engine.get(r, []) if e.complete)
    ledger = sum(_tokens(row) for r in rids for row in src.ledger.get(r, []))
    if not clean:
        _judge_cut(fleet, members, src, v)
        return
    lost = 0
    for member in members:
        rid = member.call.rid
        generated = [e for e in src.engine.get(rid, []) if e.complete]
        wasted = undelivered(fleet, member, generated)
        if wasted:  # the retry was delivered and billed; the killed agent's work was not
            lost += sum(e.prompt + e.completion for e in wasted)
            v.lost.append(rid)
        if generated and not src.ledger.get(rid):
            if at_risk(fleet, member):
                lost += sum(e.prompt + e.completion for e in generated)
                v.lost.append(rid)
            else:
                v.bad(f"{rid} ({member.call.shape}): served {generated}, no charge row")
    line.lost += lost
    if ledger != engine - lost:
        detail = [
            (
                m.call.rid,
                m.call.shape,
                m.ended,
                src.engine.get(m.call.rid),
                src.ledger.get(m.call.rid),
            )
            for m in members
        ]
        v.bad(f"group {rids[0]}: ledger {ledger} != engine {engine} - lost {lost}: {detail}")


def _judge_cut(fleet: Fleet, members: list[Result], src: Sources, v: Verdict) -> None:
    """A group some client did not read to its end. A request the engine worked on with no
    charge row is the documented loss of a router killed under it, and nothing else."""
    line = v.lines[members[0].call.tenant.name]
    for member in members:
        rid = member.call.rid
        tokens = sum(e.prompt + e.completion for e in src.engine.get(rid, []))
        rows = src.ledger.get(rid, [])
        if rows:
            line.cut_engine += tokens
            line.cut_ledger += sum(_tokens(row) for row in rows)
        elif tokens and at_risk(fleet, member):
            line.lost += tokens
            v.lost.append(rid)
        elif tokens:
            v.bad(f"{rid} ({member.call.shape}, {member.ended}): engine {tokens}, no charge row")


def judge_audit(fleet: Fleet, results: Sequence[Result], src: Sources, v: Verdict) -> None:
    cache = Counter(str(r.get("cache")) for rs in src.audit.values() for r in rs if "cache" in r)
    v.notes.append(
        "cache results in the audit: "
        + (", ".join(f"{k} {n}" for k, n in sorted(cache.items())) or "none")
    )
    unaudited = 0  # charged, no audit record: the router was killed before writing it
    for result in results:
        rid = result.call.rid
        records, rows = src.audit.get(rid, []), src.ledger.get(rid, [])
        line = v.lines[result.call.tenant.name]
        for record in records:
            if record.get("billed") is not False:
                line.audit += int(record["input_tokens"]) + int(record["output_tokens"])
        if len(records) > 1:
            v.bad(f"{rid}: {len(records)} audit records")
        if not records or not rows:
            has_tokens = any(r["input_tokens"] or r["output_tokens"] for r in records)
            if (rows or has_tokens) and not at_risk(fleet, result):
                v.bad(f"{rid}: audit records {records} but charge rows {rows}")
            elif rows:
                unaudited += 1
            continue
        record, row = records[0], rows[0]
        if record.get("billed") is False:
            if row.amount != 0:
                v.bad(f"{rid}: audit says not billed, ledger charged {row.amount}")
            continue
        pair = (int(record["input_tokens"]), int(record["output_tokens"]))
        if pair != (row.tokens_in, row.tokens_out) or Decimal(record["charge"]) != row.amount:
            v.bad(f"{rid}: audit {pair} {record.get('charge')} != ledger {row}")
    v.notes.append(
        f"{unaudited} charged requests have no audit record: a router killed with SIGKILL"
        " lost the lines its audit writer had not yet written"
    )


def judge_usage(fleet: Fleet, results: Sequence[Result], src: Sources, v: Verdict) -> None:
    if not src.usage_agree:
        v.bad("the routers' /admin/usage answers differ")
    risk: Counter[str] = Counter()
    for result in results:
        if at_risk(fleet, result):
            tokens = sum(e.prompt + e.completion for e in src.engine.get(result.call.rid, []))
            risk[result.call.tenant.name] += tokens
    for name, line in v.lines.items():
        line.usage = src.usage.get(name, 0)
        if line.usage != line.ledger:
            v.notes.append(
                f"{name}: /admin/usage {line.usage}, ledger {line.ledger}: a router killed"
                " with SIGKILL had not synced what it settled last"
            )
        if abs(line.usage - line.ledger) > risk[name]:
            v.bad(
                f"{name}: /admin/usage {line.usage} != ledger {line.ledger}"
                f" (more than the {risk[name]} tokens at risk on killed routers)"
            )


def judge_held(fleet: Fleet, results: Sequence[Result], src: Sources, v: Verdict) -> None:
    for router, gauges in src.held.items():
        if gauges:
            v.bad(f"{router}: still held after the traffic: {gauges}")
    for router, credits in src.sync_in_use.items():
        if credits:
            v.bad(f"{router}: {credits} occupancy credits still in use")
    risky = {r.call.rid for r in results if at_risk(fleet, r)}
    kept = [h for h in src.holds if h[0] not in risky]
    if kept:
        v.bad(f"wallet holds left that no router kill explains: {kept[:5]}")
    v.notes.append(
        f"{len(src.holds) - len(kept)} wallet holds of requests a killed router was running"
        " wait for the 15-minute expiry"
    )
    if src.reconcile.get("ok") is not True:
        v.bad(f"ledger reconciliation: {src.reconcile}")


def verdict(fleet: Fleet, results: Sequence[Result], src: Sources) -> Verdict:
    from tests.accounting.limits import judge_limits

    v = Verdict({t.name: Line(t.name, t.tight) for t in fleet.tenants})
    judge_billing(fleet, results, src, v)
    judge_audit(fleet, results, src, v)
    judge_usage(fleet, results, src, v)
    judge_held(fleet, results, src, v)
    judge_limits(fleet, results, src, v)
    return v


def table(v: Verdict) -> str:
    head = (
        "| tenant | tight | requests | answered | engine tokens | ledger tokens | audit tokens"
        " | /admin/usage | lost at kill | cut: engine / ledger | limits hit | closest to bound |\n"
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |\n"
    )
    rows = []
    total = Line("all", "")
    for line in v.lines.values():
        limits = ", ".join(f"{k} {n}" for k, n in sorted(line.limits.items())) or "-"
        rows.append(
            f"| {line.tenant} | {line.tight} | {line.requests} | {line.answered} | {line.engine}"
            f" | {line.ledger} | {line.audit} | {line.usage} | {line.lost}"
            f" | {line.cut_engine} / {line.cut_ledger} | {limits} | {line.worst or '-'} |"
        )
        for name in ("requests", "answered", "engine", "ledger", "audit", "usage", "lost"):
            setattr(total, name, getattr(total, name) + getattr(line, name))
        total.cut_engine += line.cut_engine
        total.cut_ledger += line.cut_ledger
    rows.append(
        f"| **all** | | {total.requests} | {total.answered} | {total.engine} | {total.ledger}"
        f" | {total.audit} | {total.usage} | {total.lost}"
        f" | {total.cut_engine} / {total.cut_ledger} | | |"
    )
    return head + "\n".join(rows) + "\n"
