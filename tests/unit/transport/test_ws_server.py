"""The router's end of the link (transport/ws_server.py) behind a real aiohttp listener, driven
by the agent's client, by aiohttp's client, and by raw sockets that misbehave."""

from __future__ import annotations

import asyncio
import base64
import math
import os
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import WSMsgType, web

from hivenet_router.http1 import coalesce
from hivenet_router.http1.coalesce import FLUSH_AT
from hivenet_router.transport import websocket, ws_server
from hivenet_router.transport.websocket import BINARY, CLOSE, CLOSED, ERROR, Message
from hivenet_router.transport.wsframes import (
    OP_BINARY,
    OP_CLOSE,
    OP_CONTINUATION,
    OP_PING,
    OP_PONG,
    OP_TEXT,
    accept_key,
    encode_frame,
)
from tests.counting import CountingTransport
from tests.linkpair import echo_every_length, serve_ws, ws_url

MAX = 1 << 20


@dataclass
class Server:
    url: str
    port: int
    runner: web.AppRunner
    sockets: list[ws_server.ServerWebSocket] = field(default_factory=list)
    ends: list[Message] = field(default_factory=list)  # what ended each echo loop


Factory = Callable[..., Awaitable[Server]]


@pytest.fixture
async def make_server() -> AsyncIterator[Factory]:
    """An echo server on ws_server: binary messages come back; `heartbeat` and `max_size`
    as given."""
    runners: list[web.AppRunner] = []

    async def make(heartbeat: float | None = None, max_size: int = MAX) -> Server:
        async def accept(request: web.Request) -> web.StreamResponse:
            try:
                response, ws = await ws_server.accept(
                    request, max_size=max_size, heartbeat=heartbeat
                )
            except ws_server.UpgradeRefused as exc:
                return web.json_response({"error": str(exc)}, status=exc.status)
            server.sockets.append(ws)
            while True:
                message = await ws.receive()
                if message.type != BINARY:
                    server.ends.append(message)
                    break
                assert isinstance(message.data, bytes)
                await ws.send_bytes(message.data)
            await ws.close(timeout=0.5)
            return response

        runner = await serve_ws(accept)
        runners.append(runner)
        url = ws_url(runner)
        server = Server(url, runner.addresses[0][1], runner)
        return server

    yield make
    for runner in runners:
        await runner.cleanup()


async def _wait_for(check: Callable[[], bool], seconds: float = 5.0) -> None:
    async with asyncio.timeout(seconds):
        while not check():
            await asyncio.sleep(0.01)


# -- a raw client ------------------------------------------------------------------------------


@dataclass
class Raw:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    head: str

    async def frame(self) -> tuple[int, bytes]:
        """The next frame from the server, which must not be masked."""
        first, second = await self.reader.readexactly(2)
        assert not second & 0x80, "a server frame arrived masked"
        size = second & 0x7F
        if size == 126:
            (size,) = struct.unpack("!H", await self.reader.readexactly(2))
        elif size == 127:
            (size,) = struct.unpack("!Q", await self.reader.readexactly(8))
        return first & 0x0F, await self.reader.readexactly(size)

    async def close_code(self) -> int:
        """Read up to the server's close frame; its code."""
        while True:
            opcode, payload = await asyncio.wait_for(self.frame(), 5)
            if opcode == OP_CLOSE:
                return int(struct.unpack("!H", payload[:2])[0])

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    def close(self) -> None:
        self.writer.close()


def _upgrade(key: str, headers: dict[str, str]) -> bytes:
    fields = {
        "Host": "127.0.0.1",
        "Upgrade": "websocket",
        "Connection": "Upgrade",
        "Sec-WebSocket-Key": key,
        "Sec-WebSocket-Version": "13",
        **headers,
    }
    lines = ["GET /ws HTTP/1.1", *(f"{k}: {v}" for k, v in fields.items() if v)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def raw_client(
    port: int, *, trailing: bytes = b"", headers: dict[str, str] | None = None
) -> Raw:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write(_upgrade(key, headers or {}) + trailing)
    head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).decode()
    if head.startswith("HTTP/1.1 101"):
        assert f"\r\nSec-WebSocket-Accept: {accept_key(key)}\r\n" in head
    return Raw(reader, writer, head)


def masked(opcode: int, payload: bytes, final: bool = True) -> bytes:
    frame = encode_frame(opcode, payload, masked=True)
    return frame if final else bytes((frame[0] & 0x7F,)) + frame[1:]


# -- the tests ---------------------------------------------------------------------------------


