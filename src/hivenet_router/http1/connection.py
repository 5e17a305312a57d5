"""One client connection of the public HTTP/1.1 server: httptools parses what arrives,
the application answers one request at a time (pipelined ones wait their turn), and the
answers go out in order. The guarantees it keeps are listed in `server`."""

from __future__ import annotations

import asyncio
import logging
import re
from collections import deque
from typing import TYPE_CHECKING
from urllib.parse import unquote

import httptools

from hivenet_router.http1.coalesce import TurnWriter
from hivenet_router.http1.guard import source_of
from hivenet_router.http1.messages import (
    Answer,
    BodyError,
    BodyTooLarge,
    Request,
    Response,
    Stream,
    head,
)

if TYPE_CHECKING:
    from hivenet_router.http1.server import HttpServer

log = logging.getLogger("hivenet.http")

BACKLOG_LIMIT = 1 << 16  # pipelined bytes buffered before reading pauses


class _HeadTooLarge(Exception):
    pass


class _NoVersion(Exception):
    """A request line without HTTP/1.0 or HTTP/1.1 (llhttp reads one that has no version
    at all as HTTP/0.9, and takes HTTP/2.0 too)."""


class ClientConnection(asyncio.Protocol):
    """One client connection: parse, run the application one request at a time, answer."""

    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._source: str | None = None
        self._address: str | None = None
        self._lingering = False  # refused by the guard, delivering its refusal
        self._draining = False  # answered, discarding an unread body before closing
        self.lost = False
        self.paused = False
        self.paused_since = 0.0  # when the client last stopped taking what it is sent
        self._drain: asyncio.Future[None] | None = None
        self._queue = TurnWriter(self._loop, self._send_now)  # a stream's pieces of one turn
        self.idle_since = self._loop.time()
        # parsing
        self._url: list[bytes] = []
        self._headers: list[tuple[str, str]] = []
        self._head_size = 0  # bytes of the head's parts the parser has handed over
        self._head_raw = 0  # bytes of whole pieces received while a head was incomplete
        self._begun = 0  # messages begun on this connection
        self._framing = 0  # bytes of a body's pieces that were not body (chunk framing, trailers)
        self._body_fed = 0  # body bytes the parser handed over from the piece being fed
        # The body of a request that offered an upgrade (`curl --http2` offers h2c with its
        # POST): the parser takes what follows that head for the other protocol, so these
        # bytes are read here instead (_Body), and the request is answered as HTTP/1.1.
        self._offered_body = 0
        # A refusal owed to what followed a request still being answered (garbage, or a
        # head too large, pipelined behind it): written after that answer, then close.
        self._owed: tuple[int, str] | None = None
        self._in_head = False
        self._reading: Request | None = None  # the request whose body is being parsed
        # answering
        self._current: Request | None = None
        self._task: asyncio.Task[None] | None = None
        self._waiting: deque[Request] = deque()
        self._backlog: list[bytes] = []
        self._backlog_size = 0
        self._reading_paused = False
        self._held = False  # an answer is waiting for the client to read: start nothing more

    @property
    def idle(self) -> bool:
        return self._current is None and not self._draining and not self.lost

    @property
    def source(self) -> str | None:
        """The source the guard counts this connection under (None: not counted)."""
        return self._source

    def evict(self) -> None:
        """Closed to make room for a new connection: uncounted now, not when it is lost."""
        if self._source is not None and self._server.guard is not None:
            self._server.guard.leave(self._source)
            self._source = None
        if self._transport is not None:
            self._transport.abort()

    def stalled(self) -> None:
        """The client has taken nothing of an answer for the write-idle timeout: treated as
        gone (its request is cancelled and gives back what it holds)."""
        self._server.malformed("a client stopped reading its answer")
        if self._transport is not None:
            self._transport.abort()

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        server = self._server
        guard = server.guard
        if guard is not None:
            source = source_of(transport)
            if not guard.enter(source):
                self._lingering = guard.refuse(transport, server.refusal)
                self.lost = True  # nothing more is parsed or answered
                return
            self._source = source
        server.connections.add(self)
        if server.closing:
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        server = self._server
        if self._lingering:
            self._lingering = False
            if server.guard is not None:
                server.guard.lingered()
        self.lost = True
        self._queue.drop()
        self._parser = _Discard()  # type: ignore[assignment]  # it points back at us
        if self._source is not None:
            assert server.guard is not None
            server.guard.leave(self._source)
            self._source = None
        server.connections.discard(self)
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the client has gone: give back what its request holds
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("the client has gone"))
            self._drain.exception()
        if self._reading is not None:
            self._reading._fail(BodyError("request body could not be read: the client has gone"))

    def eof_received(self) -> bool:
        return False  # a client that stops sending has gone: close, cancel its request

    def pause_writing(self) -> None:
        self.paused = True
        self.paused_since = self._loop.time()

    def resume_writing(self) -> None:
        self.paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        if self._held:
            self._held = False
            self._next()

    def data_received(self, data: bytes) -> None:
        if self.lost or self._draining:
            return  # refused, or answered and closing: what the client sends is discarded
        if (self._current is not None and self._reading is None) or self._held:
            # An answer is in progress and its request is complete, or the client has not
            # read the last one: hold what follows (a pipelined request) until it is done.
            self._backlog.append(data)
            self._backlog_size += len(data)
            if self._backlog_size > BACKLOG_LIMIT:
                self._pause_reading()
            return
        self._feed(data)

    # -- httptools callbacks ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._in_head = True
        self._url.clear()
        self._headers = []
        self._head_size = 0
        self._head_raw = 0
        self._framing = 0
        self._begun += 1

    def on_url(self, url: bytes) -> None:
        self._url.append(url)
        self._head_size += len(url)
        if self._head_size > self._server.limits.head:
            raise _HeadTooLarge

    def on_header(self, name: bytes, value: bytes) -> None:
        # Counted here rather than in a helper: this runs for every header of every request.
        self._head_size += len(name) + len(value) + 4
        if self._head_size > self._server.limits.head:
            raise _HeadTooLarge
        self._headers.append((name.decode("latin-1").lower(), value.decode("latin-1")))
        if not self._in_head and self._reading is not None:
            self._reading.headers.reindex()  # a trailer joins the request's headers

    def on_headers_complete(self) -> None:
        self._in_head = False
        parser = self._parser
        version = parser.get_http_version()
        if version not in {"1.1", "1.0"}:
            raise _NoVersion(version)
        path, query = _split_target(b"".join(self._url))
        request = Request(
            self,
            parser.get_method().decode("latin-1"),
            path,
            query,
            self._headers,
            version=version,
            keep_alive=parser.should_keep_alive(),
            limit=self._server.limits.body,
        )
        self._reading = request
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > request._limit:
            request._fail(BodyTooLarge(f"request body exceeds the limit of {request._limit} bytes"))
        else:
            if request.headers.get("expect", "").lower() == "100-continue":
                request._continue = True
            if length is not None and length.isdigit() and parser.should_upgrade():
                self._offered_body = int(length)
        if self._current is None:
            self._start(request)
        else:
            self._waiting.append(request)
            self._pause_reading()

    def on_body(self, body: bytes) -> None:
        self._body_fed += len(body)
        if self._reading is not None:
            self._reading._feed(body)

    def on_message_complete(self) -> None:
        request = self._reading
        if self._offered_body:
            return  # its body follows, for _Body to read (see HttpParserUpgrade in _feed)
        if request is not None:
            self._reading = None
            request._done()

    # -- parsing ------------------------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        # What the parser holds but has not handed over (a header line still arriving, a
        # trailer) is bounded by counting whole pieces that were all head, or all body.
        continuing = self._in_head
        reading = self._reading
        begun = self._begun
        self._body_fed = 0
        try:
            self._parser.feed_data(data)
        except _HeadTooLarge:
            self._refuse(431, "request headers are too large")
            return
        except httptools.HttpParserUpgrade as exc:
            # Not offered here: the request is answered as a plain one, then the
            # connection closes (what follows its head and body is not HTTP/1.1).
            self._no_more()
            if self._offered_body:
                at = exc.args[0] if exc.args and isinstance(exc.args[0], int) else len(data)
                self._parser = _Body(self, self._offered_body)  # type: ignore[assignment]
                self._parser.feed_data(data[at:])
            return
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, _HeadTooLarge):
                self._refuse(431, "request headers are too large")
                return
            if isinstance(exc.__context__, _NoVersion):
                self._server.malformed(f"request line without HTTP/1.x (HTTP/{exc.__context__})")
                self._refuse(400, "malformed HTTP request: the request line must end in HTTP/1.1")
                return
            log.error("HTTP server error while parsing a request", exc_info=exc.__context__)
            self._refuse(500, "internal router error")
            return
        except httptools.HttpParserError as exc:
            self._broken(str(exc))
            return
        limits = self._server.limits
        if self._begun != begun:
            if not self._in_head:
                return  # every message begun in this piece has its whole head
            # A head begun in this piece is still arriving: it is what follows the last
            # blank line, less whatever body of an earlier message came after that line.
            end = data.rfind(b"\r\n\r\n")
            self._head_raw = max(0, len(data) - (end + 4 if end >= 0 else 0) - self._body_fed)
            if self._head_raw > limits.head:
                self._refuse(431, "request headers are too large")
        elif continuing and self._in_head:
            # The whole piece is more of a head begun earlier.
            self._head_raw += len(data)
            if self._head_raw > limits.head:
                self._refuse(431, "request headers are too large")
        elif reading is not None and reading is self._reading:
            # The whole piece is more of one body: what the parser did not hand over as
            # body is chunk framing or trailers, which it may hold until they end.
            self._framing += len(data) - self._body_fed
            if self._framing > limits.head + limits.body:
                self._server.malformed(f"chunk framing and trailers over {self._framing} bytes")
                reading._fail(
                    BodyError(
                        "request body could not be read: its chunk framing and trailers "
                        f"exceed {limits.head + limits.body} bytes"
                    )
                )
                self._no_more()

    def _broken(self, description: str) -> None:
        self._server.malformed(f"HttpParserError: {description[:120]}")
        reading = self._reading
        if reading is not None:
            # The body broke (bad chunking): the request's reader hears of it.
            reading._fail(BodyError("request body could not be read: the transfer is broken"))
            self._no_more()
        elif self._current is not None:
            self._no_more()  # garbage after a request: answer it, refuse this, then close
            self._owed = (400, "malformed HTTP request")
        else:
            self._refuse(400, "malformed HTTP request")

    def _no_more(self) -> None:
        """Parse nothing more on this connection; close it after the answer in progress."""
        if self._current is not None:
            self._current.keep_alive = False
        if self._reading is not None:
            self._reading.keep_alive = False
        for request in self._waiting:
            request.keep_alive = False
        self._parser = _Discard()  # type: ignore[assignment]
        self._in_head = False

    def _refuse(self, status: int, message: str) -> None:
        """The server's own answer to a request it cannot parse: then close."""
        if status == 431:
            self._server.malformed(f"head over {self._server.limits.head} bytes")
        self._parser = _Discard()  # type: ignore[assignment]
        self._in_head = False
        if self._reading is not None:
            # A trailer too large: the request's reader hears of it rather than waiting.
            self._reading._fail(BodyError(f"request body could not be read: {message}"))
        if self._current is not None:
            self._current.keep_alive = False
            if self._reading is None:  # a pipelined request's head: refused after it
                self._owed = (status, message)
            return
        body = self._server.error_page(status, message)
        self.write(head(status, {"Content-Type": "application/json"}, len(body), True) + body)
        self._linger(unread=True)

    # -- running requests ---------------------------------------------------------------------

    def _start(self, request: Request) -> None:
        self._current = request
        self._task = self._loop.create_task(self._run(request))

    async def _run(self, request: Request) -> None:
        server = self._server
        try:
            answer = await server.app(request)
        except (asyncio.CancelledError, ConnectionError):
            return  # the client has gone (or the server is closing)
        except Exception:
            log.exception("unhandled error answering %s %s", request.method, request.path)
            body = server.error_page(500, "internal router error")
            answer = Response(body, 500)
            answer.close = True
        if self.lost:
            return
        try:
            if isinstance(answer, Stream):
                await answer.end()
            else:
                close = answer.close or not self._reusable(request)
                if request.version == "1.0" and not close:
                    answer.headers["Connection"] = "keep-alive"
                body = b"" if request.method == "HEAD" else answer.body
                self.write(head(answer.status, answer.headers, len(answer.body), close) + body)
        except ConnectionError:
            return
        self._finished(request, answer)

    def _reusable(self, request: Request) -> bool:
        if not request.keep_alive or request.close or self._server.closing:
            return False
        # Read to its end, even if it was too large to keep: the next request starts clean.
        # One answered while its body is still arriving is not kept: a client still sending
        # when the answer comes may not expect to go on (wrk, for one, stalls), so the
        # connection closes after a moment of reading and dropping (_linger).
        return request.complete and (
            request.error is None or isinstance(request.error, BodyTooLarge)
        )

    def _finished(self, request: Request, answer: Answer) -> None:
        self._current = None
        self._task = None
        if (isinstance(answer, Response) and answer.close) or not self._reusable(request):
            owed, self._owed = self._owed, None
            if owed is not None:
                status, message = owed
                body = self._server.error_page(status, message)
                self.write(
                    head(status, {"Content-Type": "application/json"}, len(body), True) + body
                )
            self._linger()
            return
        self.idle_since = self._loop.time()
        if self.paused:
            # The client has not read what it was sent: take nothing more from it until it
            # has (resume_writing goes on), so unread answers cannot pile up in memory.
            self._held = True
            self._pause_reading()
            return
        self._next()

    def _next(self) -> None:
        """Answer the next pipelined request, or parse what arrived behind the last one."""
        if self.lost or self._current is not None:
            return
        if self._waiting:
            self._start(self._waiting.popleft())
            if not self._waiting:
                self._resume_reading()  # its body may still be arriving
            return
        backlog, self._backlog, self._backlog_size = self._backlog, [], 0
        self._resume_reading()
        for data in backlog:
            if self.lost or (self._current is not None and self._reading is None):
                self._backlog.append(data)
                self._backlog_size += len(data)
                continue
            self._feed(data)

    def _linger(self, unread: bool = False) -> None:
        """Close after the answer. If the client may still be sending (an unread body, or a
        request that was refused part-way), read and discard for a moment first, so that
        its unread bytes do not make the kernel reset the connection before the answer is
        read."""
        transport = self._transport
        if transport is None or self.lost:
            return
        self.flush()
        if not unread and self._reading is None and not self._backlog:
            transport.close()
            return
        self._draining = True
        self._parser = _Discard()  # type: ignore[assignment]
        self._current = None
        self._reading = None
        self._resume_reading()
        self._loop.call_later(0.5, transport.close)

    # -- writing ------------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        transport = self._transport
        if transport is not None and not self.lost:
            self._queue.now(data)

    @property
    def address(self) -> str:
        """The peer's IP address, read once per connection."""
        if self._address is None:
            transport = self._transport
            peer = transport.get_extra_info("peername") if transport is not None else None
            self._address = str(peer[0]) if peer else ""
        return self._address

    def write_or_raise(self, data: bytes) -> None:
        """Write now (after whatever `write_soon` queued). Raises if the client has gone."""
        transport = self._transport
        if transport is None or self.lost or transport.is_closing():
            raise ConnectionResetError("the client has gone")
        self._queue.now(data)

    def write_soon(self, data: bytes) -> None:
        """Queue a piece of a stream: the pieces of one event-loop turn leave in one system
        call (a stream's chunks that arrived together, and its last chunk with the end)."""
        transport = self._transport
        if transport is None or self.lost or transport.is_closing():
            raise ConnectionResetError("the client has gone")
        self._queue.add(data)

    def flush(self) -> None:
        """Write what `write_soon` queued, if the client is still there."""
        self._queue.flush()

    def _send_now(self, data: bytes) -> None:
        transport = self._transport
        if transport is not None and not self.lost and not transport.is_closing():
            transport.write(data)

    async def drain(self) -> None:
        if self.lost:
            raise ConnectionResetError("the client has gone")
        if self._drain is None or self._drain.done():
            self._drain = self._loop.create_future()
        await self._drain

    def _pause_reading(self) -> None:
        if not self._reading_paused and self._transport is not None and not self.lost:
            self._reading_paused = True
            self._transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._reading_paused and self._transport is not None and not self.lost:
            self._reading_paused = False
            self._transport.resume_reading()

    def close(self) -> None:
        if self._transport is not None:
            self.flush()
            self._transport.close()


