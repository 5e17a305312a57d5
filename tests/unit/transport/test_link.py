"""The multiplexer over a real aiohttp WebSocket on loopback (no TLS: that is tested end to end)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from hivenet_router.transport import frames, websocket, ws_server
from hivenet_router.transport.frames import FrameType
from hivenet_router.transport.link import (
    INITIAL_WINDOW,
    Link,
    LinkClosed,
    Stream,
    StreamReset,
    WriteTimeout,
)
from tests.linkpair import Handler, Pair, dialled, link_pair, serve_ws, ws_url

PROTO = "/test/1.0.0"


@pytest.fixture
async def connect() -> AsyncIterator[Callable[[Handler], Awaitable[Pair]]]:
    async with contextlib.AsyncExitStack() as stack:

        async def make(handler: Handler) -> Pair:
            return await stack.enter_async_context(link_pair(PROTO, handler))

        yield make


async def echo(stream: Stream) -> None:
    body = await stream.read_all(1 << 24)
    await stream.send_head(200, [("x-echo", "1")])
    await stream.write(body, end=True)


async def test_many_concurrent_streams(connect: Callable[[Handler], Awaitable[Pair]]) -> None:
    pair = await connect(echo)

    async def one(i: int) -> bytes:
        async with pair.client.request(PROTO, "POST", "/e", [], f"body-{i}".encode()) as s:
            head = await s.response_head()
            assert head.status == 200 and ("x-echo", "1") in head.headers
            return await s.read_all(1024)

    bodies = await asyncio.gather(*(one(i) for i in range(200)))
    assert bodies == [f"body-{i}".encode() for i in range(200)]
    assert pair.client.active_streams == 0
    assert pair.server_links[0].active_streams == 0


async def test_large_bodies_cross_many_windows(
    connect: Callable[[Handler], Awaitable[Pair]],
) -> None:
    pair = await connect(echo)
    payload = bytes(range(256)) * 8192  # 2 MiB, eight windows
    async with pair.client.request(PROTO, "POST", "/e", [], payload) as s:
        await s.response_head()
        assert await s.read_all(1 << 24) == payload


async def test_a_stalled_reader_does_not_block_other_streams(
    connect: Callable[[Handler], Awaitable[Pair]],
) -> None:
    async def big(stream: Stream) -> None:
        await stream.read_all(1024)
        await stream.send_head(200, [])
        if stream.request_head and stream.request_head.path == "/big":
            await stream.write(b"x" * (4 * INITIAL_WINDOW), end=True, timeout=5)
        else:
            await stream.write(b"small", end=True)

    pair = await connect(big)
    async with pair.client.request(PROTO, "POST", "/big", [], b"") as stalled:
        await stalled.response_head()  # and never read its body
        for _ in range(20):
            async with pair.client.request(PROTO, "POST", "/small", [], b"") as other:
                await other.response_head()
                assert await other.read_all(1024) == b"small"


async def test_write_timeout_when_the_reader_stops(
    connect: Callable[[Handler], Awaitable[Pair]],
) -> None:
    outcome: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

    async def flood(stream: Stream) -> None:
        await stream.read_all(1024)
        await stream.send_head(200, [])
        try:
            await stream.write(b"y" * (2 * INITIAL_WINDOW), end=True, timeout=0.2)
            outcome.set_result(None)
        except StreamReset as exc:
            outcome.set_result(exc)
            raise

    pair = await connect(flood)
    async with pair.client.request(PROTO, "POST", "/", [], b"") as s:
        await s.response_head()
        error = await asyncio.wait_for(outcome, 5)
        assert isinstance(error, WriteTimeout)
        with pytest.raises(StreamReset, match="write_timeout"):
            await s.read_all(1 << 24)


async def test_requester_reset_cancels_the_handler(
    connect: Callable[[Handler], Awaitable[Pair]],
) -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def slow(stream: Stream) -> None:
        await stream.read_all(1024)
        await stream.send_head(200, [])
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    pair = await connect(slow)
    async with pair.client.request(PROTO, "POST", "/", [], b"x") as s:
        await s.response_head()
        await started.wait()
    # Leaving the context without finishing resets the stream.
    await asyncio.wait_for(cancelled.wait(), 5)
    await asyncio.sleep(0.05)
    assert pair.server_links[0].active_streams == 0


async def test_peer_vanishing_fails_open_streams(
    connect: Callable[[Handler], Awaitable[Pair]],
) -> None:
    async def hang(stream: Stream) -> None:
        await stream.read_all(1024)
        await stream.send_head(200, [])
        await stream.write(b"part")
        await asyncio.sleep(30)

    pair = await connect(hang)
    async with pair.client.request(PROTO, "POST", "/", [], b"") as s:
        await s.response_head()
        assert await s.read() == b"part"
        await pair.server_links[0].close("going away")
        with pytest.raises(LinkClosed):
            await asyncio.wait_for(s.read(), 5)
    assert pair.client.closed
    with pytest.raises(LinkClosed):
        await pair.client.open(PROTO, "POST", "/", [], b"")


async def test_unknown_protocol_is_refused(connect: Callable[[Handler], Awaitable[Pair]]) -> None:
    pair = await connect(echo)
    async with pair.client.request("/nope/1.0.0", "POST", "/", [], b"x") as s:
        with pytest.raises(StreamReset, match="unknown_protocol"):
            await asyncio.wait_for(s.response_head(), 5)
    assert not pair.client.closed


async def test_a_frame_that_breaks_the_protocol_closes_the_link(
    connect: Callable[[Handler], Awaitable[Pair]],
) -> None:
    pair = await connect(echo)
    await pair.client_ws.send_bytes(frames.HEADER.pack(77, 0, 1))
    await asyncio.wait_for(pair.server_links[0].wait_closed(), 5)
    assert "protocol error" in pair.server_links[0].close_reason


async def test_an_oversized_message_closes_the_link(
    connect: Callable[[Handler], Awaitable[Pair]],
) -> None:
    pair = await connect(echo)
    lying = frames.HEADER.pack(FrameType.DATA, 0, 1) + b"z" * (frames.MAX_FRAME + 10)
    await pair.client_ws.send_bytes(lying)
    await asyncio.wait_for(pair.server_links[0].wait_closed(), 5)


async def test_sending_past_the_window_resets_only_that_stream(
    connect: Callable[[Handler], Awaitable[Pair]],
) -> None:
    seen: list[str] = []

    async def sink(stream: Stream) -> None:
        try:
            await asyncio.sleep(30)  # never reads, so never grants more credit
        except asyncio.CancelledError:
            seen.append(stream.error.code if stream.error else "?")
            raise

    pair = await connect(sink)
    ws = pair.client_ws
    await ws.send_bytes(
        frames.encode_head(
            FrameType.OPEN,
            1,
            {"proto": PROTO, "method": "POST", "path": "/", "headers": []},
            b"",
            0,
            0,
        )[0]
    )
    chunk = b"q" * frames.MAX_PAYLOAD
    for _ in range(INITIAL_WINDOW // frames.MAX_PAYLOAD + 1):
        await ws.send_bytes(frames.encode(FrameType.DATA, 1, chunk))
    for _ in range(100):
        if seen:
            break
        await asyncio.sleep(0.02)
    assert seen == ["flow_control"]
    assert not pair.server_links[0].closed
    assert pair.server_links[0].active_streams == 0


async def test_bodies_ride_with_their_head_and_spill_over(
    connect: Callable[[Handler], Awaitable[Pair]],
) -> None:
    async def inline(stream: Stream) -> None:
        body = await stream.read_all(1 << 24)
        await stream.send_head(201, [], body, end=True)

    pair = await connect(inline)
    for size in (0, 10, frames.MAX_PAYLOAD - 100, frames.MAX_PAYLOAD * 3, INITIAL_WINDOW * 2):
        payload = bytes(i % 251 for i in range(size))
        async with pair.client.request(PROTO, "POST", "/", [], payload) as s:
            assert (await s.response_head()).status == 201
            assert await s.read_all(1 << 24) == payload
    assert pair.client.active_streams == 0


async def test_a_head_too_large_for_a_frame_leaves_nothing_behind(
    connect: Callable[[Handler], Awaitable[Pair]],
) -> None:
    pair = await connect(echo)
    huge = [(f"x-{i}", "v" * 8000) for i in range(10)]
    for _ in range(3):
        with pytest.raises(StreamReset) as info:
            await pair.client.open(PROTO, "POST", "/e", huge, b"{}")
        assert info.value.code == "head_too_large"
    assert pair.client.active_streams == 0
    # The connection itself is fine.
    async with pair.client.request(PROTO, "POST", "/e", [], b"ok") as stream:
        assert (await stream.response_head()).status == 200
        assert await stream.read_all(16) == b"ok"


async def test_a_cancelled_open_leaves_nothing_behind(
    connect: Callable[[Handler], Awaitable[Pair]],
) -> None:
    """A body bigger than the first window waits for credit; a caller cancelled meanwhile
    must not leave its stream on the connection."""

    async def never_reads(stream: Stream) -> None:
        await asyncio.Event().wait()

    pair = await connect(never_reads)
    task = asyncio.create_task(pair.client.open(PROTO, "POST", "/e", [], b"x" * (1 << 20)))
    await asyncio.sleep(0.2)
    assert pair.client.active_streams == 1
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert pair.client.active_streams == 0


async def test_an_answer_head_too_large_to_send_can_still_be_answered_with_an_error(
    connect: Callable[[Handler], Awaitable[Pair]],
) -> None:
    async def handler(stream: Stream) -> None:
        await stream.read_all(1024)
        with pytest.raises(frames.FrameError):
            await stream.send_head(200, [(f"x-{i}", "v" * 8000) for i in range(10)])
        assert not stream.head_sent
        await stream.send_head(502, [], b"too big", end=True)

    pair = await connect(handler)
    async with pair.client.request(PROTO, "POST", "/", [], b"") as s:
        assert (await s.response_head()).status == 502
        assert await s.read_all(64) == b"too big"


async def test_the_body_sent_with_a_head_is_bounded_by_the_write_timeout(
    connect: Callable[[Handler], Awaitable[Pair]],
) -> None:
    outcome: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

    async def whole(stream: Stream) -> None:
        await stream.read_all(1024)
        try:
            await stream.send_head(200, [], b"z" * (2 * INITIAL_WINDOW), end=True, timeout=0.2)
            outcome.set_result(None)
        except StreamReset as exc:
            outcome.set_result(exc)
            raise

    pair = await connect(whole)
    async with pair.client.request(PROTO, "POST", "/", [], b"") as s:
        await s.response_head()  # and then read nothing
        assert isinstance(await asyncio.wait_for(outcome, 5), WriteTimeout)


@contextlib.asynccontextmanager
async def router_end() -> AsyncIterator[tuple[Link, websocket.WebSocketClient, list[Link]]]:
    """An agent's link to a server end run as the router runs it: aiohttp cancels the
    handler when the connection is lost, in the same turn as the WebSocket hears of it."""
    server_links: list[Link] = []

    async def accept(request: web.Request) -> web.StreamResponse:
        response, ws = await ws_server.accept(request, max_size=frames.MAX_FRAME, heartbeat=None)
        link = Link(ws, dialer=False, handlers={}, name="agent a")
        server_links.append(link)
        await link.run()
        return response

    runner = await serve_ws(accept, handler_cancellation=True)
    try:
        async with dialled(ws_url(runner), None, {}, "router r") as (client, ws, _):
            while not server_links:
                await asyncio.sleep(0.01)
            yield client, ws, server_links
    finally:
        await runner.cleanup()


def _reset(ws: websocket.WebSocketClient) -> None:
    """Close the socket with a TCP reset, as a host that lost the process's state does."""
    transport = ws._transport
    assert transport is not None
    sock = transport.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


@pytest.mark.parametrize(
    ("end", "words"),
    [
        ("eof", "it closed the connection without a goodbye (as a killed process does)"),
        ("reset", "its connection was reset (its process or host went away)"),
        ("goodbye", "it said goodbye (WebSocket close code 1000)"),
    ],
)
async def test_a_lost_link_says_why_in_words(end: str, words: str) -> None:
    async with router_end() as (client, ws, server_links):
        if end == "eof":  # a killed agent: its kernel closes the socket, no WebSocket close
            assert ws._transport is not None
            ws._transport.close()
        elif end == "reset":
            _reset(ws)
        else:
            await client.close("agent stopping")
        server = server_links[0]
        await asyncio.wait_for(server.wait_closed(), 5)
        assert server.close_reason == words
        if end == "goodbye":
            assert client.close_reason == "agent stopping"


async def test_a_link_stopped_by_its_own_side_says_so() -> None:
    async with router_end() as (client, _, server_links):
        await server_links[0].close("router shutting down")
        await asyncio.wait_for(client.wait_closed(), 5)
        assert server_links[0].close_reason == "router shutting down"
        assert client.close_reason == "it said goodbye (WebSocket close code 1000)"
