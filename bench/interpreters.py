"""The same router on two Python builds: CPU per request of the router and its agents.

    python -m bench.interpreters /path/to/venv-a /path/to/venv-b
    python -m bench.interpreters .venv /tmp/venv-pyenv --rounds 4 --seconds 5

Each virtual environment needs this project installed (`pip install -e .`). Both routers,
each with two agents, stand in front of the same two zero-latency simulators, which run on
the interpreter of this script, so that they cost the same on both sides. wrk drives one
side, then the other, cell by cell, the order swapped every round; the table gives the
median of the rounds. Loads: 1 KB JSON answers at 32 connections and at one, and 50-chunk
streams at 32.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.common import Fleet, ensure_wrk, run_wrk, tree_cpu_seconds
from bench.peers import start_engines, start_router_and_agents
from bench.request_profile import BODIES

CELLS = (("json", 32), ("json", 1), ("sse", 32))


@dataclass
class Side:
    venv: Path
    label: str
    url: str
    router: int
    agents: list[int]


def describe(venv: Path) -> str:
    """The interpreter behind a venv: version and the executable it resolves to."""
    python = venv / "bin" / "python"
    code = "import sys, os; print(sys.version.split()[0], os.path.realpath(sys.executable))"
    done = subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True)
    return done.stdout.strip()


def start_side(fleet: Fleet, venv: Path, n: int, engines: list[str], tmp: Path) -> Side:
    own = tmp / f"side-{n}"  # a secret of its own: the other side's would overwrite it
    own.mkdir()

    def launch(name: str, program: str, argv: list[str]) -> list[str]:
        return [str(venv / "bin" / f"hivenet-{program}"), *argv]

    url, names = start_router_and_agents(fleet, engines, own, f"side-{n}", launch)
    pids = [fleet.pid(name) for name in names]
    return Side(venv, describe(venv), url, pids[0], pids[1:])


def measure(
    wrk: str, side: Side, load: str, conns: int, seconds: int, tmp: Path
) -> tuple[float, float, float, float]:
    """Requests a second, p50, and CPU per request (us) of the router and of the agents."""
    router0, agents0 = tree_cpu_seconds([side.router]), tree_cpu_seconds(side.agents)
    result = run_wrk(wrk, side.url + "/v1/chat/completions", BODIES[load], conns, seconds, tmp)
    per = 1e6 / max(result.requests, 1)
    router = (tree_cpu_seconds([side.router]) - router0) * per
    agents = (tree_cpu_seconds(side.agents) - agents0) * per
    return result.rps, result.p50_ms, router, agents


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("venvs", nargs=2, type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=5)
    args = parser.parse_args()
    wrk = ensure_wrk()
    tmp = Path(tempfile.mkdtemp(prefix="interpreters-"))
    fleet = Fleet(tmp)
    try:
        engines = start_engines(fleet, "zero")
        sides = [start_side(fleet, v.resolve(), n, engines, tmp) for n, v in enumerate(args.venvs)]
        for side in sides:  # warm both up before the first cell counts
            run_wrk(wrk, side.url + "/v1/chat/completions", BODIES["json"], 32, 2, tmp)
        rows: dict[tuple[str, int, int], list[tuple[float, float, float, float]]] = {}
        for rnd in range(args.rounds):
            for load, conns in CELLS:
                order = sides if rnd % 2 == 0 else sides[::-1]
                for side in order:
                    cell = measure(wrk, side, load, conns, args.seconds, tmp)
                    rows.setdefault((load, conns, sides.index(side)), []).append(cell)
        print(f"{args.rounds} rounds of {args.seconds} s; medians")
        for n, side in enumerate(sides):
            print(f"  [{n}] {side.venv}: Python {side.label}")
        print("load  conc. side   req/s   p50 ms   router us/req   agents us/req")
        for (load, conns, n), cells in rows.items():
            rps, p50, router, agents = (statistics.median(c[i] for c in cells) for i in range(4))
            print(f"{load:5} {conns:5} [{n}]  {rps:7.0f} {p50:8.2f} {router:15.0f} {agents:15.0f}")
    finally:
        fleet.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
