"""A multiplexed, flow-controlled connection between one agent and one router.

The agent dials a WebSocket (TLS) to the router; both ends then wrap it in a `Link`. Either
side opens streams: the agent for management calls (`/hivenet_router/router/1.0.0`), the
router for inference (`/hivenet_router/inference/1.0.0`). Streams opened by the dialing side
have odd ids, the others even ids.

Each stream has its own credit window for DATA in each direction, so a reader that stops
reading stalls only its own stream: the receive loop never waits on a consumer. A peer that
sends past its credit has the stream reset. Resetting a stream from either side cancels the
work behind it; losing the connection resets every stream on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from hivenet_router.transport import frames
from hivenet_router.transport.frames import END, FrameError, FrameType
from hivenet_router.transport.websocket import BINARY, CLOSE, CLOSED, ERROR, lost_words

CLOSING = 256  # aiohttp's kind for a close under way (its WSMsgType values are these)

log = logging.getLogger("hivenet.p2p")

ROUTER_PROTOCOL = "/hivenet_router/router/1.0.0"
INFERENCE_PROTOCOL = "/hivenet_router/inference/1.0.0"

INITIAL_WINDOW = 256 * 1024
MAX_STREAMS = 4096


class WebSocketLike(Protocol):
    """What a link needs of a WebSocket: the router's own server end
    (transport/ws_server.py) and the agent's own client (transport/websocket.py). Messages
    carry `type` and `data`, with the kind values aiohttp uses."""

    async def send_bytes(self, data: bytes) -> None: ...

    async def receive(self, timeout: float | None = None) -> Any: ...

    async def close(self, *, code: int = ..., message: bytes = ...) -> bool: ...

    @property
    def closed(self) -> bool: ...

    @property
    def ended(self) -> str:
        """Why it ended, in words (the peer is "it"); empty while it is open."""
        ...


class StreamReset(Exception):
    """The stream was abandoned: by the peer, by this side, or with the connection."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class LinkClosed(StreamReset):
    def __init__(self, message: str = "connection closed") -> None:
        super().__init__("connection_lost", message)


class WriteTimeout(StreamReset):
    def __init__(self) -> None:
        super().__init__("write_timeout", "the receiver stopped reading")


@dataclass(frozen=True, slots=True)
class Head:
    """The head of a stream: a request line for OPEN, a status for HEADERS."""

    protocol: str
    method: str
    path: str
    status: int
    headers: list[tuple[str, str]]


