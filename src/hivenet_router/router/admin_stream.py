"""GET /admin/registration-stream: agent registration changes as server-sent events.

The registry announces each change (an agent registered, registered again, became unhealthy
or healthy, was drained or undrained, lost its connection, was removed); the feed turns it
into one `data:` line of JSON, made once and shared by every subscriber.

A subscriber owns a bounded buffer. The feed never waits for one: when a subscriber's
buffer is full (its client has stopped reading and the socket is backed up), the feed ends
that subscriber, counts it and logs it once, and the stream is closed rather than buffered
without bound. A subscription lives exactly as long as the request that holds it (an
`async with`), so a client that goes away leaves nothing behind. At shutdown the feed ends
every stream at once, so open streams do not hold the shutdown for its whole grace.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import orjson

from hivenet_router.clock import Clock
from hivenet_router.http1 import messages as http
from hivenet_router.router.admin_views import rfc3339
from hivenet_router.router.registry import AgentRecord

log = logging.getLogger("hivenet.admin")

BUFFER = 256  # events a subscriber may have waiting before it is dropped
KEEPALIVE = 25.0  # seconds of silence before a comment line keeps proxies from timing out
OPENING = b": registration changes; read /admin/routing-table for the current state\n\n"
KEEPALIVE_LINE = b": keepalive\n\n"
CLOSING = b": the router is shutting down\n\n"

OVERFLOW = "overflow"
SHUTDOWN = "shutdown"


class Subscription:
    """One client's place in the feed: the events it has not been sent yet."""

    __slots__ = ("_limit", "_pending", "_task", "_wake", "ended")

    def __init__(self, limit: int, task: asyncio.Task[object] | None) -> None:
        self._limit = limit
        self._pending: deque[bytes] = deque()
        self._wake = asyncio.Event()
        self._task = task
        self.ended: str | None = None  # why the feed ended it: OVERFLOW or SHUTDOWN

    def offer(self, event: bytes) -> bool:
        """Queue one event; False when the buffer is full."""
        if len(self._pending) >= self._limit:
            return False
        self._pending.append(event)
        self._wake.set()
        return True

    def end(self, why: str) -> None:
        if self.ended is None:
            self.ended = why
            self._wake.set()
            if why == OVERFLOW and self._task is not None:
                # Its writer may be parked on a socket the client no longer reads: only a
                # cancellation gets it out. The handler tells this one from a client gone.
                self._task.cancel()

    async def next(self, keepalive: float) -> bytes | None:
        """What to send next: the events waiting (joined), a keepalive comment after
        `keepalive` seconds of silence, or None once the feed has ended this subscription
        (at shutdown, after what was already waiting)."""
        if not self._pending and self.ended is None:
            self._wake.clear()
            try:
                async with asyncio.timeout(keepalive):
                    await self._wake.wait()
            except TimeoutError:
                return KEEPALIVE_LINE
        if not self._pending or self.ended == OVERFLOW:
            return None
        events = b"".join(self._pending)
        self._pending.clear()
        return events


class RegistrationFeed:
    """Fans registration changes out to the open streams."""

    def __init__(self, clock: Clock, buffer: int = BUFFER, keepalive: float = KEEPALIVE) -> None:
        self.clock = clock
        self.buffer = buffer
        self.keepalive = keepalive
        self.closed = False
        self.dropped = 0  # subscribers ended because they did not keep up
        self._subs: set[Subscription] = set()

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    def publish(self, change: str, record: AgentRecord) -> None:
        """A registry listener: one change, to every subscriber, without waiting for any."""
        if not self._subs:
            return
        reg = record.reg
        event = orjson.dumps(
            {
                "event_type": change,
                "deployment_id": reg.deployment_id,
                "replica_id": reg.replica_id,
                "agent_id": reg.peer_id,
                "timestamp": rfc3339(self.clock.wall()),
                "model": reg.model,
            }
        )
        frame = b"data: " + event + b"\n\n"
        for sub in list(self._subs):
            if not sub.offer(frame):
                self._drop(sub)

    def _drop(self, sub: Subscription) -> None:
        self._subs.discard(sub)
        self.dropped += 1
        log.warning(
            "registration stream: a subscriber fell %d events behind and was dropped", self.buffer
        )
        sub.end(OVERFLOW)

    def close(self) -> None:
        """Shutdown: end every stream now, and any opened from here on at once."""
        self.closed = True
        for sub in list(self._subs):
            sub.end(SHUTDOWN)

    @asynccontextmanager
    async def subscribe(self) -> AsyncIterator[Subscription]:
        sub = Subscription(self.buffer, asyncio.current_task())
        if self.closed:
            sub.end(SHUTDOWN)
        else:
            self._subs.add(sub)
        try:
            yield sub
        finally:
            self._subs.discard(sub)

    async def serve(self, request: http.Request) -> http.Answer:
        """The handler of GET /admin/registration-stream."""
        rid = request.ticket.request_id if request.ticket is not None else ""
        headers = {
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # nginx: pass each event on as it comes
            "X-Request-ID": rid,
        }
        if request.method == "HEAD":
            return http.Response(b"", 200, None, headers)
        response = await http.stream(request, 200, headers)
        async with self.subscribe() as sub:
            try:
                await self._pump(response, sub)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if sub.ended != OVERFLOW or task is None or task.cancelling() > 1:
                    raise  # the client went away, or shutdown cut it: not ours to keep
                task.uncancel()
        if sub.ended is not None:
            request.close = True  # dropped or shutting down: no next request on this one
        return response

    async def _pump(self, response: http.Stream, sub: Subscription) -> None:
        await response.write(OPENING)  # sends the head, so the client knows it is subscribed
        while (chunk := await sub.next(self.keepalive)) is not None:
            await response.write(chunk)
        if sub.ended == SHUTDOWN:
            await response.write(CLOSING)
