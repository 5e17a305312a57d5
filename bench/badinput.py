"""Bad input under load: do good requests keep their throughput when a tenth are bad?

    make bench-bad-input                  # about 2.5 minutes
    make bench-bad-input ARGS="--rounds 20 --seconds 3"
    make bench-bad-input ARGS="--control" # good requests on both sides: the noise floor

Router and two agents in front of two zero-latency simulators, wrk at 256 connections.
Two loads: only good requests (1 KB JSON answers), and the same load where one request in
ten is bad, in turn: malformed JSON, a model nobody serves, and a body over the router's
size limit (64 KiB here, the bad body 100 KiB). This machine's speed drifts by a quarter
over tens of seconds, more than the 10% to be judged, so the loads alternate in short
cells, in blocks of four ordered good, bad, bad, good and then bad, good, good, bad, so
that a drift that is steady over a block falls on both loads alike. Target: the good
requests' rate summed over every mixed cell, over their rate summed over every good-only
cell, is at least 0.9. At the end nothing may be held (no forwards, queued requests, slots
or link streams) and the router's memory must be where it was.
Results: bench/results/bad-input.json and docs/benchmarks.md between the bad-input markers.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.common import (
    LOADS,
    MODEL,
    Fleet,
    ensure_wrk,
    publish,
)
from bench.soak import HELD, metric_values, rss_mb, start_site

LIMIT = 64 * 1024


@dataclass
class Run:
    name: str
    round: int
    seconds: int
    statuses: dict[str, int]
    good_rps: float
    socket_errors: int


@dataclass
class BadReport:
    control: bool = False  # both sides good only: what the harness reads when nothing differs
    runs: list[Run] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)  # each block's
    ratio: float = 0.0  # over all cells
    rss_before_mb: float = 0.0
    rss_after_mb: float = 0.0
    held: dict[str, float] = field(default_factory=dict)


def script(folder: Path, bad_every: int) -> Path:
    """A wrk script whose every `bad_every`th request is bad; it counts answers by status.
    Each request's bytes are built once, when the thread starts: wrk shares this machine's
    two cores with the site, and building a 100 KiB request each time it is sent would
    take from the site's share in the mixed load only."""
    good = json.dumps(json.dumps(LOADS["json-1k"]))
    unknown = json.dumps(json.dumps({**LOADS["json-1k"], "model": "nobody-serves-this"}))
    broken = json.dumps('{"model": "' + MODEL + '", "messages": [')
    huge = json.dumps(json.dumps({**LOADS["json-1k"], "padding": "x" * 100 * 1024}))
    path = folder / f"bad-{bad_every}.lua"
    path.write_text(
        f"local good, bad = {good}, {{{broken}, {unknown}, {huge}}}\n"
        f"local every, n, b = {bad_every}, 0, 0\n"
        "local threads = {}\n"
        "function setup(thread) table.insert(threads, thread) end\n"
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        "function init(args)\n  counts = {}\n  good = wrk.format(nil, nil, nil, good)\n"
        "  for i, body in ipairs(bad) do bad[i] = wrk.format(nil, nil, nil, body) end\nend\n"
        "function request()\n  n = n + 1\n"
        "  if every > 0 and n % every == 0 then\n    b = b % 3 + 1\n    return bad[b]\n  end\n"
        "  return good\nend\n"
        "function response(status, headers, body)\n"
        "  counts[status] = (counts[status] or 0) + 1\nend\n"
        "function done(summary, latency, requests)\n"
        "  for _, thread in ipairs(threads) do\n"
        "    local c = thread:get('counts')\n"
        "    for status, count in pairs(c) do io.write(string.format('STATUS %d %d\\n', "
        "status, count)) end\n"
        "  end\nend\n"
    )
    return path


