"""Agents tell every router of a site which prompt-prefix blocks their engines hold: real
routers, agents and simulators on loopback. Where each request went is read from the
simulators' counts; what a router knows, from its metrics."""

from __future__ import annotations

from typing import Any

import httpx2 as httpx

from tests.ports import free_port
from tests.procs import Cluster, Proc, Router, Sim, metric, wait_registered, wait_until

MODEL = "m"
SYSTEM = "You are a patient tutor of marine biology; explain with care and examples. " * 26


def site_router(cluster: Cluster, name: str, policy: str) -> Router:
    path = cluster.tmp / f"{name}.yaml"
    path.write_text(policy)
    unused = Proc("unused", [], cluster.tmp / "unused.log")
    at = Router(unused, free_port(), free_port(), free_port(), free_port())
    return cluster.router(
        "--router-id",
        name,
        "--advertise-grpc-addr",
        f"127.0.0.1:{at.grpc}",
        "--policy-file",
        str(path),
        name=name,
        ports=at,
    )


def served(sim: Sim) -> float:
    value = metric(sim.metrics(), "hivenet_sim_requests_total")
    assert value is not None
    return value


def where(sims: dict[str, Sim], router: Router, messages: list[Any]) -> str:
    """The one simulator a chat turn through `router` reached; the answer joins `messages`."""
    before = {name: served(sim) for name, sim in sims.items()}
    with router.openai() as client:
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    reached = [name for name, sim in sims.items() if served(sim) > before[name]]
    assert len(reached) == 1, reached
    return reached[0]


def blocks(router: Router) -> float:
    return metric(router.metrics(), "hivenet_prefix_index_blocks", model=MODEL) or 0.0


def test_two_routers_of_a_site_keep_a_conversation_on_one_engine(
    make_cluster: Cluster,
) -> None:
    policy = "routing_policy: {strategy: prefix-affinity}\n"
    r1, r2 = site_router(make_cluster, "r1", policy), site_router(make_cluster, "r2", policy)
    routers = f"127.0.0.1:{r1.grpc},127.0.0.1:{r2.grpc}"
    sims = {f"sim{i}": make_cluster.sim(MODEL, "--zero-latency", name=f"sim{i}") for i in range(3)}
    for name, sim in sims.items():
        make_cluster.agent(r1, sim, "--routers", routers, "--machine", name, name=f"a-{name}")
    for router in (r1, r2):
        wait_registered(router, MODEL, replicas=3)
    for conversation in range(3):
        messages: list[Any] = [{"role": "system", "content": f"{conversation}. {SYSTEM}"}]
        seen = set()
        for turn in range(4):
            router = (r1, r2)[turn % 2]
            other = (r2, r1)[turn % 2]
            # The turn before went through the other router: wait for its agent's report
            # to reach this one (each turn adds blocks: its question is a block long).
            wait_until(lambda r=router, o=other: blocks(r) >= blocks(o))
            question = f"Question {turn} of {conversation}: " + "why is the sea salty? " * 12
            messages.append({"role": "user", "content": question})
            seen.add(where(sims, router, messages))
        assert len(seen) == 1, seen


