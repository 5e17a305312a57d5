"""Time to first token at the client beside the simulators' own, run by run.

    python -m bench.ttft_split                          # this router, vllm-router, direct
    python -m bench.ttft_split --rounds 3 --fill-caches
    python -m bench.ttft_split --systems hivenet,direct --requests 200

The systems of bench.peers start side by side on two realistic simulators (never used
before: their prefix caches are empty) and take aiperf runs in turns, the order reversed
every other round. For each run: aiperf's TTFT p50 and mean, the mean the simulators
recorded for the same requests (from reading a request until its first token is ready),
the difference of the two means (what happened outside the engine: the router, aiperf's
own loop, waiting for a core), and per request answered: the CPU of the router's
processes, how long their threads waited for a CPU while runnable (schedstat), and how
long any thread of the machine did (the kernel's CPU pressure figure, "some").

Without --fill-caches the first run through each simulator pays for prefill that later
runs find cached (aiperf sends the same prompts every run), which is why bench.peers
fills the caches first; see docs/benchmarks.md, "Time to first token under aiperf".
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench.aiperf import measure, stat, warm_prefix_caches
from bench.common import Fleet
from bench.peers import STARTERS, start_engines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default="hivenet,vllm-router,direct")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=400, help="aiperf requests per run")
    parser.add_argument("--fill-caches", action="store_true", help="as bench.peers does")
    args = parser.parse_args()
    systems = args.systems.split(",")
    unknown = [s for s in systems if s not in STARTERS]
    if unknown or args.rounds < 1 or args.requests < 1:
        parser.error(f"known systems: {', '.join(STARTERS)}; rounds and requests at least 1")
    tmp = Path(tempfile.mkdtemp(prefix="ttft-split-"))
    fleet = Fleet(tmp)
    outside: dict[str, list[float]] = {s: [] for s in systems}
    p50s: dict[str, list[float]] = {s: [] for s in systems}
    pressure: dict[str, list[float]] = {s: [] for s in systems}
    try:
        engines = start_engines(fleet, "realistic")
        running = {s: STARTERS[s](fleet, engines, tmp) for s in systems}
        if args.fill_caches:
            warm_prefix_caches(engines, tmp, args.requests)
        print(
            "round system        TTFT p50   mean  engine mean  outside"
            "  CPU us/req  waited us/req  pressure us/req"
        )
        for rnd in range(args.rounds):
            for system in systems if rnd % 2 == 0 else systems[::-1]:
                pids = [fleet.pid(p) for p in running[system].procs]
                run = measure(running[system].url, engines, pids, tmp, args.requests)
                mean = stat(run.data, "time_to_first_token", "avg")
                p50 = stat(run.data, "time_to_first_token", "p50")
                engine_ms = run.engine_ttft_ms
                outside[system].append(mean - engine_ms)
                p50s[system].append(p50)
                pressure[system].append(run.pressure_us)
                cpu = "" if run.cpu_us is None else f"{run.cpu_us:.0f}"
                waited = "" if run.wait_us is None else f"{run.wait_us:.0f}"
                print(
                    f"{rnd + 1:5d} {system:13s} {p50:8.2f} {mean:6.2f} {engine_ms:12.2f} "
                    f"{mean - engine_ms:8.2f} {cpu:>11s} {waited:>14s} {run.pressure_us:16.0f}",
                    flush=True,
                )
        for system in systems:
            print(
                f"medians, {system}: TTFT p50 {statistics.median(p50s[system]):.2f} ms, "
                f"outside the engine {statistics.median(outside[system]):.2f} ms, "
                f"CPU pressure {statistics.median(pressure[system]):.0f} us per request"
            )
    finally:
        fleet.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