Handler = Callable[["Stream"], Awaitable[None]]


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Stream:
    """One request and its response on a link."""

    def __init__(self, link: Link, stream_id: int, head: Head | None) -> None:
        self.link = link
        self.id = stream_id
        self.request_head = head
        self._response_head: asyncio.Future[Head] = link.loop.create_future()
        self._chunks: deque[bytes] = deque()
        # One reader and one writer per stream; each waits on a future made only when it
        # has to wait (most answers arrive whole, so most streams never make one).
        self._reader: asyncio.Future[None] | None = None
        self._recv_done = False
        self._recv_credit = INITIAL_WINDOW
        self._consumed = 0
        self._send_credit = INITIAL_WINDOW
        self._writer: asyncio.Future[None] | None = None
        self._send_done = False
        self.error: StreamReset | None = None
        self.head_sent = False
        self.task: asyncio.Task[None] | None = None

    # -- receiving (called by the link's reader) ---------------------------------------------

    def _on_head(self, head: Head) -> None:
        if not self._response_head.done():
            self._response_head.set_result(head)

    def _on_data(self, payload: bytes, end: bool) -> None:
        if len(payload) > self._recv_credit:
            raise StreamReset("flow_control", "peer sent more than its window")
        self._recv_credit -= len(payload)
        if payload:
            self._chunks.append(payload)
        if end:
            self._recv_done = True
        if self._reader is not None:
            _wake(self._reader)

    def _on_window(self, increment: int) -> None:
        self._send_credit += increment
        if self._writer is not None:
            _wake(self._writer)

    def _fail(self, error: StreamReset) -> None:
        if self.error is None:
            self.error = error
        if self._reader is not None:
            _wake(self._reader)
        if self._writer is not None:
            _wake(self._writer)
        if not self._response_head.done():
            self._response_head.set_exception(error)
            self._response_head.exception()  # mark retrieved; the reader may never ask
        # A handler that resets its own stream unwinds by itself; cancel only from outside.
        if (
            self.task is not None
            and not self.task.done()
            and self.task is not asyncio.current_task()
        ):
            self.task.cancel()

    @property
    def finished(self) -> bool:
        return self.error is not None or (self._recv_done and self._send_done)

    # -- reading ------------------------------------------------------------------------------

    async def response_head(self) -> Head:
        return await self._response_head

    async def read(self) -> bytes | None:
        """The next body chunk, or None at the end. Raises StreamReset."""
        while not self._chunks:
            if self.error is not None:
                raise self.error
            if self._recv_done:
                return None
            waiter = self._reader = self.link.loop.create_future()
            try:
                await waiter
            finally:
                if self._reader is waiter:
                    self._reader = None
        chunk = self._chunks.popleft()
        self._consumed += len(chunk)
        if self._consumed >= INITIAL_WINDOW // 2 and not self._recv_done:
            grant, self._consumed = self._consumed, 0
            self._recv_credit += grant
            await self.link.send(frames.encode_window(self.id, grant))
        return chunk

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while (chunk := await self.read()) is not None:
            yield chunk

    async def read_all(self, limit: int) -> bytes:
        parts: list[bytes] = []
        size = 0
        while (chunk := await self.read()) is not None:
            size += len(chunk)
            if size > limit:
                error = StreamReset("too_large", f"body exceeds {limit} bytes")
                self.reset(error)  # the peer learns why, rather than of an internal error
                raise error
            parts.append(chunk)
        return b"".join(parts)

    # -- writing ------------------------------------------------------------------------------

    async def send_head(
        self,
        status: int,
        headers: list[tuple[str, str]],
        body: bytes = b"",
        end: bool = False,
        timeout: float | None = None,
    ) -> None:
        """Send the response head, with as much of `body` as fits in the same frame; the
        rest as `write` sends it (`timeout` bounds each wait for credit)."""
        self._check_writable()
        head = {"status": status, "headers": headers}
        frame, inline = frames.encode_head(
            FrameType.HEADERS, self.id, head, body, self._send_credit, END if end else 0
        )
        self.head_sent = True  # not before: a head too large to encode was never sent
        rest = body[inline:] if inline < len(body) else b""
        if end and inline == len(body):
            self._send_done = True
        self._send_credit -= inline
        await self.link.send(frame)
        if inline < len(body) or (end and not self._send_done):
            await self.write(rest, end=end, timeout=timeout)
        self.link._forget_if_finished(self)

    async def write(self, data: bytes, end: bool = False, timeout: float | None = None) -> None:
        """Send body bytes within the peer's credit. `timeout` bounds each wait for credit."""
        self._check_writable()
        view = memoryview(data)
        while True:
            while self._send_credit <= 0 and view:
                waiter = self._writer = self.link.loop.create_future()
                try:
                    async with asyncio.timeout(timeout):
                        await waiter
                except TimeoutError:
                    self.reset(WriteTimeout())
                    raise WriteTimeout() from None
                finally:
                    if self._writer is waiter:
                        self._writer = None
                self._check_writable()
            size = min(len(view), self._send_credit, frames.MAX_PAYLOAD)
            piece = bytes(view[:size])
            view = view[size:]
            last = end and not view
            self._send_credit -= size
            if last:
                self._send_done = True
            await self.link.send(frames.encode(FrameType.DATA, self.id, piece, END if last else 0))
            if not view:
                break
        if end:
            self.link._forget_if_finished(self)

    async def end(self) -> None:
        await self.write(b"", end=True)

    def _check_writable(self) -> None:
        if self.error is not None:
            raise self.error
        if self._send_done:
            raise StreamReset("stream_closed", "write after end of stream")

    def reset(self, error: StreamReset | None = None) -> None:
        """Abandon the stream in both directions and tell the peer. Safe to call twice."""
        if self.error is not None:
            return
        reason = error or StreamReset("cancelled", "cancelled by peer")
        self._fail(reason)
        self.link._forget(self)
        self.link.send_nowait(
            frames.encode_json(
                FrameType.RESET, self.id, {"code": reason.code, "message": reason.message}
            )
        )


