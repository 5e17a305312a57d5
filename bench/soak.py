"""Soak: a million requests through the router, and its memory over them.

    make soak                             # 1,000,000 requests; about 10 minutes on 2 cores
    make soak ARGS="--requests 200000"    # a shorter one

Router and two agents in front of two zero-latency simulators; wrk at 32 connections, nine
JSON answers to one 50-chunk stream. After every round (30 s) the resident and
proportional set sizes of the router and each agent are sampled. Memory is "flat" when,
after the first tenth of the requests (imports settled, pools and caches filled), no later
sample of the whole tree exceeds the first one by more than 5%. At the end nothing may be
held: no forwards, queued requests, slots or link streams.
Results: bench/results/soak.json and docs/benchmarks.md between the soak markers.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.common import (
    BIN,
    LOADS,
    MODEL,
    Fleet,
    agent_args,
    ensure_wrk,
    free_port,
    publish,
    router_args,
    secret_file,
    tree_pss_mb,
    wait_http,
)

# As in the peer benchmark: the engines and agents never limit, so the router is measured.
SIM = ("--zero-latency", "--max-num-seqs", "4096")
CAPACITY = ("--capacity", "1024")
ROUTER = ("--max-concurrent", "2048", "--queue-size", "8192", "--warmup", "0s")
HELD = (
    "hivenet_router_active_forwards",
    "hivenet_router_pending_requests",
    "hivenet_agent_capacity_utilization",
    "hivenet_agent_link_streams",
)


def start_site(fleet: Fleet, tmp: Path, *router_extra: str) -> tuple[str, int]:
    """Two simulators, the router and one agent each; returns the API URL and the
    metrics port once both agents are healthy."""
    engines = []
    for n in range(2):
        port = free_port()
        fleet.start(
            f"sim-{n}", [str(BIN / "hivenet-sim"), "--port", str(port), "--model", MODEL, *SIM]
        )
        engines.append(f"http://127.0.0.1:{port}")
    secret = secret_file(tmp)
    http, grpc, metrics = free_port(), free_port(), free_port()
    command = router_args(secret, tmp / "store", http, grpc, *ROUTER, *router_extra)
    command[command.index("--metrics-port") + 1] = f"127.0.0.1:{metrics}"
    fleet.start("router", command)
    for n, engine in enumerate(engines):
        identity = tmp / f"agent-{n}.key"
        fleet.start(f"agent-{n}", agent_args(secret, grpc, engine, identity, *CAPACITY))
    url = f"http://127.0.0.1:{http}"
    wait_http(f"{url}/v1/models", lambda t: '"healthy_replicas":2' in t)
    return url, metrics


@dataclass
class Sample:
    requests: int  # completed so far
    seconds: float
    rss_mb: dict[str, float]
    pss_mb: float


@dataclass
class SoakReport:
    requests: int = 0
    errors: int = 0
    seconds: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    growth_percent: float = 0.0
    held: dict[str, float] = field(default_factory=dict)


def mixed_script(folder: Path) -> Path:
    """Nine JSON requests, then one stream, round and round."""
    json_body = json.dumps(json.dumps(LOADS["json-1k"]))
    sse_body = json.dumps(json.dumps(LOADS["sse-50"]))
    script = folder / "mixed.lua"
    script.write_text(
        f"local bodies = {{}}\nfor i = 1, 9 do bodies[i] = {json_body} end\n"
        f"bodies[10] = {sse_body}\nlocal n = 0\n"
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        "request = function()\n  n = n % 10 + 1\n"
        "  return wrk.format(nil, nil, nil, bodies[n])\nend\n"
    )
    return script


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    return int(match.group(1)) / 1024 if match else 0.0


def metric_values(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        family = name.split("{", 1)[0]
        if family in HELD:
            values[family] = values.get(family, 0.0) + float(value)
    return values


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--round-seconds", type=int, default=30)
    parser.add_argument("--max-minutes", type=float, default=40.0)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    wrk = ensure_wrk()
    tmp = Path(tempfile.mkdtemp(prefix="hivenet-soak-"))
    fleet = Fleet(tmp)
    report = SoakReport()
    try:
        url, metrics = start_site(fleet, tmp)
        procs = {name: fleet.pid(name) for name in ("router", "agent-0", "agent-1")}
        script = mixed_script(tmp)
        started = time.monotonic()
        deadline = started + args.max_minutes * 60
        while report.requests < args.requests and time.monotonic() < deadline:
            out = subprocess.run(
                [wrk, "-t1", "-c32", f"-d{args.round_seconds}s", "-s", str(script),
                 url + "/v1/chat/completions"],
                capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            report.requests += int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
            bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
            report.errors += int(bad.group(1)) if bad else 0
            report.samples.append(
                Sample(
                    report.requests,
                    round(time.monotonic() - started, 1),
                    {name: round(rss_mb(pid), 1) for name, pid in procs.items()},
                    round(tree_pss_mb(list(procs.values())), 1),
                )
            )
            print(f"{report.requests:>9,} requests  {report.samples[-1]}", flush=True)
        report.seconds = round(time.monotonic() - started, 1)
        settled = [s for s in report.samples if s.requests >= report.requests / 10]
        if settled:
            first = sum(settled[0].rss_mb.values())
            peak = max(sum(s.rss_mb.values()) for s in settled)
            report.growth_percent = round(100 * (peak - first) / first, 2)
        time.sleep(1)
        report.held = metric_values(f"http://127.0.0.1:{metrics}/metrics")
    finally:
        fleet.stop()
    flat = report.growth_percent <= 5.0
    clean = all(value == 0 for value in report.held.values()) and len(report.held) == len(HELD)
    publish("soak", asdict(report), render(report, flat, clean), not args.no_docs)
    return 0 if flat and clean else 1


def render(report: SoakReport, flat: bool, clean: bool) -> str:
    first, last = report.samples[0], report.samples[-1]
    lines = [
        f"{report.requests:,} requests in {report.seconds:.0f} s ({report.errors} non-2xx), "
        "router and two agents, 32 connections, 9 JSON answers to 1 stream.",
        "",
        "| after requests | router RSS MiB | agents RSS MiB | tree PSS MiB |",
        "| --: | --: | --: | --: |",
    ]
    rows = report.samples[:: max(1, len(report.samples) // 10)]
    if rows[-1] is not last:
        rows.append(last)
    for sample in rows:
        agents = sample.rss_mb.get("agent-0", 0) + sample.rss_mb.get("agent-1", 0)
        lines.append(
            f"| {sample.requests:,} | {sample.rss_mb.get('router', 0):.1f} | {agents:.1f} "
            f"| {sample.pss_mb:.1f} |"
        )
    lines += [
        "",
        f"Growth of the tree's RSS after the first tenth: {report.growth_percent:+.2f}% "
        f"({'flat' if flat else 'NOT flat'}: limit +5%); first sample "
        f"{sum(first.rss_mb.values()):.1f} MiB. Held at the end: "
        + ", ".join(f"{k.removeprefix('hivenet_')} {v:g}" for k, v in report.held.items())
        + (" (nothing)" if clean else " (LEAK)")
        + ".",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
