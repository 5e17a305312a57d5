"""The agent's WebSocket client against aiohttp's server (what the router runs) and against
raw sockets that misbehave."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import math
import os
import ssl
from collections.abc import AsyncIterator

import pytest
from aiohttp import WSMsgType, web

from hivenet_router.http1 import coalesce
from hivenet_router.http1.coalesce import FLUSH_AT
from hivenet_router.transport import websocket
from hivenet_router.transport.tls import RouterTlsIdentity
from hivenet_router.transport.websocket import (
    CLOSE,
    ERROR,
    FrameReader,
    HandshakeError,
    ProtocolError,
    encode_frame,
)
from hivenet_router.transport.wsmask import mask
from tests.counting import CountingTransport
from tests.linkpair import echo_every_length, serve_ws, ws_url


@pytest.fixture
async def echo_url() -> AsyncIterator[str]:
    """An aiohttp WebSocket server that echoes binary messages and pings every 0.2 s."""

    async def accept(request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != "Bearer ok":
            return web.json_response({"error": "no"}, status=401)
        ws = web.WebSocketResponse(heartbeat=0.2, max_msg_size=1 << 20)
        await ws.prepare(request)
        async for message in ws:
            if message.type == WSMsgType.BINARY:
                await ws.send_bytes(message.data)
        return ws

    runner = await serve_ws(accept)
    yield ws_url(runner)
    await runner.cleanup()


async def open_echo(url: str, heartbeat: float | None = None) -> websocket.WebSocketClient:
    return await websocket.connect(
        url, ssl_context=None, headers={"Authorization": "Bearer ok"}, max_size=1 << 20,
        heartbeat=heartbeat,
    )  # fmt: skip


async def test_binary_messages_of_every_length_encoding_cross_both_ways(echo_url: str) -> None:
    ws = await open_echo(echo_url)
    await echo_every_length(ws)
    await ws.close()
    assert ws.closed


async def test_messages_of_one_turn_leave_in_one_write(
    echo_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # However slow the machine, this turn's writes are not old enough to go early.
    monkeypatch.setattr(coalesce, "MAX_WAIT", math.inf)
    ws = await open_echo(echo_url)
    assert ws._transport is not None
    counting = CountingTransport(ws._transport)
    ws._transport = counting  # type: ignore[assignment]
    for n in range(5):
        await ws.send_bytes(b"m%d" % n)
    assert counting.writes == []  # the loop's turn has not ended yet
    for n in range(5):
        message = await asyncio.wait_for(ws.receive(), 5)
        assert message.data == b"m%d" % n
    assert len(counting.writes) == 1
    await ws.send_bytes(b"x" * FLUSH_AT)  # a burst leaves without waiting
    assert len(counting.writes) == 2
    assert (await asyncio.wait_for(ws.receive(), 5)).data == b"x" * FLUSH_AT
    await ws.close()


async def test_server_pings_are_answered(echo_url: str) -> None:
    ws = await open_echo(echo_url)
    await asyncio.sleep(1.0)  # aiohttp closes a peer that leaves its pings unanswered
    await ws.send_bytes(b"still here")
    assert (await asyncio.wait_for(ws.receive(), 5)).data == b"still here"
    await ws.close()


async def test_a_refused_handshake_says_its_status(echo_url: str) -> None:
    with pytest.raises(HandshakeError) as info:
        await websocket.connect(echo_url, ssl_context=None, headers={}, max_size=1024)
    assert info.value.status == 401


async def read_upgrade(reader: asyncio.StreamReader) -> bytes:
    """Read a client's upgrade request; the Sec-WebSocket-Accept value that answers it,
    worked out here by hand (RFC 6455, 4.2.2) rather than by the code under test."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    key = next(
        line.split(":", 1)[1].strip()
        for line in head.split("\r\n")
        if line.lower().startswith("sec-websocket-key")
    )
    accept = key.encode() + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
    return base64.b64encode(hashlib.sha1(accept, usedforsecurity=False).digest())


