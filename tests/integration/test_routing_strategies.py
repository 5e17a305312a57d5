"""Strategies, circuit breakers, adaptive concurrency and fair queues through real
processes: a router, agents and simulators on loopback, driven with the openai SDK."""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai

from tests.procs import ADMIN_KEY, Cluster, Router, Sim, metric, wait_registered, wait_until

MODEL = "m"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
SYSTEM = "You answer questions about the ocean, briefly and kindly. " * 30


def routed(cluster: Cluster, tmp: Path, policy: str) -> Router:
    """A router started with this global policy."""
    path = tmp / "policy.yaml"
    path.write_text(policy)
    return cluster.router("--policy-file", str(path))


def fleet(cluster: Cluster, router: Router, count: int, *sim_flags: str) -> list[Sim]:
    sims = [cluster.sim(MODEL, *sim_flags, name=f"sim{i}") for i in range(count)]
    for i, sim in enumerate(sims):
        cluster.agent(router, sim, "--machine", f"agent{i}", name=f"agent{i}")
    wait_registered(router, MODEL, replicas=count)
    return sims


def served(sim: Sim) -> float:
    value = metric(sim.metrics(), "hivenet_sim_requests_total")
    assert value is not None
    return value


def table(router: Router) -> dict[str, dict[str, Any]]:
    reply = httpx.get(router.url + "/admin/routing-table", headers=ADMIN, timeout=5)
    reply.raise_for_status()
    return {a["metadata"]["machine"]: a for a in reply.json()["agents"]}


def test_prefix_affinity_keeps_a_conversation_on_one_engine(
    make_cluster: Cluster, tmp_path: Path
) -> None:
    router = routed(make_cluster, tmp_path, "routing_policy: {strategy: prefix-affinity}\n")
    sims = fleet(make_cluster, router, 3, "--zero-latency")
    with router.openai() as client:
        for conversation in range(3):
            messages: list[Any] = [
                {"role": "system", "content": f"Conversation {conversation}. {SYSTEM}"}
            ]
            before = [served(s) for s in sims]
            for turn in range(4):
                messages.append({"role": "user", "content": f"question {turn}"})
                reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
                messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            grew = [served(s) - b for s, b in zip(sims, before, strict=True)]
            # Every turn went to the engine that was sent the conversation's first turn.
            assert sorted(grew) == [0.0, 0.0, 4.0], grew
    hits = [metric(s.metrics(), "vllm:prefix_cache_hits_total") or 0.0 for s in sims]
    assert sum(hits) > 0
    assert (metric(router.metrics(), "hivenet_prefix_index_blocks", model=MODEL) or 0) > 0


def test_breaker_opens_on_a_failing_agent_and_closes_after_it_recovers(
    make_cluster: Cluster, tmp_path: Path
) -> None:
    router = routed(
        make_cluster,
        tmp_path,
        "routing_policy: {strategy: round-robin}\n"
        "circuit_breaker: {consecutive_failures: 3, open_seconds: 1, half_open_probes: 1}\n",
    )
    _, bad = fleet(make_cluster, router, 2, "--zero-latency")
    bad.set_faults(error_rate=1.0)
    with router.openai() as client:
        for _ in range(12):  # every one answered: failures are retried on the good agent
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
    assert served(bad) == 3.0  # the breaker opened at the third failure; nothing more went
    entry = table(router)["agent1"]
    assert entry["breaker"]["state"] == "open" and entry["breaker"]["opened_after"] == 3
    text = router.metrics()
    assert metric(text, "hivenet_circuit_breaker_state", kind="agent", target=entry["peer_id"]) == 2
    bad.set_faults(error_rate=0.0)
    time.sleep(1.2)  # open_seconds: the next request may probe it
    with router.openai() as client:
        for _ in range(4):
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
    assert table(router)["agent1"]["breaker"]["state"] == "closed"
    assert served(bad) > 3.0


def test_an_open_breaker_on_every_agent_says_so(make_cluster: Cluster, tmp_path: Path) -> None:
    router = routed(
        make_cluster,
        tmp_path,
        "routing_policy: {strategy: least-loaded}\n"
        "circuit_breaker: {consecutive_failures: 2, open_seconds: 30}\n",
    )
    (sim,) = fleet(make_cluster, router, 1, "--zero-latency", "--fault-error-rate", "1")
    for _ in range(2):
        reply = httpx.post(
            router.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            timeout=10,
        )
        assert reply.status_code == 503
    reply = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        timeout=10,
    )
    assert reply.status_code == 503
    error = reply.json()["error"]
    assert error["code"] == "no_agents_available" and "circuit breaker" in error["message"]
    assert int(reply.headers["retry-after"]) >= 1
    assert served(sim) == 2.0


