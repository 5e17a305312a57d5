"""The response cache and in-flight deduplication through real processes: a burst of
identical streams reaches the engine once and every client gets the same bytes; finished
answers are replayed; tenants, sampling, Cache-Control and errors are kept apart."""

from __future__ import annotations

import hashlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx2 as httpx
import orjson

from tests.procs import Cluster, Router, Sim, metric, wait_until

MODEL = "m"
KEYS = {"sk-cache-acme-0123456789": "acme", "sk-cache-other-0123456789": "other"}
ACME, OTHER = KEYS
BODY: dict[str, Any] = {
    "model": MODEL,
    "stream": True,
    "temperature": 0,
    "messages": [{"role": "user", "content": "tell me something"}],
}
SLOW = ("--ttft-base", "500ms", "--itl", "20ms", "--output-tokens", "30")


def start(cluster: Cluster, tmp: Path, block: str, *sim_flags: str) -> tuple[Router, Sim]:
    """A router whose policy for m has `response_cache: <block>`, two tenants' keys, and
    one simulator behind an agent."""
    policies = tmp / "policies"
    policies.mkdir()
    (policies / "m.yaml").write_text(
        f"models: [m]\nrouting_policy: {{strategy: least-loaded}}\nresponse_cache: {block}\n"
    )
    auth = tmp / "auth.yaml"
    entries = "".join(
        f'    - key_hash: "{hashlib.sha256(key.encode()).hexdigest()}"\n'
        f"      metadata: {{name: {owner}-key, owner: {owner}}}\n"
        for key, owner in KEYS.items()
    )
    auth.write_text(f"api:\n  mode: api-key\n  keys:\n{entries}admin:\n  mode: api-key\n")
    router = cluster.router("--policy-model-dir", str(policies), "--auth-config-file", str(auth))
    sim = cluster.sim(MODEL, *(sim_flags or ("--zero-latency",)))
    cluster.agent(router, sim)
    wait_until(lambda: metric(router.metrics(), "hivenet_routing_agent_healthy") == 1.0)
    return router, sim


def engine_calls(sim: Sim) -> float:
    count = metric(sim.metrics(), "hivenet_sim_requests_total")
    assert count is not None
    return count