class Link:
    """Both ends of an agent connection use this over their WebSocket."""

    def __init__(
        self,
        ws: WebSocketLike,
        *,
        dialer: bool,
        handlers: dict[str, Handler],
        name: str = "link",
    ) -> None:
        self.ws = ws
        self.loop = asyncio.get_running_loop()
        self.name = name
        self._handlers = handlers
        self._streams: dict[int, Stream] = {}
        self._next_id = 1 if dialer else 2
        self._peer_parity = 0 if dialer else 1
        self._closed = asyncio.Event()  # for wait_closed; `closed` is read per request
        self.closed = False
        self._going_away = False
        self.close_reason = ""
        self._background: set[asyncio.Task[None]] = set()

    def add_handler(self, protocol: str, handler: Handler) -> None:
        self._handlers[protocol] = handler

    @property
    def active_streams(self) -> int:
        return len(self._streams)

    async def wait_closed(self) -> None:
        await self._closed.wait()

    # -- sending ------------------------------------------------------------------------------

    async def send(self, data: bytes) -> None:
        if self.closed:
            raise LinkClosed(self.close_reason or "connection closed")
        try:
            await self.ws.send_bytes(data)
        except (ConnectionError, RuntimeError) as exc:
            self._shutdown(f"send failed: {exc}")
            raise LinkClosed(str(exc)) from None

    def send_nowait(self, data: bytes) -> None:
        """Queue a control frame from synchronous code (resets)."""
        if self.closed:
            return
        task = self.loop.create_task(self._send_quietly(data))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_quietly(self, data: bytes) -> None:
        with contextlib.suppress(StreamReset):
            await self.send(data)

    # -- opening streams ------------------------------------------------------------------------

    async def open(
        self,
        protocol: str,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes | None = None,
    ) -> Stream:
        """Open a stream, send the request head and, when given, the whole body."""
        if self.closed:
            raise LinkClosed(self.close_reason or "connection closed")
        if self._going_away:
            raise LinkClosed("peer is going away")
        stream_id = self._next_id
        if stream_id > frames.MAX_STREAM_ID:
            raise LinkClosed("stream ids exhausted")
        head = {"proto": protocol, "method": method, "path": path, "headers": headers}
        body = body or b""
        try:
            frame, inline = frames.encode_head(
                FrameType.OPEN, stream_id, head, body, INITIAL_WINDOW, END
            )
        except FrameError as exc:
            # Refused before the stream exists: nothing to forget, and the connection is fine.
            raise StreamReset("head_too_large", str(exc)) from None
        self._next_id += 2
        stream = Stream(self, stream_id, None)
        self._streams[stream_id] = stream
        whole = inline == len(body)
        if whole:
            stream._send_done = True
        stream._send_credit -= inline
        try:
            await self.send(frame)
            if not whole:
                await stream.write(body[inline:], end=True)
        except BaseException:
            # Whatever stopped the request (the connection, a cancelled caller) must not
            # leave its entry behind on a connection that lives on.
            if not stream.finished:
                stream.reset(StreamReset("cancelled", "request not sent"))
            self._forget(stream)
            raise
        return stream

    @contextlib.asynccontextmanager
    async def request(
        self,
        protocol: str,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes | None = None,
    ) -> AsyncIterator[Stream]:
        """Open a stream that is reset on exit unless it finished: nothing is left behind."""
        stream = await self.open(protocol, method, path, headers, body)
        try:
            yield stream
        finally:
            if not stream.finished:
                stream.reset(StreamReset("cancelled", "requester abandoned the stream"))
            self._forget(stream)

    async def call(
        self, protocol: str, path: str, body: bytes, timeout: float, limit: int = 1 << 20
    ) -> tuple[int, bytes]:
        """A small request and its whole answer, bounded by `timeout`."""
        async with (
            asyncio.timeout(timeout),
            self.request(
                protocol, "POST", path, [("content-type", "application/json")], body
            ) as stream,
        ):
            head = await stream.response_head()
            return head.status, await stream.read_all(limit)

    # -- bookkeeping ----------------------------------------------------------------------------

    def _forget(self, stream: Stream) -> None:
        self._streams.pop(stream.id, None)

    def _forget_if_finished(self, stream: Stream) -> None:
        if stream._send_done and stream._recv_done:
            self._streams.pop(stream.id, None)

    # -- the reader ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Read frames until the connection ends; then fail every stream left on it.

        `close_reason` says why in an operator's words: how the WebSocket ended (a
        goodbye, end of file, a reset, silence past the heartbeat), never an exception's
        repr. A peer that dies ends the connection and the server's handler is cancelled in
        the same turn, so a cancellation is read as the connection's end when it has one."""
        reason = ""
        try:
            while True:
                message = await self.ws.receive()
                if message.type == BINARY:
                    self._dispatch(frames.decode(message.data))
                elif message.type in (CLOSE, CLOSING, CLOSED, ERROR):
                    break
                else:
                    raise FrameError(f"unexpected WebSocket message type {message.type!r}")
        except FrameError as exc:
            reason = f"protocol error: {exc}"
            log.warning("%s: closing after a protocol error: %s", self.name, exc)
        except ConnectionError as exc:
            reason = self.ws.ended or lost_words(exc)
        except asyncio.CancelledError:
            self._shutdown(self.ws.ended or "stopped: this side is shutting down")
            await self._close_ws()
            raise
        self._shutdown(reason or self.ws.ended or "the connection closed")
        await self._close_ws()

    async def close(self, reason: str = "closed") -> None:
        with contextlib.suppress(StreamReset):
            await self.send(frames.encode(FrameType.GOAWAY, 0))
        self._shutdown(reason)
        await self._close_ws()

    async def _close_ws(self) -> None:
        with contextlib.suppress(Exception):
            await self.ws.close()

    def _shutdown(self, reason: str) -> None:
        if self.closed:
            return
        self.close_reason = reason
        self.closed = True
        self._closed.set()
        error = LinkClosed(reason)
        streams = list(self._streams.values())
        self._streams.clear()
        for stream in streams:
            stream._fail(error)

    def _dispatch(self, frame: frames.Frame) -> None:
        kind = frame.type
        if kind is FrameType.GOAWAY:
            self._going_away = True
            return
        stream = self._streams.get(frame.stream_id)
        if kind is FrameType.OPEN:
            self._on_open(frame, stream)
            return
        if stream is None:
            return  # late frames for a stream this side already reset or finished
        try:
            if kind is FrameType.DATA:
                stream._on_data(frame.payload, frame.end)
                self._forget_if_finished(stream)
            elif kind is FrameType.HEADERS:
                payload, body = frames.decode_head(frame)
                status = payload.get("status")
                if not isinstance(status, int):
                    raise FrameError("HEADERS without an integer status")
                stream._on_head(Head("", "", "", status, _headers(payload)))
                if body or frame.end:
                    stream._on_data(body, frame.end)
                    self._forget_if_finished(stream)
            elif kind is FrameType.WINDOW:
                stream._on_window(frames.decode_window(frame))
            elif kind is FrameType.RESET:
                payload = frames.decode_json(frame)
                self._forget(stream)
                stream._fail(
                    StreamReset(str(payload.get("code", "reset")), str(payload.get("message", "")))
                )
        except StreamReset as exc:
            stream.reset(exc)

    def _on_open(self, frame: frames.Frame, existing: Stream | None) -> None:
        if frame.stream_id % 2 != self._peer_parity or existing is not None:
            raise FrameError(f"OPEN on stream {frame.stream_id} that the peer cannot open")
        payload, body = frames.decode_head(frame)
        protocol = payload.get("proto")
        handler = self._handlers.get(protocol) if isinstance(protocol, str) else None
        method = payload.get("method")
        path = payload.get("path")
        if not isinstance(method, str) or not isinstance(path, str):
            raise FrameError("OPEN without method and path")
        head = Head(str(protocol), method, path, 0, _headers(payload))
        stream = Stream(self, frame.stream_id, head)
        if body or frame.end:
            try:
                stream._on_data(body, frame.end)
            except StreamReset as exc:
                stream.reset(exc)
                return
        if handler is None or len(self._streams) >= MAX_STREAMS:
            code = "unknown_protocol" if handler is None else "refused"
            self.send_nowait(
                frames.encode_json(
                    # the peer's own text, cut short: a RESET must fit in a frame
                    FrameType.RESET,
                    frame.stream_id,
                    {"code": code, "message": str(protocol)[:200]},
                )
            )
            return
        self._streams[frame.stream_id] = stream
        stream.task = self.loop.create_task(self._serve(handler, stream))

    async def _serve(self, handler: Handler, stream: Stream) -> None:
        try:
            await handler(stream)
        except asyncio.CancelledError:
            if stream.error is None:
                stream.reset(StreamReset("cancelled", "handler cancelled"))
            # Cancelled because the stream was reset: nothing more to say.
        except StreamReset:
            pass
        except Exception as exc:
            log.exception("%s: handler for %s failed", self.name, stream.request_head)
            stream.reset(StreamReset("internal_error", type(exc).__name__))
        finally:
            if not stream.finished:
                stream.reset(StreamReset("internal_error", "handler ended without finishing"))
            self._forget(stream)


def _headers(payload: dict[str, Any]) -> list[tuple[str, str]]:
    raw = payload.get("headers") or []
    if not isinstance(raw, list):
        raise FrameError("headers must be a list of pairs")
    out: list[tuple[str, str]] = []
    for pair in raw:
        # Exact types: JSON gives plain lists and strings, and these checks run per header.
        if type(pair) is not list or len(pair) != 2:
            raise FrameError("headers must be a list of [name, value] string pairs")
        name, value = pair
        if type(name) is not str or type(value) is not str:
            raise FrameError("headers must be a list of [name, value] string pairs")
        out.append((name, value))
    return out
