"""One agent, several routers (--routers): a session with each, one engine behind them all,
and every router ranking the agent by its load from all of them. Real processes; the
routers are standalone (no site store), each with its own --router-id and an advertised
address, so each hands the agent a list naming itself."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx2 as httpx

from tests.procs import (
    ADMIN_KEY,
    Cluster,
    Proc,
    Router,
    free_port,
    metric,
    wait_registered,
    wait_until,
)

MODEL = "m"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def ports(tmp: Path) -> Router:
    """Free ports chosen before the router starts: it advertises its own gRPC port."""
    unused = Proc("unused", [], tmp / "unused.log")
    return Router(unused, free_port(), free_port(), free_port(), free_port())


def site_router(cluster: Cluster, name: str, at: Router | None = None) -> Router:
    at = at or ports(cluster.tmp)
    return cluster.router(
        "--router-id",
        name,
        "--advertise-grpc-addr",
        f"127.0.0.1:{at.grpc}",
        name=name,
        ports=at,
    )


def chat(router: Router, content: str = "hi") -> str:
    with router.openai() as client:
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=3
        )
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    return reply.choices[0].message.content or ""


def agents_of(router: Router) -> dict[str, dict[str, Any]]:
    table = httpx.get(router.url + "/admin/routing-table", headers=ADMIN, timeout=5).json()
    return {agent["peer_id"]: agent for agent in table["agents"]}


def test_an_agent_serves_every_router_and_outlives_any_of_them(make_cluster: Cluster) -> None:
    r1, r2 = site_router(make_cluster, "r1"), site_router(make_cluster, "r2")
    sim = make_cluster.sim(MODEL, "--zero-latency")
    # r1 by another name than the address it advertises: the agent must recognise it by
    # its router ID in the list r1 hands out, and open no second session.
    agent = make_cluster.agent(r1, sim, "--routers", f"localhost:{r1.grpc}, 127.0.0.1:{r2.grpc}")
    wait_registered(r1, MODEL)
    wait_registered(r2, MODEL)
    assert MODEL in r1.models() and MODEL in r2.models()
    assert chat(r1) and chat(r2)
    time.sleep(1.0)  # a few heartbeats, each with its list of routers
    assert len(agents_of(r1)) == 1 and len(agents_of(r2)) == 1
    for router in (r1, r2):
        assert "replaced by a new connection" not in router.proc.log()
        assert metric(router.metrics(), "hivenet_agent_disconnections_total", model=MODEL) == 0
    assert "found through the site" not in agent.log()

    # r2 goes away: r1 keeps serving and the agent keeps running.
    r2.proc.stop()
    for _ in range(3):
        assert chat(r1)
    time.sleep(1.0)
    assert agent.alive and chat(r1)

    # r2 comes back on the same ports: the agent is back on it within a few heartbeats.
    again = site_router(make_cluster, "r2", at=r2)
    wait_registered(again, MODEL, timeout=5)
    assert chat(again) and chat(r1)
    # r2's session came back; r1's never broke through all this.
    wait_until(lambda: agent.log().count("registered with router r2 (127.0.0.1:") >= 2)
    assert agent.log().count("registered with router r1 (localhost:") == 1


def test_an_unreachable_router_in_the_list_does_not_stop_the_others(
    make_cluster: Cluster,
) -> None:
    r1 = site_router(make_cluster, "r1")
    sim = make_cluster.sim(MODEL, "--zero-latency")
    nowhere = free_port()  # nothing listens there
    agent = make_cluster.agent(r1, sim, "--routers", f"127.0.0.1:{nowhere},127.0.0.1:{r1.grpc}")
    wait_registered(r1, MODEL)
    assert chat(r1)
    time.sleep(2.0)  # about ten attempts at the unreachable one (--reconnect-delay 200ms)
    assert agent.alive and chat(r1)
    log = agent.log()
    # Retried all along, logged once for the whole outage.
    assert log.count(f"router 127.0.0.1:{nowhere} unreachable") == 1, log


def test_every_router_ranks_the_agent_by_its_load_from_all_routers(
    make_cluster: Cluster,
) -> None:
    r1, r2 = site_router(make_cluster, "r1"), site_router(make_cluster, "r2")
    sims = [make_cluster.sim(MODEL, "--itl", "50ms", name=f"sim{i}") for i in range(2)]
    routers = f"127.0.0.1:{r1.grpc},127.0.0.1:{r2.grpc}"
    for i, sim in enumerate(sims):
        make_cluster.agent(r1, sim, "--routers", routers, "--capacity", "1", name=f"agent{i}")
    wait_registered(r1, MODEL, replicas=2)
    wait_registered(r2, MODEL, replicas=2)

    # A long stream through r1 takes one agent's only slot.
    streaming = threading.Event()
    stop = threading.Event()

    def stream() -> None:
        with r1.openai() as client:
            chunks = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Tell a long story."}],
                max_tokens=400,
                stream=True,
            )
            for _chunk in chunks:
                streaming.set()
                if stop.is_set():
                    break
            chunks.close()

    worker = threading.Thread(target=stream)
    worker.start()
    try:
        assert streaming.wait(10)
        busy = next(peer for peer, agent in agents_of(r1).items() if agent["active_requests"])
        # r2 holds nothing on that agent, yet sees it busy: the agent reported its total.
        wait_until(lambda: agents_of(r2)[busy]["active_requests"] == 1, timeout=5)
        idle = next(peer for peer in agents_of(r2) if peer != busy)
        for i in range(4):
            assert chat(r2, f"question {i}")
        served = {peer: agent["history"]["successes"] for peer, agent in agents_of(r2).items()}
        # Full at its capacity of one, the busy agent was passed over every time.
        assert served == {busy: 0, idle: 4}
    finally:
        stop.set()
        worker.join(15)
    # Once the stream ends, every router hears at once that the agent is free again.
    wait_until(lambda: agents_of(r2)[busy]["active_requests"] == 0, timeout=3)
