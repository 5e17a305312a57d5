"""Site benchmark: what sharing limits through Valkey (--sync-store valkey) costs, and how
a site of two and three routers on one host compares with one router.

    make bench-site                   # about 7 minutes on 2 cores
    make bench-site ARGS=--quick      # about 2 minutes: short cells, fewer rounds
    make bench-site ARGS="--parts cpu --rounds 8 --no-docs"   # only the A/B, longer

Three parts, each with its tables in docs/benchmarks.md (between the site markers) and
bench/results/site.json:

1. `cpu`: router CPU per request with and without --sync-store valkey. Three routers
   share one zero-latency simulator and the same agents (each agent connected to all
   three with --routers): one alone in a site, and two identical ones without the store
   (the second is the control: what two runs of the same code differ by here). Every
   router reads the same auth file, a client key whose request rate and daily tokens are
   charged on every request (never refused), and the same policy with
   `admit_budget_tokens` (occupancy credits). Load: 1 KB JSON chats. Each round measures
   the synced and the plain router one after the other (wrk -t1 -c32, order reversed
   every other round), then all three at once (wrk -t3 -c33, one thread per router, the
   thread-to-router assignment turned every round), which puts them in the same seconds
   of a noisy machine. Then py-spy, when found (bench/site_profile.py), samples the
   plain and the synced router under load. Medians.
2. `rounds`: one sync round at 10, 1,000 and 10,000 active keys, driving `Site` in this
   process against a valkey-server of its own, and the request path's state calls alone,
   in memory and with the site's ports (bench/site_rounds.py).
3. `site`: one router, and sites of two and three routers (a) sharing one port with
   --reuse-port and (b) on their own ports with wrk's threads dealt over them; the same
   agents reach every router. Interleaved rounds, medians.

CPU per request is utime + stime from /proc/PID/stat over a cell divided by the requests
wrk counted (by the requests each router routed, from its /metrics, when several share a
cell); wrk's own CPU comes from getrusage of the finished child.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.common import LOADS, Fleet, ensure_wrk, publish, secret_file, wait_http
from bench.site_fleet import TICK_US, SiteFleet, Store, Target, routed, run_load, sim_args
from bench.site_profile import find_py_spy, record, summarise
from bench.site_report import Cell, Report, render
from bench.site_rounds import RoundCost
from bench.site_rounds import run as run_rounds

BODY = LOADS["json-1k"]
WARM_UP_S = 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="short cells, fewer rounds")
    parser.add_argument("--seconds", type=int, default=10, help="per cell")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds, part cpu")
    parser.add_argument("--site-rounds", type=int, default=3, help="interleaved rounds, part site")
    parser.add_argument("--key-rounds", type=int, default=7, help="measured rounds per size")
    parser.add_argument("--keys", default="10,1000,10000", help="active keys, part rounds")
    parser.add_argument("--concurrency", type=int, default=32, help="wrk connections, part cpu")
    parser.add_argument("--site-concurrency", type=int, default=48, help="part site (-t6)")
    parser.add_argument("--agents", type=int, default=2)
    parser.add_argument("--parts", default="cpu,rounds,site")
    parser.add_argument(
        "--profile",
        type=int,
        default=8,
        help="seconds of py-spy per router after part cpu (0: none; skipped without py-spy)",
    )
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.rounds, args.site_rounds, args.key_rounds = 4, 2, 1, 2
        args.profile = min(args.profile, 4)
    parts = args.parts.split(",")
    report = Report(seconds=args.seconds, rounds=args.rounds, site_rounds=args.site_rounds)
    given = " ".join(sys.argv[1:])
    report.command = "make bench-site" + (f' ARGS="{given}"' if given else "")
    tmp = Path(tempfile.mkdtemp(prefix="hivenet-bench-site-"))
    fleet = Fleet(tmp)
    try:
        if "rounds" in parts:
            sizes = [int(k) for k in args.keys.split(",")]
            report.round_costs, report.port_us = part_rounds(fleet, sizes, args)
        if "cpu" in parts or "site" in parts:
            part_load(fleet, tmp, parts, args, report)
            report.cells = medians(report.raw)
    finally:
        fleet.stop()
    data = asdict(report)
    publish("site", data, render(report), not args.no_docs)
    return 0


def part_rounds(
    fleet: Fleet, sizes: list[int], args: argparse.Namespace
) -> tuple[list[RoundCost], dict[str, float]]:
    print(f"== sync round cost at {sizes} active keys, {args.key_rounds} rounds each", flush=True)
    store = Store(fleet, "valkey-rounds")
    try:
        return run_rounds(store, sizes, args.key_rounds)
    finally:
        store.close()
        fleet.stop(["valkey-rounds"])


def part_load(
    fleet: Fleet, tmp: Path, parts: list[str], args: argparse.Namespace, report: Report
) -> None:
    wrk = ensure_wrk()
    store = Store(fleet)
    site = SiteFleet(fleet, tmp, secret_file(tmp), store)
    sim = site.port()
    fleet.start("sim", sim_args(sim))
    backend = f"http://127.0.0.1:{sim}"
    wait_http(f"{backend}/v1/models", lambda text: "bench-model" in text)
    one = site.site("one", 1, reuse_port=False)
    cells = report.raw
    try:
        if "cpu" in parts:
            plain, twin = site.plain("plain"), site.plain("plain-b")
            trio = [plain, twin, one]
            agents = site.agents(args.agents, backend, [r for t in trio for r in t.routers], "a")
            site.wait_ready(trio, args.agents)
            print(f"== with and without --sync-store, {args.rounds} rounds", flush=True)
            measure = Measure(site, wrk, tmp, agents, args.seconds)
            conns = args.concurrency
            for index in range(args.rounds):
                order = [plain, one] if index % 2 == 0 else [one, plain]
                for target in order:
                    cells.append(measure.cell("cpu", target, conns, 1))
                # The same three at once, a third of the connections each (rounded up), the
                # wrk thread that serves each turned round by round.
                turned = trio[index % 3 :] + trio[: index % 3]
                cells += measure.together("cpu-together", turned, -(-conns // 3) * 3)
            if args.profile:
                report.profiles = profile(site, [plain, one], wrk, tmp, args)
            fleet.stop([*agents, "plain", "plain-b"])
        if "site" in parts:
            cells += part_site(site, backend, one, wrk, tmp, args)
    finally:
        store.close()


def profile(
    site: SiteFleet, targets: list[Target], wrk: str, tmp: Path, args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """py-spy on each target's router while wrk loads it, summarised."""
    py_spy = find_py_spy()
    if py_spy is None:
        print("no py-spy found: no profile (see bench/site_profile.py)", flush=True)
        return {}
    out = {}
    for target in targets:
        raw = tmp / f"profile-{target.name}.txt"
        pid = site.fleet.pid(target.procs[0])

        def load(target: Target = target) -> None:
            run_load(wrk, target.ports, BODY, args.concurrency, 1, args.profile + 2, tmp)

        print(f"== py-spy on {target.name} for {args.profile} s -> {raw}", flush=True)
        record(py_spy, pid, args.profile, raw, load)
        out[target.name] = summarise(raw)
    return out


