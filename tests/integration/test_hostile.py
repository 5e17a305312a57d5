"""Hostile input and faults: what a probe sends to a router it does not own.

Each case is bounded (a few seconds at most) and shares one fleet: a router with short
connection timeouts and a policy whose `consecutive_failures` gate would take the model
offline if a client's mistake were ever counted against the agent. Every answer must be a
4xx with the JSON envelope, never a 5xx; and at the end nothing is held, nothing leaked,
and no log carries a traceback.
"""

from __future__ import annotations

import gzip
import hashlib
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import orjson
import psutil
import pytest

from tests.procs import ADMIN_KEY, Cluster, Router, Sim, cluster, metric, wait_until

MODEL = "hostile"
KEY, OTHER_KEY = "sk-hivenet-hostile-one", "sk-hivenet-hostile-two"
CHAT = "/v1/chat/completions"
PER_IP = 40
GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def _auth(tmp: Path) -> Path:
    entries = "".join(
        f'    - key_hash: "{hashlib.sha256(raw.encode()).hexdigest()}"\n'
        f"      metadata: {{name: {name}, owner: {name}}}\n"
        for raw, name in ((KEY, "one"), (OTHER_KEY, "two"))
    )
    path = tmp / "auth.yaml"
    path.write_text("api:\n  mode: api-key\n  keys:\n" + entries)
    return path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Router, Sim]]:
    tmp: Path = tmp_path_factory.mktemp("hostile")
    policy = tmp / "policy.yaml"
    policy.write_text(
        "routing_policy:\n  strategy: least-loaded\n"
        "  exclude_if: {consecutive_failures: {gte: 3}}\n"
    )
    with cluster(tmp) as c:
        router = c.router(
            "--auth-config-file",
            str(_auth(tmp)),
            "--policy-file",
            str(policy),
            "--http-idle-timeout",
            "1s",
            "--http-body-timeout",
            "1s",
            "--http-max-conns-per-ip",
            str(PER_IP),
            "--p2p-handshake-timeout",
            "1s",
            "--max-request-bytes",
            "1048576",
        )
        sim = c.sim(MODEL, "--zero-latency")
        c.agent(router, sim)
        wait_until(lambda: _chat(router, GOOD).status_code == 200)
        yield c, router, sim
        held = router.metrics()
        for name in (
            "hivenet_router_active_forwards",
            "hivenet_router_pending_requests",
            "hivenet_agent_capacity_utilization",
            "hivenet_agent_link_streams",
        ):
            assert metric(held, name) == 0.0, name
        for proc in c.procs:
            assert "Traceback" not in proc.log(), proc.name


def _client(source: str = "127.0.0.1") -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=10)


def _chat(router: Router, body: object, headers: dict[str, str] | None = None) -> httpx.Response:
    with _client() as client:
        return client.post(
            router.url + CHAT,
            content=orjson.dumps(body) if not isinstance(body, bytes) else body,
            headers={"Authorization": f"Bearer {KEY}", **(headers or {})},
        )


def _envelope(reply: httpx.Response, status: int, code: str) -> None:
    assert reply.status_code == status, reply.text[:300]
    error = reply.json()["error"]
    assert error["code"] == code, error


def _raw(router: Router, data: bytes, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(
        ("127.0.0.1", router.http), timeout=5, source_address=(source, 0)
    )
    if data:
        sock.sendall(data)
    return sock


def _read_all(sock: socket.socket, limit: float = 5.0) -> bytes:
    """Everything until the peer closes (or `limit` seconds pass)."""
    sock.settimeout(limit)
    out = b""
    deadline = time.monotonic() + limit
    try:
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                break
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return out


def test_half_sent_requests_are_closed_and_capped(fleet: tuple[Cluster, Router, Sim]) -> None:
    _, router, _ = fleet
    partial = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty"
    started = time.monotonic()
    held = [_raw(router, partial) for _ in range(PER_IP + 10)]
    try:
        # Past the per-address cap, a connection is answered at once and closed.
        refused = [_read_all(sock, 0.5) for sock in held[PER_IP:]]
        assert all(r.startswith(b"HTTP/1.1 503") and b'"queue_full"' in r for r in refused)
        # Another address is not affected.
        with _client("127.0.0.2") as client:
            reply = client.post(
                router.url + CHAT, json=GOOD, headers={"Authorization": f"Bearer {KEY}"}
            )
        assert reply.status_code == 200
        # The half-sent ones are closed once the idle timeout (1 s) passes.
        for sock in held[:PER_IP]:
            assert _read_all(sock, 5.0) == b""
        assert time.monotonic() - started < 6
    finally:
        for sock in held:
            sock.close()
    assert _chat(router, GOOD).status_code == 200  # the address may connect again


def test_a_body_that_never_arrives_gets_408(fleet: tuple[Cluster, Router, Sim]) -> None:
    _, router, _ = fleet
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + KEY.encode() + b'\r\nContent-Length: 1000\r\n\r\n{"mo'
    )
    sock = _raw(router, head)
    try:
        answer = _read_all(sock, 5.0)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"request_timeout"' in answer