async def test_the_agents_client_and_messages_of_every_length_encoding(
    make_server: Factory,
) -> None:
    server = await make_server()
    ws = await websocket.connect(server.url, ssl_context=None, headers={}, max_size=MAX)
    await echo_every_length(ws)
    await ws.close()
    await _wait_for(lambda: len(server.ends) == 1)
    assert server.ends[0] == Message(CLOSE, 1000)


async def test_aiohttps_client_speaks_to_it(make_server: Factory) -> None:
    server = await make_server()
    async with aiohttp.ClientSession() as http, http.ws_connect(server.url) as ws:
        for payload in (b"", b"hello", os.urandom(70_000)):
            await ws.send_bytes(payload)
            message = await asyncio.wait_for(ws.receive(), 5)
            assert message.type == WSMsgType.BINARY and message.data == payload
        await ws.ping(b"are you there")  # answered by the server, consumed by aiohttp
        await ws.send_bytes(b"after the ping")
        assert (await asyncio.wait_for(ws.receive(), 5)).data == b"after the ping"
        await ws.close()
        assert ws.close_code == 1000


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"Upgrade": ""}, 400),
        ({"Connection": "keep-alive"}, 400),
        ({"Sec-WebSocket-Version": "8"}, 400),
        ({"Sec-WebSocket-Key": "bm90IDE2IGJ5dGVz"}, 400),  # "not 16 bytes"
        ({"Sec-WebSocket-Key": "!!!"}, 400),
    ],
)
async def test_bad_handshakes_are_refused_before_the_upgrade(
    make_server: Factory, headers: dict[str, str], status: int
) -> None:
    server = await make_server()
    raw = await raw_client(server.port, headers=headers)
    assert raw.head.startswith(f"HTTP/1.1 {status}")
    raw.close()
    assert not server.sockets


async def test_fragments_are_reassembled_and_pings_answered_between_them(
    make_server: Factory,
) -> None:
    server = await make_server()
    raw = await raw_client(server.port)
    raw.send(masked(OP_BINARY, b"abc", final=False))
    raw.send(masked(OP_PING, b"p"))
    raw.send(masked(OP_CONTINUATION, b"def", final=False))
    raw.send(masked(OP_CONTINUATION, b"gh"))
    assert await asyncio.wait_for(raw.frame(), 5) == (OP_PONG, b"p")
    assert await asyncio.wait_for(raw.frame(), 5) == (OP_BINARY, b"abcdefgh")
    raw.send(masked(OP_CLOSE, struct.pack("!H", 1000)))
    assert await raw.close_code() == 1000
    assert await asyncio.wait_for(raw.reader.read(), 5) == b""  # the server hangs up first
    raw.close()


async def test_bytes_sent_right_behind_the_upgrade_are_not_lost(make_server: Factory) -> None:
    server = await make_server()
    raw = await raw_client(server.port, trailing=masked(OP_BINARY, b"eager"))
    assert await asyncio.wait_for(raw.frame(), 5) == (OP_BINARY, b"eager")
    raw.close()


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (encode_frame(OP_BINARY, b"plain", masked=False), 1002),  # a client must mask
        (masked(OP_TEXT, b"text"), 1002),
        (bytes((0xC2, 0x81)) + b"kkkk" + b"r", 1002),  # a reserved bit
        (masked(OP_CONTINUATION, b"orphan"), 1002),
        (masked(OP_PING, b"x" * 126), 1002),  # a control frame too long
        (masked(OP_BINARY, b"x" * 101), 1009),  # over max_size
    ],
)
async def test_protocol_errors_close_with_their_code(
    make_server: Factory, frame: bytes, code: int
) -> None:
    server = await make_server(max_size=100)
    raw = await raw_client(server.port)
    raw.send(frame)
    assert await raw.close_code() == code
    await _wait_for(lambda: len(server.ends) == 1)
    assert server.ends[0].type == ERROR and "protocol error" in str(server.ends[0].data)
    raw.close()


async def test_a_message_over_the_limit_in_fragments_is_refused(make_server: Factory) -> None:
    server = await make_server(max_size=100)
    raw = await raw_client(server.port)
    raw.send(masked(OP_BINARY, b"x" * 60, final=False) + masked(OP_CONTINUATION, b"y" * 60))
    assert await raw.close_code() == 1009
    raw.close()


