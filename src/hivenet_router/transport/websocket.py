"""An open WebSocket on an asyncio transport, and the agent's end of the link: the client.

The agent needs one thing from a WebSocket library: binary messages to and from the router
over TLS. Doing it here, rather than with a general HTTP client, keeps the agent's process
small (no HTTP client framework imported at all) and hands each message to the link as soon
as its bytes are parsed. The router's end (transport/ws_server.py) is the same `WebSocket`
in the server role. What it does (the frame codec is transport/wsframes.py):

- the opening handshake of the client (one GET with Upgrade, checked against
  Sec-WebSocket-Accept);
- binary messages out (masked by a client, not by a server) and in, reassembled from
  fragments, each bounded by `max_size`; a text message, a frame masked the wrong way or a
  reserved bit is a protocol error that closes the connection;
- pings answered with pongs; a ping sent after `heartbeat` seconds without a byte from the
  peer, and the connection given up if nothing arrives within half that again;
- the closing handshake, bounded in time;
- backpressure: `send_bytes` waits while the socket's write buffer is full;
- the frames sent within one turn of the event loop leave in one write (one TLS record, one
  system call), so many small frames cost about as much as one.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import ssl
from collections import deque
from urllib.parse import urlsplit

import httptools

from hivenet_router.http1.coalesce import TurnWriter
from hivenet_router.transport.wsframes import (
    BINARY,
    CLOSE,
    CLOSE_INTERNAL,
    CLOSE_NORMAL,
    CLOSE_PROTOCOL_ERROR,
    CLOSED,
    ERROR,
    OP_BINARY,
    OP_CLOSE,
    OP_PING,
    OP_PONG,
    SHORT,
    FrameReader,
    Message,
    ProtocolError,
    accept_key,
    encode_frame,
)

# How long a closing client waits for its connection to go once the WebSocket is closed
# (TLS says goodbye too); past it the connection is aborted.
GONE_WAIT = 1.0

__all__ = [
    "BINARY",
    "CLOSE",
    "CLOSED",
    "ERROR",
    "FrameReader",
    "HandshakeError",
    "Message",
    "ProtocolError",
    "WebSocket",
    "WebSocketClient",
    "connect",
    "encode_frame",
]


def lost_words(exc: BaseException | None) -> str:
    """Why a connection was lost, in an operator's words (the peer is "it")."""
    if exc is None:
        return "it closed the connection without a goodbye (as a killed process does)"
    if isinstance(exc, ConnectionResetError):
        return "its connection was reset (its process or host went away)"
    if isinstance(exc, TimeoutError):
        return "the connection timed out (its host or the network went away)"
    if isinstance(exc, OSError) and exc.strerror:
        return f"the connection failed: {exc.strerror}"
    return f"the connection failed: {exc or type(exc).__name__}"


class HandshakeError(ConnectionError):
    """The server did not accept the WebSocket (its status, or a bad handshake)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class SocketProtocol(asyncio.Protocol):
    """Hands the transport's events to one WebSocket."""

    def __init__(self, socket: WebSocket) -> None:
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


class WebSocket:
    """One open WebSocket; `receive` gives messages the way aiohttp's does. `client` picks
    the role: a client masks what it sends and refuses masked frames, a server the reverse."""

    def __init__(self, max_size: int, heartbeat: float | None, *, client: bool) -> None:
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._masked = client
        self._reader = FrameReader(max_size, masked=not client)
        self._heartbeat = heartbeat
        self._messages: deque[Message] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._drain: asyncio.Future[None] | None = None
        self._paused = False
        self._closed = False
        self._close_sent = False
        self._close_received: asyncio.Future[None] = self._loop.create_future()
        self._last_received = self._loop.time()
        # Why it ended, in words (the peer is "it"): the first of a goodbye, a failure, a
        # close from this side or the connection's loss. Empty while it is open.
        self.ended = ""
        self._pinger: asyncio.Task[None] | None = None
        self._queue = TurnWriter(self._loop, self._send_now)  # frames of this loop turn

    def _start(self) -> None:
        """The connection is open: start watching it."""
        self._last_received = self._loop.time()
        if self._heartbeat:
            self._pinger = self._loop.create_task(self._ping_forever(self._heartbeat))

    # -- receiving ----------------------------------------------------------------------------

    def _on_data(self, data: bytes) -> None:
        self._last_received = self._loop.time()
        if self._closed:
            return
        try:
            messages = self._reader.feed(data)
        except ProtocolError as exc:
            self._fail(f"protocol error: {exc}", self._error_code(exc))
            return
        for opcode, payload in messages:
            if opcode == OP_BINARY:
                self._push(Message(BINARY, payload))
            elif opcode == OP_PING:
                self._write(encode_frame(OP_PONG, payload, self._masked))
            elif opcode == OP_CLOSE:
                self._on_close_frame(payload)
                return

    def _error_code(self, error: ProtocolError) -> int:
        return CLOSE_PROTOCOL_ERROR

    def _on_close_frame(self, payload: bytes) -> None:
        code = SHORT.unpack_from(payload)[0] if len(payload) >= 2 else 1005
        self.ended = self.ended or f"it said goodbye (WebSocket close code {code})"
        if not self._close_received.done():
            self._close_received.set_result(None)
        if not self._close_sent:
            self._close_sent = True
            self._write(encode_frame(OP_CLOSE, SHORT.pack(CLOSE_NORMAL), self._masked))
        self._push(Message(CLOSE, code))
        self._closed = True
        self._close_transport()

    def _fail(self, reason: str, code: int) -> None:
        if self._closed:
            return
        self.ended = self.ended or reason
        if not self._close_sent:
            self._close_sent = True
            self._write(encode_frame(OP_CLOSE, SHORT.pack(code), self._masked))
        self._closed = True
        self._push(Message(ERROR, reason))
        self._close_transport()

    def _on_lost(self, exc: Exception | None) -> None:
        self.ended = self.ended or lost_words(exc)
        self._queue.drop()
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
                if timeout is None:  # the link's reader: no timer per message
                    await self._waiter
                else:
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
        """Queue a frame: the frames of one event-loop turn leave in one write (one TLS
        record, one system call); see http1/coalesce.py."""
        transport = self._transport
        if transport is not None and not transport.is_closing():
            self._queue.add(data)

    def _flush(self) -> None:
        self._queue.flush()

    def _send_now(self, data: bytes) -> None:
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.write(data)

    def _close_transport(self) -> None:
        self._flush()  # a close frame, or frames before it, may still wait for the turn's end
        if self._transport is not None:
            self._transport.close()

    def _resume(self) -> None:
        self._paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    async def send_bytes(self, data: bytes) -> None:
        transport = self._transport
        if self._closed or self._close_sent or transport is None or transport.is_closing():
            raise ConnectionResetError("the WebSocket is closed")
        self._write(encode_frame(OP_BINARY, data, self._masked))
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
            self._write(encode_frame(OP_PING, b"", self._masked))
            await asyncio.sleep(interval / 2)
            if self._loop.time() - self._last_received >= interval * 1.5:
                self._fail(
                    f"it sent nothing for {interval * 1.5:g}s, not even the answer to a ping "
                    "(its host or the network is down, or it is stuck)",
                    CLOSE_INTERNAL,
                )

    # -- closing ------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed or self._close_sent

    async def close(
        self, *, code: int = CLOSE_NORMAL, message: bytes = b"", timeout: float = 2.0
    ) -> bool:
        """Say goodbye, wait (bounded) for the peer's, then close the socket."""
        if self._pinger is not None:
            self._pinger.cancel()
        self.ended = self.ended or "closed by this side"
        if not self._close_sent and not self._closed:
            self._close_sent = True
            self._write(encode_frame(OP_CLOSE, SHORT.pack(code) + message[:123], self._masked))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await asyncio.shield(self._close_received)
        self._closed = True
        self._close_transport()
        return True


