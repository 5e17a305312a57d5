"""The agent's end of the link: a WebSocket client (RFC 6455) on an asyncio protocol.

The agent needs one thing from a WebSocket library: binary messages to and from the router
over TLS. Doing it here, rather than with a general HTTP client, keeps the agent's process
small (no HTTP client framework imported at all) and hands each message to the link as soon
as its bytes are parsed. What it does:

- the opening handshake (one GET with Upgrade, checked against Sec-WebSocket-Accept);
- binary messages out, masked as a client must, and in, reassembled from fragments, each
  bounded by `max_size`; a text message, a masked server frame or a reserved bit is a
  protocol error that closes the connection;
- pings answered with pongs; a ping sent after `heartbeat` seconds without a byte from the
  router, and the connection given up if nothing arrives within half that again;
- the closing handshake, bounded in time;
- backpressure: `send_bytes` waits while the socket's write buffer is full.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import os
import ssl
import struct
from collections import deque
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

# Message kinds, with the values aiohttp's WSMsgType uses, so that the link reads both.
BINARY = 2
CLOSE = 8
CLOSED = 257
ERROR = 258

_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
_OP_CONTINUATION, _OP_TEXT, _OP_BINARY = 0x0, 0x1, 0x2
_OP_CLOSE, _OP_PING, _OP_PONG = 0x8, 0x9, 0xA
_SHORT = struct.Struct("!H")
_LONG = struct.Struct("!Q")


class HandshakeError(ConnectionError):
    """The server did not accept the WebSocket (its status, or a bad handshake)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Message:
    type: int
    data: object = None  # bytes for BINARY, the close code for CLOSE, a reason for ERROR


