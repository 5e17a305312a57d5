"""Carry one forwarded request to the backend and stream its answer back to the router."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence

from hivenet_router.agent.cache_picture import CachePicture
from hivenet_router.domain.agent import PREFIX_HEADER, unpack_blocks
from hivenet_router.domain.classify import classify
from hivenet_router.domain.errors import ErrorCode, error_body
from hivenet_router.expiry import Deadlines, Expiry
from hivenet_router.http1.client import EngineClient, EngineError, EngineResponse, Unreachable
from hivenet_router.observability.spans import AgentTracing
from hivenet_router.slots import Slots
from hivenet_router.transport.frames import FrameError
from hivenet_router.transport.link import Stream, StreamReset

log = logging.getLogger("hivenet.agent")

MAX_REQUEST_BYTES = 64 * 1024 * 1024
MAX_ANSWER_BYTES = 64 * 1024 * 1024
MAX_ERROR_BYTES = 64 * 1024
# Headers that describe one hop, not the request; never forwarded.
_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        # The answer must reach the router as the engine's plain bytes: it reads usage from
        # them (and caches and checks them), and it never decodes a compressed body.
        "accept-encoding",
    }
)
_JSON = [("content-type", "application/json")]
_CLIENT_MESSAGES = {
    "unreachable": "the model's engine is unreachable",
    "timeout": "the model's engine did not answer in time",
    "failed": "the model's engine failed to answer",
}


def _nothing() -> None:
    pass


class BackendProxy:
    """Every router's requests, carried to the one engine.

    With `capacity`, at most that many run at once: each router counts only what it sent,
    and until the agent's next heartbeat tells them the total, two routers may together
    send more; the excess waits here for a slot rather than overload the engine. `active`
    counts every request the agent holds, running or waiting: what it reports as its
    in-flight total. `on_turn` is called when the agent becomes full or stops being full,
    so the routers can be told at once; `on_busy` when it takes a request while idle, so
    the engine's metrics are read again at once.
    """

    def __init__(
        self,
        engine: EngineClient,
        http_timeout: float,
        write_timeout: float,
        auth: Sequence[tuple[str, str]] = (),
        tracing: AgentTracing | None = None,
        capacity: int = 0,
        on_turn: Callable[[], None] = _nothing,
        on_busy: Callable[[], None] = _nothing,
        picture: CachePicture | None = None,
    ) -> None:
        self._engine = engine
        self._timeout = http_timeout or None
        self._deadlines = Deadlines()
        self._write_timeout = write_timeout or None
        # The engine's own credential (`Authorization: Bearer` of its --api-key) replaces
        # whatever Authorization the request carried.
        self._auth = list(auth)
        self._drop = (_HOP | {"authorization"} if self._auth else _HOP) | {PREFIX_HEADER}
        self.picture = picture
        self._tracing = tracing
        self.capacity = capacity
        self._slots = Slots(capacity) if capacity else None
        self._on_turn = on_turn
        self._on_busy = on_busy
        self._overbooked = False
        self.active = 0
        # Shutting down: heartbeats say so, and the routers send nothing new. What still
        # arrives (sent before they heard) is served like the rest.
        self.stopping = False

    @property
    def full(self) -> bool:
        return 0 < self.capacity <= self.active

    async def handle(self, stream: Stream) -> None:
        head = stream.request_head
        assert head is not None  # incoming streams always carry their OPEN head
        self._count(+1)
        try:
            body = await stream.read_all(MAX_REQUEST_BYTES)
            headers = [(k, v) for k, v in head.headers if k.lower() not in self._drop]
            headers += self._auth
            slots = self._slots
            if slots is not None and not slots.take():
                await self._take(slots)
            try:
                span = self._tracing.start(head.path, headers) if self._tracing else None
                try:
                    blocks = self._prefix(head.headers)
                    await self._forward(stream, head.method, head.path, headers, body, blocks)
                finally:
                    if span is not None:
                        span.end()
            finally:
                if slots is not None:
                    slots.release()
        finally:
            self._count(-1)

    def _count(self, step: int) -> None:
        capacity = self.capacity  # `full`, inline: this runs twice per request
        was = 0 < capacity <= self.active
        self.active += step
        if (0 < capacity <= self.active) != was:
            self._on_turn()
        if self.active == 1 and step > 0:
            self._on_busy()

    async def _take(self, slots: Slots) -> None:
        """Wait for a slot (the caller tried `take()` first: a free one needs no await)."""
        if not self._overbooked:
            self._overbooked = True
            log.info(
                "routers sent more than --capacity %d requests at once; the excess waits "
                "here for a slot (their view of this agent's load was a heartbeat old)",
                self.capacity,
            )
        await slots.wait()
        if self.active <= self.capacity:
            self._overbooked = False

    def _prefix(self, headers: Sequence[tuple[str, str]]) -> tuple[int, ...]:
        """The prompt's prefix blocks a router sent along, when the agent keeps a picture
        of its engine's cache; a value that does not decode is ignored."""
        if self.picture is None:
            return ()
        for name, value in headers:
            if name.lower() == PREFIX_HEADER:
                try:
                    return unpack_blocks(value)
                except ValueError:
                    return ()
        return ()

    async def _forward(
        self,
        stream: Stream,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes,
        blocks: tuple[int, ...] = (),
    ) -> None:
        answer: EngineResponse | None = None
        try:
            with self._deadlines.after(self._timeout) as expiry:
                answer = await self._engine.request(method, path, headers, body)
                if blocks and answer.status < 400 and self.picture is not None:
                    self.picture.served(blocks)
                await self._relay(stream, answer, expiry)
        except StreamReset:
            raise
        except Unreachable as exc:
            await self._fail(stream, ErrorCode.BACKEND_UNAVAILABLE, "unreachable", exc)
        except TimeoutError as exc:
            await self._fail(stream, ErrorCode.BACKEND_UNAVAILABLE, "timeout", exc)
        except (EngineError, FrameError) as exc:  # FrameError: a head the link cannot carry
            await self._fail(stream, ErrorCode.BACKEND_ERROR, "failed", exc)
        finally:
            if answer is not None:
                answer.release()  # after a whole read it is back in the pool already

    async def _relay(self, stream: Stream, answer: EngineResponse, expiry: Expiry) -> None:
        """Send the engine's answer back. `expiry` (--http-timeout) bounds it up to the
        head; a stream then goes on as long as the router reads it: the router's stream
        limits end it by resetting the stream, which cancels this."""
        if answer.status >= 400:
            raw = await answer.read(MAX_ERROR_BYTES, truncate=True)
            _code, status, envelope = classify(answer.status, raw)
            await stream.send_head(status, _JSON, envelope, end=True)
            return
        out_headers = [(k, v) for k, v in answer.headers if k.lower() not in _HOP]
        if answer.content_type != "text/event-stream":
            # A whole answer travels with its head in as few frames as it fits.
            whole = await answer.read(MAX_ANSWER_BYTES)
            await stream.send_head(
                answer.status, out_headers, whole, end=True, timeout=self._write_timeout
            )
            return
        # A stream: the head leaves with the first chunk (the router waits for both).
        first = await answer.next_chunk()
        await stream.send_head(
            answer.status,
            out_headers,
            first or b"",
            end=first is None,
            timeout=self._write_timeout,
        )
        if first is None:
            return
        expiry.cancel()
        while (chunk := await answer.next_chunk()) is not None:
            await stream.write(chunk, timeout=self._write_timeout)
        await stream.end()

    @staticmethod
    async def _fail(stream: Stream, code: ErrorCode, what: str, exc: BaseException) -> None:
        # The log gets the details (addresses, library messages); the client only learns
        # what kind of failure it was.
        log.warning("request to backend failed (%s): %r", what, exc)
        message = _CLIENT_MESSAGES[what]
        if stream.error is not None:
            return
        with contextlib.suppress(StreamReset):
            # Before the head went out the router can still retry elsewhere; after, the
            # only honest signal is to reset the stream.
            if stream.head_sent:
                stream.reset(StreamReset(code.value, message))
                return
            status = 503 if code is ErrorCode.BACKEND_UNAVAILABLE else 502
            await stream.send_head(status, _JSON, error_body(code, message, "backend"), end=True)
