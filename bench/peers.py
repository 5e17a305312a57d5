"""Peer benchmark: this router against the routers people use, on one machine, in one run.

    make bench-peers                  # about 35 minutes on 2 cores
    make bench-peers ARGS=--quick     # 3 s cells, one round, one profile: a smoke run

Every system fronts the same two engine simulators (least-loaded routing or its closest
equivalent), except "direct", which is one simulator with no router. Two simulator
profiles: zero latency (what the router itself costs) and realistic latency (30 ms to the
first token, 5 ms per token). Each peer is installed in its own virtualenv under
~/.cache/hivenet-router/peers by this script, pinned.

Load: wrk (raw HTTP; 1 KB JSON answers and 50-chunk streams at 1, 32 and 256 connections)
and aiperf (LLM-shaped: streaming chat at 32 concurrent, TTFT and inter-token latency).
For each cell: req/s, p50 and p99, added p50 over direct, the router's CPU per request
(its whole process tree, agents included for this router) and, per system, peak RSS.

The systems of a profile run side by side and take turns cell by cell, in rounds (3 by
default; the order rotates each round). Each number reported is the median over the
rounds, and each target ratio also shows its lowest and highest round. A system whose idle
CPU would slow the others (--alone: LiteLLM) is measured by itself first. Before the
aiperf rounds of a profile with prefill time, one untimed aiperf run straight to each
simulator fills its prefix cache, so that no system pays for being first (bench/aiperf.py).
Memory is measured last, each system started afresh and alone. Measured one after
another, minutes apart, the same ratio moved by up to 0.5 between runs on this machine.
Results: bench/results/peers.json, docs/benchmarks.md between the peers markers, and
docs/img/peers-*.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from bench.aiperf import PIN as AIPERF_PIN
from bench.aiperf import measure, stat, warm_prefix_caches
from bench.common import (
    BIN,
    CHAT,
    LOADS,
    MODEL,
    RESULTS,
    ROOT,
    Fleet,
    PeakPss,
    agent_args,
    ensure_wrk,
    free_port,
    idle_cpu_percent,
    publish,
    router_args,
    run_wrk,
    secret_file,
    tree_cpu_seconds,
    tree_peak_rss_mb,
    venv,
    wait_http,
)
from bench.peers_report import Cell, LlmCell, Report, plots, render

PINS = {
    "litellm": ["litellm[proxy]==1.100.5"],
    "vllm-router": ["vllm-router==0.1.17"],
    "sglang-router": ["sglang-router==0.3.2"],
    "aiperf": AIPERF_PIN,
}
PROFILES = {
    "zero": ["--zero-latency", "--max-num-seqs", "4096"],
    "realistic": [
        "--ttft-base",
        "30ms",
        "--itl",
        "5ms",
        "--batch-slowdown",
        "0.005",
        "--max-num-seqs",
        "512",
    ],
}
SYSTEMS = ["direct", "hivenet", "litellm", "vllm-router", "sglang-router"]


@dataclass
class Running:
    url: str
    procs: list[str]  # the processes whose CPU and memory count as "the router"
    command: str


Starter = Callable[[Fleet, list[str], Path], Running]


def start_direct(fleet: Fleet, engines: list[str], tmp: Path) -> Running:
    return Running(engines[0], [], "(none: requests go to one simulator)")


# How one process of this router is started: (process name, "router" or "agent", its
# arguments) -> the command line. The plain way runs this venv's programs.
Launch = Callable[[str, str, list[str]], list[str]]


def plain_launch(name: str, program: str, args: list[str]) -> list[str]:
    return [str(BIN / f"hivenet-{program}"), *args]


def start_router_and_agents(
    fleet: Fleet,
    engines: list[str],
    folder: Path,
    name: str = "hivenet",
    launch: Launch = plain_launch,
    env: dict[str, str] | None = None,
) -> tuple[str, list[str]]:
    """This router (queue and agents sized so that no limit but the machine's shapes the
    load) with one agent per engine, ready for chat. Returns its URL and process names."""
    secret = secret_file(folder)
    http, grpc = free_port(), free_port()
    queue = ("--max-concurrent", "2048", "--queue-size", "8192")
    routed = router_args(secret, folder / f"{name}-store", http, grpc, *queue)
    fleet.start(name, launch(name, "router", routed[1:]), env)
    names = [name]
    for n, engine in enumerate(engines):
        agent = f"{name}-agent-{n}"
        more = agent_args(secret, grpc, engine, folder / f"{agent}.key", "--capacity", "1024")
        fleet.start(agent, launch(agent, "agent", more[1:]), env)
        names.append(agent)
    url = f"http://127.0.0.1:{http}"
    replicas = f'"healthy_replicas":{len(engines)}'
    wait_http(f"{url}/v1/models", lambda t: replicas in t)
    wait_chat(url)
    return url, names


def start_hivenet(fleet: Fleet, engines: list[str], tmp: Path) -> Running:
    url, names = start_router_and_agents(fleet, engines, tmp)
    command = (
        f"hivenet-router --max-concurrent 2048 --queue-size 8192 (least-loaded, the default) "
        f"+ {len(engines)} x hivenet-agent --capacity 1024"
    )
    return Running(url, names, command)


def start_litellm(fleet: Fleet, engines: list[str], tmp: Path) -> Running:
    bin_dir = venv("litellm", PINS["litellm"])
    deployments = [
        {
            "model_name": MODEL,
            "litellm_params": {"model": f"openai/{MODEL}", "api_base": f"{e}/v1", "api_key": "x"},
        }
        for e in engines
    ]
    config = {"model_list": deployments, "router_settings": {"routing_strategy": "least-busy"}}
    (tmp / "litellm.json").write_text(json.dumps(config))
    # Access logs off, as for every system here: a log line per request is not routing.
    quiet = {
        "version": 1,
        "disable_existing_loggers": False,
        "loggers": {name: {"level": "WARNING"} for name in ("uvicorn.access", "uvicorn.error")},
    }
    (tmp / "litellm-log.json").write_text(json.dumps(quiet))
    port = free_port()
    args = ["--config", "litellm.json", "--host", "127.0.0.1", "--port", str(port)]
    args += ["--log_config", "litellm-log.json"]
    env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
    fleet.start("litellm", [str(bin_dir / "litellm"), *args, "--num_workers", "1"], env)
    url = f"http://127.0.0.1:{port}"
    wait_chat(url, timeout=120)
    return Running(url, ["litellm"], "litellm --config C --num_workers 1 (least-busy)")


def wait_chat(url: str, timeout: float = 60.0) -> None:
    """Ready means a chat completion through it succeeds (model lists differ by router)."""
    body = json.dumps({**CHAT, "max_tokens": 1}).encode()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        request = urllib.request.Request(
            url + "/v1/chat/completions", body, {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{url} did not answer a chat completion within {timeout:.0f}s")


_QUIET = {"vllm-router": ["--log-level", "warning"], "sglang-router": ["--log-level", "warn"]}


def rust_router(name: str, launch: list[str], policy: str = "power_of_two") -> Starter:
    def start(fleet: Fleet, engines: list[str], tmp: Path) -> Running:
        bin_dir = venv(name, PINS[name])
        port, metrics = free_port(), free_port()
        args = [
            *launch,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *engines,
            "--policy",
            policy,
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(metrics),
            *_QUIET[name],
        ]
        fleet.start(name, [str(bin_dir / args[0]), *args[1:]])
        url = f"http://127.0.0.1:{port}"
        wait_chat(url)
        shown = " ".join([*launch, "--worker-urls", "...", "--policy", policy])
        return Running(url, [name], shown)

    return start


STARTERS: dict[str, Starter] = {
    "direct": start_direct,
    "hivenet": start_hivenet,
    "litellm": start_litellm,
    "vllm-router": rust_router("vllm-router", ["vllm-router"]),
    "sglang-router": rust_router("sglang-router", ["sglang-router", "launch"]),
}


def start_engines(fleet: Fleet, profile: str) -> list[str]:
    urls = []
    for n in range(2):
        port = free_port()
        args = [str(BIN / "hivenet-sim"), "--port", str(port), "--model", MODEL, "--seed", str(n)]
        fleet.start(f"sim-{profile}-{n}", [*args, *PROFILES[profile]])
        urls.append(f"http://127.0.0.1:{port}")
    for url in urls:
        wait_http(f"{url}/v1/models", lambda t: MODEL in t)
    return urls


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name, pins in PINS.items():
        found[name] = pins[0].split("==")[1]
    wrk = subprocess.run(["wrk", "-v"], check=False, capture_output=True, text=True)
    wrk_line = (wrk.stdout or wrk.stderr).split("\n")[0]
    found["wrk"] = wrk_line.split(" [")[0].removeprefix("wrk ")
    found["hivenet-router"] = (
        "this commit: "
        + subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            check=False,
            capture_output=True,
            text=True,
            cwd=ROOT,
        ).stdout.strip()
    )
    return found


def machine() -> str:
    model = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.machine()}, {os.cpu_count()} cores ({model}), {memory:.0f} GiB"


def _mid(values: Iterable[float | None]) -> float | None:
    """The median of the values measured (None and NaN are not)."""
    known = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(known) if known else None


def _median_cell(samples: list[Cell]) -> Cell:
    first = samples[0]
    return Cell(
        first.profile,
        first.system,
        first.load,
        first.concurrency,
        sum(c.requests for c in samples),
        statistics.median(c.rps for c in samples),
        statistics.median(c.p50_ms for c in samples),
        statistics.median(c.p99_ms for c in samples),
        sum(c.errors for c in samples),
        _mid(c.cpu_us for c in samples),
        _mid(c.router_cpu_us for c in samples),
    )


def _median_llm(samples: list[LlmCell]) -> LlmCell:
    first = samples[0]

    def mid(values: Iterable[float]) -> float:
        value = _mid(values)
        return math.nan if value is None else value

    return LlmCell(
        first.profile,
        first.system,
        sum(r.requests for r in samples),
        sum(r.errors for r in samples),
        mid(r.rps for r in samples),
        mid(r.ttft_p50_ms for r in samples),
        mid(r.ttft_p99_ms for r in samples),
        mid(r.itl_p50_ms for r in samples),
        mid(r.latency_p50_ms for r in samples),
        engine_ttft_ms=mid(r.engine_ttft_ms for r in samples),
        cpu_us=_mid(r.cpu_us for r in samples),
        ttft_mean_ms=mid(r.ttft_mean_ms for r in samples),
    )


@dataclass
class Bench:
    """One run's settings and the state its cells share."""

    wrk: str
    tmp: Path
    fleet: Fleet
    seconds: int
    rounds: int
    report: Report
    bar: tqdm

    @staticmethod
    def order(systems: list[str], rnd: int) -> list[str]:
        """The systems in turn: starting one further along each round, and backwards every
        other round, so no system always follows the same one."""
        shift = rnd % len(systems)
        turn = systems[shift:] + systems[:shift]
        return turn[::-1] if rnd % 2 else turn

    def wrk_cell(
        self, profile: str, system: str, running: Running, load: str, conns: int, rnd: int
    ) -> Cell:
        pids = [self.fleet.pid(p) for p in running.procs]
        self.bar.set_description(f"{profile} {load} c={conns} round {rnd + 1}: {system}")
        url = running.url + "/v1/chat/completions"
        body = LOADS[load]
        run_wrk(self.wrk, url, body, conns, 1, self.tmp)  # warm-up
        before = tree_cpu_seconds(pids)
        alone = tree_cpu_seconds(pids[:1])
        got = run_wrk(self.wrk, url, body, conns, self.seconds, self.tmp)
        spent = tree_cpu_seconds(pids) - before
        alone = tree_cpu_seconds(pids[:1]) - alone
        cpu = spent * 1e6 / max(got.requests, 1) if pids else None
        router_cpu = alone * 1e6 / max(got.requests, 1) if pids else None
        self.bar.update()
        return Cell(
            profile,
            system,
            load,
            conns,
            got.requests,
            got.rps,
            got.p50_ms,
            got.p99_ms,
            got.errors,
            cpu,
            router_cpu,
            rnd + 1,
        )

    def llm_cell(
        self,
        profile: str,
        system: str,
        running: Running,
        engines: list[str],
        requests: int,
        rnd: int,
    ) -> LlmCell:
        self.bar.set_description(f"{profile} aiperf round {rnd + 1}: {system}")
        pids = [self.fleet.pid(p) for p in running.procs]
        run = measure(running.url, engines, pids, self.tmp, requests)
        data = run.data
        errors = data.get("error_request_count")
        self.bar.update()
        return LlmCell(
            profile,
            system,
            int(stat(data, "request_count", "avg")),
            int(errors.get("avg", 0)) if isinstance(errors, dict) else 0,
            stat(data, "request_throughput", "avg"),
            stat(data, "time_to_first_token", "p50"),
            stat(data, "time_to_first_token", "p99"),
            stat(data, "inter_token_latency", "p50"),
            stat(data, "request_latency", "p50"),
            rnd + 1,
            run.engine_ttft_ms,
            run.cpu_us,
            stat(data, "time_to_first_token", "avg"),
        )

    def memory(self, profile: str, system: str, engines: list[str], conns: int) -> None:
        """Peak memory with no other router up: PSS splits a page shared by N processes
        N ways, so other systems' Python processes would make this one's share look
        smaller. The system is started afresh and given the `conns` cells of both loads."""
        running = STARTERS[system](self.fleet, engines, self.tmp)
        pids = [self.fleet.pid(p) for p in running.procs]
        if pids:
            self.bar.set_description(f"{profile} memory: {system} alone, c={conns}")
            sampler = PeakPss(pids)
            url = running.url + "/v1/chat/completions"
            for body in LOADS.values():
                run_wrk(self.wrk, url, body, conns, 1, self.tmp)
                run_wrk(self.wrk, url, body, conns, self.seconds, self.tmp)
            key = f"{profile}/{system}"
            self.report.peak_pss_mb[key] = round(sampler.stop(), 1)
            self.report.peak_rss_mb[key] = round(tree_peak_rss_mb(pids), 1)
        self.fleet.stop(running.procs)