def test_idle_agent_link_connections_are_closed(fleet: tuple[Cluster, Router, Sim]) -> None:
    _, router, _ = fleet
    silent = socket.create_connection(("127.0.0.1", router.p2p), timeout=5)
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    tls = context.wrap_socket(socket.create_connection(("127.0.0.1", router.p2p), timeout=5))
    try:
        started = time.monotonic()
        assert _read_all(silent, 5.0) == b""  # never finished TLS
        assert tls.recv(1024) == b""  # finished TLS, never asked for the link
        assert time.monotonic() - started < 5
    finally:
        silent.close()
        tls.close()


def test_gzip_bodies_are_forwarded_decoded(fleet: tuple[Cluster, Router, Sim]) -> None:
    """The router reads the body to route it and forwards it decoded, without the label;
    the engine answers. Before the fix, each one failed on the engine and counted against
    the agent until the consecutive-failures gate took the model offline."""
    router = fleet[1]
    packed = gzip.compress(orjson.dumps(GOOD))
    for _ in range(8):
        reply = _chat(
            router, packed, {"Content-Encoding": "gzip", "Content-Type": "application/json"}
        )
        assert reply.status_code == 200, reply.text
    assert _chat(router, GOOD).status_code == 200


def test_broken_bodies_are_client_errors(fleet: tuple[Cluster, Router, Sim]) -> None:
    router = fleet[1]
    corrupt = b"\x1f\x8b\x08\x00" + b"not really gzip" * 10
    reply = _chat(router, corrupt, {"Content-Encoding": "gzip", "Content-Type": "application/json"})
    _envelope(reply, 400, "request_invalid")
    assert "Content-Encoding" in reply.json()["error"]["message"]
    # The engine's own refusals are the client's errors too: never the agent's failures.
    for _ in range(5):
        _envelope(_chat(router, {**GOOD, "max_tokens": 10**6}), 400, "context_length_exceeded")
    assert _chat(router, GOOD).status_code == 200


@pytest.mark.parametrize("depth", [990, 100_000])
@pytest.mark.parametrize(
    "route", [CHAT, "/v1/completions", "/v1/messages", "/v1/embeddings", "/v1/rerank"]
)
def test_deeply_nested_json(fleet: tuple[Cluster, Router, Sim], route: str, depth: int) -> None:
    _, router, _ = fleet
    nested = b"[" * depth + b"]" * depth
    body = b'{"model": "' + MODEL.encode() + b'", "messages": ' + nested + b', "prompt": '
    body += nested + b', "input": ' + nested + b', "max_tokens": 3}'
    with _client() as client:
        reply = client.post(
            router.url + route, content=body, headers={"Authorization": f"Bearer {KEY}"}
        )
    assert 400 <= reply.status_code < 500, reply.text[:300]
    assert reply.json()["error"]["code"] in ("request_invalid", "invalid_parameter")


def test_bodies_dense_with_values_are_read_apart_and_answered(
    fleet: tuple[Cluster, Router, Sim],
) -> None:
    """A body of tens of thousands of small values is read by the router's child process:
    it is forwarded and the engine's answer, the router's own refusals and an unknown
    model come back as they would for any body; the child is the router's own."""
    _, router, _ = fleet
    # A tool whose argument may take any of 200,000 values (400 KB), as a client listing IDs.
    ids = {"type": "integer", "enum": [0] * 200_000}
    choice = {"type": "object", "properties": {"id": ids}}
    tools = [{"type": "function", "function": {"name": "pick", "parameters": choice}}]
    dense = {**GOOD, "tools": tools}
    # Read, measured and forwarded: the simulator's context is too small for it.
    reply = _chat(router, dense)
    _envelope(reply, 400, "context_length_exceeded")
    assert reply.json()["error"]["source"] == "backend"
    _envelope(_chat(router, {**dense, "max_tokens": 2**40}), 400, "request_invalid")
    _envelope(_chat(router, {**dense, "model": "nobody-serves-this"}), 404, "model_not_found")
    assert router.proc.popen is not None
    children = psutil.Process(router.proc.popen.pid).children()
    assert [" ".join(c.cmdline()[-2:]) for c in children] == [
        f"hivenet_router.router.body_reader {160 * 1024 * 1024}"
    ]
    assert _chat(router, GOOD).status_code == 200