def post(
    router: Router,
    body: dict[str, Any] | None = None,
    key: str = ACME,
    control: str = "",
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    if control:
        headers["Cache-Control"] = control
    return httpx.post(
        router.url + "/v1/chat/completions",
        content=orjson.dumps(body or BODY),
        headers=headers,
        timeout=20,
    )


def stream_raw(router: Router, start: threading.Barrier, how: str = "read") -> bytes:
    """One streamed request's raw bytes; `slow` reads with pauses, `leave` hangs up after
    the first piece."""
    start.wait(timeout=10)
    got = bytearray()
    with httpx.stream(
        "POST",
        router.url + "/v1/chat/completions",
        content=orjson.dumps(BODY),
        headers={"Authorization": f"Bearer {ACME}", "Content-Type": "application/json"},
        timeout=20,
    ) as reply:
        assert reply.status_code == 200
        for piece in reply.iter_raw():
            got += piece
            if how == "leave":
                break
            if how == "slow":
                time.sleep(0.05)
    return bytes(got)


def audit(router: Router) -> list[dict[str, Any]]:
    assert router.audit is not None
    return router.audit_records()


def test_a_burst_of_identical_streams_reaches_the_engine_once(
    make_cluster: Cluster, tmp_path: Path
) -> None:
    router, sim = start(make_cluster, tmp_path, "{}", *SLOW)
    before = engine_calls(sim)
    hows = ["slow", "leave", *["read"] * 48]
    barrier = threading.Barrier(len(hows))
    with ThreadPoolExecutor(len(hows)) as pool:
        streams = list(pool.map(lambda how: stream_raw(router, barrier, how), hows))
    assert engine_calls(sim) == before + 1
    whole = streams[2]
    assert whole.endswith(b"data: [DONE]\n\n") and whole.count(b"data: ") > 30
    assert all(s == whole for s in streams[2:]) and streams[0] == whole  # the slow one too
    # The client that hangs up after its first piece got a prefix. On a loaded machine it
    # can connect after the answer was whole (stored, or buffered for a late follower), and
    # then its first piece is the whole answer; either way the others above were unharmed.
    assert whole.startswith(streams[1]) and len(streams[1]) > 0
    wait_until(lambda: len(audit(router)) == 50)
    marks = sorted(record.get("cache", "") for record in audit(router))
    # One leader; the rest joined its call, or (a thread the loaded machine started late)
    # found the answer already stored: either way the engine was called once (above).
    assert marks[0] == "" and set(marks[1:]) <= {"dedup", "hit"}
    assert marks.count("dedup") >= 25
    assert metric(router.metrics(), "hivenet_router_active_forwards") == 0.0
    # Finished and stored: the next identical request is answered without the engine.
    assert stream_raw(router, threading.Barrier(1)) == whole
    assert engine_calls(sim) == before + 1


def test_a_finished_answer_is_replayed_and_marked(make_cluster: Cluster, tmp_path: Path) -> None:
    router, sim = start(make_cluster, tmp_path, "{bill_hits: false}")
    body = {**BODY, "stream": False}
    first = post(router, body)
    assert first.status_code == 200 and first.headers["X-Hivenet-Cache"] == "miss"
    spaced = b' {"messages": [{"content": "tell me something", "role": "user"}],\n'
    spaced += b'  "temperature": 0, "stream": false, "model": "m"} '
    again = httpx.post(
        router.url + "/v1/chat/completions",
        content=spaced,
        headers={"Authorization": f"Bearer {ACME}", "Content-Type": "application/json"},
        timeout=20,
    )
    assert again.status_code == 200 and again.content == first.content
    assert again.headers["X-Hivenet-Cache"] == "hit" and "Age" in again.headers
    assert engine_calls(sim) == 1
    wait_until(lambda: len(audit(router)) == 2)
    hit = audit(router)[1]
    assert hit["cache"] == "hit" and hit["billed"] is False and hit["agent_id"] == "cache"
    assert hit["output_tokens"] > 0  # usage is still reported, per client
    # The tenant's token series count the hit as its audit record does (they left out
    # every answer no engine call made for the request, found by a new user).
    text = router.metrics()
    for side in ("input", "output"):
        counted = metric(text, f"hivenet_tenant_{side}_tokens_total", tenant_id="acme")
        assert counted == sum(record[f"{side}_tokens"] for record in audit(router)), side


def test_tenants_sampling_and_cache_control(make_cluster: Cluster, tmp_path: Path) -> None:
    router, sim = start(make_cluster, tmp_path, "{}")
    assert post(router).status_code == 200
    assert post(router, key=OTHER).headers["X-Hivenet-Cache"] == "miss"  # another tenant
    assert post(router, key=OTHER).headers["X-Hivenet-Cache"] == "hit"
    assert engine_calls(sim) == 2
    hot = {**BODY, "temperature": 0.7}
    for _ in range(2):
        assert "X-Hivenet-Cache" not in post(router, hot).headers
    assert engine_calls(sim) == 4
    for _ in range(2):
        assert "X-Hivenet-Cache" not in post(router, control="no-store").headers
    assert engine_calls(sim) == 6
    fresh = post(router, control="no-cache")
    assert fresh.headers["X-Hivenet-Cache"] == "miss" and engine_calls(sim) == 7
    assert post(router).headers["X-Hivenet-Cache"] == "hit" and engine_calls(sim) == 7


def test_a_shared_cache_serves_every_tenant(make_cluster: Cluster, tmp_path: Path) -> None:
    router, sim = start(make_cluster, tmp_path, "{shared: true}")
    assert post(router).headers["X-Hivenet-Cache"] == "miss"
    assert post(router, key=OTHER).headers["X-Hivenet-Cache"] == "hit"
    assert engine_calls(sim) == 1


def test_an_engine_error_is_shared_with_followers_and_not_stored(
    make_cluster: Cluster, tmp_path: Path
) -> None:
    router, sim = start(
        make_cluster, tmp_path, "{}", "--fault-error-rate", "1", "--fault-latency", "500ms"
    )
    before = engine_calls(sim)
    barrier = threading.Barrier(5)

    def ask(_: int) -> httpx.Response:
        barrier.wait(timeout=10)
        return post(router)

    with ThreadPoolExecutor(5) as pool:
        replies = list(pool.map(ask, range(5)))
    errors = [reply.json()["error"] for reply in replies]
    statuses = {reply.status_code for reply in replies}
    assert len(statuses) == 1 and statuses.pop() >= 500
    assert all(
        (e["code"], e["message"]) == (errors[0]["code"], errors[0]["message"]) for e in errors
    )
    calls = engine_calls(sim) - before
    assert 1 <= calls <= 3  # one flight (its own retries, if any), not five
    sim.set_faults(error_rate=0, latency=0)
    assert post(router).status_code == 200  # the error was not stored
    assert engine_calls(sim) == before + calls + 1


def test_an_anthropic_stream_ends_with_message_stop_and_is_replayed(
    make_cluster: Cluster, tmp_path: Path
) -> None:
    router, sim = start(make_cluster, tmp_path, "{}")
    ask: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
        "extra_body": {"temperature": 0},  # this SDK's stream() has no such argument
    }
    texts = []
    with router.anthropic(ACME) as claude:
        for _ in range(2):
            with claude.messages.stream(**ask) as stream:
                texts.append("".join(stream.text_stream))
    assert texts[0] == texts[1] and texts[0]
    assert engine_calls(sim) == 1  # ended with message_stop: stored, then replayed