def run(wrk: str, url: str, lua: Path, name: str, seconds: int, round_: int = 0) -> Run:
    out = subprocess.run(
        [wrk, "-t1", "-c256", f"-d{seconds}s", "-s", str(lua), url],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    statuses: dict[str, int] = {}
    for status, count in re.findall(r"^STATUS (\d+) (\d+)$", out, re.M):
        statuses[status] = statuses.get(status, 0) + int(count)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    errors = sum(int(x) for x in sock.groups()) if sock else 0
    good_rps = round(statuses.get("200", 0) / seconds, 1)
    return Run(name, round_, seconds, statuses, good_rps, errors)


GOOD, MIXED = "good only", "one in ten bad"


def block(number: int) -> list[str]:
    """The loads of one block, in order: ABBA, then BAAB."""
    order = [GOOD, MIXED, MIXED, GOOD]
    return order if number % 2 else [MIXED, GOOD, GOOD, MIXED]


def pooled(runs: list[Run]) -> float:
    """The good requests' rate summed over the mixed cells, over the good-only cells'."""
    good = sum(r.good_rps for r in runs if r.name == GOOD)
    mixed = sum(r.good_rps for r in runs if r.name == MIXED)
    return round(mixed / good, 3) if good else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=12, help="blocks of four cells")
    parser.add_argument("--seconds", type=int, default=3, help="per cell")
    parser.add_argument("--control", action="store_true", help="good requests on both sides")
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    wrk = ensure_wrk()
    tmp = Path(tempfile.mkdtemp(prefix="hivenet-bad-"))
    fleet = Fleet(tmp)
    report = BadReport(control=args.control)
    try:
        url, metrics = start_site(fleet, tmp, "--max-request-bytes", str(LIMIT))
        chat = url + "/v1/chat/completions"
        scripts = {GOOD: script(tmp, 0), MIXED: script(tmp, 0 if args.control else 10)}
        run(wrk, chat, scripts[GOOD], "warm-up", 3)
        report.rss_before_mb = round(rss_mb(fleet.pid("router")), 1)
        for number in range(1, args.rounds + 1):
            cells = [
                run(wrk, chat, scripts[name], name, args.seconds, number) for name in block(number)
            ]
            report.runs += cells
            report.ratios.append(pooled(cells))
        report.ratio = pooled(report.runs)
        time.sleep(1)
        report.rss_after_mb = round(rss_mb(fleet.pid("router")), 1)
        report.held = metric_values(f"http://127.0.0.1:{metrics}/metrics")
    finally:
        fleet.stop()
    nothing_held = len(report.held) == len(HELD) and not any(report.held.values())
    kept = report.ratio >= 0.9
    name = "bad-input-control" if args.control else "bad-input"
    publish(name, asdict(report), render(report, kept, nothing_held), not args.no_docs)
    return 0 if kept and nothing_held else 1


def render(report: BadReport, kept: bool, nothing_held: bool) -> str:
    lines = [
        "| block | good only: good req/s | with bad: good req/s | ratio | bad answers by status "
        "| socket errors |",
        "| --: | --: | --: | --: | --- | --: |",
    ]
    for number, ratio in enumerate(report.ratios, 1):
        cells = [r for r in report.runs if r.round == number]
        rates = {
            name: sum(r.good_rps for r in cells if r.name == name) / 2 for name in (GOOD, MIXED)
        }
        bad: dict[str, int] = {}
        for r in cells:
            if r.name == MIXED:
                for status, count in r.statuses.items():
                    if status != "200":
                        bad[status] = bad.get(status, 0) + count
        shown = ", ".join(f"{k}: {v:,}" for k, v in sorted(bad.items())) or "none"
        errors = sum(r.socket_errors for r in cells)
        lines.append(
            f"| {number} | {rates[GOOD]:,.0f} | {rates[MIXED]:,.0f} | {100 * ratio:.1f}% "
            f"| {shown} | {errors} |"
        )
    spread = sorted(report.ratios)
    seconds = report.runs[0].seconds if report.runs else 0
    what = "good requests on both sides (control)" if report.control else "one request in ten bad"
    lines += [
        "",
        f"{len(report.ratios)} blocks of four {seconds} s cells, {what}. Good requests kept "
        f"{100 * report.ratio:.1f}% of their rate over all cells (blocks "
        f"{100 * spread[0]:.1f}% to {100 * spread[-1]:.1f}%, median "
        f"{100 * statistics.median(spread):.1f}%; "
        f"{'met' if kept else 'NOT met'}: at least 90%). Router RSS "
        f"{report.rss_before_mb:.1f} MiB before the runs, {report.rss_after_mb:.1f} after. "
        "Held at the end: "
        + ", ".join(f"{k.removeprefix('hivenet_')} {v:g}" for k, v in report.held.items())
        + (" (nothing)." if nothing_held else " (LEAK)."),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