async def test_the_server_closes_with_a_bounded_handshake(make_server: Factory) -> None:
    server = await make_server()
    raw = await raw_client(server.port)
    await _wait_for(lambda: len(server.sockets) == 1)
    closing = asyncio.create_task(server.sockets[0].close(code=1001, timeout=5))
    assert await raw.close_code() == 1001
    assert not closing.done()  # it waits for the client's answer
    raw.send(masked(OP_CLOSE, struct.pack("!H", 1000)))
    assert await asyncio.wait_for(closing, 5)
    assert await asyncio.wait_for(raw.reader.read(), 5) == b""
    raw.close()
    # A client that never answers is given up after the timeout.
    silent = await raw_client(server.port)
    await _wait_for(lambda: len(server.sockets) == 2)
    async with asyncio.timeout(2):
        await server.sockets[1].close(timeout=0.2)
    assert server.sockets[1].closed
    silent.close()


async def test_a_silent_client_is_pinged_then_given_up(make_server: Factory) -> None:
    server = await make_server(heartbeat=0.2)
    raw = await raw_client(server.port)
    assert await asyncio.wait_for(raw.frame(), 5) == (OP_PING, b"")
    await _wait_for(lambda: len(server.ends) == 1)
    assert server.ends[0].type == ERROR and "ping" in str(server.ends[0].data)
    assert await raw.close_code() == 1011
    raw.close()


async def test_a_client_that_answers_pings_stays(make_server: Factory) -> None:
    server = await make_server(heartbeat=0.2)
    ws = await websocket.connect(server.url, ssl_context=None, headers={}, max_size=MAX)
    await asyncio.sleep(1.0)  # several heartbeats, each ping answered by the client
    await ws.send_bytes(b"still here")
    assert (await asyncio.wait_for(ws.receive(), 5)).data == b"still here"
    assert not server.ends
    await ws.close()


async def test_a_lost_client_ends_the_websocket_and_aiohttps_connection(
    make_server: Factory,
) -> None:
    server = await make_server()
    raw = await raw_client(server.port)
    await _wait_for(lambda: len(server.sockets) == 1)
    aio = server.runner.server
    assert aio is not None and len(aio.connections) == 1
    raw.writer.transport.abort()
    await _wait_for(lambda: len(server.ends) == 1)
    assert server.ends[0].type == CLOSED
    await _wait_for(lambda: not aio.connections)
    with pytest.raises(ConnectionResetError):
        await server.sockets[0].send_bytes(b"too late")


async def test_frames_of_one_turn_leave_in_one_write_and_big_ones_at_once(
    make_server: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # However slow the machine, this turn's writes are not old enough to go early.
    monkeypatch.setattr(coalesce, "MAX_WAIT", math.inf)
    server = await make_server()
    raw = await raw_client(server.port)
    await _wait_for(lambda: len(server.sockets) == 1)
    socket = server.sockets[0]
    assert socket._transport is not None
    counting = CountingTransport(socket._transport)
    socket._transport = counting  # type: ignore[assignment]
    for n in range(5):
        await socket.send_bytes(b"small %d" % n)
    assert counting.writes == []  # nothing yet: the turn of the loop has not ended
    await asyncio.sleep(0)
    assert len(counting.writes) == 1
    for n in range(5):
        assert await asyncio.wait_for(raw.frame(), 5) == (OP_BINARY, b"small %d" % n)
    big = os.urandom(FLUSH_AT)
    await socket.send_bytes(big)
    assert len(counting.writes) == 2  # past FLUSH_AT: written without waiting
    assert await asyncio.wait_for(raw.frame(), 5) == (OP_BINARY, big)
    raw.close()


async def test_send_waits_while_the_client_does_not_read(make_server: Factory) -> None:
    server = await make_server()
    raw = await raw_client(server.port)
    await _wait_for(lambda: len(server.sockets) == 1)
    socket = server.sockets[0]
    chunk = os.urandom(60_000)
    sent = 0
    blocked = False
    for _ in range(2000):  # at most 120 MB: far past any socket buffer
        try:
            await asyncio.wait_for(socket.send_bytes(chunk), 0.2)
        except TimeoutError:
            blocked = True
            break
        sent += 1
    assert blocked, "send_bytes never waited for a client that does not read"
    assert socket._paused
    # The client reads again: the writer is released (the frame of the send that timed out
    # was written before it waited).
    for _ in range(sent + 1):
        opcode, payload = await asyncio.wait_for(raw.frame(), 10)
        assert opcode == OP_BINARY and payload == chunk
    await _wait_for(lambda: not socket._paused)
    await asyncio.wait_for(socket.send_bytes(b"flowing"), 5)
    raw.close()
