"""Router overhead benchmark: the same load straight to the engine simulator, through a bare
aiohttp proxy, and through router plus agent.

    make bench-overhead                       # full run (about 6 minutes)
    make bench-overhead ARGS=--quick
    make bench-overhead ARGS="--compare HEAD~1"   # also another commit's router and agent
    make bench-overhead ARGS="--compare HEAD~1 --targets router+agent --loads json-1k \
        --concurrency 32 --rounds 6 --seconds 6"   # an interleaved A/B of one cell
    make bench-overhead ARGS="--variants audit-off,tracing,access-log --targets router+agent"

With --compare, the source of that commit is exported from git into a scratch folder and its
router and agent run from it (same virtual environment, same simulator) as one more target,
`router+agent@REV`, so the two are measured in the same run, cell after cell. With
--rounds N every cell is measured N times, the order of the targets reversed every other
round, and the median of each figure is reported: on a shared machine whose speed drifts
over minutes, that interleaving is what makes a difference of a few percent visible.

Load comes from wrk (installed with apt-get when missing). For each target, load and
concurrency it reports req/s, p50 and p99 latency, and the CPU time each process spent per
request (utime + stime from /proc, divided by the requests served). Results go to
bench/results/overhead.json and into docs/benchmarks.md between the overhead markers.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tests.otlp import Receiver

from bench.common import (
    BIN,
    LOADS,
    MODEL,
    ROOT,
    Fleet,
    agent_args,
    cpu_ticks,
    ensure_wrk,
    free_port,
    publish,
    router_args,
    run_wrk,
    secret_file,
    wait_http,
)


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


# Router settings measured beside the default (audit records on, request log off at
# --log-level warn): extra router flags and environment for router and agent.
VARIANTS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "audit-off": ((), {"HIVENET_ROUTER_AUDIT_LOG_PATH": ""}),
    "access-log": (("--log-level", "info"), {}),
    "tracing": ((), {"OTEL_TRACES_SAMPLER": "always_on"}),
    "tracing-10pct": (
        (),
        {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"},
    ),
    # Every span sampled, to a collector that is not there (connections refused).
    "tracing-down": ((), {"OTEL_EXPORTER_OTLP_ENDPOINT": "127.0.0.1:9"}),
}


def wait_ready(url: str) -> None:
    wait_http(url, lambda text: MODEL in text, timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="3 s per cell")
    parser.add_argument("--concurrency", default="1,32,256")
    parser.add_argument("--loads", default=",".join(LOADS))
    parser.add_argument("--targets", default="direct,aiohttp proxy,router+agent")
    parser.add_argument("--no-docs", action="store_true")
    parser.add_argument("--compare", default="", help="a git revision to measure beside")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved repeats per cell")
    parser.add_argument(
        "--variants",
        default="",
        help=f"more router+agent targets with one setting changed: {', '.join(VARIANTS)}",
    )
    args = parser.parse_args()
    seconds = 3 if args.quick else args.seconds
    levels = [int(x) for x in args.concurrency.split(",")]
    wrk = ensure_wrk()
    tmp = Path(tempfile.mkdtemp(prefix="hivenet-bench-"))
    secret = secret_file(tmp)
    sim, http, grpc, base = (free_port() for _ in range(4))
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
    queue = ("--max-concurrent", "1024", "--queue-size", "4096")
    fleet.start("router", router_args(secret, tmp / "store", http, grpc, *queue))
    fleet.start("agent", agent_args(secret, grpc, sim_url, tmp / "id.key", "--capacity", "1024"))
    targets = {
        "direct": (sim_url, ["sim"]),
        "aiohttp proxy": (f"http://127.0.0.1:{base}", ["baseline", "sim"]),
        "router+agent": (f"http://127.0.0.1:{http}", ["router", "agent", "sim"]),
    }
    targets = {k: v for k, v in targets.items() if k in args.targets.split(",")}
    if args.compare:
        other_http, other_grpc = free_port(), free_port()
        src = export(args.compare, tmp / "compare")
        env = {"PYTHONPATH": str(src)}
        program = [
            sys.executable,
            "-c",
            "import sys; from hivenet_router.cli import {}; sys.exit({}())",
        ]
        args_router = router_args(secret, tmp / "store-b", other_http, other_grpc, *queue)
        args_agent = agent_args(secret, other_grpc, sim_url, tmp / "id-b.key", "--capacity", "1024")
        fleet.start("router@", [*_main(program, "router_main"), *args_router[1:]], env)
        fleet.start("agent@", [*_main(program, "agent_main"), *args_agent[1:]], env)
        targets[f"router+agent@{args.compare}"] = (
            f"http://127.0.0.1:{other_http}",
            ["router@", "agent@", "sim"],
        )
    receiver: Receiver | None = None
    for variant in filter(None, args.variants.split(",")):
        extra, env = VARIANTS[variant]
        if variant.startswith("tracing") and "OTEL_EXPORTER_OTLP_ENDPOINT" not in env:
            receiver = receiver or Receiver()  # a local OTLP collector, in this process
            env = {**env, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
        v_http, v_grpc = free_port(), free_port()
        name = f"router[{variant}]"
        fleet.start(
            name, router_args(secret, tmp / f"store-{variant}", v_http, v_grpc, *queue, *extra), env
        )
        fleet.start(
            f"agent[{variant}]",
            agent_args(secret, v_grpc, sim_url, tmp / f"id-{variant}.key", "--capacity", "1024"),
            env,
        )
        targets[f"router+agent[{variant}]"] = (
            f"http://127.0.0.1:{v_http}",
            [name, f"agent[{variant}]", "sim"],
        )
    rows: list[Row] = []
    try:
        wait_ready(f"{sim_url}/v1/models")
        for url, _ in targets.values():
            wait_ready(f"{url}/v1/models")
        loads = {k: v for k, v in LOADS.items() if k in args.loads.split(",")}
        total = len(targets) * len(loads) * len(levels) * args.rounds
        done = 0
        for load, body in loads.items():
            for conns in levels:
                for round_ in range(args.rounds):
                    order = list(targets.items())
                    for target, (url, procs) in order if round_ % 2 == 0 else order[::-1]:
                        done += 1
                        print(f"[{done}/{total}] {target:14s} {load:8s} c={conns:<4d}", end=" ")
                        row = measure(fleet, wrk, tmp, url, procs, body, conns, seconds)
                        rows.append(Row(target, load, conns, *row))
                        print(
                            f"{row[1]:9.0f} req/s  p50 {row[2]:7.2f} ms  p99 {row[3]:7.2f} ms  "
                            f"cpu/req {row[5]}  errors {row[4]}",
                            flush=True,
                        )
    finally:
        fleet.stop()
        if receiver is not None:
            receiver.stop()
    rows = medians(rows, list(targets))
    text = render(rows, seconds, args.rounds)
    publish("overhead", [asdict(r) for r in rows], text, not args.no_docs)
    return 0


def measure(
    fleet: Fleet,
    wrk: str,
    tmp: Path,
    url: str,
    procs: list[str],
    body: dict[str, object],
    conns: int,
    seconds: int,
) -> tuple[int, float, float, float, int, dict[str, float]]:
    """One cell after a 1 s warm-up: requests, req/s, p50, p99, errors, CPU us/request."""
    run_wrk(wrk, url + "/v1/chat/completions", body, conns, 1, tmp)
    before = {p: cpu_ticks(fleet.pid(p)) for p in procs}
    got = run_wrk(wrk, url + "/v1/chat/completions", body, conns, seconds, tmp)
    tick_us = 1e6 / os.sysconf("SC_CLK_TCK")
    n = max(got.requests, 1)
    cpu = {p: round((cpu_ticks(fleet.pid(p)) - before[p]) * tick_us / n, 1) for p in procs}
    return got.requests, got.rps, got.p50_ms, got.p99_ms, got.errors, cpu


def medians(rows: list[Row], order: list[str]) -> list[Row]:
    """One row per target, load and concurrency: the median of its rounds, field by field."""
    groups: dict[tuple[str, str, int], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.load, row.concurrency, row.target), []).append(row)
    out = []
    for (load, conns, target), group in groups.items():
        procs = group[0].cpu_us
        out.append(
            Row(
                target,
                load,
                conns,
                sum(r.requests for r in group),
                round(statistics.median(r.rps for r in group), 1),
                round(statistics.median(r.p50_ms for r in group), 2),
                round(statistics.median(r.p99_ms for r in group), 2),
                sum(r.errors for r in group),
                {p: round(statistics.median(r.cpu_us[p] for r in group), 1) for p in procs},
            )
        )
    out.sort(key=lambda r: (r.load, r.concurrency, order.index(r.target)))
    return out


def export(revision: str, folder: Path) -> Path:
    """The `src` folder of another commit, exported from git (no worktree to clean up)."""
    folder.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", revision, "src"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder / "src"


def _main(program: list[str], name: str) -> list[str]:
    return [program[0], program[1], program[2].format(name, name)]


def render(rows: list[Row], seconds: int, rounds: int = 1) -> str:
    each = f", median of {rounds} interleaved rounds" if rounds > 1 else ""
    direct = {(r.load, r.concurrency): r for r in rows if r.target == "direct"}
    if not direct:
        direct = {(r.load, r.concurrency): r for r in rows}
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}, "
        f"wrk -t1, {seconds} s per cell{each}.",
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
