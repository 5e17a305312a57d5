"""Agents, routers and engines coming and going, and streams cut from either end."""

from __future__ import annotations

import json
import signal
import socket
import time

import anthropic
import httpx2 as httpx
import openai
import pytest

from tests.procs import (
    ADMIN_KEY,
    Cluster,
    Router,
    break_stream,
    metric,
    wait_registered,
    wait_until,
)

MODEL = "m"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def _ok(router: Router) -> bool:
    reply = httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=10)
    return reply.status_code == 200


def test_the_public_port_opens_after_every_other_listener(make_cluster: Cluster) -> None:
    # What waits for the public port (a readiness probe, an agent's operator, a test) may
    # dial the agent and metrics ports the moment it answers.
    router = make_cluster.router(wait=False)
    deadline = time.monotonic() + 30
    while True:
        assert time.monotonic() < deadline, "the public port never opened"
        assert router.proc.alive, router.proc.log()
        try:
            socket.create_connection(("127.0.0.1", router.http), timeout=1).close()
            break
        except OSError:
            time.sleep(0.001)
    for port in (router.grpc, router.p2p, router.metrics_port):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_dead_agent_leaves_the_pool_then_the_registry(make_cluster: Cluster) -> None:
    router = make_cluster.router()
    sim = make_cluster.sim(MODEL, "--zero-latency")
    agent = make_cluster.agent(router, sim)
    wait_registered(router, MODEL)
    assert metric(router.metrics(), "hivenet_routing_agent_healthy", model=MODEL) == 1.0
    agent.kill()
    # The connection drops at once, so the agent stops being eligible at once...
    wait_until(lambda: router.healthy_replicas(MODEL) == 0, timeout=5)
    # ...and the log says how, in words.
    lost = [line for line in router.proc.log().splitlines() if " disconnected: " in line]
    assert len(lost) == 1, lost
    assert lost[0].endswith(
        "(127.0.0.1) disconnected: it closed the connection without a goodbye (as a killed "
        "process does)"
    ), lost
    reply = httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert reply.json()["error"]["code"] == "no_agents_available"
    # The gauge says so at once too, rather than after --unhealthy-after.
    page = router.metrics()
    assert metric(page, "hivenet_routing_agent_healthy", model=MODEL) == 0.0
    assert metric(page, "hivenet_agent_disconnections_total", model=MODEL) == 1.0
    # ...and is removed once --remove-after (5s) passes without a heartbeat; its series go
    # with it (they come back, restored from the history store, if it returns).
    wait_until(lambda: MODEL not in router.models(), timeout=10)
    reply = httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert reply.status_code == 404
    assert reply.json()["error"]["code"] == "model_not_found"
    assert metric(router.metrics(), "hivenet_agent_disconnections_total", model=MODEL) is None


def test_unhealthy_backend_is_taken_out_and_back(make_cluster: Cluster) -> None:
    router = make_cluster.router()
    sim = make_cluster.sim(MODEL, "--zero-latency")
    make_cluster.agent(router, sim)
    wait_registered(router, MODEL)
    sim.proc.kill()
    wait_until(lambda: router.healthy_replicas(MODEL) == 0, timeout=10)
    assert MODEL in router.models()  # the agent itself is alive and stays registered
    reply = httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert reply.status_code == 503
    make_cluster.sim(MODEL, "--zero-latency", port=sim.port, name="sim-again")
    wait_until(lambda: router.healthy_replicas(MODEL) == 1, timeout=10)
    assert _ok(router)


def test_agent_started_before_router_registers_when_router_comes(
    make_cluster: Cluster,
) -> None:
    first = make_cluster.router(name="router-probe")
    first.proc.stop()
    sim = make_cluster.sim(MODEL, "--zero-latency")
    make_cluster.agent(first, sim)
    time.sleep(0.5)
    router = make_cluster.router(ports=first, name="router")
    wait_registered(router, MODEL)
    assert _ok(router)


def test_router_restart_agents_reconnect(make_cluster: Cluster) -> None:
    router = make_cluster.router(name="router1")
    sim = make_cluster.sim(MODEL, "--zero-latency")
    make_cluster.agent(router, sim)
    wait_registered(router, MODEL)
    router.proc.stop()
    again = make_cluster.router(ports=router, name="router2")
    wait_registered(again, MODEL)
    assert _ok(again)


