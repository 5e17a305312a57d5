"""The admin API's answers in the Go router's documented shapes, the registration stream, the
storage view, the metrics reset and policies written in memory, through real processes."""

from __future__ import annotations

import itertools
import json
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx2 as httpx
import pytest

from tests.procs import ADMIN_KEY, Cluster, Router, metric, wait_registered, wait_until

MODEL = "parity-model"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
STREAM = "/admin/registration-stream"
BASE = "routing_policy:\n  strategy: least-loaded\n"

Event = dict[str, Any]


class Events:
    """An open registration stream, read line by line; every wait is bounded."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self._lines = response.iter_lines()

    def until(self, wanted: Callable[[Event], bool], timeout: float = 20.0) -> Event:
        deadline = time.monotonic() + timeout
        seen: list[Event] = []
        while time.monotonic() < deadline:
            line = next(self._lines)  # the read timeout bounds one wait (keepalives come at 25s)
            if line.startswith("data: "):
                event: Event = json.loads(line[6:])
                if wanted(event):
                    return event
                seen.append(event)
        raise AssertionError(f"no such event within {timeout}s; saw {seen}")


@contextmanager
def events(router: Router) -> Iterator[Events]:
    timeout = httpx.Timeout(5.0, read=30.0)
    with httpx.stream("GET", router.url + STREAM, headers=ADMIN, timeout=timeout) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream"
        yield Events(response)


def admin(router: Router, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, router.url + path, headers=ADMIN, timeout=10, **kwargs)


def subscribers(router: Router) -> int:
    return int(admin(router, "GET", "/admin/health").json()["registration_stream"]["subscribers"])


def peers(router: Router) -> dict[str, dict[str, Any]]:
    table = admin(router, "GET", "/admin/routing-table").json()
    return {agent["peer_id"]: agent for agent in table["agents"]}


def chat(router: Router) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    reply = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=10)
    assert reply.status_code == 200, reply.text


@pytest.fixture
def fleet(make_cluster: Cluster) -> tuple[Cluster, Router]:
    router = make_cluster.router("--universal-flush-interval", "200ms")
    sim = make_cluster.sim(MODEL, "--zero-latency")
    make_cluster.agent(
        router, sim, "--deployment-id", "deploy-42", "--replica-id", "replica-3", "--region", "EU"
    )
    wait_registered(router, MODEL)
    return make_cluster, router


def test_the_stream_follows_a_real_agent_and_leaves_nothing_behind(
    make_cluster: Cluster,
) -> None:
    router = make_cluster.router()
    sim = make_cluster.sim(MODEL, "--zero-latency")
    with events(router) as stream:
        assert subscribers(router) == 1
        agent = make_cluster.agent(
            router, sim, "--deployment-id", "deploy-42", "--replica-id", "replica-3"
        )
        joined = stream.until(lambda e: e["event_type"] == "registered")
        assert joined["deployment_id"] == "deploy-42" and joined["replica_id"] == "replica-3"
        assert joined["model"] == MODEL and joined["timestamp"].endswith("Z")
        peer = joined["agent_id"]
        assert peer in peers(router)
        admin(router, "POST", f"/admin/agents/{peer}/drain").raise_for_status()
        stream.until(lambda e: e["event_type"] == "drained" and e["agent_id"] == peer)
        agent.kill()
        stream.until(lambda e: e["event_type"] == "disconnected" and e["agent_id"] == peer)
        # --remove-after 5s of silence, then it is gone from the registry
        stream.until(lambda e: e["event_type"] == "unregistered" and e["agent_id"] == peer)
    # The client hung up: its subscription went with it.
    wait_until(lambda: subscribers(router) == 0, timeout=10)


def _stuck_subscriber(router: Router) -> socket.socket:
    """A client that asks for the stream and never reads it; small buffers, so the
    router's socket backs up after a few hundred events instead of a few megabytes."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.settimeout(5)
    sock.connect(("127.0.0.1", router.http))
    sock.sendall(
        f"GET {STREAM} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN_KEY}\r\n\r\n".encode()
    )
    return sock


def test_a_subscriber_that_stops_reading_is_dropped(fleet: tuple[Cluster, Router]) -> None:
    _, router = fleet
    peer = next(iter(peers(router)))
    sock = _stuck_subscriber(router)
    try:
        wait_until(lambda: subscribers(router) == 1, timeout=10)
        dropped = 0
        with httpx.Client(base_url=router.url, headers=ADMIN, timeout=5) as client:
            # Each drain or undrain is one event. Bounded: far more than the buffers hold.
            for n in range(6000):
                action = "drain" if n % 2 == 0 else "undrain"
                assert client.post(f"/admin/agents/{peer}/{action}").status_code == 200
                if n % 100 == 99:
                    stream = client.get("/admin/health").json()["registration_stream"]
                    dropped = stream["dropped"]
                    if dropped:
                        break
            client.post(f"/admin/agents/{peer}/undrain").raise_for_status()
        assert dropped == 1
        assert subscribers(router) == 0
        chat(router)  # the router kept answering throughout, and still does
    finally:
        sock.close()
    assert "registration stream: a subscriber fell 256 events behind" in router.proc.log()


