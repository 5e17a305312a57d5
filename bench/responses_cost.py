"""Router CPU per request: /v1/responses against the same request as /v1/chat/completions
(docs/benchmarks.md, "The Responses API").

    python -m bench.responses_cost                 # 300 requests per cell, 3 rounds
    python -m bench.responses_cost --requests 1000 --rounds 5

One router, one agent, one simulator with no delays, on loopback. Each round sends every
load in turn (the order reversed every other round) from 8 concurrent clients and reads the
router's CPU time (user plus system, from /proc) over the load; the median per request of
each load is printed. Loads: a ~1 KB whole answer (130 tokens) and a 50-token stream, as
chat, as a stored Response and as a Response with `store: false`.
"""

from __future__ import annotations

import argparse
import asyncio
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, cluster(Path(tmp)) as c:
        router = c.router()
        c.agent(router, c.sim(MODEL, "--zero-latency"))
        wait_registered(router, MODEL)
        assert router.proc.popen is not None
        pid = router.proc.popen.pid
        per: dict[str, list[float]] = {name: [] for name in LOADS}
        names = list(LOADS)
        asyncio.run(_load(router.url + "/v1/chat/completions", LOADS["chat json-1k"][1], 50))
        for index in range(args.rounds):
            for name in names if index % 2 == 0 else names[::-1]:
                route, body = LOADS[name]
                before = tree_cpu_seconds([pid])
                asyncio.run(_load(router.url + route, body, args.requests))
                spent = tree_cpu_seconds([pid]) - before
                per[name].append(spent / args.requests * 1e6)
        for name, values in per.items():
            print(f"{name:32} {statistics.median(values):8.0f} us router CPU per request")


if __name__ == "__main__":
    main()