def test_a_restarted_router_asks_clients_to_retry_while_agents_reconnect(
    make_cluster: Cluster,
) -> None:
    router = make_cluster.router("--warmup", "3s")
    started = time.monotonic()
    reply = httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert reply.status_code == 503 and reply.headers["Retry-After"] == "1"
    assert reply.json()["error"]["code"] == "no_agents_available"
    assert "starting" in reply.json()["error"]["message"]
    # The SDKs retry a 503 with Retry-After: an agent that registers meanwhile answers.
    sim = make_cluster.sim(MODEL, "--zero-latency")
    make_cluster.agent(router, sim)
    with router.openai("x", 8) as client:
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert answer.choices[0].message.content
    # Once warm, a model nobody serves is simply not found.
    time.sleep(max(0.0, 3.2 - (time.monotonic() - started)))
    other = httpx.post(router.url + "/v1/chat/completions", json={**CHAT, "model": "x"})
    assert other.status_code == 404


def test_agent_restart_keeps_peer_id(make_cluster: Cluster) -> None:
    router = make_cluster.router()
    sim = make_cluster.sim(MODEL, "--zero-latency")
    agent = make_cluster.agent(router, sim)
    wait_registered(router, MODEL)
    peers = {
        line
        for line in router.metrics().splitlines()
        if line.startswith("hivenet_routing_agent_info")
    }
    agent.stop()
    make_cluster.agent(router, sim, name="agent")
    wait_until(lambda: router.healthy_replicas(MODEL) == 1, timeout=10)
    after = {
        line
        for line in router.metrics().splitlines()
        if line.startswith("hivenet_routing_agent_info")
    }
    assert peers == after
    assert _ok(router)


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_agent_dying_mid_stream_ends_the_stream_with_an_error(
    make_cluster: Cluster, api: str
) -> None:
    router = make_cluster.router()
    sim = make_cluster.sim(MODEL, "--itl", "50ms", "--ttft-base", "0")
    agent = make_cluster.agent(router, sim)
    wait_registered(router, MODEL)
    route = "/v1/chat/completions" if api == "openai" else "/v1/messages"
    body = {**CHAT, "max_tokens": 100, "stream": True}
    with httpx.stream("POST", router.url + route, json=body, timeout=20) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        for _ in range(6):
            next(lines)
        agent.kill()
        rest = "\n".join(lines)
        rid = reply.headers["X-Request-ID"]
    assert "stream interrupted" in rest
    assert ("event: error" in rest) == (api == "anthropic")
    event = json.loads(next(line for line in rest.splitlines() if '"error"' in line)[5:])
    assert event["type"] == "error" and event["request_id"] == rid
    text = router.metrics()
    assert metric(text, "hivenet_router_active_forwards") == 0.0
    assert metric(text, "hivenet_agent_capacity_utilization") == 0.0


def test_openai_sdk_raises_on_a_broken_stream(make_cluster: Cluster) -> None:
    router = make_cluster.router()
    sim = make_cluster.sim(MODEL, "--itl", "50ms", "--ttft-base", "0")
    agent = make_cluster.agent(router, sim)
    wait_registered(router, MODEL)
    with router.openai() as client:
        break_stream(client, MODEL, agent.kill)


def test_anthropic_sdk_raises_on_a_broken_stream(make_cluster: Cluster) -> None:
    router = make_cluster.router()
    sim = make_cluster.sim(MODEL, "--itl", "50ms", "--ttft-base", "0")
    agent = make_cluster.agent(router, sim)
    wait_registered(router, MODEL)
    with router.anthropic() as client:
        seen = 0
        with (
            pytest.raises(anthropic.APIError, match="stream interrupted"),
            client.messages.stream(
                model=MODEL, max_tokens=100, messages=[{"role": "user", "content": "x"}]
            ) as stream,
        ):
            for _text in stream.text_stream:
                seen += 1
                if seen == 3:
                    agent.kill()
    assert seen >= 3


def test_client_disconnect_cancels_the_backend_request(make_cluster: Cluster) -> None:
    router = make_cluster.router()
    sim = make_cluster.sim(MODEL, "--itl", "50ms", "--ttft-base", "0")
    make_cluster.agent(router, sim)
    wait_registered(router, MODEL)
    body = {**CHAT, "max_tokens": 200, "stream": True}
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=20) as reply:
        lines = reply.iter_lines()
        for _ in range(4):
            next(lines)
        assert metric(sim.metrics(), "vllm:num_requests_running") == 1.0
    # Closing the client connection resets the stream; the agent cancels the backend call.
    wait_until(lambda: metric(sim.metrics(), "vllm:num_requests_running") == 0.0, timeout=5)
    wait_until(lambda: metric(router.metrics(), "hivenet_router_active_forwards") == 0.0, timeout=5)
    assert metric(sim.metrics(), "vllm:request_success_total", finished_reason="abort") == 1.0
    assert _ok(router)


