"""Slow bodies: how good requests fare while clients send 10 MiB bodies built to be slow.

    make bench-heavy-body                        # two 20 s runs, about a minute
    make bench-heavy-body ARGS="--seconds 10 --senders 4"

A body of the router's default size limit (10 MiB) can hold millions of tiny JSON values:
empty messages, token IDs, content parts of made-up types. Reading one builds millions of
Python objects. This starts a router with its default body limit and two agents in front
of two zero-latency simulators, and runs wrk at 32 connections with 1 KB JSON chats twice:
alone, then while `--senders` clients post such bodies back to back (cycling through three
shapes, each naming a model nobody serves, so the router reads the whole body and answers
404). It reports the good requests' rate and latency in both runs, how long each slow body
took, and the router's peak RSS.
Results: bench/results/heavy-body.json and docs/benchmarks.md between the heavy-body markers.
"""

from __future__ import annotations

import argparse
import http.client
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.badinput import script
from bench.common import Fleet, ensure_wrk, publish
from bench.soak import rss_mb, start_site

SIZE = 10 * 1024 * 1024 - 4096  # under the default --max-request-bytes


def _fill(head: bytes, item: bytes, tail: bytes) -> bytes:
    count = (SIZE - len(head) - len(tail)) // (len(item) + 1)
    return head + b",".join([item] * count) + tail


SHAPES: dict[str, tuple[str, bytes]] = {
    "empty messages": (
        "/v1/chat/completions",
        _fill(b'{"model": "nobody", "messages": [', b"{}", b"]}"),
    ),
    "token IDs": ("/v1/completions", _fill(b'{"model": "nobody", "prompt": [', b"1", b"]}")),
    "unknown parts": (
        "/v1/chat/completions",
        _fill(
            b'{"model": "nobody", "messages": [{"role": "user", "content": [',
            b'{"type": "x", "a": 1}',
            b"]}]}",
        ),
    ),
}


@dataclass
class Run:
    name: str
    good_rps: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    timeouts: int = 0  # wrk's: no answer within 2 s
    slow_bodies: int = 0
    slow_body_mean_s: float = 0.0
    router_peak_rss_mb: float = 0.0


@dataclass
class HeavyReport:
    senders: int
    runs: list[Run] = field(default_factory=list)


def _ms(out: str, pattern: str) -> float:
    """A latency wrk printed, in ms; NaN when it printed none (no request answered)."""
    found = re.search(pattern, out, re.M)
    value = found and re.fullmatch(r"([\d.]+)(us|ms|s|m)", found.group(1))
    if not value:
        return float("nan")
    scale = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60000.0}[value.group(2)]
    return round(float(value.group(1)) * scale, 2)


def good_load(wrk: str, url: str, lua: Path, name: str, seconds: int) -> Run:
    out = subprocess.run(
        [wrk, "-t1", "-c32", f"-d{seconds}s", "--latency", "-s", str(lua), url],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    good = sum(int(n) for n in re.findall(r"^STATUS 200 (\d+)$", out, re.M))
    timeouts = re.search(r"timeout (\d+)", out)
    return Run(
        name,
        round(good / seconds, 1),
        _ms(out, r"^\s+50%\s+(\S+)$"),
        _ms(out, r"^\s+99%\s+(\S+)$"),
        _ms(out, r"^\s+Latency\s+\S+\s+\S+\s+(\S+)"),
        int(timeouts.group(1)) if timeouts else 0,
    )


class Senders:
    """Threads posting the slow bodies back to back until told to stop."""

    def __init__(self, port: int, count: int) -> None:
        self.port = port
        self.stop = threading.Event()
        self.took: list[float] = []
        self.statuses: dict[int, int] = {}
        self.threads = [threading.Thread(target=self._send, args=(n,)) for n in range(count)]

    def _send(self, n: int) -> None:
        shapes = list(SHAPES.values())
        turn = n
        while not self.stop.is_set():
            path, body = shapes[turn % len(shapes)]
            turn += 1
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            start = time.monotonic()
            try:
                conn.request("POST", path, body, {"Content-Type": "application/json"})
                status = conn.getresponse().status
            except OSError:
                status = 0
            finally:
                conn.close()
            self.took.append(time.monotonic() - start)
            self.statuses[status] = self.statuses.get(status, 0) + 1

    def __enter__(self) -> Senders:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)


def peak_rss(pid: int, done: threading.Event, seen: list[float]) -> None:
    while not done.wait(0.05):
        try:
            seen.append(rss_mb(pid))
        except OSError:  # the router is gone: the run says so by its answers
            return


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--senders", type=int, default=2)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    wrk = ensure_wrk()
    tmp = Path(tempfile.mkdtemp(prefix="hivenet-heavy-"))
    fleet = Fleet(tmp)
    report = HeavyReport(args.senders)
    try:
        url, _ = start_site(fleet, tmp)  # the default body limit, 10 MiB
        port = int(url.rsplit(":", 1)[1])
        chat, lua = url + "/v1/chat/completions", script(tmp, 0)
        good_load(wrk, chat, lua, "warm-up", 3)
        for name, senders in (("good only", 0), (f"{args.senders} slow-body senders", 1)):
            done, seen = threading.Event(), [rss_mb(fleet.pid("router"))]
            watch = threading.Thread(target=peak_rss, args=(fleet.pid("router"), done, seen))
            watch.start()
            try:
                if senders:
                    with Senders(port, args.senders) as slow:
                        run = good_load(wrk, chat, lua, name, args.seconds)
                    run.slow_bodies = len(slow.took)
                    run.slow_body_mean_s = round(sum(slow.took) / max(len(slow.took), 1), 2)
                    print("slow bodies answered:", slow.statuses)
                else:
                    run = good_load(wrk, chat, lua, name, args.seconds)
            finally:
                done.set()
                watch.join()
            run.router_peak_rss_mb = round(max(seen), 1)
            report.runs.append(run)
    finally:
        fleet.stop()
    publish("heavy-body", asdict(report), render(report), not args.no_docs)
    return 0


def render(report: HeavyReport) -> str:
    lines = [
        "| run | good req/s | p50 ms | p99 ms | max ms | timeouts | slow bodies (mean s) "
        "| router peak MiB |",
        "| --- | --: | --: | --: | --: | --: | --: | --: |",
    ]
    for r in report.runs:
        slow = f"{r.slow_bodies} ({r.slow_body_mean_s:g})" if r.slow_bodies else "-"
        lines.append(
            f"| {r.name} | {r.good_rps:,.0f} | {r.p50_ms:g} | {r.p99_ms:g} | {r.max_ms:g} | "
            f"{r.timeouts} | {slow} | {r.router_peak_rss_mb:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