class _Discard:
    """Stands in for the parser once nothing more is to be parsed."""

    def feed_data(self, data: bytes) -> None:
        pass


class _Body:
    """Stands in for the parser to read the body of a request that offered an upgrade
    (Content-Length bytes), then nothing more."""

    def __init__(self, connection: ClientConnection, length: int) -> None:
        self._connection = connection
        self._left = length

    def feed_data(self, data: bytes) -> None:
        if self._left <= 0:
            return
        piece = data[: self._left]
        self._left -= len(piece)
        connection = self._connection
        if piece:
            connection.on_body(piece)
        if self._left <= 0:
            connection._offered_body = 0
            connection.on_message_complete()
            connection._parser = _Discard()  # type: ignore[assignment]


_ABSOLUTE = re.compile(rb"^[a-zA-Z][a-zA-Z0-9+.-]*://[^/?#]*")


# Kept encoded when a path is decoded: a slash inside a segment (a tenant named `team/a`)
# must not split it, and a percent sign must not be decoded twice when a route's
# parameter is decoded (router/edge.py). Paths of fixed routes hold neither.
_KEPT_ENCODED = re.compile(r"(%2[Ff]|%25)")


def _unquote_path(text: str) -> str:
    pieces = _KEPT_ENCODED.split(text)
    # The odd pieces are the kept escapes, written alike whatever their case.
    return "".join(piece.upper() if at % 2 else unquote(piece) for at, piece in enumerate(pieces))


def _split_target(target: bytes) -> tuple[str, str]:
    """The decoded path and the raw query of a request target (origin or absolute form);
    an encoded slash or percent sign stays encoded (`_KEPT_ENCODED`)."""
    if not target.startswith(b"/"):
        target = _ABSOLUTE.sub(b"", target) or b"/"
        if not target.startswith(b"/"):
            target = b"/" + target
    path, _, query = target.partition(b"?")
    path = path.partition(b"#")[0]
    text = path.decode("latin-1")
    if "%" in text:
        text = _unquote_path(text)
    return text, query.partition(b"#")[0].decode("latin-1")
