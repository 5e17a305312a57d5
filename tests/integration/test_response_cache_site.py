"""The response cache across the routers of a site (--sync-store=valkey): a follower on
another router reads the leader's stream, a stored answer is a hit on every router, and a
malformed entry in the store is a miss and is replaced."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx2 as httpx
import orjson
import pytest
import valkey

from tests.procs import Cluster, Router, Sim, metric, sync_view, wait_until
from tests.valkey_site import ValkeySite, split_addr

MODEL = "m"
SITE = "cache-site"
BODY: dict[str, Any] = {
    "model": MODEL,
    "stream": True,
    "temperature": 0,
    "messages": [{"role": "user", "content": "across the site"}],
}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ValkeySite]:
    with ValkeySite(tmp_path / "valkey", replicas=0, sentinels=0) as site:
        yield site


def site_of(cluster: Cluster, tmp: Path, store: ValkeySite) -> tuple[list[Router], Sim]:
    policies = tmp / "policies"
    policies.mkdir()
    (policies / "m.yaml").write_text(
        "models: [m]\nrouting_policy: {strategy: least-loaded}\nresponse_cache: {}\n"
    )
    flags = [
        *("--policy-model-dir", str(policies)),
        *("--sync-store", "valkey", "--sync-addr", store.primary_addr),
        *("--sync-site", SITE, "--sync-interval", "250ms", "--sync-min-routers", "2"),
    ]
    routers = [cluster.router(*flags, "--router-id", f"r{i}", name=f"router{i}") for i in range(2)]
    sim = cluster.sim(MODEL, "--ttft-base", "500ms", "--itl", "20ms", "--output-tokens", "30")
    everyone = ",".join(f"127.0.0.1:{router.grpc}" for router in routers)
    cluster.agent(routers[0], sim, "--routers", everyone, "--capacity", "64")
    for router in routers:
        wait_until(lambda r=router: metric(r.metrics(), "hivenet_routing_agent_healthy") == 1.0)
        wait_until(lambda r=router: sync_view(r)["routers"] == ["r0", "r1"])
    return routers, sim


def engine_calls(sim: Sim) -> float:
    count = metric(sim.metrics(), "hivenet_sim_requests_total")
    assert count is not None
    return count


def stream(router: Router, body: dict[str, Any], go: threading.Event | None = None) -> bytes:
    got = bytearray()
    with httpx.stream(
        "POST", router.url + "/v1/chat/completions", content=orjson.dumps(body), timeout=20
    ) as reply:
        assert reply.status_code == 200
        for piece in reply.iter_raw():
            got += piece
            if go is not None:
                go.set()  # the leader's answer has begun: now the other router asks
    return bytes(got)


def audit_marks(router: Router) -> list[str]:
    assert router.audit is not None
    return [
        record.get("cache", "") for record in router.audit_records() if record["model"] == MODEL
    ]


def test_a_follower_on_another_router_gets_the_same_stream(
    make_cluster: Cluster, tmp_path: Path, store: ValkeySite
) -> None:
    (a, b), sim = site_of(make_cluster, tmp_path, store)
    before = engine_calls(sim)
    started = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        leader = pool.submit(stream, a, BODY, started)
        assert started.wait(timeout=10)
        follower = pool.submit(stream, b, BODY)
        led, followed = leader.result(timeout=20), follower.result(timeout=20)
    assert led == followed and led.endswith(b"data: [DONE]\n\n")
    assert engine_calls(sim) == before + 1
    wait_until(lambda: audit_marks(b) == ["dedup"])
    # Stored by the leader's router in the site store: a hit on the other.
    body = {**BODY, "stream": False, "messages": [{"role": "user", "content": "stored"}]}
    first = httpx.post(a.url + "/v1/chat/completions", content=orjson.dumps(body), timeout=20)
    assert first.headers["X-Hivenet-Cache"] == "miss"
    calls = engine_calls(sim)

    def replayed() -> bool:
        reply = httpx.post(b.url + "/v1/chat/completions", content=orjson.dumps(body), timeout=20)
        return reply.headers["X-Hivenet-Cache"] == "hit" and reply.content == first.content

    wait_until(replayed, timeout=5)  # the store write is off the request path
    assert engine_calls(sim) == calls


def test_a_malformed_entry_in_the_store_is_a_miss_and_deleted(
    make_cluster: Cluster, tmp_path: Path, store: ValkeySite
) -> None:
    (a, b), sim = site_of(make_cluster, tmp_path, store)
    body = {**BODY, "stream": False}
    raw = orjson.dumps(body)
    host, port = split_addr(store.primary_addr)
    with valkey.Valkey(host=host, port=port, socket_timeout=2) as client:  # bytes, not text
        # The entry's name is found in the store, not worked out here: the key is the body
        # as forwarded, which admission gave its output bound (docs/cache.md).
        first = httpx.post(a.url + "/v1/chat/completions", content=raw, timeout=20)
        assert first.headers["X-Hivenet-Cache"] == "miss"
        pattern = f"hivenet:{{{SITE}}}:cache:*"
        wait_until(lambda: len(client.keys(pattern)) == 1, timeout=5)
        (name,) = client.keys(pattern)
        client.set(name, "not msgpack at all", px=60_000)
        before = engine_calls(sim)
        reply = httpx.post(b.url + "/v1/chat/completions", content=raw, timeout=20)
        assert reply.status_code == 200 and reply.headers["X-Hivenet-Cache"] == "miss"
        assert engine_calls(sim) == before + 1
        # Deleted, then written again with the fresh answer.
        wait_until(lambda: client.get(name) not in (None, b"not msgpack at all"), timeout=5)
    again = httpx.post(a.url + "/v1/chat/completions", content=raw, timeout=20)
    # a keeps the answer it stored first in its own memory; the store holds b's
    assert again.headers["X-Hivenet-Cache"] == "hit"
    assert again.content in (first.content, reply.content)