def test_agent_started_before_its_backend_waits_for_it(make_cluster: Cluster) -> None:
    from tests.procs import free_port

    router = make_cluster.router()
    port = free_port()
    make_cluster.agent(router, None, backend_url=f"http://127.0.0.1:{port}", name="agent")
    time.sleep(1.0)
    assert MODEL not in router.models()
    make_cluster.sim(MODEL, "--zero-latency", port=port)
    wait_registered(router, MODEL)
    assert _ok(router)


def test_router_shutdown_lets_in_flight_streams_finish(make_cluster: Cluster) -> None:
    router = make_cluster.router()
    sim = make_cluster.sim(MODEL, "--itl", "40ms", "--ttft-base", "0")
    make_cluster.agent(router, sim)
    wait_registered(router, MODEL)
    body = {**CHAT, "max_tokens": 30, "stream": True}
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=20) as reply:
        lines = reply.iter_lines()
        next(lines)
        router.proc.popen.send_signal(__import__("signal").SIGTERM)  # type: ignore[union-attr]
        rest = "\n".join(lines)
    assert rest.rstrip().endswith("data: [DONE]")
    router.proc.popen.wait(timeout=10)  # type: ignore[union-attr]
    assert router.proc.popen.returncode == 0  # type: ignore[union-attr]


def test_agent_sigterm_lets_its_streams_finish_and_takes_nothing_new(
    make_cluster: Cluster,
) -> None:
    """An agent told to stop (a rolling restart, a pod ending) tells the router at once and
    gives what it has in flight up to --shutdown-grace: the stream ends whole, a new request
    goes elsewhere (here nowhere: 503), and the agent exits 0 once the stream is done."""
    router = make_cluster.router()
    sim = make_cluster.sim(MODEL, "--itl", "100ms", "--ttft-base", "0")
    agent = make_cluster.agent(router, sim)
    wait_registered(router, MODEL)
    body = {**CHAT, "max_tokens": 20, "stream": True}
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=30) as reply:
        lines = reply.iter_lines()
        next(lines)
        # The stream all but paused (3 s a token) while the checks below run, however slow
        # the machine, then let go: it must still be running when they look.
        sim.set_faults(slowdown=30)
        agent.popen.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        # The router hears it from the next heartbeat, sent at once: out of the pool.
        wait_until(lambda: router.healthy_replicas(MODEL) == 0, timeout=5)
        table = httpx.get(
            router.url + "/admin/routing-table",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=5,
        ).json()
        (entry,) = table["agents"]
        assert entry["health"]["stopping"] is True and entry["health"]["eligible"] is False
        assert agent.alive  # still carrying the stream
        refused = httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=10)
        assert refused.json()["error"]["code"] == "no_agents_available", refused.text
        sim.set_faults(slowdown=1)  # within the 25 s grace: the stream ends whole
        rest = "\n".join(lines)
    assert rest.rstrip().endswith("data: [DONE]"), rest[-300:]
    agent.popen.wait(timeout=10)  # type: ignore[union-attr]
    assert agent.popen.returncode == 0  # type: ignore[union-attr]
    assert "1 request(s) in flight get up to 25s" in agent.log()
    assert "requests in flight finished" in agent.log()
    assert "is shutting down: no new requests" in router.proc.log()


def test_agent_shutdown_grace_bounds_its_wait(make_cluster: Cluster) -> None:
    router = make_cluster.router("--request-timeout", "60s")
    sim = make_cluster.sim(MODEL, "--itl", "100ms", "--ttft-base", "0")
    agent = make_cluster.agent(router, sim, "--shutdown-grace", "1s")
    wait_registered(router, MODEL)
    body = {**CHAT, "max_tokens": 300, "stream": True}  # 30 s of tokens
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=20) as reply:
        lines = reply.iter_lines()
        next(lines)
        agent.popen.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        rest = "\n".join(lines)
    assert "data: [DONE]" not in rest and '"error"' in rest, rest[-300:]
    agent.popen.wait(timeout=10)  # type: ignore[union-attr]
    assert "shutdown grace over: cutting 1 request(s) still in flight" in agent.log()


