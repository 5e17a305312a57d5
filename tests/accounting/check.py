"""One run of the accounting checker: start the site, send the seeded traffic while the
faults happen, wait for the site to be quiet, read the sources and judge them."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from tests.accounting.fleet import Fleet, held, make_tenants, started
from tests.accounting.sources import read_all
from tests.accounting.traffic import Fault, Result, plan, run
from tests.accounting.verify import Verdict, table, verdict


@dataclass
class Report:
    verdict: Verdict
    table: str
    results: list[Result]
    faults: list[tuple[str, float, float]]
    seconds: float

    def text(self) -> str:
        faults = "\n".join(f"- {name}: {end - start:.1f} s" for name, start, end in self.faults)
        notes = "\n".join(f"- {note}" for note in self.verdict.notes)
        findings = "\n".join(f"- {f}" for f in self.verdict.findings) or "- none"
        return (
            f"{self.table}\nFaults (time from the fault to its recovery):\n{faults}\n"
            f"Notes:\n{notes}\nFindings:\n{findings}\n"
            f"{len(self.results)} requests, {self.seconds:.0f} s in all\n"
        )


def faults_for(fleet: Fleet, count: int) -> list[Fault]:
    """The faults, each fired at a fixed request and overlapping the same requests every run."""
    ledger_down: list[float] = []

    def at(share: float) -> int:
        return int(count * share)

    faults = [
        Fault("router kill", at(0.15), at(0.30), lambda: fleet.kill_router(1)),
        Fault("valkey failover", at(0.30), at(0.45), fleet.fail_over),
        Fault("ledger kill", at(0.45), at(0.55), lambda: ledger_down.append(fleet.kill_ledger())),
        Fault("ledger restart", at(0.55), at(0.65), lambda: fleet.restart_ledger(ledger_down[0])),
        Fault("agent kill", at(0.70), at(0.85), lambda: fleet.kill_agent(2)),
    ]
    if count >= 1000:
        faults.append(Fault("router kill", at(0.88), at(0.95), lambda: fleet.kill_router(2)))
    return faults


def summary(fleet: Fleet, results: list[Result], judged: Verdict) -> list[str]:
    """What happened, for the reader of the table: how requests ended, and what each
    router kill caught in flight."""
    ended = Counter(r.ended for r in results)
    notes = [
        "requests by how their client saw them end: "
        + ", ".join(f"{k} {n}" for k, n in sorted(ended.items()))
    ]
    busy = [r for r in results if r.code == "concurrency_limit_exceeded"]
    during = [r for r in busy if any(a <= r.started <= b for _, a, b in fleet.faults)]
    notes.append(
        f"{len(busy)} requests refused concurrency_limit_exceeded, {len(during)} of them"
        " sent while a fault was being recovered from"
    )
    for life in fleet.lives:
        if life.killed is None:
            continue
        caught = [
            r
            for r in results
            if r.call.router == life.index and r.started <= life.killed < r.finished
        ]
        lost = [r for r in caught if r.call.rid in judged.lost]
        notes.append(
            f"router r{life.index} killed with {len(caught)} of its requests in flight:"
            f" {len(lost)} of them had engine tokens and no charge (the documented loss),"
            f" {sum(r.ended == 'whole' for r in caught)} were read whole by their client"
        )
    return notes


def check(tmp: Path, seed: int, count: int, workers: int) -> Report:
    began = time.monotonic()
    tenants = make_tenants()
    with started(tmp, tenants) as fleet:
        calls = plan(seed, count, tenants)
        results = run(fleet, calls, faults_for(fleet, count), workers)
        try:
            fleet.settle()
            left: dict[str, dict[str, float]] = {}
        except AssertionError:
            left = {f"r{i}": held(r.metrics()) for i, r in enumerate(fleet.routers)}
        sources = read_all(fleet)
        sources.held = left
        judged = verdict(fleet, results, sources)
        judged.notes.extend(summary(fleet, results, judged))
        return Report(judged, table(judged), results, fleet.faults, time.monotonic() - began)
