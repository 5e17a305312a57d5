"""Two ends of a real agent connection on loopback, for multiplexer tests: the router's
aiohttp WebSocket server and the agent's own client (plain WebSocket: TLS is tested end to
end)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from hivenet_router.transport import frames, websocket, ws_server
from hivenet_router.transport.link import Link, Stream

Handler = Callable[[Stream], Awaitable[None]]


async def serve_ws(
    accept: Callable[[web.Request], Awaitable[web.StreamResponse]],
    *,
    handler_cancellation: bool = False,
) -> web.AppRunner:
    """An aiohttp server on a free loopback port with `accept` at /ws (the caller cleans up
    the runner). `handler_cancellation`: a lost connection cancels its handler, as the
    router's agent port does."""
    app = web.Application()
    app.router.add_get("/ws", accept)
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


def ws_url(runner: web.AppRunner) -> str:
    return f"ws://127.0.0.1:{runner.addresses[0][1]}/ws"


@dataclass
class Pair:
    client: Link  # the dialer, which opens streams in these tests
    server_links: list[Link]
    client_ws: websocket.WebSocketClient


@contextlib.asynccontextmanager
async def dialled(
    url: str, tls: ssl.SSLContext | None, headers: dict[str, str], name: str
) -> AsyncIterator[tuple[Link, websocket.WebSocketClient, asyncio.Task[None]]]:
    """A link dialled as an agent dials one (its own WebSocket client), read by a task, and
    closed on the way out: the link, its WebSocket and the reading task."""
    ws = await websocket.connect(url, ssl_context=tls, headers=headers, max_size=frames.MAX_FRAME)
    link = Link(ws, dialer=True, handlers={}, name=name)
    reader = asyncio.create_task(link.run())
    try:
        yield link, ws, reader
    finally:
        await link.close()
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


@contextlib.asynccontextmanager
async def link_pair(protocol: str, handler: Handler) -> AsyncIterator[Pair]:
    server_links: list[Link] = []

    async def accept(request: web.Request) -> web.StreamResponse:
        # The router's own end of the link, as control.py accepts it.
        response, ws = await ws_server.accept(request, max_size=frames.MAX_FRAME, heartbeat=None)
        link = Link(ws, dialer=False, handlers={protocol: handler}, name="server")
        server_links.append(link)
        await link.run()
        return response

    runner = await serve_ws(accept)
    try:
        async with dialled(ws_url(runner), None, {}, "client") as (client, ws, _):
            while not server_links:
                await asyncio.sleep(0.01)
            yield Pair(client, server_links, ws)
    finally:
        await runner.cleanup()


async def echo_every_length(ws: websocket.WebSocket) -> None:
    """Send a message of each length encoding (7-bit, 16-bit, 64-bit, at their edges) to an
    echoing peer; each must come back whole."""
    for size in (0, 1, 125, 126, 65535, 65536, 300_000):
        payload = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
        await ws.send_bytes(payload)
        message = await asyncio.wait_for(ws.receive(), 5)
        assert message.type == websocket.BINARY and message.data == payload
