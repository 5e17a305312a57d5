"""Where the router's CPU goes per request: one router with two agents in front of two
simulators (bench.peers' setup, zero-latency unless --profile says), wrk at fixed
concurrency, py-spy on the router.

    python -m bench.request_profile                      # 1 KB JSON answers, 32 connections
    python -m bench.request_profile --load sse --seconds 15
    python -m bench.request_profile --load sse --profile realistic   # chunks 5 ms apart

Prints requests a second, CPU per request of the router, each agent and the simulators
(the simulators are the same program whatever is measured: divide by them to take out the
machine's speed), then the router's main thread: the functions with the most samples of
their own and the request path's functions with the most samples inclusive. Threads that
only wait (the log writers, the store's worker) are left out of the shares.
"""

from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from pathlib import Path

from bench.common import Fleet, ensure_wrk, run_wrk, tree_cpu_seconds
from bench.peers import MODEL, PROFILES, start_engines, start_hivenet
from bench.site_profile import find_py_spy, record

BODIES: dict[str, dict[str, object]] = {
    "json": {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 20}]},
    "sse": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello " * 20}],
        "max_tokens": 50,
        "stream": True,
    },
}


def main_thread(raw: Path) -> tuple[int, Counter[str], Counter[str]]:
    """Samples of the main thread, by leaf function and by function anywhere on the stack."""
    total, own, inclusive = 0, Counter[str](), Counter[str]()
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        frames = stack.split(";")
        if not count_text.isdigit() or not frames[0].startswith("<module>"):
            continue
        count = int(count_text)
        total += count
        own[frames[-1]] += count
        for function in {frame.rsplit(":", 1)[0] + ")" for frame in frames}:
            inclusive[function] += count
    return total, own, inclusive


def load_options(description: str, seconds: int) -> argparse.ArgumentParser:
    """The options of a profiling run of bench.peers' setup: which load, how hard, how long,
    how many rows to print, which simulator profile."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--load", choices=sorted(BODIES), default="json")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=int, default=seconds)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="zero")
    return parser


def main() -> int:
    args = load_options(__doc__.splitlines()[0], seconds=10).parse_args()
    py_spy = find_py_spy()
    if py_spy is None:
        raise SystemExit("py-spy not found (see bench/site_profile.py for where to install it)")
    wrk = ensure_wrk()
    tmp = Path(tempfile.mkdtemp(prefix="request-profile-"))
    fleet = Fleet(tmp)
    try:
        engines = start_engines(fleet, args.profile)
        running = start_hivenet(fleet, engines, tmp)
        url = running.url + "/v1/chat/completions"
        body = BODIES[args.load]
        run_wrk(wrk, url, body, args.concurrency, 3, tmp)  # warm up
        pids = {name: fleet.pid(name) for name in running.procs}
        sims = [fleet.pid(name) for name in fleet.procs if name.startswith("sim-")]
        before = {name: tree_cpu_seconds([pid]) for name, pid in pids.items()}
        sims_before = tree_cpu_seconds(sims)
        results = []
        raw = tmp / "router.raw"
        record(
            py_spy,
            pids["hivenet"],
            args.seconds,
            raw,
            lambda: results.append(run_wrk(wrk, url, body, args.concurrency, args.seconds, tmp)),
        )
        result = results[0]
        per = 1e6 / max(result.requests, 1)
        print(
            f"{args.load} at {args.concurrency} connections: {result.rps:.0f} requests/s, "
            f"p50 {result.p50_ms} ms, {result.errors} errors"
        )
        for name, pid in pids.items():
            print(f"  {name}: {(tree_cpu_seconds([pid]) - before[name]) * per:.0f} us/request")
        print(f"  simulators: {(tree_cpu_seconds(sims) - sims_before) * per:.0f} us/request")
        total, own, inclusive = main_thread(raw)
        print(f"router main thread: {total} samples; most samples of their own")
        for frame, count in own.most_common(args.top):
            print(f"  {100 * count / max(total, 1):5.1f}%  {frame}")
        print("the request path's functions, inclusive")
        ours = [(f, n) for f, n in inclusive.most_common() if "hivenet_router/" in f]
        for function, count in ours[: args.top]:
            print(f"  {100 * count / max(total, 1):5.1f}%  {function}")
        print(f"raw samples: {raw}")
    finally:
        fleet.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