def test_agent_history_survives_a_router_restart(make_cluster: Cluster) -> None:
    router = make_cluster.router()
    sim = make_cluster.sim(MODEL, "--zero-latency")
    make_cluster.agent(router, sim)
    wait_registered(router, MODEL)
    for _ in range(5):
        assert _ok(router)
    srtt = metric(router.metrics(), "hivenet_agent_srtt_ms")
    assert srtt > 0
    router.proc.stop()  # graceful: history is flushed at shutdown
    again = make_cluster.router(ports=router)
    wait_registered(again, MODEL)
    wait_until(lambda: metric(again.metrics(), "hivenet_agent_requests_success_total") == 5.0)
    assert metric(again.metrics(), "hivenet_agent_srtt_ms") == pytest.approx(srtt)
    assert _ok(again)
    wait_until(lambda: metric(again.metrics(), "hivenet_agent_requests_success_total") == 6.0)
    assert "resumes its history: 5 ok" in again.proc.log()


def test_shutdown_grace_bounds_the_whole_shutdown(make_cluster: Cluster) -> None:
    """A stream longer than the grace is cut, with an error event, when the grace is over;
    the process is gone right after (aiohttp alone waited twice the grace)."""
    router = make_cluster.router("--shutdown-grace", "2s", "--request-timeout", "60s")
    sim = make_cluster.sim(MODEL, "--itl", "100ms", "--ttft-base", "0")
    make_cluster.agent(router, sim)
    wait_registered(router, MODEL)
    with router.openai() as client:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=300,  # 30 s of tokens
            stream=True,
        )
        started = 0.0
        with pytest.raises(openai.APIError, match="shutting down"):
            for _chunk in stream:
                if not started:
                    started = time.monotonic()
                    router.proc.popen.send_signal(__import__("signal").SIGTERM)  # type: ignore[union-attr]
    router.proc.popen.wait(timeout=15)  # type: ignore[union-attr]
    elapsed = time.monotonic() - started
    assert 1.5 < elapsed < 6, elapsed
    assert "get up to 2s" in router.proc.log()
    assert "cut 1 request(s)" in router.proc.log()


def _raw_stream(router: Router) -> socket.socket:
    """A streamed chat request on a plain socket, its head and first event read."""
    body = json.dumps({**CHAT, "max_tokens": 300, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", router.http), timeout=15)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    )
    seen = b""
    while b"data: " not in seen:
        piece = sock.recv(65536)
        assert piece, seen
        seen += piece
    assert seen.startswith(b"HTTP/1.1 200") and b"Transfer-Encoding: chunked" in seen
    return sock


def test_a_stream_cut_at_shutdown_ends_its_body_after_the_error_event(
    make_cluster: Cluster,
) -> None:
    """Cut when the grace is over, a stream gets its error event and then the end of its
    chunked body: the client sees the error, never a broken transfer as well."""
    router = make_cluster.router("--shutdown-grace", "1s", "--request-timeout", "60s")
    sim = make_cluster.sim(MODEL, "--itl", "100ms", "--ttft-base", "0")
    make_cluster.agent(router, sim)
    wait_registered(router, MODEL)
    request = {"model": MODEL, "messages": CHAT["messages"], "max_tokens": 300}
    with router.openai() as client:
        sdk = iter(client.chat.completions.create(**request, stream=True))
        next(sdk)
        raw = client.chat.completions.with_streaming_response.create(**request, stream=True)
        with raw as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            sock = _raw_stream(router)
            router.proc.popen.send_signal(__import__("signal").SIGTERM)  # type: ignore[union-attr]
            # The SDK raises the error event itself, not a connection error...
            with pytest.raises(openai.APIError, match="shutting down") as raised:
                for _chunk in sdk:
                    pass
            assert not isinstance(raised.value, openai.APIConnectionError)
            # ...and its HTTP client reads the body to its end (httpx raises
            # RemoteProtocolError for a chunked body cut short).
            events = [line for line in lines if line.startswith("data: ")]
        assert "shutting down" in events[-1]
        with sock:
            tail = b""
            while piece := sock.recv(65536):
                tail += piece
    assert b"shutting down" in tail
    assert tail.endswith(b"}\n\n\r\n0\r\n\r\n"), tail[-200:]
    router.proc.popen.wait(timeout=15)  # type: ignore[union-attr]
    assert "cut 3 request(s)" in router.proc.log()