def test_an_eviction_reported_by_the_agent_moves_the_next_request(
    make_cluster: Cluster,
) -> None:
    # r1 routes over both engines; r2 only to the small one, whose cache (1,024 tokens:
    # sixteen 256-character blocks) a few long prompts fill.
    r1 = site_router(make_cluster, "r1", "routing_policy: {strategy: prefix-affinity}\n")
    r2 = site_router(
        make_cluster,
        "r2",
        "routing_policy: {strategy: prefix-affinity, match: {machine: small}}\n",
    )
    routers = f"127.0.0.1:{r1.grpc},127.0.0.1:{r2.grpc}"
    small = make_cluster.sim(MODEL, "--zero-latency", "--kv-cache-tokens", "1024", name="small")
    big = make_cluster.sim(MODEL, "--zero-latency", name="big")
    sims = {"small": small, "big": big}
    for name, sim in sims.items():
        make_cluster.agent(r1, sim, "--routers", routers, "--machine", name, name=f"a-{name}")
    for router in (r1, r2):
        wait_registered(router, MODEL, replicas=2)
    conversation: list[Any] = [
        {"role": "system", "content": SYSTEM[:2000]},
        {"role": "user", "content": "What is a coral?"},
    ]
    assert where(sims, r2, conversation) == "small"
    # r1 never sent it, yet knows from the small engine's agent where it is cached.
    wait_until(lambda: blocks(r1) > 0)
    conversation.append({"role": "user", "content": "And a sponge?"})
    assert where(sims, r1, conversation) == "small"
    assert 0 < blocks(r1) < 16
    # Other prompts through r2 fill the small engine's cache: the conversation is evicted,
    # and the agent says so to r1, whose index then holds the last prompt's 16 blocks.
    for n in range(2):
        flood = [{"role": "user", "content": f"{n} " + "Tell me about kelp forests. " * 200}]
        where(sims, r2, flood)
    wait_until(lambda: blocks(r1) == 16)
    conversation.append({"role": "user", "content": "And a sea urchin?"})
    # Held nowhere now: a fresh prompt, to the engine with the most room in its cache.
    assert where(sims, r1, conversation) == "big"
    # A router that restarts (it keeps no prefix index) is sent both whole pictures again.
    wait_until(lambda: blocks(r1) > 16)
    before = blocks(r1)
    r1.proc.stop()
    r1.proc.start()
    wait_registered(r1, MODEL, replicas=2)
    wait_until(lambda: blocks(r1) == before)


def test_an_eviction_in_the_engine_s_kv_events_moves_the_next_request(
    make_cluster: Cluster,
) -> None:
    """The small engine publishes vLLM-format KV events; its agent follows them. Its
    prefix cache reset (AllBlocksCleared) reaches the routers through the agent's report,
    and the conversation cached there goes elsewhere."""
    r1 = site_router(make_cluster, "r1", "routing_policy: {strategy: prefix-affinity}\n")
    r2 = site_router(
        make_cluster,
        "r2",
        "routing_policy: {strategy: prefix-affinity, match: {machine: small}}\n",
    )
    routers = f"127.0.0.1:{r1.grpc},127.0.0.1:{r2.grpc}"
    events = free_port()
    small = make_cluster.sim(
        MODEL,
        "--zero-latency",
        "--kv-cache-tokens",
        "1024",
        "--kv-events-port",
        str(events),
        name="small",
    )
    big = make_cluster.sim(MODEL, "--zero-latency", name="big")
    sims = {"small": small, "big": big}
    make_cluster.agent(
        r1,
        small,
        "--routers",
        routers,
        "--machine",
        "small",
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{events}",
        name="a-small",
    )
    make_cluster.agent(r1, big, "--routers", routers, "--machine", "big", name="a-big")
    for router in (r1, r2):
        wait_registered(router, MODEL, replicas=2)
    wait_until(lambda: "following the engine's KV-cache events" in make_agent_log(make_cluster))
    conversation: list[Any] = [
        {"role": "system", "content": SYSTEM[:2000]},
        {"role": "user", "content": "What is a coral?"},
    ]
    assert where(sims, r2, conversation) == "small"
    wait_until(lambda: blocks(r1) > 0)
    conversation.append({"role": "user", "content": "And a sponge?"})
    assert where(sims, r1, conversation) == "small"
    httpx.post(small.url + "/reset_prefix_cache", timeout=5).raise_for_status()
    # Held nowhere now (r1's own entries went too): to the engine with the most room.
    wait_until(lambda: blocks(r1) == 0)
    conversation.append({"role": "user", "content": "And a sea urchin?"})
    assert where(sims, r1, conversation) == "big"


def make_agent_log(cluster: Cluster) -> str:
    return (cluster.tmp / "a-small.log").read_text()