def test_health_routing_table_and_models_shapes(fleet: tuple[Cluster, Router]) -> None:
    _, router = fleet
    chat(router)
    health = admin(router, "GET", "/admin/health").json()
    assert health["status"] == "healthy" and isinstance(health["timestamp"], int)
    assert health["total_agents"] == 1 and health["healthy_agents"] == 1
    assert health["queue_length"] == 0 and health["eligible_agents"] == 1
    (agent,) = health["agents"]
    assert set(agent) == {
        "peer_id",
        "model",
        "engine",
        "version",
        "capacity",
        "region",
        "is_healthy",
        "last_seen",
    }
    assert agent["model"] == MODEL and agent["region"] == "EU" and agent["is_healthy"] is True
    assert MODEL in health["models"] and "queue" in health and "uptime_seconds" in health

    table = admin(router, "GET", "/admin/routing-table").json()
    assert table["total"] == 1
    (row,) = table["agents"]
    assert row["metadata"]["model"] == MODEL and row["metadata"]["deployment_id"] == "deploy-42"
    status = row["status"]
    assert status["healthy"] is True and status["backend_healthy"] is True
    assert status["active_requests"] == 0 and status["last_seen"].endswith("Z")
    universal = row["universal"]
    assert universal["successful_requests_total"] == 1 and universal["success_rate"] == 1.0
    assert universal["latency_state"] == "KNOWN" and universal["srtt_ms"] is not None
    for field in ("rejected_requests_total", "disconnections_total", "backend_failures_total"):
        assert universal[field] == 0
    assert row["history"]["successes"] == 1 and row["health"]["eligible"] is True  # kept

    listing = admin(router, "GET", "/admin/models").json()
    assert listing["object"] == "list"
    (model,) = listing["data"]
    assert model["id"] == MODEL and model["capability"] == "llm"
    assert model["agents"] == {
        "total": 1,
        "healthy": 1,
        "total_capacity": row["metadata"]["capacity"],
        "engines": [row["metadata"]["engine"]],
        "regions": ["EU"],
    }
    assert listing[MODEL][0]["peer_id"] == row["peer_id"]  # the earlier shape, kept

    detail = admin(router, "GET", f"/admin/models/{MODEL}").json()
    (entry,) = detail["agents"]["list"]
    assert entry["peer_id"] == row["peer_id"] and entry["is_healthy"] is True
    assert detail["policy"] == "built-in"
    assert detail["routing_table"][0]["peer_id"] == row["peer_id"]  # the full rows, kept
    assert admin(router, "GET", "/admin/models/nope").status_code == 404


def test_metrics_reset_clears_live_and_persisted_history(fleet: tuple[Cluster, Router]) -> None:
    cluster, router = fleet
    sim = cluster.sim(MODEL, "--zero-latency", name="sim-b")
    second = cluster.agent(router, sim, name="agent-b")
    wait_registered(router, MODEL, replicas=2)
    # Two at once, so the second goes to the agent the first left idle (one at a time
    # would stay on the agent chosen last).
    with ThreadPoolExecutor(2) as pool:
        for _ in range(20):  # bounded: until both agents have answered
            list(pool.map(lambda _: chat(router), range(2)))
            if all(a["universal"]["successful_requests_total"] for a in peers(router).values()):
                break
    table = peers(router)
    assert all(a["universal"]["successful_requests_total"] for a in table.values())
    gone = next(p for p, a in table.items() if a["metadata"]["replica_id"] != "replica-3")
    live = next(p for p in table if p != gone)
    # One agent leaves: its history is now only on disk.
    second.kill()
    admin(router, "DELETE", f"/admin/agents/{gone}").raise_for_status()
    wait_until(
        lambda: admin(router, "GET", "/admin/storage").json()["disk_db"]["univ_history_count"] == 2
    )
    text = router.metrics()
    assert (metric(text, "hivenet_agent_requests_success_total", peer_id=live) or 0) >= 1

    reply = admin(router, "POST", "/admin/metrics/reset")
    assert reply.status_code == 200 and reply.json()["status"] == "metrics reset"
    universal = peers(router)[live]["universal"]
    assert universal["successful_requests_total"] == 0 and universal["input_tokens_total"] == 0
    assert universal["srtt_ms"] is None and universal["latency_state"] == "UNKNOWN"
    assert metric(router.metrics(), "hivenet_agent_requests_success_total", peer_id=live) == 0
    # The agent that left comes back under the same peer ID: nothing of it was kept.
    cluster.agent(router, sim, name="agent-b")
    wait_until(lambda: gone in peers(router))
    first = peers(router)[gone]["status"]["last_seen"]
    # A later heartbeat means its registration, history restore included, is done.
    wait_until(lambda: peers(router)[gone]["status"]["last_seen"] != first)
    universal = peers(router)[gone]["universal"]
    assert universal["successful_requests_total"] == 0 and universal["disconnections_total"] == 0
    assert f"agent {gone} resumes its history" not in router.proc.log()


