"""Count TLS connections from the moment they are accepted, not from the end of the handshake.

asyncio's TLS servers (`create_server(ssl=...)`, uvloop's too) hand a connection to the
protocol only once its handshake is over, so a guard in the protocol never sees a client
that connects and sends nothing: each such socket holds a descriptor for the whole
handshake timeout, uncounted, and enough of them exhaust the process. Here the listening
socket is plain; a small gate sees every accepted connection, refuses it at once (an
abort, before any TLS byte) when its source or the port is over its cap, and otherwise
starts TLS on it with the loop's own `start_tls` (uvloop's compiled TLS on the router),
counted until the socket is closed.

A connection that later proves who it is (an agent link with a valid session) can be
moved to another guard with `TlsGate.promote`, so that a flood of connections that prove
nothing cannot use up the room kept for those that did.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable
from typing import Any

from hivenet_router.http1.guard import ConnectionGuard, source_of

Peer = tuple[Any, ...]
MAX_EARLY = 64 * 1024  # bytes a client may send before TLS has its socket


class _Counted(asyncio.Protocol):
    """Stands in front of the application's protocol and tells the gate when the connection
    is lost. It sits on the byte path only until the application hands the connection to
    another protocol (the link's WebSocket does, and calls this one's `connection_lost` at
    the end)."""

    def __init__(self, gate: TlsGate, app: asyncio.Protocol, source: str, peer: Peer) -> None:
        self.gate = gate
        self.app = app
        self.guard = gate.guard
        self.source = source
        self.peer = peer
        # What TLS delivered between the end of the handshake and the moment start_tls's
        # caller ran: held for the application, which has not been told of the connection.
        self._early: list[bytes] | None = []
        self._early_eof = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.app.connection_made(transport)
        early, self._early = self._early, None
        for data in early or ():
            self.app.data_received(data)
        if self._early_eof and not self.app.eof_received():
            transport.close()

    def data_received(self, data: bytes) -> None:
        if self._early is not None:
            self._early.append(data)
            return
        self.app.data_received(data)

    def eof_received(self) -> bool | None:
        if self._early is not None:
            self._early_eof = True
            return True  # the application decides once it has been told of the connection
        return self.app.eof_received()

    def pause_writing(self) -> None:
        self.app.pause_writing()

    def resume_writing(self) -> None:
        self.app.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.gate.released(self)
        self.app.connection_lost(exc)


class _Gate(asyncio.Protocol):
    """What a new socket talks to first: admitted, it starts TLS; refused, it is aborted.

    The loops start reading a new socket as soon as `connection_made` returns, before the
    task that starts TLS runs, so the ClientHello may arrive here first: it is kept and
    handed to TLS once TLS has the socket (`_feed`)."""

    def __init__(self, gate: TlsGate) -> None:
        self._gate = gate
        self._counted: _Counted | None = None
        self._transport: asyncio.BaseTransport | None = None
        self.early = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._counted = self._gate.admit(transport, self)

    def data_received(self, data: bytes) -> None:
        self.early += data
        if len(self.early) > MAX_EARLY and self._transport is not None:
            self._transport.abort()  # type: ignore[attr-defined]  # no ClientHello is this big

    def connection_lost(self, exc: Exception | None) -> None:
        # Lost before TLS took the socket over (or refused): no longer counted.
        if self._counted is not None:
            self._gate.released(self._counted)


def _feed(transport: asyncio.BaseTransport, data: bytes) -> None:
    """Give TLS the bytes the gate read before TLS had the socket, as if just read."""
    if transport.is_closing():
        return
    protocol: Any = transport.get_protocol()
    if not hasattr(protocol, "buffer_updated"):
        protocol.data_received(data)
        return
    view = memoryview(data)
    while view:
        buffer = protocol.get_buffer(len(view))
        size = min(len(buffer), len(view))
        buffer[:size] = view[:size]
        protocol.buffer_updated(size)
        view = view[size:]


class TlsGate:
    """The protocol factory of a TLS listening socket whose connections a guard caps.

    `make_app()` builds the application's protocol for an admitted connection;
    `handshake_timeout` bounds the TLS handshake (the socket is then closed)."""

    def __init__(
        self,
        guard: ConnectionGuard,
        context: ssl.SSLContext,
        make_app: Callable[[], asyncio.Protocol],
        handshake_timeout: float,
    ) -> None:
        self.guard = guard
        self.context = context
        self.make_app = make_app
        self.handshake_timeout = handshake_timeout
        self.loop = asyncio.get_running_loop()
        self._live: dict[Peer, _Counted] = {}
        self._handshakes: set[asyncio.Task[None]] = set()

    def __call__(self) -> asyncio.BaseProtocol:
        return _Gate(self)

    @property
    def live(self) -> int:
        """Connections admitted and not yet closed, whichever guard counts them now."""
        return len(self._live)

    def admit(self, transport: asyncio.BaseTransport, first: _Gate) -> _Counted | None:
        source = source_of(transport)
        if not self.guard.enter(source):
            transport.abort()  # type: ignore[attr-defined]
            return None
        peer = transport.get_extra_info("peername") or (id(transport),)
        counted = _Counted(self, self.make_app(), source, tuple(peer))
        self._live[counted.peer] = counted
        task = self.loop.create_task(self._handshake(transport, counted, first))
        self._handshakes.add(task)
        task.add_done_callback(self._handshakes.discard)
        return counted

    async def _handshake(
        self, transport: asyncio.BaseTransport, counted: _Counted, first: _Gate
    ) -> None:
        early = bytes(first.early)
        if early:
            # start_tls sets TLS's protocol now and schedules its connection_made and the
            # resumed reading; this, scheduled one turn later, comes after both, and before
            # the client sends more (it waits for the server's answer to its hello).
            self.loop.call_soon(self.loop.call_soon, _feed, transport, early)
        try:
            secure = await self.loop.start_tls(
                transport,  # type: ignore[arg-type]
                counted,
                self.context,
                server_side=True,
                ssl_handshake_timeout=self.handshake_timeout,
            )
        except (OSError, ssl.SSLError, TimeoutError, RuntimeError, asyncio.CancelledError):
            # A failed or late handshake, or a client gone: the socket is closed.
            with contextlib.suppress(Exception):
                transport.abort()  # type: ignore[attr-defined]
            self.released(counted)
            return
        if secure is None or secure.is_closing():
            self.released(counted)
            return
        counted.connection_made(secure)

    def released(self, counted: _Counted) -> None:
        if self._live.get(counted.peer) is counted:
            del self._live[counted.peer]
            counted.guard.leave(counted.source)

    def promote(self, peer: Peer | None, to: ConnectionGuard) -> bool:
        """Count the connection from `peer` against `to` instead of its present guard.
        False (nothing changed) when `to` has no room for its source; True too when the
        connection is unknown (already closed: there is nothing to count)."""
        counted = self._live.get(tuple(peer)) if peer else None
        if counted is None or counted.guard is to:
            return True
        if not to.enter(counted.source):
            return False
        counted.guard.leave(counted.source)
        counted.guard = to
        return True
