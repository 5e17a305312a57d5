"""Count TLS connections from the moment they are accepted, not from the end of the handshake.

asyncio's own TLS servers (`create_server(ssl=...)`) hand a connection to the protocol only
once its handshake is over, so a guard in the protocol never sees a client that connects
and sends nothing: each such socket holds a descriptor for the whole handshake timeout,
uncounted, and enough of them exhaust the process. Here the listening socket is plain; a
small gate sees every accepted connection, refuses it at once (an abort, before any TLS
byte) when its source or the port is over its cap, and otherwise starts TLS itself with
the same `SSLProtocol` asyncio would have used, counted until the socket is closed.

A connection that later proves who it is (an agent link with a valid session) can be
moved to another guard with `TlsGate.promote`, so that a flood of connections that prove
nothing cannot use up the room kept for those that did.
"""

from __future__ import annotations

import asyncio
import ssl
from asyncio import sslproto
from collections.abc import Callable
from typing import Any

from hivenet_router.http1.guard import ConnectionGuard, source_of

Peer = tuple[Any, ...]


class _GatedTls(sslproto.SSLProtocol):
    """asyncio's TLS protocol, with the guard's count released when the socket closes."""

    def __init__(self, gate: TlsGate, app: asyncio.BaseProtocol, source: str, peer: Peer) -> None:
        # No waiter: nobody awaits the handshake (asyncio checks for None). typeshed
        # asks for a future and an int timeout where the code takes None and a float.
        super().__init__(
            gate.loop,
            app,
            gate.context,
            None,  # type: ignore[arg-type]
            server_side=True,
            ssl_handshake_timeout=gate.handshake_timeout,  # type: ignore[arg-type]
        )
        self.gate = gate
        self.guard = gate.guard
        self.source = source
        self.peer = peer

    def connection_lost(self, exc: BaseException | None) -> None:
        self.gate.released(self)
        super().connection_lost(exc)


class _Gate(asyncio.Protocol):
    """What a new socket talks to first: admitted, it is handed to TLS; refused, aborted."""

    def __init__(self, gate: TlsGate) -> None:
        self._gate = gate

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._gate.admit(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        pass  # refused: nothing was counted


class TlsGate:
    """The protocol factory of a TLS listening socket whose connections a guard caps.

    `make_app()` builds the application's protocol for an admitted connection;
    `handshake_timeout` bounds the TLS handshake (asyncio then aborts the socket)."""

    def __init__(
        self,
        guard: ConnectionGuard,
        context: ssl.SSLContext,
        make_app: Callable[[], asyncio.BaseProtocol],
        handshake_timeout: float,
    ) -> None:
        self.guard = guard
        self.context = context
        self.make_app = make_app
        self.handshake_timeout = handshake_timeout
        self.loop = asyncio.get_running_loop()
        self._live: dict[Peer, _GatedTls] = {}

    def __call__(self) -> asyncio.BaseProtocol:
        return _Gate(self)

    @property
    def live(self) -> int:
        """Connections admitted and not yet closed, whichever guard counts them now."""
        return len(self._live)

    def admit(self, transport: asyncio.BaseTransport) -> None:
        source = source_of(transport)
        if not self.guard.enter(source):
            transport.abort()  # type: ignore[attr-defined]
            return
        peer = transport.get_extra_info("peername") or (id(transport),)
        tls = _GatedTls(self, self.make_app(), source, tuple(peer))
        self._live[tls.peer] = tls
        transport.set_protocol(tls)
        tls.connection_made(transport)

    def released(self, tls: _GatedTls) -> None:
        if self._live.get(tls.peer) is tls:
            del self._live[tls.peer]
            tls.guard.leave(tls.source)

    def promote(self, peer: Peer | None, to: ConnectionGuard) -> bool:
        """Count the connection from `peer` against `to` instead of its present guard.
        False (nothing changed) when `to` has no room for its source; True too when the
        connection is unknown (already closed: there is nothing to count)."""
        tls = self._live.get(tuple(peer)) if peer else None
        if tls is None or tls.guard is to:
            return True
        if not to.enter(tls.source):
            return False
        tls.guard.leave(tls.source)
        tls.guard = to
        return True