def test_storage_shape(fleet: tuple[Cluster, Router]) -> None:
    _, router = fleet
    wait_until(
        lambda: admin(router, "GET", "/admin/storage").json()["disk_db"]["univ_history_count"] == 1
    )
    storage = admin(router, "GET", "/admin/storage").json()
    assert storage["mem_db"]["metadata_count"] == 1
    assert storage["mem_db"]["univ_punctual_count"] == 1
    disk = storage["disk_db"]
    assert disk["backend"] == "sqlite" and disk["entry_ttl_days"] == 30
    assert disk["db_size_bytes"] > 0 and disk["path"].endswith("hivenet.sqlite3")
    assert storage["gc_interval"] == "200ms" and storage["last_gc_at"].endswith("Z")


def _error(reply: httpx.Response) -> str:
    message: str = reply.json()["error"]["message"]
    return message


def test_policies_written_in_memory(fleet: tuple[Cluster, Router]) -> None:
    _, router = fleet
    put = admin(router, "PUT", "/admin/policy", content=BASE + "  max_tries: 2\n")
    assert put.status_code == 200 and put.json()["status"] == "policy updated"
    current = admin(router, "GET", "/admin/policy").json()
    assert current["routing_policy"]["max_tries"] == 2 and "admin API" in current["source"]
    # Invalid documents: 400, naming the field; nothing changes.
    for text, field in (
        (BASE + "  exclude_if:\n    sucess_rate: {lt: 0.5}\n", "routing_policy.exclude_if.sucess"),
        ("routing_polcy: {strategy: least-loaded}\n", "policy.routing_polcy"),
        ("routing_policy: {strategy: fastest}\n", "routing_policy.strategy"),
        ("routing_policy: [\n", "not valid YAML"),
    ):
        reply = admin(router, "PUT", "/admin/policy", content=text)
        assert reply.status_code == 400 and field in _error(reply), reply.text
    too_big = admin(router, "PUT", "/admin/policy", content=b"#" * ((1 << 20) + 1))
    assert too_big.status_code == 413
    # A dry run changes nothing, however it is spelt; a value that is neither true nor
    # false is refused, not read as false (which applied the document).
    other = BASE + "  max_tries: 3\n"
    for flag in ("true", "1", "TRUE", ""):
        dry = admin(router, "PUT", f"/admin/policy?dry_run={flag}", content=other)
        assert dry.status_code == 200 and dry.json()["status"] == "policy valid", flag
    for flag in ("yes", "on", "maybe"):
        for path in ("/admin/policy", "/admin/policy/models/gpt"):
            refused = admin(router, "PUT", f"{path}?dry_run={flag}", content=other)
            assert refused.status_code == 400, (path, flag, refused.text)
            assert refused.json()["error"]["param"] == "dry_run"
    assert admin(router, "GET", "/admin/policy").json() == current
    assert admin(router, "GET", "/admin/policy/models").json() == {}
    # Every write meant to apply is a reload the metric counts, as the reference counts it
    # (found by an operator of the Go router: a failed push never reached the alert); a
    # dry run is none.
    page = router.metrics()
    assert metric(page, "hivenet_policy_reload_total", trigger="api", result="success") == 1.0
    assert metric(page, "hivenet_policy_reload_total", trigger="api", result="error") == 5.0

    # Named policies.
    named = "models: [" + MODEL + "]\n" + BASE + "  max_tries: 1\n"
    put = admin(router, "PUT", "/admin/policy/models/gpt", content=named)
    assert put.json() == {"status": "policy updated", "name": "gpt", "models": [MODEL]}
    assert admin(router, "GET", "/admin/policy/models").json() == {"gpt": [MODEL]}
    assert admin(router, "GET", f"/admin/models/{MODEL}").json()["policy"] == "gpt"
    chat(router)  # routed under it
    clash = admin(router, "PUT", "/admin/policy/models/other", content=named)
    assert clash.status_code == 409 and "already claimed by policy gpt" in clash.json()["error"]
    bare = admin(router, "PUT", "/admin/policy/models/other", content=BASE)
    assert bare.status_code == 400 and "models" in _error(bare)
    for _ in range(2):  # deleting is idempotent
        gone = admin(router, "DELETE", "/admin/policy/models/gpt")
        assert gone.json() == {"status": "policy deleted", "name": "gpt"}
    assert admin(router, "GET", "/admin/policy/models/gpt").status_code == 404
    assert admin(router, "GET", f"/admin/models/{MODEL}").json()["policy"] != "gpt"
    # A reload rebuilds from the files: the written global policy goes too.
    admin(router, "POST", "/admin/reload").raise_for_status()
    assert admin(router, "GET", "/admin/policy").json()["name"] == "built-in"


def test_shutdown_ends_open_streams_at_once(make_cluster: Cluster) -> None:
    router = make_cluster.router("--shutdown-grace", "30s")
    with events(router) as stream:
        started = time.monotonic()
        router.proc.stop(timeout=20)  # SIGTERM
        lines = list(itertools.islice(stream.response.iter_lines(), 1000))  # ends with the stream
    assert ": the router is shutting down" in lines
    assert time.monotonic() - started < 10  # not held for the whole grace
