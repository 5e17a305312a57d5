"""The TLS gate counts connections from the accept, refuses before TLS, releases on close."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from hivenet_router.http1.guard import ConnectionGuard
from hivenet_router.http1.tlsgate import TlsGate
from hivenet_router.transport.tls import RouterTlsIdentity

IDENTITY = RouterTlsIdentity.from_secret(b"s" * 48)
SERVER, CLIENT = IDENTITY.server_context(), IDENTITY.client_context()  # files: off the loop
LOOPS = [asyncio.new_event_loop, uvloop.new_event_loop]


def _run(new_loop: Callable[[], Any], main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(main())


class _Echo(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)  # type: ignore[attr-defined]


async def _serve(guard: ConnectionGuard, handshake: float = 30.0) -> tuple[asyncio.Server, TlsGate]:
    gate = TlsGate(guard, SERVER, _Echo, handshake)
    server = await asyncio.get_running_loop().create_server(gate, "127.0.0.1", 0)
    return server, gate


def _port(server: asyncio.Server) -> int:
    return int(server.sockets[0].getsockname()[1])


async def _raw(port: int, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A plain TCP connection from `source` (any 127/8 address) that never starts TLS."""
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def _echo_over_tls(port: int, source: str = "127.0.0.1") -> bytes:
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=CLIENT, local_addr=(source, 0)
    )
    writer.write(b"ping")
    data = await reader.readexactly(4)
    writer.close()
    return data


async def _until(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(20):
        while not check():
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("new_loop", LOOPS)
def test_a_source_over_its_cap_is_reset_before_tls_and_others_still_get_in(
    new_loop: Callable[[], Any],
) -> None:
    async def main() -> None:
        guard = ConnectionGuard("test", per_source=2, total=3)
        server, gate = await _serve(guard)
        port = _port(server)
        idle = [await _raw(port, "127.0.0.2") for _ in range(2)]
        await _until(lambda: guard.open == 2)  # counted though no TLS byte was sent
        reader, writer = await _raw(port, "127.0.0.2")  # a third from the same address
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await reader.readexactly(1)  # reset before any TLS
        writer.close()
        assert guard.open == 2 and guard.from_source("127.0.0.2") == 2
        assert await _echo_over_tls(port) == b"ping"  # another address is served
        for _, w in idle:
            w.close()
        await _until(lambda: guard.open == 0 and gate.live == 0)
        server.close()

    _run(new_loop, main)


@pytest.mark.parametrize("new_loop", LOOPS)
def test_the_total_cap_counts_every_source(new_loop: Callable[[], Any]) -> None:
    async def main() -> None:
        guard = ConnectionGuard("test", per_source=5, total=2)
        server, _ = await _serve(guard)
        port = _port(server)
        held = [await _raw(port, "127.0.0.2"), await _raw(port, "127.0.0.3")]
        await _until(lambda: guard.open == 2)
        reader, writer = await _raw(port, "127.0.0.4")
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await reader.readexactly(1)
        writer.close()
        for _, w in held:
            w.close()
        await _until(lambda: guard.open == 0)
        assert await _echo_over_tls(port) == b"ping"
        server.close()

    _run(new_loop, main)


@pytest.mark.parametrize("new_loop", LOOPS)
def test_a_handshake_that_never_starts_is_closed_and_uncounted(
    new_loop: Callable[[], Any],
) -> None:
    async def main() -> None:
        guard = ConnectionGuard("test", per_source=5, total=5)
        server, gate = await _serve(guard, handshake=0.2)
        reader, writer = await _raw(_port(server), "127.0.0.2")
        await _until(lambda: guard.open == 1)
        async with asyncio.timeout(20):
            assert await reader.read() == b""  # the router gave up on it
        await _until(lambda: guard.open == 0 and gate.live == 0)
        writer.close()
        server.close()

    _run(new_loop, main)


@pytest.mark.parametrize("new_loop", LOOPS)
def test_a_promoted_connection_leaves_the_first_guard_for_the_second(
    new_loop: Callable[[], Any],
) -> None:
    async def main() -> None:
        pending = ConnectionGuard("pending", per_source=1, total=1)
        trusted = ConnectionGuard("trusted", per_source=1, total=1)
        server, gate = await _serve(pending)
        port = _port(server)
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=CLIENT)
        writer.write(b"hi")
        await reader.readexactly(2)
        peer = writer.get_extra_info("sockname")
        assert pending.open == 1 and trusted.open == 0
        assert gate.promote(peer, trusted)
        assert pending.open == 0 and trusted.open == 1
        # The room it left is free for another connection; a second promotion has none.
        other_reader, other_writer = await asyncio.open_connection("127.0.0.1", port, ssl=CLIENT)
        other_writer.write(b"hi")
        await other_reader.readexactly(2)
        assert not gate.promote(other_writer.get_extra_info("sockname"), trusted)
        assert pending.open == 1 and trusted.open == 1
        writer.close()
        other_writer.close()
        await _until(lambda: pending.open == 0 and trusted.open == 0 and gate.live == 0)
        assert gate.promote(peer, trusted)  # gone already: nothing to count
        server.close()

    _run(new_loop, main)


def test_an_unknown_peer_is_let_through() -> None:
    async def main() -> None:
        guard = ConnectionGuard("test", 1, 1)
        gate = TlsGate(guard, SERVER, _Echo, 1.0)
        assert gate.promote(None, guard) and gate.promote(("1.2.3.4", 5), guard)

    _run(asyncio.new_event_loop, main)


@pytest.mark.parametrize("new_loop", LOOPS)
def test_many_clients_at_once_all_finish_their_handshake(new_loop: Callable[[], Any]) -> None:
    """A loop may read a ClientHello before TLS has the socket; the gate hands it over."""

    async def main() -> None:
        guard = ConnectionGuard("test", per_source=200, total=200)
        server, gate = await _serve(guard)
        port = _port(server)
        answers = await asyncio.gather(*(_echo_over_tls(port) for _ in range(100)))
        assert answers == [b"ping"] * 100
        await _until(lambda: guard.open == 0 and gate.live == 0)
        server.close()

    _run(new_loop, main)
