"""Tables and plots for the peer benchmark (bench/peers.py)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


@dataclass
class Cell:
    profile: str
    system: str
    load: str
    concurrency: int
    requests: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    cpu_us: float | None
    router_cpu_us: float | None = None  # the router process alone (agents left out)
    round: int = 0  # the round a sample is from; 0 for the medians


@dataclass
class LlmCell:
    profile: str
    system: str
    requests: int
    errors: int
    rps: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    latency_p50_ms: float
    round: int = 0
    # Mean time to first token the simulators themselves measured during the cell: what
    # the client's TTFT adds to it happened outside the engine (router, client, the CPU).
    engine_ttft_ms: float = math.nan
    cpu_us: float | None = None  # the router's CPU per request over the cell
    ttft_mean_ms: float = math.nan  # at the client, beside the engines' mean


@dataclass
class Report:
    machine: str
    started: str
    versions: dict[str, str]
    commands: dict[str, str]
    cells: list[Cell] = field(default_factory=list)
    llm: list[LlmCell] = field(default_factory=list)
    peak_rss_mb: dict[str, float] = field(default_factory=dict)
    peak_pss_mb: dict[str, float] = field(default_factory=dict)
    idle_cpu_percent: dict[str, float] = field(default_factory=dict)
    idle_seconds: float = 0.0  # the window idle CPU was measured over
    notes: list[str] = field(default_factory=list)
    rounds: int = 1
    alone: list[str] = field(default_factory=list)  # measured by themselves, not in turns
    samples: list[Cell] = field(default_factory=list)  # every round's cells
    llm_samples: list[LlmCell] = field(default_factory=list)


def _direct(cells: list[Cell]) -> dict[tuple[str, str, int], Cell]:
    return {(c.profile, c.load, c.concurrency): c for c in cells if c.system == "direct"}


def plots(report: Report, folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for profile in dict.fromkeys(c.profile for c in report.cells):
        cells = [c for c in report.cells if c.profile == profile]
        systems = list(dict.fromkeys(c.system for c in cells))
        loads = list(dict.fromkeys(c.load for c in cells))
        levels = list(dict.fromkeys(c.concurrency for c in cells))
        fig, axes = plt.subplots(2, len(loads), figsize=(6 * len(loads), 7), squeeze=False)
        width = 0.8 / len(systems)
        for col, load in enumerate(loads):
            for row, (metric, label) in enumerate((("rps", "req/s"), ("p50_ms", "p50 ms"))):
                ax = axes[row][col]
                for n, system in enumerate(systems):
                    values = [
                        next(
                            (
                                getattr(c, metric)
                                for c in cells
                                if c.system == system and c.load == load and c.concurrency == lvl
                            ),
                            0.0,
                        )
                        for lvl in levels
                    ]
                    xs = [i + n * width for i in range(len(levels))]
                    ax.bar(xs, values, width, label=system)
                ax.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(levels))])
                ax.set_xticklabels([f"c={lvl}" for lvl in levels])
                ax.set_title(f"{load}: {label} ({profile} latency)")
                if metric == "p50_ms":
                    ax.set_yscale("log")
                ax.grid(axis="y", alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        path = folder / f"peers-{profile}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def _fmt(value: float | None, spec: str = ".0f") -> str:
    return "" if value is None else format(value, spec)


def _cell(report: Report, system: str, load: str, conns: int, profile: str = "zero") -> Cell | None:
    for c in report.cells:
        if (c.profile, c.system, c.load, c.concurrency) == (profile, system, load, conns):
            return c
    return None


def _added(
    report: Report, system: str, load: str, conns: int = 1, profile: str = "zero"
) -> float | None:
    """p50 over direct's: the median of each round's difference (both were measured
    seconds apart), or the difference of the medians for a report without rounds."""
    diffs = [
        d
        for d in _per_round(report, load, conns, lambda cells: _added_in(cells, system), profile)
        if d is not None
    ]
    if diffs:
        return statistics.median(diffs)
    cell, base = (
        _cell(report, system, load, conns, profile),
        _cell(report, "direct", load, conns, profile),
    )
    return None if cell is None or base is None else cell.p50_ms - base.p50_ms


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours / theirs; None when either is unknown or theirs is not above zero (a peer that
    added nothing, or less than nothing, over direct gives no meaningful ratio)."""
    return None if ours is None or theirs is None or theirs <= 0 else ours / theirs


Pick = Callable[[dict[str, "Cell"]], float | None]


