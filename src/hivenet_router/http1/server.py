"""A lean HTTP/1.1 server for the public API.

A general framework spends most of a small request's cost on objects the router never
uses (multidicts, URL objects, middleware chains, per-request timers). This server parses
with httptools (llhttp) on an asyncio protocol and gives the application only what it
reads: the method, the decoded path, the query, the headers as a list, and the body, read
when the application asks for it (so a refused request never has its body buffered).

What it guarantees, whatever the client does:
- a request head (request line and headers) is bounded in bytes (431 past the limit);
- a body is bounded (413 as soon as its declared or received size passes the limit) and,
  when encoded, is decoded within the same bound (gzip and deflate);
- a request read to its end keeps its connection after the answer, even when its body
  was refused as too large; one answered while its body was still arriving closes it;
- a connection that sends no complete request head within the idle timeout of being
  accepted or of its last answer is closed (one sweep a fraction of that timeout, not a
  timer per request);
- a connection whose client stops reading an answer (the socket's buffers full, nothing
  taken for `write_idle` seconds) is aborted like one whose client hung up, so a stream
  cannot hold its engine slot for a reader that never reads;
- at the guard's total, a new connection takes the place of an idle one (no request in
  progress), picked from the source holding the most connections, longest idle first;
- a connection whose client goes away has its request's task cancelled, so whatever the
  request held is given back at once;
- malformed HTTP gets one error answer and the connection closes; it is reported to a
  callback (summarised by the caller), never with a traceback per request;
- pipelined requests are answered in order, and reading stops while more than one waits.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from hivenet_router.http1.connection import ClientConnection
from hivenet_router.http1.guard import ConnectionGuard
from hivenet_router.http1.messages import App

EVICTION_SAMPLE = 64  # idle connections compared to choose one to close at the cap

# -- the server ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Limits:
    body: int = 1 << 20  # bytes of body, before and after decoding
    head: int = 32 * 1024  # bytes of request line and headers together
    idle: float = 30.0  # seconds a connection may go without a complete request head
    write_idle: float = 60.0  # seconds an answer may wait for its client to read anything


class HttpServer:
    """Serves `app` on one or more sockets.

    `error_page(status, message)` makes the body of answers the server gives itself
    (malformed request, head too large); `refusal` is written to a connection the guard
    refuses; `malformed(description)` hears of every malformed request."""

    def __init__(
        self,
        app: App,
        limits: Limits,
        *,
        error_page: Callable[[int, str], bytes],
        guard: ConnectionGuard | None = None,
        refusal: bytes = b"",
        malformed: Callable[[str], None] = lambda description: None,
    ) -> None:
        self.app = app
        self.limits = limits
        self.error_page = error_page
        self.guard = guard
        if guard is not None:
            guard.make_room = self._make_room
        self.refusal = refusal
        self.malformed = malformed
        self.connections: set[ClientConnection] = set()
        self.closing = False
        self._servers: list[asyncio.Server] = []
        self._sweeper: asyncio.Task[None] | None = None

    async def listen(
        self, host: str, port: int, backlog: int = 1024, *, reuse_port: bool = False
    ) -> None:
        """`reuse_port`: other processes may listen on the same port (SO_REUSEPORT); the
        kernel spreads new connections over them."""
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: ClientConnection(self),
            host,
            port,
            backlog=backlog,
            reuse_address=True,
            reuse_port=reuse_port or None,
        )
        self._servers.append(server)
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep())

    @property
    def ports(self) -> list[int]:
        return [s.getsockname()[1] for srv in self._servers for s in srv.sockets]

    def stop_listening(self) -> None:
        """Accept no more connections; close the idle ones; answers in progress finish and
        close their connections."""
        self.closing = True
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            if conn.idle:
                conn.close()

    async def close(self) -> None:
        """Close every connection (requests still running are cancelled)."""
        self.stop_listening()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        for conn in list(self.connections):
            conn.close()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()
        self._servers.clear()

    async def _sweep(self) -> None:
        """Close connections that have been idle (no complete request head) too long, and
        abort those whose client has read nothing of an answer for too long."""
        idle, write_idle = self.limits.idle, self.limits.write_idle
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(max(0.1, min(1.0, idle / 4, write_idle / 4)))
            now = loop.time()
            for conn in list(self.connections):
                if conn.idle and now - conn.idle_since >= idle:
                    conn.close()
                elif conn.paused and now - conn.paused_since >= write_idle:
                    conn.stalled()

    def _make_room(self) -> bool:
        """Close one idle connection to make room for a new one (see the module's list).
        Looks at a bounded sample, so a flood of new connections at the cap costs each of
        them little."""
        guard = self.guard
        assert guard is not None
        victim: ClientConnection | None = None
        best = (0, 0.0)
        for seen, conn in enumerate(self.connections):
            if seen >= EVICTION_SAMPLE and victim is not None:
                break
            source = conn.source
            if source is None or not conn.idle:
                continue
            rank = (guard.from_source(source), -conn.idle_since)
            if victim is None or rank > best:
                victim, best = conn, rank
        if victim is None:
            return False
        victim.evict()
        return True
