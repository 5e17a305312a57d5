"""Router CPU per request: /v1/responses against the same request as /v1/chat/completions
(docs/benchmarks.md, "The Responses API").

    python -m bench.responses_cost                 # 300 requests per cell, 3 rounds
    python -m bench.responses_cost --requests 1000 --rounds 5
    python -m bench.responses_cost --compare /tmp/base/src   # A/B against another tree

One router, one agent, one simulator with no delays, on loopback. Each round sends every
load in turn (the order reversed every other round) from 8 concurrent clients and reads the
router's CPU time (user plus system, from /proc) over the load; the median per request of
each load is printed. Loads: a ~1 KB whole answer (130 tokens) and a 50-token stream, as
chat, as a stored Response and as a Response with `store: false`.

With `--compare SRC` a second router runs the code under SRC (a `git archive` of another
commit's `src`), with its own agent on the same simulator, and each load is sent to one
router then the other (the order swapped every round), so that both see the same machine
load; both medians and their difference are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
from pathlib import Path

import httpx2 as httpx
from tests.procs import cluster, wait_registered

from bench.common import tree_cpu_seconds

MODEL = "bench-model"
PROMPT = "hello"
LOADS: dict[str, tuple[str, dict[str, object]]] = {
    "chat json-1k": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 130},
    ),
    "responses json-1k": ("/v1/responses", {"input": PROMPT, "max_output_tokens": 130}),
    "responses json-1k store:false": (
        "/v1/responses",
        {"input": PROMPT, "max_output_tokens": 130, "store": False},
    ),
    "chat sse-50": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 50, "stream": True},
    ),
    "responses sse-50": (
        "/v1/responses",
        {"input": PROMPT, "max_output_tokens": 50, "stream": True},
    ),
}


async def _load(url: str, body: dict[str, object], requests: int) -> None:
    left = iter(range(requests))
    async with httpx.AsyncClient(timeout=30) as client:

        async def worker() -> None:
            for _ in left:
                reply = await client.post(url, json={"model": MODEL, **body})
                assert reply.status_code == 200, reply.text[:200]

        await asyncio.gather(*(worker() for _ in range(8)))


def _measure(pid: int, url: str, name: str, requests: int) -> float:
    """Router CPU per request, in microseconds, over one load."""
    route, body = LOADS[name]
    before = tree_cpu_seconds([pid])
    asyncio.run(_load(url + route, body, requests))
    return (tree_cpu_seconds([pid]) - before) / requests * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--compare", metavar="SRC", help="also measure a router running the code under SRC"
    )
    parser.add_argument(
        "--loads", default="", help="only the loads whose names contain one of these (a,b)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, cluster(Path(tmp)) as c:
        sim = c.sim(MODEL, "--zero-latency")
        routers = {"this": c.router()}
        c.agent(routers["this"], sim)
        if args.compare:
            path = os.pathsep.join([args.compare, os.environ.get("PYTHONPATH", "")])
            routers["compared"] = c.router(name="compared", env={"PYTHONPATH": path})
            c.agent(routers["compared"], sim, name="compared-agent")
        pids: dict[str, int] = {}
        for label, router in routers.items():
            wait_registered(router, MODEL)
            assert router.proc.popen is not None
            pids[label] = router.proc.popen.pid
            asyncio.run(_load(router.url + "/v1/chat/completions", LOADS["chat json-1k"][1], 50))
        per: dict[tuple[str, str], list[float]] = {(r, n): [] for r in routers for n in LOADS}
        wanted = [part for part in args.loads.split(",") if part]
        names = [name for name in LOADS if not wanted or any(p in name for p in wanted)]
        labels = list(routers)
        for index in range(args.rounds):
            for name in names if index % 2 == 0 else names[::-1]:
                for label in labels if index % 2 == 0 else labels[::-1]:
                    spent = _measure(pids[label], routers[label].url, name, args.requests)
                    per[label, name].append(spent)
        for name in names:
            line = f"{name:32}"
            for label in labels:
                line += f" {label} {statistics.median(per[label, name]):6.0f} us"
            if args.compare:
                # Each round's two measurements ran back to back: the median of their
                # differences is steadier than the difference of the medians.
                pairs = zip(per["this", name], per["compared", name], strict=True)
                diff = statistics.median(a - b for a, b in pairs)
                line += f"  ({diff:+.0f} us)"
            print(line + "  router CPU per request, median")


if __name__ == "__main__":
    main()
