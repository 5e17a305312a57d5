"""Bad input under load: do good requests keep their throughput when a tenth are bad?

    make bench-bad-input                  # about 2 minutes
    make bench-bad-input ARGS="--rounds 9 --seconds 8"

Router and two agents in front of two zero-latency simulators, wrk at 256 connections.
Two loads: only good requests (1 KB JSON answers), and the same load where one request in
ten is bad, in turn: malformed JSON, a model nobody serves, and a body over the router's
size limit (64 KiB here, the bad body 100 KiB). Each round runs both, seconds apart, the
order swapped every other round, so that the machine's drift over minutes falls on both
sides alike. Target: the median over the rounds of the good requests' rate with bad ones
over their rate alone is at least 0.9. At the end nothing may be held (no forwards,
queued requests, slots or link streams) and the router's memory must be where it was.
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
    runs: list[Run] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)  # each round's
    ratio: float = 0.0  # their median
    rss_before_mb: float = 0.0
    rss_after_mb: float = 0.0
    held: dict[str, float] = field(default_factory=dict)


def script(folder: Path, bad_every: int) -> Path:
    """A wrk script whose every `bad_every`th request is bad; it counts answers by status."""
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
        "function init(args) counts = {} end\n"
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        "function request()\n  n = n + 1\n"
        "  if every > 0 and n % every == 0 then\n    b = b % 3 + 1\n"
        "    return wrk.format(nil, nil, nil, bad[b])\n  end\n"
        "  return wrk.format(nil, nil, nil, good)\nend\n"
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=int, default=10, help="per run")
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    wrk = ensure_wrk()
    tmp = Path(tempfile.mkdtemp(prefix="hivenet-bad-"))
    fleet = Fleet(tmp)
    report = BadReport()
    try:
        url, metrics = start_site(fleet, tmp, "--max-request-bytes", str(LIMIT))
        chat = url + "/v1/chat/completions"
        clean_lua, mixed_lua = script(tmp, 0), script(tmp, 10)
        run(wrk, chat, clean_lua, "warm-up", 3)
        report.rss_before_mb = round(rss_mb(fleet.pid("router")), 1)
        for number in range(1, args.rounds + 1):
            loads = [("good only", clean_lua), ("one in ten bad", mixed_lua)]
            if number % 2 == 0:
                loads.reverse()
            runs = {name: run(wrk, chat, lua, name, args.seconds, number) for name, lua in loads}
            report.runs += runs.values()
            clean, mixed = runs["good only"], runs["one in ten bad"]
            report.ratios.append(round(mixed.good_rps / clean.good_rps, 3) if clean.good_rps else 0)
        report.ratio = statistics.median(report.ratios)
        time.sleep(1)
        report.rss_after_mb = round(rss_mb(fleet.pid("router")), 1)
        report.held = metric_values(f"http://127.0.0.1:{metrics}/metrics")
    finally:
        fleet.stop()
    nothing_held = len(report.held) == len(HELD) and not any(report.held.values())
    kept = report.ratio >= 0.9
    publish("bad-input", asdict(report), render(report, kept, nothing_held), not args.no_docs)
    return 0 if kept and nothing_held else 1


def render(report: BadReport, kept: bool, nothing_held: bool) -> str:
    lines = [
        "| round | run | good req/s | answers by status | socket errors |",
        "| --: | --- | --: | --- | --: |",
    ]
    for r in report.runs:
        shown = ", ".join(f"{k}: {v:,}" for k, v in sorted(r.statuses.items()))
        lines.append(f"| {r.round} | {r.name} | {r.good_rps:,.0f} | {shown} | {r.socket_errors} |")
    rounds = ", ".join(f"{100 * ratio:.1f}%" for ratio in report.ratios)
    lines += [
        "",
        f"Good requests kept {100 * report.ratio:.1f}% of their rate, the median of "
        f"{len(report.ratios)} round(s) ({rounds}; "
        f"{'met' if kept else 'NOT met'}: at least 90%). Router RSS "
        f"{report.rss_before_mb:.1f} MiB before the runs, {report.rss_after_mb:.1f} after. "
        "Held at the end: "
        + ", ".join(f"{k.removeprefix('hivenet_')} {v:g}" for k, v in report.held.items())
        + (" (nothing)." if nothing_held else " (LEAK)."),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