def test_oversized_headers(fleet: tuple[Cluster, Router, Sim]) -> None:
    router = fleet[1]
    many = {f"x-filler-{i}": "v" * 8000 for i in range(10)}  # 80 KB in all
    _envelope(_chat(router, GOOD, many), 431, "request_too_large")
    sock = _raw(router, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000)
    try:
        answer = _read_all(sock, 5.0)
    finally:
        sock.close()
    assert answer[:10] in (b"HTTP/1.0 4", b"HTTP/1.1 4"), answer[:100]
    assert b'"type":"error"' in answer


def _many_headers(router: Router, count: int) -> bytes:
    """A chat request that would forward `count` headers (its ID among them), on a raw
    socket: the whole answer."""
    body = orjson.dumps(GOOD)
    mine = b"".join(b"X-H%d: v\r\n" % n for n in range(count - 2))
    request = (
        b"POST %b HTTP/1.1\r\nHost: r\r\nConnection: close\r\nAuthorization: Bearer %b\r\n"
        b"Content-Type: application/json\r\n%bContent-Length: %d\r\n\r\n%b"
        % (CHAT.encode(), KEY.encode(), mine, len(body), body)
    )
    sock = _raw(router, request)
    try:
        return _read_all(sock, 5.0)
    finally:
        sock.close()


def test_headers_forwarded_to_an_engine_are_bounded_in_number(
    fleet: tuple[Cluster, Router, Sim],
) -> None:
    # The simulator (aiohttp) refuses past 128 headers, llama.cpp past 100: the router
    # forwards at most 90 and answers more itself, before any agent is involved.
    _, router, _ = fleet
    assert _many_headers(router, 90).startswith(b"HTTP/1.1 200")
    for count in (91, 129):
        answer = _many_headers(router, count)
        assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
        error = orjson.loads(answer.partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == "request_too_large" and "at most 90" in error["message"]


@pytest.mark.parametrize(
    "line", [b"GET /health", b"GET /health HTTP/0.9", b"POST /v1/chat/completions"]
)
def test_a_request_line_without_http_1_is_400(
    fleet: tuple[Cluster, Router, Sim], line: bytes
) -> None:
    _, router, _ = fleet
    sock = _raw(router, line + b"\r\nHost: x\r\n\r\n")
    try:
        answer = _read_all(sock, 5.0)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert b'"code":"request_invalid"' in answer and b"HTTP/1.1" in answer.partition(b"\r\n\r\n")[2]


def test_malformed_http_is_answered_and_logged_quietly(fleet: tuple[Cluster, Router, Sim]) -> None:
    _, router, _ = fleet
    before = router.proc.log()
    for junk in (b"GARBAGE\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"\x16\x03\x01\x02\x00\x01") * 50:
        sock = _raw(router, junk)
        try:
            answer = _read_all(sock, 2.0)
        finally:
            sock.close()
        assert not answer or answer[:10] in (b"HTTP/1.0 4", b"HTTP/1.1 4"), answer[:100]
    added = router.proc.log()[len(before) :]
    assert "Traceback" not in added
    assert added.count("\n") <= 2, added[:2000]


def test_conflicting_credentials_are_refused(fleet: tuple[Cluster, Router, Sim]) -> None:
    _, router, _ = fleet
    same = httpx.Headers([("Authorization", f"Bearer {KEY}"), ("x-api-key", KEY)])
    with _client() as client:
        assert client.post(router.url + CHAT, json=GOOD, headers=same).status_code == 200
        for headers in (
            [("Authorization", f"Bearer {KEY}"), ("Authorization", f"Bearer {OTHER_KEY}")],
            [("Authorization", f"Bearer {KEY}"), ("x-api-key", OTHER_KEY)],
            [("x-api-key", OTHER_KEY), ("x-api-key", KEY)],
        ):
            reply = client.post(router.url + CHAT, json=GOOD, headers=httpx.Headers(headers))
            _envelope(reply, 401, "unauthorized")
            assert "conflicting credentials" in reply.json()["error"]["message"]


def test_errors_name_no_internal_address(fleet: tuple[Cluster, Router, Sim]) -> None:
    _, router, sim = fleet
    sim.proc.kill()  # the engine goes away; its agent stays registered for a moment
    try:
        reply = _chat(router, GOOD)
        assert reply.status_code in (502, 503), reply.text
        message = reply.json()["error"]["message"]
        assert "127.0.0.1" not in message and str(sim.port) not in message
        assert "Cannot connect" not in message and "Error" not in message
    finally:
        wait_until(lambda: _eligible(router) == 0)  # the agent reports its engine down
        sim.proc.start()
        wait_until(lambda: _eligible(router) == 1)
    assert _chat(router, GOOD).status_code == 200


def _eligible(router: Router) -> int:
    health = httpx.get(
        router.url + "/admin/health", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=5
    )
    return int(health.json()["eligible_agents"])