def run_profile(
    bench: Bench,
    profile: str,
    systems: list[str],
    alone: set[str],
    levels: list[int],
    idle: float | None,
    llm_requests: int,
) -> None:
    """This profile's engines; the systems in `alone` measured one by one, then the rest
    side by side in turns; then each one's memory on its own."""
    report = bench.report
    engines = start_engines(bench.fleet, profile)
    first = len(report.cells)
    groups = [[s] for s in systems if s in alone] + [[s for s in systems if s not in alone]]
    for group in groups:
        if group:
            run_group(bench, profile, group, engines, levels, idle, llm_requests)
    # The tables read best in one order whatever the groups were: load, level, system.
    loads, rank = list(LOADS), {s: n for n, s in enumerate(systems)}
    report.cells[first:] = sorted(
        report.cells[first:],
        key=lambda c: (loads.index(c.load), levels.index(c.concurrency), rank[c.system]),
    )
    for system in systems:
        bench.memory(profile, system, engines, max(levels))
    bench.fleet.stop([name for name in bench.fleet.procs if name.startswith("sim-")])


def run_group(
    bench: Bench,
    profile: str,
    systems: list[str],
    engines: list[str],
    levels: list[int],
    idle: float | None,
    llm_requests: int,
) -> None:
    """Start these systems side by side, measure them cell by cell in turns, stop them."""
    report, fleet = bench.report, bench.fleet
    running: dict[str, Running] = {}
    for system in systems:
        bench.bar.set_description(f"{profile}: starting {system}")
        running[system] = STARTERS[system](fleet, engines, bench.tmp)
        report.commands[system] = running[system].command
    if idle is not None and "hivenet" in running:
        bench.bar.set_description(f"{profile}: idle CPU of hivenet")
        named = {name: fleet.pid(name) for name in running["hivenet"].procs}
        report.idle_cpu_percent = idle_cpu_percent(named, idle)
        report.idle_seconds = idle
    for load in LOADS:
        for conns in levels:
            by_system: dict[str, list[Cell]] = {system: [] for system in systems}
            for rnd in range(bench.rounds):
                for system in bench.order(systems, rnd):
                    cell = bench.wrk_cell(profile, system, running[system], load, conns, rnd)
                    by_system[system].append(cell)
            for system in systems:
                report.samples.extend(by_system[system])
                report.cells.append(_median_cell(by_system[system]))
    llm: dict[str, list[LlmCell]] = {system: [] for system in systems}
    if "--zero-latency" not in PROFILES[profile]:
        # The wrk cells' long answers have pushed aiperf's prompts out of the prefix caches.
        bench.bar.set_description(f"{profile}: filling the simulators' prefix caches")
        warm_prefix_caches(engines, bench.tmp, llm_requests)
    for rnd in range(bench.rounds):
        for system in bench.order(systems, rnd):
            sample = bench.llm_cell(profile, system, running[system], engines, llm_requests, rnd)
            llm[system].append(sample)
    for system in systems:
        report.llm_samples.extend(llm[system])
        report.llm.append(_median_llm(llm[system]))
        fleet.stop(running[system].procs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=int, default=5, help="wrk seconds per cell and round")
    parser.add_argument("--rounds", type=int, default=3, help="turns each system takes per cell")
    parser.add_argument("--quick", action="store_true", help="3 s cells, zero profile only")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--profiles", default=",".join(PROFILES))
    parser.add_argument("--concurrency", default="1,32,256")
    parser.add_argument("--aiperf-requests", type=int, default=400)
    parser.add_argument(
        "--idle-seconds", type=float, default=60.0, help="idle CPU window for this router"
    )
    parser.add_argument(
        "--alone",
        default="litellm",
        help="systems measured one by one, not beside the others (their idle CPU is high)",
    )
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    if args.rounds < 1 or args.seconds < 1:
        parser.error("--rounds and --seconds must be at least 1")
    seconds = 3 if args.quick else args.seconds
    rounds = 1 if args.quick else args.rounds
    profiles = ["zero"] if args.quick else args.profiles.split(",")
    systems = args.systems.split(",")
    unknown = [s for s in systems if s not in STARTERS]
    if unknown:
        parser.error(f"unknown systems {unknown}; known: {', '.join(STARTERS)}")
    levels = [int(x) for x in args.concurrency.split(",")]
    alone = {s for s in args.alone.split(",") if s}
    wrk = ensure_wrk()
    for name in systems:  # install everything before the clock starts
        if name in PINS:
            venv(name, PINS[name])
    venv("aiperf", PINS["aiperf"])
    report = Report(machine(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), versions(), {})
    report.rounds = rounds
    report.alone = sorted(alone & set(systems))
    total = len(profiles) * len(systems) * (len(LOADS) * len(levels) + 1) * rounds
    bar = tqdm(total=total, unit="cell", dynamic_ncols=True)
    tmp = Path(tempfile.mkdtemp(prefix="hivenet-peers-"))
    fleet = Fleet(tmp)
    bench = Bench(wrk, tmp, fleet, seconds, rounds, report, bar)
    try:
        for profile in profiles:
            idle = None
            if profile == profiles[0]:
                idle = 10.0 if args.quick else args.idle_seconds
            llm_requests = 100 if args.quick else args.aiperf_requests
            run_profile(bench, profile, systems, alone, levels, idle, llm_requests)
    finally:
        bar.close()
        fleet.stop()
    # A run kept out of the docs keeps its charts out of them too.
    charts = RESULTS if args.no_docs else ROOT / "docs" / "img"
    charts.mkdir(parents=True, exist_ok=True)
    images = plots(report, charts)
    publish("peers", asdict(report), render(report, seconds, images), not args.no_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
