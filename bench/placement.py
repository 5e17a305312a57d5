"""One connection at a time: what CPU placement does to added latency and CPU per request.

    python -m bench.placement                                    # 4 rounds, JSON and streams
    python -m bench.placement --systems direct,hivenet --loads json-1k --rounds 2

First the price of waking a process on another CPU: two processes pass one byte back and
forth over a pair of pipes, both on one CPU, on two different CPUs, and where the
scheduler puts them. Then the systems of bench.peers with its loads (zero-latency
simulators, 1 KB JSON answers and 50-chunk streams, wrk with one connection), every
process (simulators and wrk included) pinned to the first CPU, and spread over all CPUs
as the scheduler likes; the two placements alternate, the order swapped every round.
Prints every cell as it is measured (the machine's own swings show as the simulators'
CPU per request moving with everyone else's), then medians of p50, p50 added over
direct, and CPU per request of each system's processes, of the router process alone and
of the simulators.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import psutil

from bench.common import LOADS, Fleet, ensure_wrk, run_wrk, tree_cpu_seconds
from bench.peers import STARTERS, Running, start_engines

# p50 us; CPU us/request of the system's processes, of its first (the router alone), and
# of the simulators
Sample = tuple[float, float, float, float]


def pipe_round_trip(cpus: tuple[int, int] | None, trips: int = 3000) -> float:
    """Microseconds for one byte to go to a child process and back, each side pinned to
    its CPU (or wherever the scheduler puts it)."""
    there_r, there_w = os.pipe()
    back_r, back_w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child process
        try:
            os.close(there_w)
            os.close(back_r)
            if cpus is not None:
                os.sched_setaffinity(0, {cpus[1]})
            for _ in range(trips):
                if not os.read(there_r, 1):
                    break  # the parent gave up
                os.write(back_w, b"x")
        finally:
            os._exit(0)
    os.close(there_r)
    os.close(back_w)
    mine = os.sched_getaffinity(0)
    try:
        if cpus is not None:
            os.sched_setaffinity(0, {cpus[0]})
        time.sleep(0.05)
        start = time.perf_counter()
        for _ in range(trips):
            os.write(there_w, b"x")
            os.read(back_r, 1)
        return (time.perf_counter() - start) / trips * 1e6
    finally:
        os.close(there_w)  # a child still reading sees the end and leaves
        os.close(back_r)
        os.waitpid(child, 0)
        os.sched_setaffinity(0, mine)


def pin(pids: list[int], cpus: set[int]) -> None:
    """Every thread of these processes, of their children and of this one, onto `cpus`
    (wrk, started from here, inherits it). A thread or process that ends meanwhile is
    skipped; the others are still pinned."""
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for proc in procs:
            try:
                threads = proc.threads()
            except psutil.NoSuchProcess:
                continue
            for thread in threads:
                with contextlib.suppress(ProcessLookupError):
                    os.sched_setaffinity(thread.id, cpus)
    os.sched_setaffinity(0, cpus)


def measure(
    fleet: Fleet, run: Running, sims: list[int], load: str, seconds: int, wrk: str
) -> Sample:
    url, folder = run.url + "/v1/chat/completions", fleet.tmp
    run_wrk(wrk, url, LOADS[load], 1, 1, folder)  # the connection and caches warm
    groups = [
        [fleet.pid(name) for name in run.procs],
        [fleet.pid(name) for name in run.procs[:1]],
        sims,
    ]
    before = [tree_cpu_seconds(pids) for pids in groups]
    got = run_wrk(wrk, url, LOADS[load], 1, seconds, folder)
    per = 1e6 / max(got.requests, 1)
    cpu = [(tree_cpu_seconds(pids) - was) * per for pids, was in zip(groups, before, strict=True)]
    return got.p50_ms * 1000, cpu[0], cpu[1], cpu[2]


def report(samples: dict[tuple[str, str, str], list[Sample]]) -> None:
    print(
        "\n| placement | system | load | p50 us | added us | CPU us/request | router alone |",
        end="",
    )
    print(" simulators |\n| --- | --- | --- | --: | --: | --: | --: | --: |")
    for (place, system, load), rows in sorted(samples.items()):
        p50, cpu, alone, sims = (statistics.median(row[i] for row in rows) for i in range(4))
        if system == "direct":
            print(f"| {place} | {system} | {load} | {p50:.0f} | | | | {sims:.0f} |")
            continue
        direct = samples.get((place, "direct", load))
        added = f"{p50 - statistics.median(r[0] for r in direct):+.0f}" if direct else ""
        print(
            f"| {place} | {system} | {load} | {p50:.0f} | {added} | {cpu:.0f} | {alone:.0f} "
            f"| {sims:.0f} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default="direct,hivenet,vllm-router")
    parser.add_argument("--loads", default=",".join(LOADS))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=int, default=4)
    args = parser.parse_args()
    every = os.sched_getaffinity(0)
    first = {min(every)}
    if len(every) > 1:
        two = (min(every), max(every))
        for label, pair in (("one CPU", (two[0], two[0])), ("two CPUs", two), ("unpinned", None)):
            trips = sorted(pipe_round_trip(pair) for _ in range(3))
            print(
                f"pipe round trip, {label}: {trips[1]:.1f} us "
                f"(of 3: {trips[0]:.1f} to {trips[2]:.1f})"
            )
    wrk, tmp = ensure_wrk(), Path(tempfile.mkdtemp(prefix="placement-"))
    fleet = Fleet(tmp)
    samples: dict[tuple[str, str, str], list[Sample]] = defaultdict(list)
    try:
        engines = start_engines(fleet, "zero")
        sims = [fleet.pid(name) for name in fleet.procs]
        runs = {system: STARTERS[system](fleet, engines, tmp) for system in args.systems.split(",")}
        everyone = [fleet.pid(name) for name in fleet.procs]
        places = [("one CPU", first), ("spread", every)]
        for round_ in range(args.rounds):
            for place, cpus in places if round_ % 2 == 0 else places[::-1]:
                pin(everyone, cpus)
                for system, run in runs.items():
                    for load in args.loads.split(","):
                        sample = measure(fleet, run, sims, load, args.seconds, wrk)
                        samples[place, system, load].append(sample)
                        p50, cpu, alone, theirs = sample
                        print(
                            f"  {place}, {system}, {load}: p50 {p50:.0f} us, CPU per request "
                            f"{cpu:.0f} us (router {alone:.0f}, simulators {theirs:.0f})",
                            flush=True,
                        )
            print(f"round {round_ + 1} of {args.rounds} done", flush=True)
    finally:
        pin([fleet.pid(name) for name in fleet.procs], every)
        fleet.stop()
    report(samples)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