def _per_round(
    report: Report, load: str, conns: int, pick: Pick, profile: str = "zero"
) -> list[float]:
    """`pick` applied to each round's cells of one profile, load and level, by system."""
    rounds: dict[int, dict[str, Cell]] = {}
    for c in report.samples:
        if (c.profile, c.load, c.concurrency) == (profile, load, conns):
            rounds.setdefault(c.round, {})[c.system] = c
    values = (pick(cells) for _, cells in sorted(rounds.items()))
    return [v for v in values if v is not None]


def _cpu(cells: dict[str, Cell], system: str, router_only: bool = False) -> float | None:
    cell = cells.get(system)
    if cell is None:
        return None
    return cell.router_cpu_us if router_only else cell.cpu_us


def _added_in(cells: dict[str, Cell], system: str) -> float | None:
    cell, base = cells.get(system), cells.get("direct")
    return None if cell is None or base is None else cell.p50_ms - base.p50_ms


def targets(report: Report, peer: str = "vllm-router") -> list[str]:
    """The performance targets as ratios against `peer` in this same run."""
    rows: list[tuple[str, str, str, bool | None]] = []

    def ratio_row(
        name: str,
        ours: float | None,
        theirs: float | None,
        limit: float,
        rounds: list[float] | None = None,
    ) -> None:
        value = _ratio(ours, theirs)
        spec = ".2f" if ours is not None and abs(ours) < 10 else ".1f"
        shown = (
            "n/a" if value is None else f"{value:.2f}x ({_fmt(ours, spec)} / {_fmt(theirs, spec)})"
        )
        if value is not None and rounds and len(rounds) > 1:
            shown += f"; rounds {min(rounds):.2f} to {max(rounds):.2f}x"
        rows.append((name, shown, f"<= {limit:g}x", None if value is None else value <= limit))

    def cpu_rounds(load: str, router_only: bool = False) -> list[float]:
        def pick(cells: dict[str, Cell]) -> float | None:
            return _ratio(_cpu(cells, "hivenet", router_only), _cpu(cells, peer))

        return _per_round(report, load, 32, pick)

    def added_rounds(load: str) -> list[float]:
        def pick(cells: dict[str, Cell]) -> float | None:
            return _ratio(_added_in(cells, "hivenet"), _added_in(cells, peer))

        return _per_round(report, load, 1, pick)

    zero32 = {
        (c.system, c.load): c for c in report.cells if (c.profile, c.concurrency) == ("zero", 32)
    }
    json32 = {system: c for (system, load), c in zero32.items() if load == "json-1k"}
    sse32 = {system: c for (system, load), c in zero32.items() if load == "sse-50"}
    theirs = _cpu(json32, peer)
    ratio_row(
        "router CPU per JSON request, c=32",
        _cpu(json32, "hivenet", router_only=True),
        theirs,
        2,
        cpu_rounds("json-1k", router_only=True),
    )
    ratio_row(
        "router + agents CPU per JSON request, c=32",
        _cpu(json32, "hivenet"),
        theirs,
        3,
        cpu_rounds("json-1k"),
    )
    ratio_row(
        "router + agents CPU per 50-chunk stream, c=32",
        _cpu(sse32, "hivenet"),
        _cpu(sse32, peer),
        1.5,
        cpu_rounds("sse-50"),
    )
    for load in ("json-1k", "sse-50"):
        ratio_row(
            f"added p50 latency at c=1, {load} (ms over direct)",
            _added(report, "hivenet", load),
            _added(report, peer, load),
            1.5,
            added_rounds(load),
        )
    llm = {r.system: r.ttft_p50_ms for r in report.llm if r.profile == "realistic"}
    ttft: dict[int, dict[str, float]] = {}
    for r in report.llm_samples:
        if r.profile == "realistic":
            ttft.setdefault(r.round, {})[r.system] = r.ttft_p50_ms
    ttft_rounds = [
        v for by in ttft.values() if (v := _ratio(by.get("hivenet"), by.get(peer))) is not None
    ]
    ratio_row(
        "aiperf TTFT p50, realistic, 32 streams",
        llm.get("hivenet"),
        llm.get(peer),
        1.2,
        ttft_rounds,
    )
    for name, value in report.idle_cpu_percent.items():
        label = f"idle CPU, {name} ({report.idle_seconds:g} s)"
        rows.append((label, f"{value:.2f}% of a core", "< 0.2%", value < 0.2))
    for key, value in report.peak_pss_mb.items():
        if key.endswith("/hivenet"):
            rss = report.peak_rss_mb.get(key, 0.0)
            rows.append(
                (
                    f"peak memory, router + 2 agents ({key.split('/')[0]} profile)",
                    f"PSS {value:.0f} MiB (RSS sum {rss:.0f} MiB)",
                    "< 150 MiB",
                    value < 150,
                )
            )
    lines = [
        f"Targets, as ratios to {peer} in this run (zero-latency profile unless named), "
        f"of the medians over {report.rounds} round(s), with the lowest and highest round:",
        "",
        "| target | measured | limit | met |",
        "| --- | --- | --- | --- |",
    ]
    for name, shown, limit, met in rows:
        verdict = "n/a" if met is None else ("yes" if met else "**no**")
        lines.append(f"| {name} | {shown} | {limit} | {verdict} |")
    return lines


