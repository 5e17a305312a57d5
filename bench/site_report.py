"""Tables for the site benchmark (bench/site.py), and the estimate for a 16-core host."""

from __future__ import annotations

import math
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

from bench.common import ROOT
from bench.site_rounds import RoundCost

TARGET_RATIO = 1.05
NAMES = {
    "plain": "one router, limits in memory",
    "plain-b": "its twin, limits in memory",
    "one": "one router, --sync-store valkey",
    "rp2": "site of 2, one port (--reuse-port)",
    "sep2": "site of 2, own ports",
    "rp3": "site of 3, one port (--reuse-port)",
    "sep3": "site of 3, own ports",
}


@dataclass
class Cell:
    part: str
    target: str
    routers: int
    conns: int
    threads: int
    requests: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    cpu_us: dict[str, float]  # per request: routers, agents, sim, valkey, wrk
    split: list[float] = field(default_factory=list)  # share of requests per router


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no", "src"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out + (" with uncommitted changes in src/" if dirty else "")


@dataclass
class Report:
    seconds: int
    rounds: int
    site_rounds: int
    command: str = "make bench-site"
    started: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M"))
    machine: str = field(
        default_factory=lambda: (
            f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
        )
    )
    commit: str = field(default_factory=_commit)
    round_costs: list[RoundCost] = field(default_factory=list)
    port_us: dict[str, float] = field(default_factory=dict)  # request-path state calls
    cells: list[Cell] = field(default_factory=list)  # medians
    raw: list[Cell] = field(default_factory=list)  # every round
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)  # by target


def render(report: Report) -> str:
    lines = [
        f"Measured {report.started} on {report.machine}, at commit {report.commit}, with "
        f"`{report.command}`. Every process (wrk, simulator, agents, routers, Valkey) "
        "shares the cores.",
    ]
    cpu = [c for c in report.cells if c.part == "cpu"]
    if cpu:
        lines += ["", *_cpu(report, cpu)]
    together = [c for c in report.cells if c.part == "cpu-together"]
    if together:
        lines += ["", *_together(report, together)]
    if report.profiles:
        lines += ["", *_profiles(report.profiles)]
    if report.port_us:
        lines += ["", _ports(report.port_us)]
    if report.round_costs:
        lines += ["", *_rounds(report.round_costs)]
    site = [c for c in report.cells if c.part == "site"]
    if site:
        lines += ["", *_site(report, site)]
        one = next((c for c in site if c.target == "one"), None)
        if one is not None:
            lines += ["", *_host(one, site, report.round_costs)]
    return "\n".join(lines)


def _cpu(report: Report, cells: list[Cell]) -> list[str]:
    by = {c.target: c for c in cells}
    conns = cells[0].conns
    out = [
        f"**With and without the store, one after the other**: wrk -t1 -c{conns}, 1 KB JSON "
        f"answers, {report.seconds} s cells after a 1 s warm-up, medians of {report.rounds} "
        "rounds (the two routers alternate, the order reversed every other round). CPU in us "
        "per request.",
        "",
        "| router | req/s | p50 ms | p99 ms | router CPU | agents | simulator | Valkey | wrk "
        "| errors |",
        "| --- | --: | --: | --: | --: | --: | --: | --: | --: | --: |",
    ]
    for cell in cells:
        c = cell.cpu_us
        out.append(
            f"| {NAMES.get(cell.target, cell.target)} | {cell.rps:,.0f} | {cell.p50_ms:.2f} | "
            f"{cell.p99_ms:.2f} | {c['routers']:.0f} | {c['agents']:.0f} | {c['sim']:.0f} | "
            f"{c['valkey']:.1f} | {c['wrk']:.0f} | {cell.errors} |"
        )
    if "plain" in by and "one" in by:
        ratio = by["one"].cpu_us["routers"] / max(by["plain"].cpu_us["routers"], 1e-9)
        paired = _paired(report.raw, "cpu", "one", "plain")
        out += [
            "",
            f"Router CPU per request {by['one'].cpu_us['routers']:.0f} us with the store "
            f"against {by['plain'].cpu_us['routers']:.0f} without: {ratio:.3f} "
            f"(round by round: {_spread(paired)}). Throughput {by['one'].rps:,.0f} against "
            f"{by['plain'].rps:,.0f} req/s. Valkey: {by['one'].cpu_us['valkey']:.1f} us per "
            f"request of the synced router ({by['plain'].cpu_us['valkey']:.1f} while the "
            "other had the load: the idle synced router's rounds).",
        ]
    return out


