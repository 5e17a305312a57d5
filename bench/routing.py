"""Routing-quality benchmark: how well each router places work on an unlike fleet, and how
this router copes with four harder cases.

    make bench-routing                               # under 15 minutes: everything
    make bench-routing ARGS=--quick                  # shorter runs, for a smoke run
    make bench-routing ARGS="--scenarios uniform,burst --no-docs"

Scenario `main` (the workload): four engine simulators serving one model, unlike on
purpose: two decode fast and two slowly (4 ms and 12 ms per token, prefill 0.05 and
0.15 ms per uncached prompt token), and in each pair one has a large prefix cache and one
a small one (262,144 and 16,384 tokens). The workload is the same for every system
(seeded): conversations that share one of eight long system prompts (a few are much more
popular than the rest), four turns each whose prompt carries the whole conversation so
far, arriving in three bursts with think time between turns. Streaming chat, 48 output
tokens per turn. Measured per system: time to first token p50 and p99 (at the client,
first content chunk), requests and output tokens per second, the fleet's prefix-cache hit
rate (from the simulators' vLLM metrics) and the share of requests each engine served.
The workload's floor is printed beside them: every request on the fastest engine, idle,
holding every prefix an earlier request of the workload sent (the base plus the fastest
prefill of the rest), which no router can beat; for a predicted-latency run, the
router's median and 90th-percentile prediction error too.
Systems: this router with least-loaded, prefix-affinity, scored (latency-first) and
predicted-latency; a site of two routers with prefix-affinity and sites of two and three
with predicted-latency (every agent serves every router, `--routers`, and reports its
engine's prefix blocks to each; a conversation's turns go to the routers in turn, each
conversation starting at another); vllm-router (round robin, power of two, cache aware),
sglang-router (cache aware) and LiteLLM (least-busy). Fresh simulators for every system,
so no one inherits a warm cache.
Results: bench/results/routing.json, docs/benchmarks.md between the routing markers, and
docs/img/routing-quality.png.

Scenarios `uniform`, `failing`, `slowdown` and `burst` run this router alone, each on
fresh simulators, and print every target as met or not met: see bench/routing_scenarios.py.
Results: bench/results/routing-scenarios.json, docs/benchmarks.md between the
routing-scenarios markers (left alone, with a note, when the page lacks them), and
docs/img/routing-slowdown.png and routing-burst.png.

A policy this router refuses (a strategy it does not know yet) runs as --fallback
(least-loaded) instead, and every table says so; `--fallback none` stops instead.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx2 as httpx
from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]

from bench.common import DOC, MODEL, RESULTS, ROOT, Fleet, publish
from bench.peers import STARTERS, Running, Starter, machine, rust_router, versions
from bench.routing_fleet import (
    COMMON,
    ENGINES,
    HiveRunning,
    Policy,
    PolicyRefused,
    RouterSetup,
    Session,
    drive,
    engine_counters,
    quantile,
    start_router,
    start_sims,
    start_site,
    workload,
)
from bench.routing_report import plot, render, render_scenarios
from bench.routing_scenarios import SCENARIOS, Context, Scenarios


@dataclass(frozen=True)
class Hive:
    """This router with this global policy (None: no policy file, the built-in one); with
    `routers` > 1, a site of that many routers whose clients alternate between them."""

    policy: Policy | None
    routers: int = 1


SYSTEMS: dict[str, Hive | Starter] = {
    "hivenet least-loaded": Hive(None),
    "hivenet prefix-affinity": Hive(Policy("prefix-affinity")),
    "hivenet scored latency-first": Hive(Policy("scored", "latency-first")),
    "hivenet predicted-latency": Hive(Policy("predicted-latency")),
    # The policy's TTFT objective: under it, the most cached candidate wins.
    "hivenet predicted-latency (objective 100 ms)": Hive(
        Policy("predicted-latency", step_yaml="  prediction:\n    ttft_objective_ms: 100\n")
    ),
    "hivenet prefix-affinity (site of 2)": Hive(Policy("prefix-affinity"), 2),
    "hivenet predicted-latency (site of 2)": Hive(Policy("predicted-latency"), 2),
    "hivenet predicted-latency (site of 3)": Hive(Policy("predicted-latency"), 3),
    "vllm-router round_robin": rust_router("vllm-router", ["vllm-router"], "round_robin"),
    "vllm-router power_of_two": rust_router("vllm-router", ["vllm-router"], "power_of_two"),
    "vllm-router cache_aware": rust_router("vllm-router", ["vllm-router"], "cache_aware"),
    "sglang-router cache_aware": rust_router(
        "sglang-router", ["sglang-router", "launch"], "cache_aware"
    ),
    "litellm least-busy": STARTERS["litellm"],
}


@dataclass
class Result:
    system: str
    requests: int
    errors: int
    seconds: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    rps: float
    output_tokens_per_s: float
    cache_hit_rate: float
    share: dict[str, float]
    command: str
    policy: str = ""  # the policy YAML this router ran (empty for the peers)
    # predicted-latency: median and p90 absolute error of the predicted TTFT (shares)
    prediction_error: dict[str, float] | None = None


def prediction_errors(running: HiveRunning) -> dict[str, float] | None:
    """The router's hivenet_ttft_prediction_error_ratio quantiles, when it predicted."""
    try:
        text = httpx.get(running.metrics_url, timeout=5).text
    except httpx.HTTPError:
        return None
    found = {}
    for line in text.splitlines():
        if line.startswith("hivenet_ttft_prediction_error_ratio{"):
            quantile_label = line.split('quantile="')[1].split('"')[0]
            found[f"p{round(float(quantile_label) * 100)}"] = float(line.rsplit(" ", 1)[1])
    return found or None