def mask(payload: bytes, key: bytes) -> bytes:
    """XOR `payload` with the repeated 4-byte `key` (its own inverse)."""
    size = len(payload)
    if not size:
        return payload
    stream = (key * (size // 4 + 1))[:size]
    value = int.from_bytes(payload, "little") ^ int.from_bytes(stream, "little")
    return value.to_bytes(size, "little")


def encode_frame(opcode: int, payload: bytes, masked: bool = True) -> bytes:
    size = len(payload)
    first = 0x80 | opcode
    bit = 0x80 if masked else 0
    if size < 126:
        head = bytes((first, bit | size))
    elif size < 1 << 16:
        head = bytes((first, bit | 126)) + _SHORT.pack(size)
    else:
        head = bytes((first, bit | 127)) + _LONG.pack(size)
    if not masked:
        return head + payload
    key = os.urandom(4)
    return head + key + mask(payload, key)


class ProtocolError(Exception):
    pass


class FrameReader:
    """Server frames in, whole messages out."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._buffer = bytearray()
        self._fragments: list[bytes] = []
        self._fragment_size = 0

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """(opcode, payload) of every complete message or control frame in `data`."""
        buffer = self._buffer
        buffer += data
        out: list[tuple[int, bytes]] = []
        while True:
            if len(buffer) < 2:
                break
            first, second = buffer[0], buffer[1]
            if first & 0x70:
                raise ProtocolError("reserved bits set")
            if second & 0x80:
                raise ProtocolError("the server masked a frame")
            opcode, final, size = first & 0x0F, bool(first & 0x80), second & 0x7F
            start = 2
            if size == 126:
                if len(buffer) < 4:
                    break
                (size,) = _SHORT.unpack_from(buffer, 2)
                start = 4
            elif size == 127:
                if len(buffer) < 10:
                    break
                (size,) = _LONG.unpack_from(buffer, 2)
                start = 10
            if opcode >= 0x8 and (size > 125 or not final):
                raise ProtocolError("control frame too long or fragmented")
            if size > self.max_size:
                raise ProtocolError(f"frame of {size} bytes over the limit of {self.max_size}")
            if len(buffer) < start + size:
                break
            payload = bytes(buffer[start : start + size])
            del buffer[: start + size]
            message = self._assemble(opcode, final, payload)
            if message is not None:
                out.append(message)
        return out

    def _assemble(self, opcode: int, final: bool, payload: bytes) -> tuple[int, bytes] | None:
        if opcode >= 0x8:
            return opcode, payload
        if opcode == _OP_TEXT:
            raise ProtocolError("text messages are not part of the link protocol")
        if opcode == _OP_BINARY:
            if self._fragments:
                raise ProtocolError("a new message before the last one ended")
            if final:
                return opcode, payload
        elif opcode == _OP_CONTINUATION:
            if not self._fragments:
                raise ProtocolError("a continuation without a message")
        else:
            raise ProtocolError(f"unknown opcode {opcode:#x}")
        self._fragment_size += len(payload)
        if self._fragment_size > self.max_size:
            raise ProtocolError(f"message over the limit of {self.max_size} bytes")
        self._fragments.append(payload)
        if not final:
            return None
        whole = b"".join(self._fragments)
        self._fragments, self._fragment_size = [], 0
        return _OP_BINARY, whole


class _Protocol(asyncio.Protocol):
    def __init__(self, socket: WebSocketClient) -> None:
        self._socket = socket

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._socket._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._socket._on_data(data)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._socket._on_lost(exc)

    def pause_writing(self) -> None:
        self._socket._paused = True

    def resume_writing(self) -> None:
        self._socket._resume()


class WebSocketClient:
    """One client WebSocket; `receive` gives messages the way aiohttp's does."""

    def __init__(self, max_size: int, heartbeat: float | None) -> None:
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._reader = FrameReader(max_size)
        self._heartbeat = heartbeat
        self._messages: deque[Message] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._drain: asyncio.Future[None] | None = None
        self._paused = False
        self._closed = False
        self._close_sent = False
        self._close_received: asyncio.Future[None] = self._loop.create_future()
        self._last_received = self._loop.time()
        self._pinger: asyncio.Task[None] | None = None
        # the handshake
        self._handshake: asyncio.Future[bytes] = self._loop.create_future()
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self._status = 0
        self._accept = ""

    # -- the handshake --------------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"sec-websocket-accept":
            self._accept = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        assert self._parser is not None
        self._status = self._parser.get_status_code()

    def on_message_complete(self) -> None:
        # A 101 ends here too, just before the parser stops at the upgrade.
        if self._status != 101 and not self._handshake.done():
            self._handshake.set_exception(
                HandshakeError(f"server answered {self._status}, not 101", self._status)
            )

    async def _open(self, path: str, host: str, headers: dict[str, str], timeout: float) -> None:
        key = base64.b64encode(os.urandom(16)).decode()
        lines = [
            f"GET {path} HTTP/1.1",
            f"Host: {host}",
            "Upgrade: websocket",
            "Connection: Upgrade",
            f"Sec-WebSocket-Key: {key}",
            "Sec-WebSocket-Version: 13",
            *(f"{name}: {value}" for name, value in headers.items()),
        ]
        assert self._transport is not None
        self._transport.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        # SHA-1 is what RFC 6455 prescribes for this check; it guards nothing secret.
        digest = hashlib.sha1(key.encode() + _GUID, usedforsecurity=False).digest()
        expected = base64.b64encode(digest).decode()
        async with asyncio.timeout(timeout):
            rest = await self._handshake
        if self._status != 101:
            raise HandshakeError(f"server answered {self._status}, not 101", self._status)
        if self._accept != expected:
            raise HandshakeError("server sent a wrong Sec-WebSocket-Accept")
        self._last_received = self._loop.time()
        if rest:
            self._on_data(rest)
        if self._heartbeat:
            self._pinger = self._loop.create_task(self._ping_forever(self._heartbeat))

    # -- receiving ----------------------------------------------------------------------------

    def _on_data(self, data: bytes) -> None:
        self._last_received = self._loop.time()
        if self._parser is not None:
            try:
                self._parser.feed_data(data)
            except httptools.HttpParserUpgrade as upgrade:
                self._parser = None
                offset = upgrade.args[0] if upgrade.args else len(data)
                if not self._handshake.done():
                    self._handshake.set_result(data[offset:])
            except httptools.HttpParserError as exc:
                if not self._handshake.done():
                    self._handshake.set_exception(HandshakeError(f"bad handshake: {exc}"))
            return
        if self._closed:
            return
        try:
            messages = self._reader.feed(data)
        except ProtocolError as exc:
            self._fail(f"protocol error: {exc}", 1002)
            return
        for opcode, payload in messages:
            if opcode == _OP_BINARY:
                self._push(Message(BINARY, payload))
            elif opcode == _OP_PING:
                self._write(encode_frame(_OP_PONG, payload))
            elif opcode == _OP_CLOSE:
                self._on_close_frame(payload)
                return

    def _on_close_frame(self, payload: bytes) -> None:
        code = _SHORT.unpack_from(payload)[0] if len(payload) >= 2 else 1005
        if not self._close_received.done():
            self._close_received.set_result(None)
        if not self._close_sent:
            self._close_sent = True
            self._write(encode_frame(_OP_CLOSE, _SHORT.pack(1000)))
        self._push(Message(CLOSE, code))
        self._closed = True
        if self._transport is not None:
            self._transport.close()

    def _fail(self, reason: str, code: int) -> None:
        if self._closed:
            return
        if not self._close_sent:
            self._close_sent = True
            self._write(encode_frame(_OP_CLOSE, _SHORT.pack(code)))
        self._closed = True
        self._push(Message(ERROR, reason))
        if self._transport is not None:
            self._transport.close()

    def _on_lost(self, exc: Exception | None) -> None:
        if not self._handshake.done():
            self._handshake.set_exception(ConnectionResetError("connection lost in handshake"))
            self._handshake.exception()
        if not self._close_received.done():
            self._close_received.set_result(None)
        if self._pinger is not None:
            self._pinger.cancel()
        self._closed = True
        self._push(Message(CLOSED, None))
        self._resume()

    def _push(self, message: Message) -> None:
        self._messages.append(message)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def receive(self, timeout: float | None = None) -> Message:
        while not self._messages:
            self._waiter = self._loop.create_future()
            try:
                async with asyncio.timeout(timeout):
                    await self._waiter
            finally:
                self._waiter = None
        message = self._messages.popleft()
        if message.type == CLOSED:
            self._messages.appendleft(message)  # stays closed for any later reader
        return message

    # -- sending ------------------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.write(data)

    def _resume(self) -> None:
        self._paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    async def send_bytes(self, data: bytes) -> None:
        transport = self._transport
        if self._closed or self._close_sent or transport is None or transport.is_closing():
            raise ConnectionResetError("the WebSocket is closed")
        transport.write(encode_frame(_OP_BINARY, data))
        if self._paused:
            if self._drain is None or self._drain.done():
                self._drain = self._loop.create_future()
            await self._drain
            if self._closed:
                raise ConnectionResetError("the WebSocket closed while sending")

    async def _ping_forever(self, interval: float) -> None:
        while not self._closed:
            await asyncio.sleep(interval)
            if self._loop.time() - self._last_received < interval:
                continue
            self._write(encode_frame(_OP_PING, b""))
            await asyncio.sleep(interval / 2)
            if self._loop.time() - self._last_received >= interval * 1.5:
                self._fail("no answer to a ping", 1011)

    # -- closing ------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed or self._close_sent

    async def close(self, *, code: int = 1000, message: bytes = b"", timeout: float = 2.0) -> bool:
        """Say goodbye, wait (bounded) for the server's, then close the socket."""
        if self._pinger is not None:
            self._pinger.cancel()
        if not self._close_sent and not self._closed:
            self._close_sent = True
            self._write(encode_frame(_OP_CLOSE, _SHORT.pack(code) + message[:123]))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await asyncio.shield(self._close_received)
        self._closed = True
        if self._transport is not None:
            self._transport.close()
        return True


async def connect(
    url: str,
    *,
    ssl_context: ssl.SSLContext | None,
    headers: dict[str, str],
    max_size: int,
    heartbeat: float | None = None,
    timeout: float = 10.0,
) -> WebSocketClient:
    """Open a WebSocket to `url` (ws:// or wss://). Raises HandshakeError or OSError."""
    parts = urlsplit(url)
    secure = parts.scheme in ("wss", "https")
    if parts.scheme not in ("ws", "wss", "http", "https") or not parts.hostname:
        raise ValueError(f"not a WebSocket URL: {url!r}")
    port = parts.port or (443 if secure else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    socket = WebSocketClient(max_size, heartbeat)
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(timeout):
        await loop.create_connection(
            lambda: _Protocol(socket),
            parts.hostname,
            port,
            ssl=(ssl_context or ssl.create_default_context()) if secure else None,
            server_hostname=parts.hostname if secure else None,
        )
    try:
        await socket._open(path, f"{host}:{port}", headers, timeout)
    except BaseException:
        if socket._transport is not None:
            socket._transport.close()
        raise
    return socket
