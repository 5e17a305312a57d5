"""A lean HTTP/1.1 client for the one engine an agent serves.

The agent sends every request to the same origin, so it needs neither URL joining, cookie
jars, redirects nor per-request timers, which are most of what a general client costs. This
one keeps a pool of keep-alive connections, writes a request head and body in one call,
parses answers with httptools (llhttp, as Node.js does) and hands the body over chunk by
chunk as it arrives, pausing the socket when the reader falls behind.

A connection taken from the pool may have been closed by the engine while idle; if it fails
before a single byte of answer arrived, the request is sent once more on a new connection
(nothing can have been processed: the engine closed the connection instead of reading it).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import deque
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

HIGH_WATER = 1 << 20  # buffered body bytes past which the socket stops being read
LOW_WATER = 1 << 18
# Bytes of an answer's header lines. An engine's are a few hundred; the agent relays them
# in one link frame of at most 64 KiB, whatever characters they hold.
HEAD_LIMIT = 16 * 1024


class EngineError(Exception):
    """The engine could not be reached, or broke its answer."""


class Unreachable(EngineError):
    """No connection to the engine could be made."""


class _Closed(EngineError):
    """The connection closed before any answer arrived."""


class _Unexpected(EngineError):
    """Raised from a parser callback: the engine sent what no request asked for."""


@dataclass(frozen=True, slots=True)
class Origin:
    scheme: str
    host: str
    port: int
    prefix: str  # a path the base URL carries, prepended to every request path

    @classmethod
    def parse(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, parts.hostname, port, parts.path.rstrip("/"))

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"


class _Gone:
    """Stands in for the parser of a closed connection."""

    def feed_data(self, data: bytes) -> None:
        pass


_GONE = _Gone()


class _Connection(asyncio.Protocol):
    """One socket to the engine and the parser of the answer on it."""

    def __init__(self, pool: EngineClient) -> None:
        self._pool = pool
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.busy = False  # an exchange is running (not idle in the pool)
        self._paused = False  # reading stopped: the body's reader fell behind
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.head: asyncio.Future[None] = self._loop.create_future()
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.complete = False
        self.keep_alive = False
        self.received = False
        self.error: EngineError | None = None
        self._readable: asyncio.Future[None] | None = None
        self._head_size = 0
        self._interim = False  # parsing a 1xx (100 Continue, 103 Early Hints): skipped
        self.resume()

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:  # raised by a callback below
            self._fail(EngineError(f"unusable answer from the engine: {exc.__context__ or exc}"))
            self.close()
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._fail(EngineError(f"malformed answer from the engine: {exc!r}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._parser = _GONE  # type: ignore[assignment]  # it points back at us
        if not self.complete and exc is None and self._ends_at_close():
            # An answer with neither a length nor chunks ends where the connection does.
            self.complete = True
            self._wake()
        if not self.complete:
            if self.received:
                self._fail(EngineError("the engine closed the connection mid-answer"))
            else:
                self._fail(_Closed("the engine closed the connection"))
        self._pool._forget(self)

    def _ends_at_close(self) -> bool:
        if not self.head.done() or self.error is not None or self.status in (204, 304):
            return False
        for name, value in self.headers:
            key = name.lower()
            if key == "content-length":
                return False
            if key == "transfer-encoding" and "chunked" in value.lower():
                return False
        return True

    # -- httptools callbacks ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete or not self.busy:
            # An answer nobody asked for (a second one to one request, or bytes on an idle
            # connection): whatever follows on this connection cannot be matched to a
            # request, so it is closed (data_received) rather than reused.
            raise _Unexpected("an answer to no request")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value) + 4
        if self._head_size > HEAD_LIMIT:
            raise EngineError(f"answer head over {HEAD_LIMIT} bytes")
        self.headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            # An interim answer: the final one follows on the same connection.
            self._interim = True
            self.headers = []
            self._head_size = 0
            return
        self.status = status
        if not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()
        self._wake()

    # -- for the response -----------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._readable
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: EngineError) -> None:
        if self.error is None:
            self.error = error
        if not self.head.done():
            self.head.set_exception(error)
            self.head.exception()  # retrieved: a request abandoned meanwhile never asks
        self._wake()

    async def next_chunk(self) -> bytes | None:
        while not self.chunks:
            if self.complete:
                return None
            if self.error is not None:
                raise self.error
            self._readable = self._loop.create_future()
            await self._readable
        chunks = self.chunks
        # Everything that has arrived goes on as one piece: a stream's events that are
        # ready together cross the link in one frame, not one frame each.
        chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered -= len(chunk)
        if self.buffered < LOW_WATER:
            self.resume()
        return chunk

    def resume(self) -> None:
        """Read the socket again (if the body's reader had fallen behind)."""
        if self._paused and self.transport is not None and not self.closed:
            self.transport.resume_reading()
        self._paused = False

    def send(self, data: bytes) -> None:
        """Start the next exchange on this connection (llhttp resets itself between
        messages, so the parser carries on)."""
        assert self.transport is not None
        self._reset()
        self.busy = True
        self.transport.write(data)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class EngineResponse:
    """An answer's head, and its body read as it comes. `release` (or reading to the end)
    returns the connection to the pool; abandoning it part-way closes the connection."""

    __slots__ = ("_conn", "_done", "headers", "status")

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status = conn.status
        self.headers = conn.headers
        self._done = False

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    @property
    def content_type(self) -> str:
        return (self.header("content-type") or "").split(";", 1)[0].strip().lower()

    async def next_chunk(self) -> bytes | None:
        """The next part of the body, or None at its end (which releases the connection)."""
        chunk = await self._conn.next_chunk()
        if chunk is None:
            self.release()
        return chunk

    async def read(self, limit: int, truncate: bool = False) -> bytes:
        """The whole body; past `limit` bytes, EngineError (or, with `truncate`, the first
        `limit` bytes, and the connection is closed)."""
        parts: list[bytes] = []
        size = 0
        while (chunk := await self.next_chunk()) is not None:
            size += len(chunk)
            if size > limit:
                self.release()
                if truncate:
                    parts.append(chunk)
                    return b"".join(parts)[:limit]
                raise EngineError(f"answer larger than {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        if self._done:
            return
        self._done = True
        conn = self._conn
        conn.busy = False
        if conn.complete and conn.keep_alive and not conn.closed:
            # Reading again: an idle connection must hear the engine close it, or send
            # what no request asked for (it is then closed, not reused).
            conn.resume()
            conn._pool._give_back(conn)
        else:
            conn.close()


class EngineClient:
    """Requests to one origin over pooled keep-alive connections."""

    def __init__(self, base_url: str, *, max_idle: int = 64, connect_timeout: float = 10.0) -> None:
        self.origin = Origin.parse(base_url)
        self._max_idle = max_idle
        self._connect_timeout = connect_timeout
        self._idle: deque[_Connection] = deque()
        self._all: set[_Connection] = set()
        self._ssl: ssl.SSLContext | None = (
            ssl.create_default_context() if self.origin.scheme == "https" else None
        )

    def _forget(self, conn: _Connection) -> None:
        self._all.discard(conn)
        with contextlib.suppress(ValueError):
            self._idle.remove(conn)

    def _give_back(self, conn: _Connection) -> None:
        if len(self._idle) < self._max_idle:
            self._idle.append(conn)
        else:
            conn.close()

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        origin = self.origin
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self),
                    origin.host,
                    origin.port,
                    ssl=self._ssl,
                    server_hostname=origin.host if self._ssl else None,
                )
        except (OSError, TimeoutError) as exc:
            raise Unreachable(f"cannot connect to {origin.host}:{origin.port}: {exc!r}") from None
        self._all.add(conn)
        return conn

    def _encode(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
        origin = self.origin
        lines = [f"{method} {origin.prefix}{path} HTTP/1.1", f"Host: {origin.host_header}"]
        for name, value in headers:
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
                raise EngineError(f"header {name!r} cannot be sent")
            lines.append(f"{name}: {value}")
        if body or method not in ("GET", "HEAD"):
            lines.append(f"Content-Length: {len(body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

    async def request(
        self, method: str, path: str, headers: list[tuple[str, str]], body: bytes = b""
    ) -> EngineResponse:
        """Send a request; return once the answer's head arrived."""
        data = self._encode(method, path, headers, body)
        while self._idle:
            conn = self._idle.pop()
            if conn.closed:
                continue
            try:
                return await self._exchange(conn, data)
            except _Closed:
                continue  # closed by the engine while idle: try another, then a new one
        return await self._exchange(await self._connect(), data)

    @staticmethod
    async def _exchange(conn: _Connection, data: bytes) -> EngineResponse:
        conn.send(data)
        try:
            await conn.head
        except BaseException:
            conn.close()
            raise
        return EngineResponse(conn)

    async def close(self) -> None:
        for conn in list(self._all):
            conn.close()
        self._idle.clear()