def start_system(
    name: str, fleet: Fleet, urls: dict[str, str], folder: Path, fallback: Policy | None
) -> tuple[str, Running]:
    """Start one system; a policy the router refused shows in the name."""
    system = SYSTEMS[name]
    if not isinstance(system, Hive):
        return name, system(fleet, list(urls.values()), folder)
    if system.routers > 1 and system.policy is not None:
        return name, start_site(fleet, urls, folder, system.policy, system.routers)
    running = start_router(fleet, urls, folder, RouterSetup(system.policy, fallback))
    if running.refused:
        name = f"{name} (ran as {running.strategy})"
    return name, running


def measure(
    name: str,
    sessions: list[Session],
    prompts: list[str],
    folder: Path,
    bar: Any,
    fallback: Policy | None,
) -> Result:
    folder.mkdir(parents=True)
    fleet = Fleet(folder)
    try:
        urls = start_sims(fleet, {e: [*COMMON, *flags] for e, flags in ENGINES.items()})
        bar.set_description(f"{name}: starting")
        shown, running = start_system(name, fleet, urls, folder, fallback)
        bar.set_description(shown)
        before = {engine: engine_counters(url) for engine, url in urls.items()}
        site = running.urls if isinstance(running, HiveRunning) else []
        targets = [url + "/v1/chat/completions" for url in site or [running.url]]
        outcome, seconds = asyncio.run(drive(targets, prompts, sessions, bar))
        after = {engine: engine_counters(url) for engine, url in urls.items()}
        errors = prediction_errors(running) if isinstance(running, HiveRunning) else None
    finally:
        fleet.stop()
    # Less what the readiness check sent (one short chat completion through the router).
    counters = {e: {k: after[e][k] - before[e][k] for k in after[e]} for e in after}
    total = sum(c["requests"] for c in counters.values()) or 1.0
    queries = sum(c["queries"] for c in counters.values()) or 1.0
    return Result(
        system=shown,
        requests=outcome.completed,
        errors=outcome.errors,
        seconds=round(seconds, 1),
        ttft_p50_ms=quantile(outcome.ttft_ms, 0.5),
        ttft_p99_ms=quantile(outcome.ttft_ms, 0.99),
        rps=outcome.completed / seconds,
        output_tokens_per_s=outcome.output_tokens / seconds,
        cache_hit_rate=sum(c["hits"] for c in counters.values()) / queries,
        share={engine: c["requests"] / total for engine, c in counters.items()},
        command=running.command,
        policy=running.policy_yaml if isinstance(running, HiveRunning) else "",
        prediction_error=errors,
    )


def floor(prompts: list[str], sessions: list[Session]) -> dict[str, float]:
    """TTFT p50 and p99 of the workload on the fastest engine, idle, holding every prefix
    an earlier request sent (ms): the base plus the fastest prefill of the rest."""
    base_ms = 10.0  # COMMON's --ttft-base
    per_token_ms = 0.05  # the fast engines' --prefill-per-token
    seen: set[int] = set()
    floors: list[float] = []
    for session in sorted(sessions, key=lambda s: s.start):
        for turn, text in enumerate(session.turns):
            # The conversation so far is cached; only the new turn (and the answer before
            # it, 48 tokens) is prefilled, and the system prompt too if nobody sent it yet.
            tokens = len(text) / 4 + (48 if turn else 0)
            if turn == 0 and session.system_prompt not in seen:
                tokens += len(prompts[session.system_prompt]) / 4
                seen.add(session.system_prompt)
            floors.append(base_ms + per_token_ms * tokens)
    return {"p50": quantile(floors, 0.5), "p99": quantile(floors, 0.99)}