def _together(report: Report, cells: list[Cell]) -> list[str]:
    by = {c.target: c for c in cells}
    shared = cells[0].cpu_us
    out = [
        "**The same, at the same time**: the router with the store, the one without and an "
        "identical twin of the one without, each with a third of the connections (wrk "
        f"-t3 -c{3 * cells[0].conns}, one thread per router), so all three are measured in "
        "the same seconds of the same busy machine. Each router's CPU is divided by the "
        f"requests it routed; medians of {report.rounds} rounds.",
        "",
        "| router | req/s | router CPU us/req | share of requests |",
        "| --- | --: | --: | --: |",
    ]
    for cell in cells:
        out.append(
            f"| {NAMES.get(cell.target, cell.target)} | {cell.rps:,.0f} | "
            f"{cell.cpu_us['routers']:.0f} | {100 * cell.split[0]:.1f}% |"
        )
    out += [
        "",
        f"Shared by the three, per request: agents {shared['agents']:.0f} us, simulator "
        f"{shared['sim']:.0f}, Valkey {shared['valkey']:.1f}, wrk {shared['wrk']:.0f}.",
    ]
    if {"plain", "plain-b", "one"} <= set(by):
        synced = _versus_both(report.raw)
        noise = _paired(report.raw, "cpu-together", "plain-b", "plain")
        ratio = statistics.median(synced)
        met = "met" if ratio <= TARGET_RATIO else "NOT met"
        out += [
            "",
            "Router CPU per request with the store over the mean of the two without, round "
            f"by round: {_spread(synced)}. The twin over the first (the same code twice: "
            f"what noise alone gives here) {_spread(noise)}. Target (at most "
            f"{TARGET_RATIO:.2f}): {met} by the median.",
        ]
    return out


def _versus_both(raw: list[Cell]) -> list[float]:
    """The synced router's CPU per request over the mean of the two plain ones', per round."""

    def series(target: str) -> list[float]:
        return [c.cpu_us["routers"] for c in raw if c.part == "cpu-together" and c.target == target]

    return [
        one / ((plain + twin) / 2)
        for one, plain, twin in zip(series("one"), series("plain"), series("plain-b"), strict=False)
        if plain + twin > 0
    ]


def _paired(raw: list[Cell], part: str, over: str, under: str) -> list[float]:
    """Router CPU per request of `over` divided by `under`'s, round by round."""
    tops = [c.cpu_us["routers"] for c in raw if c.part == part and c.target == over]
    bottoms = [c.cpu_us["routers"] for c in raw if c.part == part and c.target == under]
    return [a / b for a, b in zip(tops, bottoms, strict=False) if b > 0]


def _spread(ratios: list[float]) -> str:
    if not ratios:
        return "no pairs"
    return (
        f"median {statistics.median(ratios):.3f}, from {min(ratios):.3f} to "
        f"{max(ratios):.3f} over {len(ratios)} rounds"
    )


def _profiles(profiles: dict[str, dict[str, Any]]) -> list[str]:
    names = list(profiles)
    first = profiles[names[0]]
    out = [
        "py-spy (250 samples/s) on each router under the same load: share of the samples "
        "with a frame in each part of the code.",
        "",
        "| part of the code | " + " | ".join(NAMES.get(n, n) for n in names) + " |",
        "| --- |" + " --: |" * len(names),
    ]
    for group in first["groups"]:
        shares = " | ".join(f"{100 * profiles[n]['groups'][group]:.1f}%" for n in names)
        out.append(f"| {group} | {shares} |")
    for name in names:
        top = ", ".join(f"{leaf} {100 * share:.1f}%" for leaf, share in profiles[name]["top"][:8])
        out += ["", f"Top functions (own samples), {NAMES.get(name, name)}: {top}."]
    return out


def _ports(port_us: dict[str, float]) -> str:
    return (
        "**The request path's state calls alone** (in this process, 20,000 times, medians of "
        "5 interleaved tries: request rate, occupancy reserve and release, daily charge and "
        f"settle): {port_us['site']:.1f} us per request with the site's ports against "
        f"{port_us['memory']:.1f} us in memory, {port_us['site'] - port_us['memory']:+.1f} us."
    )


def _rounds(costs: list[RoundCost]) -> list[str]:
    rounds = costs[0].rounds
    out = [
        "**One sync round** of a router (in-process `Site.round()`) with another router of "
        f"the site publishing the same keys; median of {rounds} rounds per size, sizes "
        "interleaved. Commands, bytes and Valkey CPU are the store's own counters (`INFO`).",
        "",
        "| active keys | wall ms | router CPU ms | store commands | bytes to the store "
        "| bytes from it | Valkey CPU ms | router CPU us/key | bytes/key |",
        "| --: | --: | --: | --: | --: | --: | --: | --: | --: |",
    ]
    for r in costs:
        out.append(
            f"| {r.keys:,} | {r.wall_ms:,.1f} | {r.cpu_ms:,.1f} | {r.commands:,.0f} | "
            f"{r.bytes_in:,.0f} | {r.bytes_out:,.0f} | {r.store_cpu_ms:.2f} | "
            f"{r.cpu_us_per_key:.0f} | {r.bytes_per_key:,.0f} |"
        )
    if len(costs) >= 2:
        small, big = costs[-2], costs[-1]
        exponent = math.log(big.cpu_ms / small.cpu_ms) / math.log(big.keys / small.keys)
        verdict = "linear or better" if exponent <= 1.1 else "faster than linear"
        biggest = max(costs, key=lambda r: r.keys)
        out += [
            "",
            f"From {small.keys:,} to {big.keys:,} keys the router's CPU per round grows as "
            f"keys^{exponent:.2f} ({verdict}). Per changed key a round writes one HSET of "
            "the router's own daily fields (and EXPIRE on the day's first write), publishes "
            "the change in its one stream entry, and reads the key's hash again once in "
            "30 rounds; plus about 9 commands per round. At "
            f"{biggest.keys:,} active keys one round costs the router "
            f"{biggest.cpu_ms:,.0f} ms of CPU, "
            f"{biggest.cpu_ms / 10:.0f}% of a core at the default --sync-interval of 1 s.",
        ]
    return out


