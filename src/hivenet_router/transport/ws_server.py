"""The router's end of the agent link: the server role of RFC 6455 after an aiohttp upgrade.

aiohttp still serves the HTTP part of the p2p port (TLS, the connection guard, the request
and the session check). `accept` answers the upgrade itself (101 with Sec-WebSocket-Accept)
and then takes the connection over: `transport.set_protocol` makes the socket's events come
straight to a `WebSocket` in the server role (transport/websocket.py), so neither aiohttp's
WebSocket reader nor its writer, nor its protocol, sits on the byte path any more. When the
connection ends, aiohttp's protocol hears of it as before (its connection count, the
per-source guard, the handler's cancellation).

What differs from the client: frames out unmasked, frames in must be masked; a message over
the limit closes with 1009. Both ends write the frames of one event-loop turn in one write.
"""

from __future__ import annotations

import asyncio
import binascii
from typing import Any

from aiohttp import web

from hivenet_router.transport.websocket import SocketProtocol, WebSocket
from hivenet_router.transport.wsframes import ProtocolError, accept_key


class UpgradeRefused(Exception):
    """The request is not a WebSocket upgrade this server accepts; answer `status`."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class ServerWebSocket(WebSocket):
    """The server end of one link."""

    def __init__(self, max_size: int, heartbeat: float | None) -> None:
        super().__init__(max_size, heartbeat, client=False)

    def _error_code(self, error: ProtocolError) -> int:
        return error.code


class _Protocol(SocketProtocol):
    """The socket's protocol once upgraded: the WebSocket's, and at the end aiohttp's."""

    def __init__(self, socket: WebSocket, previous: asyncio.BaseProtocol) -> None:
        super().__init__(socket)
        self._previous = previous

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._previous.connection_lost(exc)


def _key(request: web.Request) -> str:
    """The client's Sec-WebSocket-Key, once the request is a valid upgrade."""
    headers = request.headers
    if request.method != "GET" or request.version < (1, 1) or request.can_read_body:
        raise UpgradeRefused("a WebSocket upgrade is a GET of HTTP/1.1 without a body")
    if headers.get("Upgrade", "").strip().lower() != "websocket":
        raise UpgradeRefused("not a WebSocket upgrade (Upgrade: websocket missing)")
    tokens = {t.strip().lower() for t in headers.get("Connection", "").split(",")}
    if "upgrade" not in tokens:
        raise UpgradeRefused("not a WebSocket upgrade (Connection: upgrade missing)")
    if headers.get("Sec-WebSocket-Version", "") != "13":
        raise UpgradeRefused("unsupported WebSocket version (13 is supported)")
    key = headers.get("Sec-WebSocket-Key", "")
    try:
        valid = len(binascii.a2b_base64(key.encode())) == 16
    except binascii.Error:
        valid = False
    if not valid:
        raise UpgradeRefused("bad Sec-WebSocket-Key")
    return key


async def accept(
    request: web.Request, *, max_size: int, heartbeat: float | None
) -> tuple[web.StreamResponse, ServerWebSocket]:
    """Answer the upgrade and take the connection over. Return the response the handler
    returns once the WebSocket is done (already sent: aiohttp then closes the connection)
    and the WebSocket. Raises UpgradeRefused (nothing sent yet) or ConnectionResetError."""
    key = _key(request)
    response = web.StreamResponse(
        status=101,
        headers={"Upgrade": "websocket", "Connection": "Upgrade"},
    )
    response.headers["Sec-WebSocket-Accept"] = accept_key(key)
    response.force_close()  # the connection ends with the WebSocket, never kept alive
    await response.prepare(request)
    previous: Any = request.protocol
    transport = request.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("the client left during the upgrade")
    previous.keep_alive(False)  # no idle timer on a connection that is no longer HTTP
    socket = ServerWebSocket(max_size, heartbeat)
    socket._transport = transport
    socket._paused = bool(previous.writing_paused)
    # What the socket talked to before (aiohttp's protocol, or what stands in front of it,
    # such as the port's connection gate) hears of the end, as it would have.
    transport.set_protocol(_Protocol(socket, transport.get_protocol()))
    # Bytes that came behind the request before the switch wait in aiohttp's protocol.
    tail = getattr(previous, "_message_tail", b"")
    if tail:
        previous._message_tail = b""
        socket._on_data(tail)
    socket._start()
    return response, socket
