"""What the public HTTP/1.1 server hands the application and takes back: the request
(headers, query, a body read on demand and decoded within its bound), whole and streamed
answers, and the bytes of a response head. The connection that parses and writes them is
in server.py; these objects reach it only through the small `Connection` protocol.
"""

from __future__ import annotations

import asyncio
import http
import logging
import time
import zlib
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any, Protocol
from urllib.parse import parse_qsl

log = logging.getLogger("hivenet.http")


class Connection(Protocol):
    """What a request and a streamed answer need of their client connection."""

    lost: bool
    paused: bool

    @property
    def address(self) -> str: ...

    def write(self, data: bytes) -> None: ...

    def write_or_raise(self, data: bytes) -> None: ...

    def write_soon(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...


# -- what the application sees ------------------------------------------------------------------


class BodyError(Exception):
    """The request body cannot be had; `status` says why (400, 413, 415)."""

    status = 400


class BodyTooLarge(BodyError):
    status = 413


class EncodingUnsupported(BodyError):
    status = 415


class Headers(Mapping[str, str]):
    """Request headers in arrival order, names in lower case; lookups give the first value."""

    __slots__ = ("_first", "_items")

    def __init__(self, items: list[tuple[str, str]]) -> None:
        self._items = items
        # Each name's first value, made at the first lookup: a request is looked up five
        # or six times, and SDK clients send a dozen headers or more.
        self._first: dict[str, str] | None = None

    def reindex(self) -> None:
        """The list grew after a lookup (trailers of a chunked body): look again."""
        self._first = None

    def _index(self) -> dict[str, str]:
        first = self._first
        if first is None:
            first = self._first = dict(reversed(self._items))
        return first

    def __getitem__(self, name: str) -> str:
        return self._index()[name.lower()]

    def get(self, name: str, default: Any = None) -> Any:
        first = self._first
        if first is None:
            first = self._first = dict(reversed(self._items))
        return first.get(name.lower(), default)

    def getall(self, name: str) -> list[str]:
        name = name.lower()
        return [value for key, value in self._items if key == name]

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        return name.lower() in self._index()

    def __iter__(self) -> Iterator[str]:
        return (key for key, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def items(self) -> list[tuple[str, str]]:  # type: ignore[override]
        return self._items


class Request:
    """One request. `ticket` is the application's own; `close` asks for the connection to
    be closed after the answer."""

    __slots__ = (
        "_conn",
        "_continue",
        "_limit",
        "_parts",
        "_query",
        "_size",
        "_waiter",
        "close",
        "complete",
        "error",
        "headers",
        "keep_alive",
        "match_info",
        "method",
        "path",
        "query_string",
        "ticket",
        "version",
    )

    def __init__(
        self,
        conn: Connection | None,
        method: str,
        path: str,
        query_string: str,
        headers: list[tuple[str, str]],
        *,
        version: str = "1.1",
        keep_alive: bool = True,
        limit: int = 1 << 20,
        body: bytes | None = None,
    ) -> None:
        self._conn = conn
        self.method = method
        self.path = path
        self.query_string = query_string
        self.headers = Headers(headers)
        self.version = version
        self.keep_alive = keep_alive
        self.match_info: dict[str, str] = {}
        self.ticket: Any = None
        self.close = False
        self._limit = limit
        self._parts: list[bytes] = [] if body is None else [body]
        self._size = 0 if body is None else len(body)
        self._query: dict[str, str] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._continue = False
        self.complete = body is not None
        self.error: BodyError | None = None

    @property
    def source(self) -> str:
        """The client's IP address ("" when the request came from no connection)."""
        return self._conn.address if self._conn is not None else ""

    @property
    def query(self) -> dict[str, str]:
        """The query's parameters; a repeated name keeps its first value."""
        if self._query is None:
            query: dict[str, str] = {}
            for key, value in parse_qsl(self.query_string, keep_blank_values=True):
                query.setdefault(key, value)
            self._query = query
        return self._query

    async def read(self) -> bytes:
        """The whole body, decoded as its Content-Encoding says. Raises BodyError."""
        if self._continue and self._conn is not None:
            self._continue = False
            self._conn.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        while not self.complete and self.error is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self.error is not None:
            raise self.error
        parts = self._parts
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        encoding = self.headers.get("content-encoding")
        if encoding:
            body = decode(body, encoding, self._limit)
        return body

    # -- fed by the connection ----------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        if self.error is not None:
            return
        self._size += len(data)
        if self._size > self._limit:
            self._fail(BodyTooLarge(f"request body exceeds the limit of {self._limit} bytes"))
            self._parts.clear()
            return
        self._parts.append(data)

    def _done(self) -> None:
        self.complete = True
        self._wake()

    def _fail(self, error: BodyError) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def decode(body: bytes, encoding: str, limit: int) -> bytes:
    """Undo a Content-Encoding, never producing more than `limit` bytes."""
    name = encoding.strip().lower()
    if name == "identity":
        return body
    if name in ("gzip", "x-gzip"):
        wbits = 16 + zlib.MAX_WBITS
    elif name == "deflate":
        wbits = zlib.MAX_WBITS if body[:1] and body[0] & 0x0F == 8 else -zlib.MAX_WBITS
    else:
        raise EncodingUnsupported(f"Content-Encoding {encoding!r} is not supported")
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error:
        raise BodyError("request body could not be read: its Content-Encoding is broken") from None
    if len(out) > limit:
        raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes once decoded")
    if not inflater.eof:
        raise BodyError("request body could not be read: its Content-Encoding is cut short")
    return out


class Response:
    """A whole answer."""

    __slots__ = ("body", "close", "headers", "status")
    prepared = False

    def __init__(
        self,
        body: bytes = b"",
        status: int = 200,
        content_type: str | None = "application/json",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.status = status
        self.body = body
        self.headers: dict[str, str] = {}
        if content_type is not None:
            self.headers["Content-Type"] = content_type
        if headers:
            self.headers.update(headers)
        self.close = False


class Stream:
    """An answer sent as it is produced (chunked; to an HTTP/1.0 client, until close). The
    head goes out with the first piece, in one write."""

    __slots__ = ("_chunked", "_conn", "_head", "ended", "status")
    prepared = True

    def __init__(
        self, conn: Connection, request: Request, status: int, headers: dict[str, str]
    ) -> None:
        self._conn = conn
        self.status = status
        self._chunked = request.version != "1.0"
        if not self._chunked:
            request.keep_alive = False
        framing = {"Transfer-Encoding": "chunked"} if self._chunked else {}
        self._head: bytes | None = head(status, {**headers, **framing}, None, not self._chunked)
        self.ended = False

    async def write(self, data: bytes) -> None:
        if not data:
            return
        piece = b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data
        if self._head is not None:
            piece, self._head = self._head + piece, None
        conn = self._conn
        conn.write_soon(piece)  # with whatever else this loop turn writes to the stream
        if conn.paused:
            await conn.drain()

    async def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        last = b"0\r\n\r\n" if self._chunked else b""
        if self._head is not None:
            last, self._head = self._head + last, None
        self._conn.write_or_raise(last)


Answer = Response | Stream
App = Callable[[Request], Awaitable[Answer]]


async def stream(request: Request, status: int, headers: dict[str, str]) -> Stream:
    """Start a streamed answer to `request`."""
    conn = request._conn
    if conn is None or conn.lost:
        raise ConnectionResetError("the client has gone")
    return Stream(conn, request, status, headers)


# -- writing heads ------------------------------------------------------------------------------

_REASONS = {status.value: status.phrase for status in http.HTTPStatus}
_date_second = 0
_date_header = b""


def _date_line() -> bytes:
    """The Date header, formatted once a second."""
    global _date_second, _date_header
    now = int(time.time())
    if now != _date_second:
        stamp = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(now))
        _date_second, _date_header = now, b"Date: " + stamp.encode()
    return _date_header


def head(status: int, headers: Mapping[str, str], length: int | None, close: bool) -> bytes:
    """A response head. A header value that could end the line is left out, not sent."""
    lines = [b"HTTP/1.1 %d %s" % (status, _REASONS.get(status, "Unknown").encode())]
    for name, value in headers.items():
        if "\r" in value or "\n" in value:
            log.warning("left out header %s: its value would break the response head", name)
            continue
        lines.append(f"{name}: {value}".encode("latin-1", "replace"))
    if length is not None:
        lines.append(b"Content-Length: %d" % length)
    if close:
        lines.append(b"Connection: close")
    lines.append(_date_line())
    lines.append(b"\r\n")
    return b"\r\n".join(lines)