def _site(report: Report, cells: list[Cell]) -> list[str]:
    one = next((c for c in cells if c.target == "one"), cells[0])
    out = [
        f"**A site on one host**: wrk -t{cells[0].threads} -c{cells[0].conns} (its threads "
        "dealt round-robin over the routers' ports where each has its own), 1 KB JSON, "
        f"{report.seconds} s cells, medians of {report.site_rounds} interleaved rounds. CPU "
        "in us per request; router CPU is the sum over the site's routers.",
        "",
        "| target | req/s | vs one | p50 ms | p99 ms | routers | agents | simulator | Valkey "
        "| wrk | requests per router | errors |",
        "| --- | --: | --: | --: | --: | --: | --: | --: | --: | --: | --- | --: |",
    ]
    for cell in cells:
        c = cell.cpu_us
        split = " / ".join(f"{100 * s:.0f}%" for s in cell.split)
        out.append(
            f"| {NAMES.get(cell.target, cell.target)} | {cell.rps:,.0f} | "
            f"{cell.rps / max(one.rps, 1e-9):.2f} | {cell.p50_ms:.2f} | {cell.p99_ms:.2f} | "
            f"{c['routers']:.0f} | {c['agents']:.0f} | {c['sim']:.0f} | {c['valkey']:.1f} | "
            f"{c['wrk']:.0f} | {split} | {cell.errors} |"
        )
    return out


def _host(one: Cell, sites: list[Cell], costs: list[RoundCost]) -> list[str]:
    """What a 16-core host should reach, from the measured CPU per request."""
    c = one.cpu_us
    router = c["routers"]
    worst = max(cell.cpu_us["routers"] for cell in sites)
    everything = router + c["agents"] + c["sim"] + c["valkey"] + c["wrk"]
    per_router = 1e6 / router
    out = [
        "**What a 16-core host should reach**, from the one-router row above (CPU per "
        f"request: router {router:.0f} us, agents {c['agents']:.0f}, simulator "
        f"{c['sim']:.0f}, Valkey {c['valkey']:.1f}, wrk {c['wrk']:.0f}):",
        "",
        f"- A router is one Python process, one event loop: at most one core, about "
        f"{per_router:,.0f} req/s of these requests. Routers only on the host (agents on "
        "the engine hosts, clients elsewhere), one per core with --reuse-port and one core "
        f"left to Valkey and the kernel: 15 x {per_router:,.0f} = about "
        f"{15 * per_router:,.0f} req/s; about {15e6 / worst:,.0f} at the highest router CPU "
        f"per request of a site row above ({worst:.0f} us, routers sharing two cores with "
        "everything else).",
        f"- Everything on the host, as here: {everything:.0f} us of CPU per request in all, "
        f"so 16 cores give at most about {16e6 / everything:,.0f} req/s, with the cores "
        f"shared as the CPU is: routers {16 * router / everything:.1f}, agents "
        f"{16 * c['agents'] / everything:.1f}, simulator {16 * c['sim'] / everything:.1f}, "
        f"wrk {16 * c['wrk'] / everything:.1f}, Valkey {16 * c['valkey'] / everything:.2f} "
        "(so about that many router processes, and as many agent processes, since each is "
        "single-threaded too).",
    ]
    if costs:
        each = "; ".join(
            f"{r.keys:,} keys: {r.cpu_ms / 10:.1f}% of each router's core, "
            f"{15 * r.store_cpu_ms / 10:.1f}% of Valkey's one thread for 15 routers, "
            f"{15 * (r.bytes_in + r.bytes_out) / 1e6:.1f} MB/s to and from it"
            for r in costs
        )
        out.append(
            "- The sync round grows not with traffic but with the keys charged in the last 5 "
            f"minutes (one round a second per router, from the round table): {each}. "
            "Each router pays its own rounds; Valkey pays every router's, on one thread."
        )
    return out
