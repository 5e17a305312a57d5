"""The forwarding limit follows the fleet, or stays where --max-concurrent puts it.

Six agents of capacity 10 in front of one engine, 80 streams at once, each held open by
its client until the test lets go. By default every agent slot fills: the engine runs 60
streams and the other 20 wait in the model's queue, none refused. With --max-concurrent 20
the engine runs 20 and 60 wait in the global queue while 40 agent slots stay idle, as
docs/api.md (Limits and queues) says. Both read the engine's own running count, and every
stream gets its answer once the test lets the first ones go.
"""

from __future__ import annotations

import asyncio

import httpx2 as httpx
import pytest

from tests.procs import Cluster, Router, Sim, metric, wait_registered

MODEL = "fleet-model"
AGENTS, CAPACITY, STREAMS = 6, 10, 80
# One token a second and room for them all: a stream lasts as long as its client holds it.
ENGINE = (
    "--itl",
    "1s",
    "--batch-slowdown",
    "0",
    "--ttft-base",
    "0",
    "--max-num-seqs",
    "128",
    "--kv-cache-tokens",
    "1000000",
)
BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "max_tokens": 4000,
    "stream": True,
}


async def streams_wait(
    router: Router, sim: Sim, running: int, waiting: str, limit: float, **labels: str
) -> None:
    """Send STREAMS streams; once the engine runs `running` of them and the rest wait where
    they should (`waiting`: a router gauge), let them all go and check each was answered."""
    statuses: list[int] = []
    refusals: list[str] = []
    release = asyncio.Event()
    pool = httpx.Limits(max_connections=STREAMS, max_keepalive_connections=0)
    async with (
        httpx.AsyncClient(base_url=router.url, timeout=120, limits=pool) as client,
        httpx.AsyncClient(timeout=10) as scraper,  # not queued behind the streams' connections
    ):

        async def one() -> None:
            async with client.stream("POST", "/v1/chat/completions", json=BODY) as reply:
                statuses.append(reply.status_code)
                if reply.status_code == 200:
                    await release.wait()  # hold the stream open; leaving resets it
                else:
                    refusals.append((await reply.aread()).decode(errors="replace"))

        state: dict[str, float | None] = {}

        async def reached() -> None:
            # Polled, with a generous bound: processes share a small machine. The engine
            # counts a stream as running before its answer's head has reached the client,
            # so the clients' 200s are waited for too.
            while (state.get("running"), state.get("waiting")) != (
                running,
                STREAMS - running,
            ) or statuses.count(200) < running:
                await asyncio.sleep(0.1)
                engine, own = await asyncio.gather(
                    scraper.get(sim.url + "/metrics"),
                    scraper.get(f"http://127.0.0.1:{router.metrics_port}/metrics"),
                )
                state["running"] = metric(engine.text, "vllm:num_requests_running")
                state["waiting"] = metric(own.text, waiting, **labels)
                state["forwarding"] = metric(own.text, "hivenet_router_active_forwards")
                state["limit"] = metric(own.text, "hivenet_router_forwarding_limit")
                assert not refusals, refusals

        tasks = [asyncio.create_task(one()) for _ in range(STREAMS)]
        try:
            await asyncio.wait_for(reached(), 120)
        except TimeoutError:
            raise AssertionError(f"never {running} running, the rest waiting: {state}") from None
        finally:
            release.set()  # the first streams end, the waiting ones get their turn
        assert state["limit"] == limit
        assert statuses.count(200) == running
        await asyncio.gather(*tasks)
    assert (statuses, refusals) == ([200] * STREAMS, [])  # no queue_full, no no_capacity


def fleet(cluster: Cluster, *router_args: str) -> tuple[Router, Sim]:
    router = cluster.router("--request-timeout", "5m", *router_args)
    sim = cluster.sim(MODEL, *ENGINE)
    for n in range(AGENTS):
        cluster.agent(router, sim, "--capacity", str(CAPACITY), name=f"agent{n}")
    wait_registered(router, MODEL, replicas=AGENTS, timeout=60)
    return router, sim


@pytest.mark.timeout(300)
async def test_by_default_every_agent_slot_of_the_fleet_is_used(make_cluster: Cluster) -> None:
    router, sim = fleet(make_cluster)
    # 60 agent slots and the model's queue of 30 (--queue-depth).
    limit = AGENTS * CAPACITY + 30
    await streams_wait(router, sim, AGENTS * CAPACITY, "hivenet_queue_depth", limit, model=MODEL)


@pytest.mark.timeout(300)
async def test_a_fixed_max_concurrent_caps_the_streams(make_cluster: Cluster) -> None:
    router, sim = fleet(make_cluster, "--max-concurrent", "20")
    await streams_wait(router, sim, 20, "hivenet_router_pending_requests", 20)