def render(report: Report, seconds: int, images: list[Path]) -> str:
    direct = _direct(report.cells)
    lines = [
        f"Measured {report.started} on {report.machine}: everything (engines, routers, load",
        "generators) on the same cores, so read the numbers against each other, not as",
        "absolutes.",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in report.versions.items()) + ".",
        "",
        "| system | how it was started |",
        "| --- | --- |",
        *(f"| {k} | `{v}` |" for k, v in report.commands.items()),
        "",
        f"wrk: `wrk -t1 -cC -d{seconds}s --latency -s post.lua URL/v1/chat/completions`, after "
        "a 1 s warm-up. CPU/req is user+system CPU of the router's whole process tree (for "
        "this router: router and both agents) divided by the requests wrk completed. The "
        f"systems run side by side and take turns cell by cell, {report.rounds} round(s), the "
        "order moving one place each round and backwards every other round; every number "
        "below is the median over the rounds (requests and errors: the sum)"
        + (
            f"; measured by itself, before the others: {', '.join(report.alone)}."
            if report.alone
            else "."
        ),
        "",
    ]
    lines += [*targets(report), ""]
    for image in images:
        lines += [f"![{image.stem}](img/{image.name})", ""]
    lines += [
        "| profile | load | conc. | system | req/s | p50 ms | p99 ms | added p50 ms "
        "| CPU/req us | errors |",
        "| --- | --- | --: | --- | --: | --: | --: | --: | --: | --: |",
    ]
    for c in report.cells:
        base = direct.get((c.profile, c.load, c.concurrency))
        value = _added(report, c.system, c.load, c.concurrency, c.profile)
        added = "" if base is None or c.system == "direct" or value is None else f"{value:+.2f}"
        lines.append(
            f"| {c.profile} | {c.load} | {c.concurrency} | {c.system} | {c.rps:,.0f} | "
            f"{c.p50_ms:.2f} | {c.p99_ms:.2f} | {added} | {_fmt(c.cpu_us)} | {c.errors} |"
        )
    lines += [
        "",
        "LLM-shaped load, aiperf: streaming chat, 32 concurrent, 100 input and 50 output "
        "tokens, server-reported token counts, 32 warm-up requests:",
        "",
        "| profile | system | requests | errors | req/s | TTFT p50 ms | TTFT p99 ms "
        "| TTFT mean ms | engine TTFT mean ms | ITL p50 ms | latency p50 ms | CPU/req (us) |",
        "| --- | --- | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: |",
    ]
    for r in report.llm:
        lines.append(
            f"| {r.profile} | {r.system} | {r.requests} | {r.errors} | {r.rps:,.0f} | "
            f"{r.ttft_p50_ms:.2f} | {r.ttft_p99_ms:.2f} | {r.ttft_mean_ms:.2f} | "
            f"{r.engine_ttft_ms:.2f} | "
            f"{r.itl_p50_ms:.3f} | {r.latency_p50_ms:.2f} | {_fmt(r.cpu_us)} |"
        )
    lines += [
        "",
        "Engine TTFT is the mean the simulators measured themselves over the same run (from "
        "reading a request until its first token is ready; aiperf's warm-up requests "
        "included); what the client's mean TTFT adds to it was spent in the router, in "
        "aiperf's own loop and waiting for a core. CPU per request is the router's process "
        "tree over the whole aiperf run, its start included, divided by every request the "
        "engines answered, warm-up included.",
    ]
    lines += [
        "",
        "Peak memory of the router's process tree: RSS is the sum of each process's VmHWM "
        "(shared libraries counted once per process); PSS, sampled every 250 ms, counts a "
        "page shared by N processes as 1/N in each, so the sum is what the tree holds.",
        "",
    ]
    lines += ["| profile/system | peak RSS MiB | peak PSS MiB |", "| --- | --: | --: |"]
    lines += [
        f"| {k} | {v:.0f} | {_fmt(report.peak_pss_mb.get(k))} |"
        for k, v in report.peak_rss_mb.items()
    ]
    for note in report.notes:
        lines += ["", note]
    return "\n".join(lines)
