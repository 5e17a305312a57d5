"""Router overhead benchmark: the same load straight to the engine simulator, through a bare
aiohttp proxy, and through router plus agent.

    make bench            # full run (about 6 minutes)
    make bench ARGS=--quick

Load comes from wrk (installed with apt-get when missing). For each target, load and
concurrency it reports req/s, p50 and p99 latency, and the CPU time each process spent per
request (utime + stime from /proc, divided by the requests served). Results go to
bench/results/overhead.json and into docs/benchmarks.md between the overhead markers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
MODEL = "bench-model"

LOADS = {
    # ~1 KB JSON answer (130 tokens of the simulator's words)
    "json-1k": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 130,
    },
    # 50 content chunks plus the role, finish and [DONE] events
    "sse-50": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 50,
        "stream": True,
    },
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def ensure_wrk() -> str:
    path = shutil.which("wrk")
    if path:
        return path
    print("installing wrk with apt-get ...", flush=True)
    subprocess.run(["apt-get", "update", "-qq"], check=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", "wrk"], check=True)
    return shutil.which("wrk") or "wrk"


def wait_ready(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if MODEL in resp.read().decode():
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} did not become ready")


_UNITS = {"us": 0.001, "ms": 1.0, "s": 1000.0}


def _ms(text: str) -> float:
    match = re.match(r"([\d.]+)(us|ms|s)", text)
    if not match:
        return float("nan")
    return float(match.group(1)) * _UNITS[match.group(2)]


@dataclass
class Row:
    target: str
    load: str
    concurrency: int
    requests: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    cpu_us: dict[str, float]


def run_wrk(
    wrk: str, url: str, body: dict[str, object], conns: int, seconds: int, script_dir: Path
) -> tuple[int, float, float, float, int]:
    script = script_dir / "post.lua"
    script.write_text(
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = {json.dumps(json.dumps(body))}\n"
    )
    out = subprocess.run(
        [wrk, "-t1", f"-c{conns}", f"-d{seconds}s", "--latency", "-s", str(script), url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    requests = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    # Anchor at line start: "68.50%" in the stdev column must not read as the 50th percentile.
    p50 = _ms(re.search(r"^\s+50%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    p99 = _ms(re.search(r"^\s+99%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = int(bad.group(1)) if bad else 0
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if sock:
        errors += sum(int(x) for x in sock.groups())
    return requests, rps, p50, p99, errors


class Fleet:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, args: list[str]) -> None:
        log = (self.tmp / f"{name}.log").open("wb")
        env = {**os.environ, "HIVENET_ROUTER_ADMIN_API_KEYS": secrets.token_urlsafe(16)}
        self.procs[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="3 s per cell")
    parser.add_argument("--concurrency", default="1,32,256")
    parser.add_argument("--loads", default=",".join(LOADS))
    parser.add_argument("--targets", default="direct,aiohttp proxy,router+agent")
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    seconds = 3 if args.quick else args.seconds
    levels = [int(x) for x in args.concurrency.split(",")]
    wrk = ensure_wrk()
    tmp = Path(tempfile.mkdtemp(prefix="hivenet-bench-"))
    secret = tmp / "secret"
    secret.write_text(secrets.token_urlsafe(48))
    secret.chmod(0o600)
    sim, http, grpc, p2p, met, base = (free_port() for _ in range(6))
    fleet = Fleet(tmp)
    sim_url = f"http://127.0.0.1:{sim}"
    fleet.start(
        "sim",
        [
            str(BIN / "hivenet-sim"),
            "--port",
            str(sim),
            "--model",
            MODEL,
            "--zero-latency",
            "--max-num-seqs",
            "4096",
        ],
    )
    fleet.start(
        "baseline", [sys.executable, str(ROOT / "bench" / "baseline_proxy.py"), str(base), sim_url]
    )
    fleet.start(
        "router",
        [
            str(BIN / "hivenet-router"),
            "--http-port",
            f"127.0.0.1:{http}",
            "--grpc-port",
            f"127.0.0.1:{grpc}",
            "--metrics-port",
            f"127.0.0.1:{met}",
            "--p2p-port",
            str(p2p),
            "--jwt-secret-file",
            str(secret),
            "--max-concurrent",
            "1024",
            "--queue-size",
            "4096",
            "--log-level",
            "warn",
            "--disk-db-path",
            str(tmp / "store"),
        ],
    )
    fleet.start(
        "agent",
        [
            str(BIN / "hivenet-agent"),
            "--backend-url",
            sim_url,
            "--router-grpc",
            f"127.0.0.1:{grpc}",
            "--jwt-secret-file",
            str(secret),
            "--identity-path",
            str(tmp / "id.key"),
            "--capacity",
            "1024",
            "--reconnect-delay",
            "200ms",
            "--log-level",
            "warn",
        ],
    )
    rows: list[Row] = []
    try:
        wait_ready(f"{sim_url}/v1/models")
        wait_ready(f"http://127.0.0.1:{http}/v1/models")
        targets = {
            "direct": (sim_url, ["sim"]),
            "aiohttp proxy": (f"http://127.0.0.1:{base}", ["baseline", "sim"]),
            "router+agent": (f"http://127.0.0.1:{http}", ["router", "agent", "sim"]),
        }
        targets = {k: v for k, v in targets.items() if k in args.targets.split(",")}
        loads = {k: v for k, v in LOADS.items() if k in args.loads.split(",")}
        total = len(targets) * len(loads) * len(levels)
        done = 0
        for load, body in loads.items():
            for conns in levels:
                for target, (url, procs) in targets.items():
                    done += 1
                    print(
                        f"[{done}/{total}] {target:14s} {load:8s} c={conns:<4d}",
                        end=" ",
                        flush=True,
                    )
                    run_wrk(wrk, url + "/v1/chat/completions", body, conns, 1, tmp)  # warm-up
                    before = {p: cpu_ticks(fleet.pid(p)) for p in procs}
                    n, rps, p50, p99, errors = run_wrk(
                        wrk, url + "/v1/chat/completions", body, conns, seconds, tmp
                    )
                    tick_us = 1e6 / os.sysconf("SC_CLK_TCK")
                    cpu = {
                        p: round((cpu_ticks(fleet.pid(p)) - before[p]) * tick_us / max(n, 1), 1)
                        for p in procs
                    }
                    rows.append(Row(target, load, conns, n, rps, p50, p99, errors, cpu))
                    print(
                        f"{rps:9.0f} req/s  p50 {p50:7.2f} ms  p99 {p99:7.2f} ms  "
                        f"cpu/req {cpu}  errors {errors}",
                        flush=True,
                    )
    finally:
        fleet.stop()
    report = render(rows, seconds)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "overhead.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))
    print(report)
    if not args.no_docs:
        text = DOC.read_text()
        start, end = "<!-- bench:overhead -->", "<!-- /bench:overhead -->"
        head, _, rest = text.partition(start)
        _, _, tail = rest.partition(end)
        DOC.write_text(f"{head}{start}\n{report}\n{end}{tail}")
    return 0


def render(rows: list[Row], seconds: int) -> str:
    direct = {(r.load, r.concurrency): r for r in rows if r.target == "direct"}
    if not direct:
        direct = {(r.load, r.concurrency): r for r in rows}
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}, "
        f"wrk -t1, {seconds} s per cell.",
        "",
        "| load | conc. | target | req/s | p50 ms | p99 ms | added p50 ms | CPU/req (us) "
        "| errors |",
        "| --- | --: | --- | --: | --: | --: | --: | --- | --: |",
    ]
    for r in rows:
        base = direct[(r.load, r.concurrency)]
        added = "" if r.target == "direct" else f"{r.p50_ms - base.p50_ms:+.2f}"
        cpu = ", ".join(f"{k} {v:.0f}" for k, v in r.cpu_us.items())
        lines.append(
            f"| {r.load} | {r.concurrency} | {r.target} | {r.rps:,.0f} | "
            f"{r.p50_ms:.2f} | {r.p99_ms:.2f} | {added} | {cpu} | {r.errors} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
