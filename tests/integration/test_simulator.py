"""The engine simulator on its own: determinism, faults, and its vLLM-style metrics."""

from __future__ import annotations

import json
import socket
import struct

import httpx2 as httpx
import pytest

from tests.procs import Cluster, metric, wait_until

CHAT = {"model": "m", "messages": [{"role": "user", "content": "tell me"}], "max_tokens": 20}


def _text(url: str, body: dict[str, object] = CHAT) -> str:
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=10)
    reply.raise_for_status()
    return str(reply.json()["choices"][0]["message"]["content"])


def test_same_seed_same_answers(make_cluster: Cluster) -> None:
    a = make_cluster.sim("m", "--zero-latency", name="a")
    b = make_cluster.sim("m", "--zero-latency", name="b")
    assert _text(a.url) == _text(b.url)
    other = make_cluster.sim("m", "--zero-latency", "--seed", "99", name="c")
    assert _text(other.url) != _text(a.url)


def test_prefix_cache_shows_in_metrics(make_cluster: Cluster) -> None:
    sim = make_cluster.sim("m", "--zero-latency")
    long = {**CHAT, "messages": [{"role": "user", "content": "shared context " * 200}]}
    _text(sim.url, long)
    _text(sim.url, long)
    text = sim.metrics()
    hits = metric(text, "vllm:prefix_cache_hits_total")
    queries = metric(text, "vllm:prefix_cache_queries_total")
    assert 0.4 < hits / queries < 0.5  # the second request found the first one's blocks


def test_faults_by_admin_call(make_cluster: Cluster) -> None:
    sim = make_cluster.sim("m", "--zero-latency")
    sim.set_faults(error_rate=1.0)
    reply = httpx.post(sim.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert reply.status_code == 500
    sim.set_faults(error_rate=0.0, repeat_rate=1.0)
    assert set(_text(sim.url).split()) == {"over", "and"}
    bad = httpx.post(sim.url + "/admin/faults", json={"error_rate": 3}, timeout=5)
    assert bad.status_code == 400
    assert httpx.get(sim.url + "/admin/faults", timeout=5).json()["repeat_rate"] == 1.0


def test_stall_stops_a_stream_halfway(make_cluster: Cluster) -> None:
    sim = make_cluster.sim("m", "--zero-latency", "--fault-stall-rate", "1")
    body = {**CHAT, "stream": True}
    lines: list[str] = []
    with (
        pytest.raises(httpx.ReadTimeout),
        httpx.stream("POST", sim.url + "/v1/chat/completions", json=body, timeout=1.0) as reply,
    ):
        lines.extend(line for line in reply.iter_lines() if line)
    assert len(lines) == 11  # the role event and the first 10 of 20 tokens, then silence
    assert "[DONE]" not in "".join(lines)


def test_clients_hanging_up_mid_answer_free_their_sequences_quietly(
    make_cluster: Cluster,
) -> None:
    """What a load generator does when it stops: many connections reset with requests still
    being answered. Each sequence must be released, without a traceback per connection."""
    sim = make_cluster.sim("m", "--zero-latency", "--max-num-seqs", "4096")
    body = json.dumps({**CHAT, "max_tokens": 50, "stream": True}).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    sockets = [socket.create_connection(("127.0.0.1", sim.port)) for _ in range(200)]
    for sock in sockets:
        sock.sendall(request)
    for sock in sockets:  # close with a reset (linger 0), as a killed client would
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    wait_until(lambda: metric(sim.metrics(), "vllm:num_requests_running") == 0.0, timeout=5)
    assert "Traceback" not in sim.proc.log()


def test_hang_and_latency(make_cluster: Cluster) -> None:
    sim = make_cluster.sim("m", "--zero-latency", "--fault-hang-rate", "1")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(sim.url + "/v1/chat/completions", json=CHAT, timeout=0.5)
    sim.set_faults(hang_rate=0.0, latency=0.3)
    reply = httpx.post(sim.url + "/v1/chat/completions", json=CHAT, timeout=5)
    assert reply.status_code == 200 and reply.elapsed.total_seconds() >= 0.3


def test_crash_after(make_cluster: Cluster) -> None:
    sim = make_cluster.sim("m", "--zero-latency", "--fault-crash-after", "2")
    assert _text(sim.url)
    with pytest.raises(httpx.HTTPError):
        _text(sim.url)
    wait_until(lambda: not sim.proc.alive, timeout=5)


async def test_queueing_shows_as_waiting(make_cluster: Cluster) -> None:
    import asyncio

    sim = make_cluster.sim("m", "--max-num-seqs", "1", "--itl", "50ms", "--ttft-base", "0")
    body = {**CHAT, "max_tokens": 40}
    async with httpx.AsyncClient(base_url=sim.url, timeout=10) as client:
        calls = [
            asyncio.create_task(client.post("/v1/chat/completions", json=body)) for _ in range(2)
        ]
        await asyncio.sleep(0.5)
        text = sim.metrics()
        assert metric(text, "vllm:num_requests_running") == 1.0
        assert metric(text, "vllm:num_requests_waiting") == 1.0
        replies = await asyncio.gather(*calls)
    assert [r.status_code for r in replies] == [200, 200]
