"""Time to first token when requests come together: waves of streams sent at once.

    python -m bench.burst                              # this router, vllm-router, direct
    python -m bench.burst --compare HEAD~1 --waves 20  # and another commit's router

Two simulators with realistic latency (bench.peers' profile: 30 ms to the first token, 5 ms
per token) stand behind every system. A wave is --size streaming chat requests sent at the
same moment on kept-alive connections; the next wave starts when the last answer of the
one before has ended, and the systems take turns wave by wave. For each system it prints
the time to the first content chunk over all waves (p50, p90, max) and the median of
each wave's spread (its slowest first token less its fastest). A router that handles a
whole burst before it forwards the first request shows here, where aiperf's steadier
arrivals hide it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.common import Fleet
from bench.overhead import export
from bench.peers import MODEL, STARTERS, start_engines, start_router_and_agents

BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hello " * 100}],
    "max_tokens": 50,
    "stream": True,
}


async def first_token(session: aiohttp.ClientSession, url: str) -> float:
    """Milliseconds to the first chunk that carries content; the answer is read to its end."""
    start = time.perf_counter()
    first = 0.0
    async with session.post(url + "/v1/chat/completions", json=BODY) as reply:
        reply.raise_for_status()
        async for line in reply.content:
            if not first and line.startswith(b"data: {") and b'"content"' in line:
                first = (time.perf_counter() - start) * 1000
    return first


async def run_waves(urls: dict[str, str], waves: int, size: int) -> dict[str, list[list[float]]]:
    seen: dict[str, list[list[float]]] = {name: [] for name in urls}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for url in urls.values():  # warm-up: connections opened, engines' caches full
            await asyncio.gather(*(first_token(session, url) for _ in range(size)))
        for wave in range(waves):
            order = list(urls) if wave % 2 == 0 else list(urls)[::-1]
            for name in order:
                times = await asyncio.gather(
                    *(first_token(session, urls[name]) for _ in range(size))
                )
                seen[name].append(list(times))
    return seen


def report(seen: dict[str, list[list[float]]]) -> None:
    print("system                 p50 ms   p90 ms   max ms   wave spread p50 ms")
    for name, waves in seen.items():
        every = sorted(t for wave in waves for t in wave)
        p90 = every[min(len(every) - 1, int(len(every) * 0.9))]
        spread = statistics.median(max(wave) - min(wave) for wave in waves)
        print(
            f"{name:20} {statistics.median(every):8.2f} {p90:8.2f} {every[-1]:8.2f} {spread:12.2f}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waves", type=int, default=10)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--systems", default="direct,hivenet,vllm-router")
    parser.add_argument("--compare", default="", help="a git revision to measure beside")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="burst-"))
    fleet = Fleet(tmp)
    try:
        engines = start_engines(fleet, "realistic")
        urls = {name: STARTERS[name](fleet, engines, tmp).url for name in args.systems.split(",")}
        if args.compare:
            src = export(args.compare, tmp / "compare")
            code = "import sys; from hivenet_router.cli import {0}_main as m; sys.exit(m())"

            def launch(name: str, program: str, argv: list[str]) -> list[str]:
                return [sys.executable, "-c", code.format(program), *argv]

            other = tmp / "other"
            other.mkdir()
            env = {"PYTHONPATH": str(src)}
            url, _ = start_router_and_agents(fleet, engines, other, "other", launch, env)
            urls[f"hivenet@{args.compare}"] = url
        report(asyncio.run(run_waves(urls, args.waves, args.size)))
    finally:
        fleet.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