def part_site(
    site: SiteFleet, backend: str, one: Target, wrk: str, tmp: Path, args: argparse.Namespace
) -> list[Cell]:
    targets = [
        one,
        site.site("rp2", 2, reuse_port=True),
        site.site("sep2", 2, reuse_port=False),
        site.site("rp3", 3, reuse_port=True),
        site.site("sep3", 3, reuse_port=False),
    ]
    everyone = [router for target in targets for router in target.routers]
    agents = site.agents(args.agents, backend, everyone, "b")
    site.wait_ready(targets, args.agents)
    print(f"== one router against sites of 2 and 3, {args.site_rounds} rounds", flush=True)
    measure = Measure(site, wrk, tmp, agents, args.seconds)
    cells = []
    for index in range(args.site_rounds):
        order = targets if index % 2 == 0 else targets[::-1]
        for target in order:
            cells.append(measure.cell("site", target, args.site_concurrency, 6))
    return cells


class Measure:
    def __init__(
        self, site: SiteFleet, wrk: str, tmp: Path, agents: list[str], seconds: int
    ) -> None:
        self.site, self.wrk, self.tmp, self.agents, self.seconds = site, wrk, tmp, agents, seconds

    def cell(self, part: str, target: Target, conns: int, threads: int) -> Cell:
        site = self.site
        run_load(self.wrk, target.ports, BODY, conns, threads, WARM_UP_S, self.tmp)
        names = [*target.procs, *self.agents, "sim", site.store.name]
        before = site.cpu_ticks(names)
        routed_before = [routed(router) for router in target.routers]
        load = run_load(self.wrk, target.ports, BODY, conns, threads, self.seconds, self.tmp)
        after = site.cpu_ticks(names)
        routed_after = [routed(router) for router in target.routers]
        got = load.result
        n = max(got.requests, 1)

        def per_request(group: list[str]) -> float:
            return round(sum(after[p] - before[p] for p in group) * TICK_US / n, 1)

        cpu = {
            "routers": per_request(target.procs),
            "agents": per_request(self.agents),
            "sim": per_request(["sim"]),
            "valkey": per_request([site.store.name]),
            "wrk": round(load.wrk_cpu_s * 1e6 / n, 1),
        }
        served = [b - a for a, b in zip(routed_before, routed_after, strict=True)]
        split = [round(s / max(sum(served), 1), 3) for s in served]
        cell = Cell(
            part, target.name, len(target.routers), conns, threads, got.requests, got.rps,
            got.p50_ms, got.p99_ms, got.errors, cpu, split,
        )  # fmt: skip
        print(
            f"  {part:4s} {target.name:6s} {got.rps:8.0f} req/s  p50 {got.p50_ms:6.2f} ms  "
            f"CPU us/req {cpu}  split {split}  errors {got.errors}",
            flush=True,
        )
        return cell

    def together(self, part: str, targets: list[Target], conns: int) -> list[Cell]:
        """Every target (one router each) under load at the same time, one wrk thread per
        router: each router's CPU divided by the requests it routed, so all of them are
        measured in the same seconds on the same busy machine."""
        site, threads = self.site, len(targets)
        ports = [target.ports[0] for target in targets]
        run_load(self.wrk, ports, BODY, conns, threads, WARM_UP_S, self.tmp)
        names = [*(t.procs[0] for t in targets), *self.agents, "sim", site.store.name]
        before = site.cpu_ticks(names)
        routed_before = [routed(target.routers[0]) for target in targets]
        load = run_load(self.wrk, ports, BODY, conns, threads, self.seconds, self.tmp)
        after = site.cpu_ticks(names)
        served = [
            routed(target.routers[0]) - was
            for target, was in zip(targets, routed_before, strict=True)
        ]
        got, total = load.result, max(sum(served), 1)

        def per_request(group: list[str], n: float) -> float:
            return round(sum(after[p] - before[p] for p in group) * TICK_US / max(n, 1), 1)

        shared = {
            "agents": per_request(self.agents, total),
            "sim": per_request(["sim"], total),
            "valkey": per_request([site.store.name], total),
            "wrk": round(load.wrk_cpu_s * 1e6 / total, 1),
        }
        cells = []
        for target, n in zip(targets, served, strict=True):
            cpu = {"routers": per_request([target.procs[0]], n), **shared}
            cells.append(
                Cell(
                    part,
                    target.name,
                    1,
                    conns // threads,
                    1,
                    int(n),
                    n / self.seconds,
                    got.p50_ms,
                    got.p99_ms,
                    got.errors,
                    cpu,
                    [round(n / total, 3)],
                )
            )
        print(
            "  together: "
            + ", ".join(f"{c.target} {c.rps:.0f} req/s {c.cpu_us['routers']} us" for c in cells)
            + f"; {shared}",
            flush=True,
        )
        return cells


def medians(cells: list[Cell]) -> list[Cell]:
    """One cell per part and target: the median of its rounds, field by field."""
    groups: dict[tuple[str, str], list[Cell]] = {}
    for cell in cells:
        groups.setdefault((cell.part, cell.target), []).append(cell)
    out = []
    for (part, target), group in groups.items():
        first = group[0]
        out.append(
            Cell(
                part,
                target,
                first.routers,
                first.conns,
                first.threads,
                sum(c.requests for c in group),
                round(statistics.median(c.rps for c in group), 1),
                round(statistics.median(c.p50_ms for c in group), 2),
                round(statistics.median(c.p99_ms for c in group), 2),
                sum(c.errors for c in group),
                {k: round(statistics.median(c.cpu_us[k] for c in group), 1) for k in first.cpu_us},
                [statistics.median(c.split[i] for c in group) for i in range(first.routers)],
            )
        )
    return out


if __name__ == "__main__":
    sys.exit(main())