async def test_adaptive_concurrency_holds_a_slowing_engine_below_its_capacity(
    make_cluster: Cluster, tmp_path: Path
) -> None:
    router = routed(
        make_cluster,
        tmp_path,
        "routing_policy: {strategy: least-loaded}\n"
        "adaptive_concurrency: {enabled: true, initial_limit: 16, alpha: 1, beta: 2}\n",
    )
    # Two sequences at once, each slowing the other: queueing shows as latency.
    sim = make_cluster.sim(
        MODEL, "--ttft-base", "20ms", "--itl", "5ms", "--max-num-seqs", "2", name="sim0"
    )
    make_cluster.agent(router, sim, "--capacity", "16", "--machine", "agent0", name="agent0")
    wait_registered(router, MODEL)
    async with openai.AsyncOpenAI(
        base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=60
    ) as client:

        async def one() -> None:
            # Streams: the limit follows their time to the first chunk.
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                stream=True,
            )
            async for _ in stream:
                pass

        for _ in range(4):
            await asyncio.gather(*(one() for _ in range(16)))
    entry = table(router)["agent0"]
    assert entry["capacity"] == 16
    assert entry["limit"] < 16, entry["adaptive_concurrency"]
    assert entry["adaptive_concurrency"]["min_latency"] is not None
    limit = metric(router.metrics(), "hivenet_agent_concurrency_limit", peer_id=entry["peer_id"])
    assert limit == entry["limit"]


async def test_fair_queue_serves_a_quiet_tenant_before_a_bursting_ones_backlog(
    make_cluster: Cluster, tmp_path: Path
) -> None:
    keys = {"tenant-a": "sk-hivenet-tenant-a-key", "tenant-b": "sk-hivenet-tenant-b-key"}
    auth = tmp_path / "auth.yaml"
    auth.write_text(
        "api:\n  mode: api-key\n  keys:\n"
        + "".join(
            f'    - key_hash: "{hashlib.sha256(key.encode()).hexdigest()}"\n'
            f"      metadata: {{name: {owner}, owner: {owner}}}\n"
            for owner, key in keys.items()
        )
        + "admin:\n  mode: api-key\n"
    )
    router = make_cluster.router("--auth-config-file", str(auth))
    sim = make_cluster.sim(MODEL, "--ttft-base", "300ms", name="sim0")
    make_cluster.agent(router, sim, "--capacity", "1", name="agent0")
    wait_until(lambda: metric(router.metrics(), "hivenet_routing_agent_healthy") == 1.0)
    finished: list[str] = []
    clients = {
        owner: openai.AsyncOpenAI(
            base_url=router.url + "/v1", api_key=key, max_retries=0, timeout=60
        )
        for owner, key in keys.items()
    }

    async def send(owner: str) -> None:
        await clients[owner].chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        finished.append(owner)

    async def queued() -> float:
        async with httpx.AsyncClient(timeout=5) as http:
            text = (await http.get(f"http://127.0.0.1:{router.metrics_port}/metrics")).text
        return metric(text, "hivenet_queue_depth", model=MODEL) or 0.0

    burst = [asyncio.create_task(send("tenant-a")) for _ in range(8)]
    for _ in range(100):  # until tenant A's backlog waits behind the one slot
        if await queued() >= 6:
            break
        await asyncio.sleep(0.05)
    ahead = len(finished)
    quiet = asyncio.create_task(send("tenant-b"))
    await asyncio.gather(*burst, quiet)
    for client in clients.values():
        await client.close()
    # FIFO would serve B after all of A's backlog; fair queueing serves it after the
    # request in service and at most one more of A's.
    assert finished.index("tenant-b") <= ahead + 2, (ahead, finished)


def test_a_reload_with_a_bad_scorer_is_refused_naming_the_field(
    make_cluster: Cluster, tmp_path: Path
) -> None:
    router = routed(make_cluster, tmp_path, "routing_policy: {strategy: scored}\n")
    reply = httpx.put(
        router.url + "/admin/policy",
        headers=ADMIN,
        content="routing_policy:\n  strategy: scored\n  scoring:\n    weights: {speed: 1}\n",
        timeout=5,
    )
    assert reply.status_code == 400
    assert "scoring.weights.speed: unknown scorer" in reply.text