class WebSocketClient(WebSocket):
    """The client end: the opening handshake over the transport, then a `WebSocket`."""

    def __init__(self, max_size: int, heartbeat: float | None) -> None:
        super().__init__(max_size, heartbeat, client=True)
        self._handshake: asyncio.Future[bytes] = self._loop.create_future()
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self._status = 0
        self._accept = ""
        self._upgrade = False  # Upgrade: websocket
        self._connection = False  # Connection: ... upgrade ...
        self._gone: asyncio.Future[None] = self._loop.create_future()  # the connection is lost

    # -- the handshake (httptools callbacks) -----------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"sec-websocket-accept":
            self._accept = value.decode("latin-1")
        elif name == b"upgrade":
            self._upgrade = value.strip().lower() == b"websocket"
        elif name == b"connection":
            self._connection = b"upgrade" in (t.strip() for t in value.lower().split(b","))

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
        async with asyncio.timeout(timeout):
            rest = await self._handshake
        if self._status != 101:
            raise HandshakeError(f"server answered {self._status}, not 101", self._status)
        if self._accept != accept_key(key):
            raise HandshakeError("server sent a wrong Sec-WebSocket-Accept")
        if not (self._upgrade and self._connection):
            raise HandshakeError("server's 101 lacks Upgrade: websocket or Connection: Upgrade")
        self._last_received = self._loop.time()
        if rest:
            self._on_data(rest)
        if self._heartbeat:
            self._pinger = self._loop.create_task(self._ping_forever(self._heartbeat))

    def _on_data(self, data: bytes) -> None:
        if self._parser is None:
            super()._on_data(data)
            return
        self._last_received = self._loop.time()
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

    def _on_lost(self, exc: Exception | None) -> None:
        if not self._handshake.done():
            self._handshake.set_exception(ConnectionResetError("connection lost in handshake"))
            self._handshake.exception()
        if not self._gone.done():
            self._gone.set_result(None)
        super()._on_lost(exc)

    async def close(
        self, *, code: int = CLOSE_NORMAL, message: bytes = b"", timeout: float = 2.0
    ) -> bool:
        """Close the WebSocket, then wait (bounded) until the connection itself is gone: a
        closed client holds no socket, even when the server never answers TLS's goodbye."""
        closed = await super().close(code=code, message=message, timeout=timeout)
        if not await self._wait_gone() and self._transport is not None:
            self._transport.abort()  # TLS's goodbye went unanswered
            await self._wait_gone()  # the socket is closed a loop turn after the abort
        return closed

    async def _wait_gone(self) -> bool:
        """Whether the connection ended within GONE_WAIT."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(GONE_WAIT):
                await asyncio.shield(self._gone)
        return self._gone.done()


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
            lambda: SocketProtocol(socket),
            parts.hostname,
            port,
            ssl=(ssl_context or ssl.create_default_context()) if secure else None,
            server_hostname=parts.hostname if secure else None,
        )
    try:
        await socket._open(path, f"{host}:{port}", headers, timeout)
    except BaseException:
        # A WebSocket that never opened has nothing to say goodbye with: the connection
        # goes at once rather than after a TLS shutdown nobody waits for.
        if socket._transport is not None:
            socket._transport.abort()
        raise
    return socket
