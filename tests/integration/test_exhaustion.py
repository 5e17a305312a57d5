"""One address cannot take the router offline by holding connections (issue 36).

A flood of idle TLS connections and of half-open ones (TCP only, TLS never started) from
one address on each agent port, the authentication (gRPC) port and the link port, while
the public port, a chat request and an agent that restarts and authenticates again are
watched; then the same with the router's open-files limit at 1,024. And a client that stops
reading a stream loses its engine slot at the write timeout, as one that hung up does.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import orjson
import psutil
import pytest

from tests.procs import (
    Cluster,
    Proc,
    Router,
    Sim,
    cluster,
    metric,
    wait_registered,
    wait_until,
)

MODEL = "flooded"
FLOOD = 7000  # connection attempts per port
ATTACKER = "127.0.0.2"  # every 127/8 address is loopback: the flood has its own source
PARALLEL = 200
GRPC_PER_IP, P2P_PER_IP = 8, 32  # the defaults (at 1,024 open files, fewer)
# The flood's connections stay for the whole test: what is measured is the caps, not the
# deadlines (tests/unit/http1/test_tlsgate.py has those).
LONG_DEADLINES = ("--grpc-conn-timeout", "10m", "--p2p-handshake-timeout", "10m")


@pytest.fixture(autouse=True)
def _enough_descriptors() -> Iterator[None]:
    """The test process holds what the router admits of the flood, and opens sockets for
    the rest one batch at a time."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _tls() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    return context


Held = list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]


async def _flood(port: int, held: Held) -> None:
    """FLOOD attempts on `port` from ATTACKER, half of them TLS, half left before TLS;
    whatever the router did not refuse at once is held in `held`."""
    context = _tls()
    gate = asyncio.Semaphore(PARALLEL)

    async def one(n: int) -> None:
        async with gate:
            try:
                async with asyncio.timeout(30):
                    connection = await asyncio.open_connection(
                        "127.0.0.1", port, ssl=context if n % 2 else None, local_addr=(ATTACKER, 0)
                    )
            except (OSError, ssl.SSLError, TimeoutError):
                return
            held.append(connection)

    await asyncio.gather(*(one(n) for n in range(FLOOD)))


def _open(held: Held) -> int:
    return sum(not (r.at_eof() or w.transport.is_closing()) for r, w in held)


async def _kept(held: Held, most: int) -> int:
    """How many held connections the router kept, once it has closed the rest (seen when
    the close arrives, however late the router accepted the connection)."""
    async with asyncio.timeout(60):
        while _open(held) > most:
            await asyncio.sleep(0.1)
    return _open(held)


def _chat(router: Router) -> None:
    reply = router.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert reply.choices[0].message.content


def _fds(router: Router) -> int:
    assert router.proc.popen is not None
    return psutil.Process(router.proc.popen.pid).num_fds()


def _serves_through_a_flood(c: Cluster, router: Router, sim: Sim) -> None:
    agent = c.agent(router, sim)
    wait_registered(router, MODEL)
    _chat(router)
    baseline = _fds(router)

    async def main() -> None:
        grpc: Held = []
        p2p: Held = []
        try:
            await _flood(router.grpc, grpc)
            await _flood(router.p2p, p2p)
            # The caps held: a handful of connections each, not thousands; and the router
            # holds descriptors for those alone (three for each relayed gRPC connection).
            kept = await _kept(grpc, GRPC_PER_IP), await _kept(p2p, P2P_PER_IP)
            assert kept[0] > 0 and kept[1] > 0, kept  # the flood did hold what it could
            bound = baseline + 3 * GRPC_PER_IP + P2P_PER_IP + 16
            wait_until(lambda: _fds(router) <= bound, timeout=30)
            await asyncio.to_thread(_still_serves, c, router, sim, agent)
            assert await _kept(grpc, GRPC_PER_IP) and await _kept(p2p, P2P_PER_IP)
        finally:
            for _, writer in grpc + p2p:
                writer.transport.abort()

    asyncio.run(main())


def _still_serves(c: Cluster, router: Router, sim: Sim, agent: Proc) -> None:
    assert httpx.get(router.url + "/health", timeout=5).status_code == 200
    assert "hivenet" in httpx.get(f"http://127.0.0.1:{router.metrics_port}/metrics").text
    _chat(router)
    # An agent that restarts authenticates and registers again through the flood.
    agent.kill()
    wait_until(lambda: router.healthy_replicas(MODEL) == 0, timeout=30)
    c.agent(router, sim, name="agent-again")
    wait_until(lambda: router.healthy_replicas(MODEL) == 1, timeout=30)
    _chat(router)
    # The killed agent's link gave its place back; the flood's refusals were counted.
    wait_until(lambda: _connections(router, "agent links") == 1.0, timeout=30)
    page = router.metrics()
    for port in ("agent authentication", "agent port before a session"):
        assert (metric(page, "hivenet_router_connections_refused_total", port=port) or 0) > 0


def _connections(router: Router, port: str) -> float | None:
    return metric(router.metrics(), "hivenet_router_connections", port=port)


def test_a_flood_from_one_address_on_the_agent_ports_takes_nothing_offline(
    tmp_path: Path,
) -> None:
    with cluster(tmp_path) as c:
        router = c.router(*LONG_DEADLINES)
        sim = c.sim(MODEL, "--zero-latency")
        _serves_through_a_flood(c, router, sim)


def test_the_same_at_an_open_files_limit_of_1024(tmp_path: Path) -> None:
    with cluster(tmp_path) as c:
        router = c.router(*LONG_DEADLINES, open_files=1024)
        assert "connection caps lowered to fit" in router.proc.log()
        sim = c.sim(MODEL, "--zero-latency")
        _serves_through_a_flood(c, router, sim)
        # The public port: one address cannot hold every client connection either.
        sockets = []
        try:
            for _ in range(1100):
                sock = socket.create_connection(
                    ("127.0.0.1", router.http), timeout=5, source_address=(ATTACKER, 0)
                )
                sockets.append(sock)
            _chat(router)  # from another address, served
            assert httpx.get(router.url + "/health", timeout=5).status_code == 200
        finally:
            for sock in sockets:
                sock.close()


def test_a_client_that_stops_reading_a_stream_loses_its_slot(tmp_path: Path) -> None:
    with cluster(tmp_path) as c:
        router = c.router("--stream-write-timeout", "2s", "--request-timeout", "10m")
        sim = c.sim(MODEL, "--itl", "0", "--ttft-base", "0", "--max-model-len", "10000000")
        c.agent(router, sim)
        wait_registered(router, MODEL)
        body = orjson.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "go on"}],
                "max_tokens": 5_000_000,
                "stream": True,
            }
        )
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect
        sock.connect(("127.0.0.1", router.http))
        with contextlib.closing(sock):
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body)
            )
            assert sock.recv(1).startswith(b"H")  # the answer has begun; then one byte a second

            def running() -> float:
                return metric(sim.metrics(), "vllm:num_requests_running") or 0.0

            wait_until(lambda: running() == 1.0, timeout=30)  # the state exists first
            sock.setblocking(False)

            def freed() -> bool:
                with contextlib.suppress(BlockingIOError, ConnectionError):
                    sock.recv(1)
                return running() == 0.0

            wait_until(freed, timeout=120, interval=1.0)
            wait_until(
                lambda: metric(router.metrics(), "hivenet_router_active_forwards") == 0.0,
                timeout=30,
            )
            assert "a client stopped reading its answer" in router.proc.log()