async def accept_upgrade(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Read a client's upgrade request and accept it with a well-formed 101."""
    accept = await read_upgrade(reader)
    writer.write(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n"
    )


async def test_a_silent_server_is_given_up_after_the_heartbeat() -> None:
    done = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await accept_upgrade(reader, writer)
        await done.wait()  # never answers a ping
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    ws = await websocket.connect(
        f"ws://127.0.0.1:{port}/", ssl_context=None, headers={}, max_size=1024, heartbeat=0.2
    )
    message = await asyncio.wait_for(ws.receive(), 5)
    assert message.type == ERROR and "ping" in str(message.data)
    assert ws.ended.startswith("it sent nothing for 0.3s, not even the answer to a ping")
    await ws.close(timeout=0.1)
    done.set()
    server.close()
    await server.wait_closed()


def test_masking_is_its_own_inverse() -> None:
    payload = bytes(range(200))
    key = b"\x01\x02\x03\x04"
    assert mask(mask(payload, key), key) == payload
    assert mask(b"\x00\x00\x00\x00\x00", key) == b"\x01\x02\x03\x04\x01"


def test_fragments_are_reassembled_and_violations_refused() -> None:
    reader = FrameReader(max_size=100)
    first = bytes((0x02, 3)) + b"abc"  # binary, not final
    ping = bytes((0x89, 1)) + b"p"  # a control frame between fragments
    last = bytes((0x80, 2)) + b"de"  # continuation, final
    assert reader.feed(first + ping[:1]) == []
    assert reader.feed(ping[1:] + last) == [(0x9, b"p"), (0x2, b"abcde")]
    close = encode_frame(CLOSE, b"\x03\xe8", masked=False)
    assert reader.feed(close) == [(CLOSE, b"\x03\xe8")]
    for bad in (
        bytes((0x81, 1)) + b"t",  # text
        bytes((0x82, 0x81)) + b"kkkk" + b"m",  # masked by the server
        bytes((0xC2, 1)) + b"r",  # reserved bit
        bytes((0x82, 126)) + (101).to_bytes(2, "big"),  # over the limit
        bytes((0x89, 126)) + (126).to_bytes(2, "big"),  # control frame too long
        bytes((0x8B, 0)),  # a reserved control opcode
        bytes((0x88, 1)) + b"\x03",  # a close body of one byte
        bytes((0x88, 2)) + (1005).to_bytes(2, "big"),  # a code that is never sent
        bytes((0x88, 2)) + (999).to_bytes(2, "big"),  # a code out of range
        bytes((0x88, 4)) + (1000).to_bytes(2, "big") + b"\xff\xfe",  # a reason not UTF-8
    ):
        with pytest.raises(ProtocolError):
            FrameReader(max_size=100).feed(bad)
    good = bytes((0x88, 12)) + (4000).to_bytes(2, "big") + "bye, été".encode()
    assert FrameReader(max_size=100).feed(good) == [(CLOSE, good[2:])]


async def test_a_101_without_the_upgrade_headers_is_refused() -> None:
    async def half(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accept = await read_upgrade(reader)
        writer.write(  # the right accept key, but no Upgrade or Connection header
            b"HTTP/1.1 101 Switching Protocols\r\nSec-WebSocket-Accept: " + accept + b"\r\n\r\n"
        )
        await asyncio.wait_for(reader.read(), 5)  # until the client hangs up
        writer.close()
        await writer.wait_closed()
        finished.set()

    finished = asyncio.Event()
    server = await asyncio.start_server(half, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    with pytest.raises(HandshakeError, match="Upgrade"):
        await websocket.connect(
            f"ws://127.0.0.1:{port}/", ssl_context=None, headers={}, max_size=1024
        )
    await asyncio.wait_for(finished.wait(), 5)  # the client closed its connection
    server.close()
    await server.wait_closed()


@pytest.fixture
def tls_pair() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A router's server context and an agent's client context for one secret (made outside
    the event loop: the server context writes its key to a scratch folder)."""
    identity = RouterTlsIdentity.from_secret(b"w" * 32)
    return identity.server_context(), identity.client_context()


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_a_closed_client_holds_no_socket_when_the_server_goes_silent(
    tls_pair: tuple[ssl.SSLContext, ssl.SSLContext],
) -> None:
    """A server that stops reading answers neither the close frame nor TLS's goodbye: the
    client's close gives up on both and aborts, so its socket is closed when close returns
    rather than when TLS's own shutdown timeout (30 s) ends it."""
    closed = asyncio.Event()

    async def deaf(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await accept_upgrade(reader, writer)
        writer.transport.pause_reading()
        await closed.wait()
        writer.transport.abort()

    server_tls, client_tls = tls_pair
    server = await asyncio.start_server(deaf, "127.0.0.1", 0, ssl=server_tls)
    port = server.sockets[0].getsockname()[1]
    try:
        ws = await websocket.connect(
            f"wss://127.0.0.1:{port}/", ssl_context=client_tls, headers={}, max_size=1024
        )
        both_ends = open_files()  # the client's socket and the server's end of it
        async with asyncio.timeout(websocket.GONE_WAIT + 5):
            await ws.close(timeout=0.2)
        assert open_files() == both_ends - 1  # the server's end alone
    finally:
        closed.set()
        server.close()


@pytest.mark.parametrize(
    ("error", "words"),
    [
        (None, "it closed the connection without a goodbye (as a killed process does)"),
        (ConnectionResetError(104, "Connection reset by peer"), "its connection was reset"),
        (TimeoutError(110, "Connection timed out"), "the connection timed out"),
        (OSError(113, "No route to host"), "the connection failed: No route to host"),
    ],
)
def test_a_lost_connection_is_described_in_words(error: OSError | None, words: str) -> None:
    described = websocket.lost_words(error)
    assert described.startswith(words)
    assert "Error(" not in described
