"""Routing-quality benchmark: how well each router places work on an unlike fleet.

    make bench-routing                  # about 10 minutes; every system, one workload
    make bench-routing ARGS=--quick     # a third of the sessions, for a smoke run

The fleet is four engine simulators serving one model, unlike on purpose: two decode fast
and two slowly (4 ms and 12 ms per token, prefill 0.05 and 0.15 ms per uncached prompt
token), and in each pair one has a large prefix cache and one a small one (262,144 and
16,384 tokens). The workload is the same for every system (seeded): conversations that
share one of eight long system prompts (a few are much more popular than the rest), four
turns each whose prompt carries the whole conversation so far, arriving in three bursts
with think time between turns. Streaming chat, 48 output tokens per turn.

Measured per system: time to first token p50 and p99 (at the client, first content chunk),
requests and output tokens per second over the run, the fleet's prefix-cache hit rate
(cached prompt tokens over prompt tokens, from the simulators' vLLM metrics), and the
share of requests each engine served. Systems: this router (least-loaded), vllm-router
(round robin, power of two, cache aware), sglang-router (cache aware) and LiteLLM
(least-busy). Fresh simulators for every system, so no one inherits a warm cache.
Results: bench/results/routing.json, docs/benchmarks.md between the routing markers, and
docs/img/routing-quality.png.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from bench.common import BIN, MODEL, ROOT, Fleet, free_port, publish, wait_http
from bench.peers import STARTERS, Running, machine, rust_router, versions
from bench.routing_report import plot, render

ENGINES = {
    "fast-big": ["--itl", "4ms", "--prefill-per-token", "0.05ms", "--kv-cache-tokens", "262144"],
    "fast-small": ["--itl", "4ms", "--prefill-per-token", "0.05ms", "--kv-cache-tokens", "16384"],
    "slow-big": ["--itl", "12ms", "--prefill-per-token", "0.15ms", "--kv-cache-tokens", "262144"],
    "slow-small": ["--itl", "12ms", "--prefill-per-token", "0.15ms", "--kv-cache-tokens", "16384"],
}
COMMON = ["--ttft-base", "10ms", "--max-num-seqs", "8", "--max-model-len", "32768"]
SYSTEMS = {
    "hivenet least-loaded": STARTERS["hivenet"],
    "vllm-router round_robin": rust_router("vllm-router", ["vllm-router"], "round_robin"),
    "vllm-router power_of_two": rust_router("vllm-router", ["vllm-router"], "power_of_two"),
    "vllm-router cache_aware": rust_router("vllm-router", ["vllm-router"], "cache_aware"),
    "sglang-router cache_aware": rust_router(
        "sglang-router", ["sglang-router", "launch"], "cache_aware"
    ),
    "litellm least-busy": STARTERS["litellm"],
}
OUTPUT_TOKENS = 48


@dataclass(frozen=True)
class Session:
    start: float  # seconds after the run begins
    system_prompt: int
    turns: list[str]
    think: list[float]


def workload(sessions: int, seed: int = 11) -> tuple[list[str], list[Session]]:
    rng = random.Random(seed)
    vocabulary = [f"w{n}" for n in range(5000)]
    prompts = [" ".join(rng.choices(vocabulary, k=800)) for _ in range(8)]
    # Three bursts; popularity of the system prompts falls off like 1/rank.
    weights = [1 / (rank + 1) for rank in range(len(prompts))]
    bursts = [0.0, 20.0, 40.0]
    out = []
    for n in range(sessions):
        burst = bursts[n * len(bursts) // sessions]
        out.append(
            Session(
                start=burst + rng.uniform(0, 2.0),
                system_prompt=rng.choices(range(len(prompts)), weights)[0],
                turns=[" ".join(rng.choices(vocabulary, k=60)) for _ in range(4)],
                think=[rng.uniform(0.2, 1.5) for _ in range(4)],
            )
        )
    return prompts, out


@dataclass
class Outcome:
    ttft_ms: list[float] = field(default_factory=list)
    output_tokens: int = 0
    completed: int = 0
    errors: int = 0


async def one_turn(
    http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], outcome: Outcome
) -> str:
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": OUTPUT_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.monotonic()
    text: list[str] = []
    first = None
    try:
        async with http.post(url, data=orjson.dumps(body), headers=_JSON) as reply:
            if reply.status != 200:
                outcome.errors += 1
                await reply.read()
                return ""
            async for raw in reply.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                chunk = orjson.loads(line[5:])
                if chunk.get("usage"):
                    outcome.output_tokens += int(chunk["usage"].get("completion_tokens", 0))
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        if first is None:
                            first = time.monotonic() - started
                        text.append(piece)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        outcome.errors += 1
        return ""
    if first is None:
        outcome.errors += 1
        return ""
    outcome.ttft_ms.append(first * 1000)
    outcome.completed += 1
    return "".join(text)


_JSON = {"Content-Type": "application/json"}


async def run_session(
    http: aiohttp.ClientSession,
    url: str,
    prompt: str,
    session: Session,
    outcome: Outcome,
    began: float,
    bar: tqdm,  # type: ignore[type-arg]
) -> None:
    await asyncio.sleep(max(0.0, began + session.start - time.monotonic()))
    messages = [{"role": "system", "content": prompt}]
    for turn, think in zip(session.turns, session.think, strict=True):
        messages.append({"role": "user", "content": turn})
        answer = await one_turn(http, url, messages, outcome)
        messages.append({"role": "assistant", "content": answer})
        bar.update()
        await asyncio.sleep(think)


async def drive(
    url: str, prompts: list[str], sessions: list[Session], bar: tqdm
) -> tuple[Outcome, float]:  # type: ignore[type-arg]
    outcome = Outcome()
    timeout = aiohttp.ClientTimeout(total=120)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        began = time.monotonic()
        await asyncio.gather(
            *(
                run_session(http, url, prompts[s.system_prompt], s, outcome, began, bar)
                for s in sessions
            )
        )
        return outcome, time.monotonic() - began


def engine_counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    wanted = {
        "vllm:prefix_cache_hits_total": "hits",
        "vllm:prefix_cache_queries_total": "queries",
        "vllm:time_to_first_token_seconds_count": "requests",
    }
    found = dict.fromkeys(wanted.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                found[wanted[sample.name]] += sample.value
    return found


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


def _quantile(values: list[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def measure(name: str, sessions: list[Session], prompts: list[str], tmp: Path, bar: tqdm) -> Result:  # type: ignore[type-arg]
    fleet = Fleet(tmp)
    try:
        urls = {}
        for engine, flags in ENGINES.items():
            port = free_port()
            args = [str(BIN / "hivenet-sim"), "--port", str(port), "--model", MODEL]
            fleet.start(f"sim-{engine}", [*args, "--seed", "3", *COMMON, *flags])
            urls[engine] = f"http://127.0.0.1:{port}"
        for url in urls.values():
            wait_http(url + "/v1/models", lambda t: MODEL in t)
        bar.set_description(f"{name}: starting")
        running: Running = SYSTEMS[name](fleet, list(urls.values()), tmp)
        bar.set_description(name)
        outcome, seconds = asyncio.run(
            drive(running.url + "/v1/chat/completions", prompts, sessions, bar)
        )
        counters = {engine: engine_counters(url) for engine, url in urls.items()}
    finally:
        fleet.stop()
    served = sum(c["requests"] for c in counters.values()) or 1.0
    queries = sum(c["queries"] for c in counters.values()) or 1.0
    return Result(
        system=name,
        requests=outcome.completed,
        errors=outcome.errors,
        seconds=round(seconds, 1),
        ttft_p50_ms=_quantile(outcome.ttft_ms, 0.5),
        ttft_p99_ms=_quantile(outcome.ttft_ms, 0.99),
        rps=outcome.completed / seconds,
        output_tokens_per_s=outcome.output_tokens / seconds,
        cache_hit_rate=sum(c["hits"] for c in counters.values()) / queries,
        share={engine: c["requests"] / served for engine, c in counters.items()},
        command=running.command,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a third of the sessions")
    parser.add_argument("--sessions", type=int, default=96)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    sessions_count = args.sessions // 3 if args.quick else args.sessions
    prompts, sessions = workload(sessions_count)
    names = [n for n in SYSTEMS if n in args.systems.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="hivenet-routing-"))
    results = []
    turns = sum(len(s.turns) for s in sessions)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tqdm(total=turns * len(names), unit="req", dynamic_ncols=True) as bar:
        for name in names:
            results.append(measure(name, sessions, prompts, tmp, bar))
    report = {
        "machine": machine(),
        "started": started,
        "versions": versions(),
        "sessions": sessions_count,
        "requests_per_system": turns,
        "results": [asdict(r) for r in results],
    }
    image = plot(results, ROOT / "docs" / "img" / "routing-quality.png")
    publish("routing", report, render(report, results, image), not args.no_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
