"""Python calls per request in the router and its agents, counted by cProfile.

    python -m bench.call_counts                       # 1 KB JSON, 32 connections, 8 s
    python -m bench.call_counts --load sse --top 40
    python -m bench.call_counts --load sse --profile realistic   # chunks 5 ms apart

Timings under cProfile drift with the machine and with the profiler itself; call counts do
not, so they show whether a change to the request path took steps out of it. The router
and both agents (bench.peers' setup, two simulators, zero-latency unless --profile says)
run under cProfile, switched on after a warm-up (SIGUSR2) and written out at the end
(SIGUSR1). Prints the calls per request of each process (an agent serves half the
requests) and the functions with the most time of their own, with their calls per request.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench.common import BIN, ROOT, Fleet, ensure_wrk, run_wrk
from bench.peers import start_engines, start_router_and_agents
from bench.request_profile import BODIES, load_options


def serve(which: str, out: str, argv: list[str]) -> int:
    """Run the router or an agent with a profiler that signals turn on and write out."""
    from hivenet_router.cli import agent_main, router_main

    profile = cProfile.Profile()

    def write(*_: object) -> None:
        profile.disable()
        profile.dump_stats(out)
        os._exit(0)

    signal.signal(signal.SIGUSR2, lambda *_: profile.enable())
    signal.signal(signal.SIGUSR1, write)
    return (router_main if which == "router" else agent_main)(argv)


def report(path: Path, requests: float, top: int) -> None:
    stats = pstats.Stats(str(path)).stats
    calls = sum(v[1] for v in stats.values())
    print(f"{path.stem}: {calls / requests:.1f} calls per request")
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    for (file, line, function), (_, count, own, _, _) in rows:
        where = f"{Path(file).name}:{line}" if file != "~" else ""
        print(f"  {count / requests:6.2f} calls {own / requests * 1e6:7.1f} us  {where} {function}")


def main() -> int:
    if len(sys.argv) > 3 and sys.argv[1] == "--serve":
        return serve(sys.argv[2], sys.argv[3], sys.argv[4:])
    args = load_options(__doc__.splitlines()[0], seconds=8).parse_args()
    wrk = ensure_wrk()
    tmp = Path(tempfile.mkdtemp(prefix="call-counts-"))
    fleet = Fleet(tmp)
    me = [str(BIN / "python"), "-m", "bench.call_counts", "--serve"]
    here = {"PYTHONPATH": str(ROOT)}  # the processes start in the scratch folder

    def launch(name: str, program: str, argv: list[str]) -> list[str]:
        return [*me, program, str(tmp / f"{name}.prof"), *argv]

    try:
        engines = start_engines(fleet, args.profile)
        url, names = start_router_and_agents(fleet, engines, tmp, "router", launch, here)
        chat = url + "/v1/chat/completions"
        run_wrk(wrk, chat, BODIES[args.load], args.concurrency, 2, tmp)  # warm up, uncounted
        for name in names:
            os.kill(fleet.pid(name), signal.SIGUSR2)
        result = run_wrk(wrk, chat, BODIES[args.load], args.concurrency, args.seconds, tmp)
        for name in names:
            os.kill(fleet.pid(name), signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(fleet.procs[n].poll() is None for n in names):
            time.sleep(0.1)
        print(f"{args.load} at {args.concurrency} connections: {result.requests} requests")
        for name in names:
            share = result.requests if name == "router" else result.requests / len(engines)
            report(tmp / f"{name}.prof", max(share, 1), args.top)
    finally:
        fleet.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