def destination(name: str, docs: bool) -> tuple[bool, Path]:
    """Whether report NAME goes into the docs page, and the folder for its images. A page
    without the report's markers is left alone (with a note) rather than given a new
    section at its end; the report and its images then go only to bench/results/."""
    marker = f"<!-- bench:{name} -->"
    if docs and marker not in DOC.read_text():
        print(
            f"note: {DOC.relative_to(ROOT)} has no {marker} ... <!-- /bench:{name} --> block; "
            f"this report goes only to bench/results/{name}.json (add the markers to publish it)",
            file=sys.stderr,
        )
        docs = False
    return docs, ROOT / "docs" / "img" if docs else RESULTS / "img"


def _versions() -> dict[str, str]:
    try:
        return versions()
    except OSError as exc:  # wrk missing, say
        return {"note": f"versions unknown: {exc}"}


def run_main(args: argparse.Namespace, tmp: Path, fallback: Policy | None) -> None:
    sessions_count = args.sessions // 3 if args.quick else args.sessions
    prompts, sessions = workload(sessions_count)
    names = [n for n in SYSTEMS if n in args.systems.split(",")]
    turns = sum(len(s.turns) for s in sessions)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = []
    with tqdm(total=turns * len(names), unit="req", dynamic_ncols=True) as bar:
        for n, name in enumerate(names):
            folder = tmp / f"main-{n}"
            results.append(measure(name, sessions, prompts, folder, bar, fallback))
    report = {
        "machine": machine(),
        "started": started,
        "versions": _versions(),
        "sessions": sessions_count,
        "requests_per_system": turns,
        "floor_ms": floor(prompts, sessions),
        "results": [asdict(r) for r in results],
    }
    docs, images = destination("routing", not args.no_docs)
    image = plot(results, images / "routing-quality.png")
    publish("routing", report, render(report, results, image), docs)


def run_scenarios(
    names: list[str], args: argparse.Namespace, tmp: Path, fallback: Policy | None
) -> None:
    context = Context(tmp, args.quick, Policy(args.strategy), fallback, args.scored_preset)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = Scenarios()
    for name in names:
        began = time.monotonic()
        print(f"scenario {name} ...", file=sys.stderr, flush=True)
        SCENARIOS[name](context, results)
        print(f"scenario {name}: {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
    report: dict[str, Any] = {
        "machine": machine(),
        "started": started,
        "model": MODEL,
        "quick": args.quick,
        "strategy": args.strategy,
        "fallback": fallback.label if fallback else None,
        **asdict(results),
    }
    docs, images = destination("routing-scenarios", not args.no_docs)
    text = render_scenarios(report, results, images)
    publish("routing-scenarios", report, text, docs)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    every = ["main", *SCENARIOS]
    parser.add_argument("--quick", action="store_true", help="a third of the sessions, short runs")
    parser.add_argument("--scenarios", default=",".join(every), help="any of " + ",".join(every))
    parser.add_argument("--sessions", type=int, default=96, help="main: conversations")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="main: systems to compare")
    parser.add_argument(
        "--strategy", default="prefix-affinity", help="this router's strategy in the scenarios"
    )
    parser.add_argument("--scored-preset", default="latency-first", help="slowdown: scored run")
    parser.add_argument(
        "--fallback",
        default="least-loaded",
        help="strategy to run when the router refuses a policy; 'none' stops instead",
    )
    parser.add_argument("--no-docs", action="store_true", help="leave docs/ alone")
    args = parser.parse_args()
    chosen = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in every]
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(every)}")
    fallback = None if args.fallback == "none" else Policy(args.fallback)
    tmp = Path(tempfile.mkdtemp(prefix="hivenet-routing-"))
    print(f"logs and scratch files in {tmp}", file=sys.stderr, flush=True)
    try:
        if "main" in chosen:
            run_main(args, tmp, fallback)
        others = [s for s in SCENARIOS if s in chosen]
        if others:
            run_scenarios(others, args, tmp, fallback)
    except PolicyRefused as refused:
        print(f"the router refused a policy (and --fallback none): {refused}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
