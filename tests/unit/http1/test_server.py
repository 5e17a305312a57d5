"""The public HTTP/1.1 server on a real loopback socket, driven byte by byte."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from hivenet_router.http1 import coalesce
from hivenet_router.http1.guard import ConnectionGuard
from hivenet_router.http1.messages import Answer, BodyError, Request, Response, stream
from hivenet_router.http1.server import HttpServer, Limits
from tests.counting import CountingTransport
from tests.cycles import freed_by_refcount

Client = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class App:
    """Echoes method, path, query and body; /stream streams; /wait waits forever."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.started = asyncio.Event()
        self.go_on = asyncio.Event()

    async def __call__(self, request: Request) -> Answer:
        if request.path == "/wait":
            self.started.set()
            try:
                await asyncio.Event().wait()
            finally:
                self.cancelled.set()
        if request.path == "/stream":
            out = await stream(request, 200, {"Content-Type": "text/event-stream"})
            for n in range(3):
                await out.write(b"data: %d\n\n" % n)
            return out
        if request.path == "/flood":  # writes until the client stops taking it
            out = await stream(request, 200, {"Content-Type": "text/event-stream"})
            try:
                while True:
                    await out.write(b"data: " + b"x" * 16384 + b"\n\n")
            finally:
                self.cancelled.set()
        if request.path == "/pause":  # one piece, then nothing until the test says
            out = await stream(request, 200, {"Content-Type": "text/event-stream"})
            await out.write(b"data: first\n\n")
            await self.go_on.wait()
            await out.write(b"data: second\n\n")
            return out
        try:
            body = await request.read()
        except BodyError as exc:
            response = Response(str(exc).encode(), exc.status, "text/plain")
            response.close = request.path != "/keep"  # /keep leaves it to the server
            return response
        text = f"{request.method} {request.path} {request.query} ".encode() + body
        return Response(text, 200, "text/plain")


@pytest.fixture
async def served() -> AsyncIterator[tuple[HttpServer, App, Callable[[], Awaitable[Client]]]]:
    app = App()
    malformed: list[str] = []
    server = HttpServer(
        app,
        Limits(body=100, head=2048, idle=0.4),
        error_page=lambda status, message: f'{{"status":{status}}}'.encode(),
        guard=ConnectionGuard("test", per_source=4, total=10),
        refusal=b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n",
        malformed=malformed.append,
    )
    await server.listen("127.0.0.1", 0)
    port = server.ports[0]

    async def connect() -> Client:
        return await asyncio.open_connection("127.0.0.1", port)

    yield server, app, connect
    await server.close()


async def answer(reader: asyncio.StreamReader) -> tuple[bytes, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = head.decode().split("\r\n")
    headers = {}
    for line in lines[1:]:
        if line:
            name, value = line.split(":", 1)
            headers[name.lower()] = value.strip()
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            piece = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += piece[:-2]
    else:
        body = await asyncio.wait_for(reader.read(), 5)
    return lines[0].encode(), headers, body


Served = tuple[HttpServer, App, Callable[[], Awaitable[Client]]]


async def closed(reader: asyncio.StreamReader) -> bool:
    return await asyncio.wait_for(reader.read(), 5) == b""


async def last_answer(client: Client) -> tuple[bytes, bytes]:
    """An answer that says the connection closes after it, and then does; status line and
    body."""
    reader, writer = client
    status, headers, body = await answer(reader)
    assert headers["connection"] == "close"
    assert await closed(reader)
    writer.close()
    return status, body


async def test_keep_alive_head_and_query(served: Served) -> None:
    _, _, connect = served
    reader, writer = await connect()
    writer.write(b"POST /a%20b?x=1&x=2&y= HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\nhi")
    status, headers, body = await answer(reader)
    assert status == b"HTTP/1.1 200 OK" and "date" in headers
    assert body == b"POST /a b {'x': '1', 'y': ''} hi"
    writer.write(b"HEAD /h HTTP/1.1\r\nHost: h\r\n\r\n")
    status, headers, _ = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5), {}, b""
    assert status.startswith(b"HTTP/1.1 200") and b"Content-Length: 11" in status
    writer.write(b"GET /again HTTP/1.1\r\nHost: h\r\n\r\n")
    assert (await answer(reader))[2] == b"GET /again {} "  # nothing of HEAD's body came
    writer.close()


async def test_pipelined_requests_are_answered_in_order(served: Served) -> None:
    _, _, connect = served
    reader, writer = await connect()
    writer.write(b"".join(b"GET /%d HTTP/1.1\r\nHost: h\r\n\r\n" % n for n in range(5)))
    for n in range(5):
        assert (await answer(reader))[2] == b"GET /%d {} " % n
    writer.close()


async def test_a_head_over_the_limit_gets_431_even_in_pieces(served: Served) -> None:
    _, _, connect = served
    for pieces in ([b"x" * 3000], [b"x" * 100] * 30):
        reader, writer = await connect()
        writer.write(b"GET / HTTP/1.1\r\nX-Big: ")
        for piece in pieces:
            writer.write(piece)
            await asyncio.sleep(0)
        status, _, body = await answer(reader)
        assert status.startswith(b"HTTP/1.1 431") and body == b'{"status":431}'
        assert await closed(reader)
        writer.close()


async def test_bodies_over_the_limit_are_refused_declared_or_not(served: Served) -> None:
    _, _, connect = served
    reader, writer = await connect()
    writer.write(b"POST / HTTP/1.1\r\nContent-Length: 1000\r\n\r\n")  # declared: at once
    status, _, _ = await answer(reader)
    assert status.startswith(b"HTTP/1.1 413")
    assert await closed(reader)
    writer.close()
    reader, writer = await connect()
    writer.write(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
    for _ in range(3):
        writer.write(b"40\r\n" + b"z" * 64 + b"\r\n")
    status, _, _ = await answer(reader)
    assert status.startswith(b"HTTP/1.1 413")
    writer.close()


async def test_a_refused_body_read_to_its_end_keeps_the_connection(served: Served) -> None:
    _, _, connect = served
    reader, writer = await connect()
    for _ in range(2):  # head and whole body in one piece: read to its end, then refused
        writer.write(b"POST /keep HTTP/1.1\r\nContent-Length: 500\r\n\r\n" + b"c" * 500)
        status, headers, _ = await answer(reader)
        assert status.startswith(b"HTTP/1.1 413") and "connection" not in headers
        writer.write(b"GET /next HTTP/1.1\r\nHost: h\r\n\r\n")
        assert (await answer(reader))[2] == b"GET /next {} "
    writer.close()


@pytest.mark.parametrize(
    "start",
    [
        b"Content-Length: 1000\r\n\r\n" + b"a" * 300,  # answered while the rest is coming
        b"Transfer-Encoding: chunked\r\n\r\n80\r\n" + b"z" * 128 + b"\r\n",
        b"Content-Length: 1000\r\nExpect: 100-continue\r\n\r\n",  # the body never sent
    ],
)
async def test_a_refused_body_still_arriving_closes_the_connection(
    served: Served, start: bytes
) -> None:
    _, _, connect = served
    client = await connect()
    client[1].write(b"POST /keep HTTP/1.1\r\n" + start)
    status, _ = await last_answer(client)
    assert status.startswith(b"HTTP/1.1 413")


async def test_100_continue_is_sent_when_the_body_is_read(served: Served) -> None:
    _, _, connect = served
    reader, writer = await connect()
    writer.write(b"POST /c HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n")
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == (
        b"HTTP/1.1 100 Continue\r\n\r\n"
    )
    writer.write(b"abc")
    assert (await answer(reader))[2] == b"POST /c {} abc"
    writer.close()


async def test_idle_and_half_sent_connections_are_closed(served: Served) -> None:
    server, _, connect = served
    reader, writer = await connect()
    partial_reader, partial_writer = await connect()
    partial_writer.write(b"GET / HTTP/1.1\r\nHost")
    assert len(server.connections) == 2
    assert await closed(reader) and await closed(partial_reader)
    assert not server.connections
    writer.close()
    partial_writer.close()


async def test_a_client_that_goes_away_cancels_its_request(served: Served) -> None:
    _server, app, connect = served
    _reader, writer = await connect()
    writer.write(b"GET /wait HTTP/1.1\r\n\r\n")
    await asyncio.wait_for(app.started.wait(), 5)
    writer.close()
    await asyncio.wait_for(app.cancelled.wait(), 5)


async def test_streams_are_chunked_or_closed_for_http_1_0(served: Served) -> None:
    _, _, connect = served
    reader, writer = await connect()
    writer.write(b"GET /stream HTTP/1.1\r\n\r\n")
    status, headers, body = await answer(reader)
    assert status == b"HTTP/1.1 200 OK" and headers["transfer-encoding"] == "chunked"
    assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    writer.close()
    reader, writer = await connect()
    writer.write(b"GET /stream HTTP/1.0\r\n\r\n")
    status, headers, body = await answer(reader)
    assert status == b"HTTP/1.1 200 OK" and "transfer-encoding" not in headers
    assert body.endswith(b"data: 2\n\n")
    writer.close()


async def _counted(server: HttpServer) -> CountingTransport:
    for _ in range(100):
        if server.connections:
            break
        await asyncio.sleep(0.01)
    (conn,) = server.connections
    counting = CountingTransport(conn._transport)  # type: ignore[arg-type]
    conn._transport = counting  # type: ignore[assignment]
    return counting


async def test_a_stream_written_in_one_turn_leaves_in_one_write(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    # However slow the machine, this turn's writes are not old enough to go early.
    monkeypatch.setattr(coalesce, "MAX_WAIT", math.inf)
    server, _, connect = served
    reader, writer = await connect()
    counting = await _counted(server)
    writer.write(b"GET /stream HTTP/1.1\r\n\r\n")
    _, _, body = await answer(reader)
    assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert len(counting.writes) == 1  # head, three chunks and the end, together
    writer.close()


async def test_a_piece_leaves_at_the_end_of_its_turn_not_at_the_end(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    # However slow the machine, this turn's writes are not old enough to go early.
    monkeypatch.setattr(coalesce, "MAX_WAIT", math.inf)
    server, app, connect = served
    reader, writer = await connect()
    counting = await _counted(server)
    writer.write(b"GET /pause HTTP/1.1\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200")
    first = await asyncio.wait_for(reader.readuntil(b"data: first\n\n\r\n"), 5)
    assert first.endswith(b"data: first\n\n\r\n")  # while the stream still waits
    assert len(counting.writes) == 1
    app.go_on.set()
    rest = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 5)
    assert b"data: second" in rest
    assert len(counting.writes) == 2  # the second piece and the end, together
    writer.close()


async def test_malformed_http_is_answered_once_and_reported(served: Served) -> None:
    _, _, connect = served
    reader, writer = await connect()
    writer.write(b"NOT HTTP\r\n\r\n")
    status, _, body = await answer(reader)
    assert status.startswith(b"HTTP/1.1 400") and body == b'{"status":400}'
    assert await closed(reader)
    writer.close()


async def test_connections_over_the_cap_are_refused(served: Served) -> None:
    _, _, connect = served
    held = [await connect() for _ in range(4)]
    reader, writer = await connect()
    assert (await asyncio.wait_for(reader.read(), 5)).startswith(b"HTTP/1.1 503")
    writer.close()
    for _, held_writer in held:
        held_writer.close()


async def _capped(app: App, per_source: int, total: int, write_idle: float = 60.0) -> HttpServer:
    server = HttpServer(
        app,
        Limits(body=100, head=2048, idle=30.0, write_idle=write_idle),
        error_page=lambda status, message: f'{{"status":{status}}}'.encode(),
        guard=ConnectionGuard("test", per_source=per_source, total=total),
        refusal=b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n",
    )
    await server.listen("127.0.0.1", 0)
    return server


async def _from(server: HttpServer, source: str) -> Client:
    return await asyncio.open_connection("127.0.0.1", server.ports[0], local_addr=(source, 0))


async def test_at_the_cap_a_new_connection_takes_the_place_of_an_idle_one() -> None:
    app = App()
    server = await _capped(app, per_source=2, total=3)
    try:
        first = await _from(server, "127.0.0.2")
        second = await _from(server, "127.0.0.2")
        other = await _from(server, "127.0.0.3")
        other[1].write(b"GET /x HTTP/1.1\r\nHost: h\r\n\r\n")
        assert (await answer(other[0]))[0].startswith(b"HTTP/1.1 200")
        assert server.guard is not None and server.guard.open == 3
        # Full: a newcomer closes an idle connection of the source holding the most, the
        # longest idle of them first, and is served.
        reader, writer = await _from(server, "127.0.0.4")
        writer.write(b"GET /y HTTP/1.1\r\nHost: h\r\n\r\n")
        assert (await answer(reader))[0].startswith(b"HTTP/1.1 200")
        assert await closed(first[0])
        assert server.guard.from_source("127.0.0.2") == 1 and server.guard.open == 3
        second[1].write(b"GET /z HTTP/1.1\r\nHost: h\r\n\r\n")
        assert (await answer(second[0]))[0].startswith(b"HTTP/1.1 200")
        for _, w in (first, second, other, (reader, writer)):
            w.close()
    finally:
        await server.close()


async def test_at_the_cap_connections_with_a_request_in_progress_are_kept() -> None:
    app = App()
    server = await _capped(app, per_source=2, total=2)
    try:
        busy = [await _from(server, "127.0.0.2") for _ in range(2)]
        for _, w in busy:
            w.write(b"GET /wait HTTP/1.1\r\nHost: h\r\n\r\n")
        await asyncio.wait_for(app.started.wait(), 5)
        while sum(not conn.idle for conn in server.connections) < 2:
            await asyncio.sleep(0.01)
        reader, writer = await _from(server, "127.0.0.3")
        assert (await asyncio.wait_for(reader.read(), 5)).startswith(b"HTTP/1.1 503")
        assert not app.cancelled.is_set()
        writer.close()
        for _, w in busy:
            w.close()
    finally:
        await server.close()


async def test_a_client_that_stops_reading_a_stream_is_cut_at_the_write_timeout() -> None:
    app = App()
    server = await _capped(app, per_source=4, total=4, write_idle=0.3)
    try:
        _reader, writer = await asyncio.open_connection("127.0.0.1", server.ports[0])
        writer.write(b"GET /flood HTTP/1.1\r\nHost: h\r\n\r\n")
        while not any(conn.paused for conn in server.connections):
            await asyncio.sleep(0.01)  # the buffers are full: the state exists first
        await asyncio.wait_for(app.cancelled.wait(), 20)  # the request gave back its hold
        while server.connections:
            await asyncio.sleep(0.01)
        writer.transport.abort()
    finally:
        await server.close()


async def test_a_closed_connection_is_freed_without_the_cycle_collector(served: Served) -> None:
    server, _, connect = served
    with freed_by_refcount("_Connection", "Request", "HttpRequestParser"):
        reader, writer = await connect()
        writer.write(b"POST /x HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\nhi")
        assert (await answer(reader))[2] == b"POST /x {} hi"
        writer.close()
        for _ in range(100):  # until the server has seen the close
            if not server.connections:
                break
            await asyncio.sleep(0.01)
        assert not server.connections
        del reader, writer


async def test_a_head_within_the_limit_passes_in_pieces_and_after_other_requests(
    served: Served,
) -> None:
    _, _, connect = served
    lines = b"".join(b"X-%d: %s\r\n" % (n, b"v" * 90) for n in range(15))  # 1,500 bytes
    reader, writer = await connect()
    writer.write(b"GET /split HTTP/1.1\r\nHost: h\r\n" + lines[:700])
    await writer.drain()
    await asyncio.sleep(0.05)  # two pieces for certain
    writer.write(lines[700:] + b"\r\n")
    assert (await answer(reader))[0] == b"HTTP/1.1 200 OK"
    # The same head pipelined behind answered requests, split after its first part.
    quick = b"GET /q HTTP/1.1\r\nHost: h\r\n\r\n" * 40
    writer.write(quick + b"GET /late HTTP/1.1\r\nHost: h\r\n" + lines[:700])
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.write(lines[700:] + b"\r\n")
    for _ in range(40):
        assert (await answer(reader))[2] == b"GET /q {} "
    assert (await answer(reader))[2] == b"GET /late {} "
    writer.close()


async def test_a_burst_of_pipelined_requests_larger_than_the_head_limit_is_answered(
    served: Served,
) -> None:
    _, _, connect = served
    reader, writer = await connect()
    burst = b"GET /b HTTP/1.1\r\nHost: h\r\n\r\n" * 2000  # 58 KB against a 2 KB head limit
    writer.write(burst)
    for _ in range(2000):
        assert (await answer(reader))[0] == b"HTTP/1.1 200 OK"
    writer.close()


async def test_one_huge_header_behind_a_pipelined_request_closes_the_connection(
    served: Served,
) -> None:
    _, _, connect = served
    client = await connect()
    client[1].write(b"GET /q HTTP/1.1\r\nHost: h\r\n\r\nGET /big HTTP/1.1\r\nX-Big: " + b"x" * 5000)
    # The request in progress is answered, then the refused one gets its 431, and the
    # connection closes.
    status, _, body = await answer(client[0])
    assert status == b"HTTP/1.1 200 OK" and body == b"GET /q {} "
    assert (await answer(client[0]))[0].startswith(b"HTTP/1.1 431")
    assert await closed(client[0])
    client[1].close()


async def test_a_pipelined_request_whose_body_arrives_later_is_answered(served: Served) -> None:
    _, _, connect = served
    reader, writer = await connect()
    writer.write(
        b"POST /a HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\n\r\nA"
        b"POST /b HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\nB"
    )
    await writer.drain()
    assert (await answer(reader))[2] == b"POST /a {} A"
    await asyncio.sleep(0.05)
    writer.write(b"BB")
    assert (await answer(reader))[2] == b"POST /b {} BBB"
    writer.close()


async def test_a_client_that_does_not_read_its_answers_stops_being_read(served: Served) -> None:
    server, _, connect = served
    _, writer = await connect()
    request = b"GET /%s HTTP/1.1\r\nHost: h\r\n\r\n" % (b"p" * 60)
    sent = 0

    async def flood() -> None:
        nonlocal sent
        for _ in range(20_000):  # about 1.8 MB of requests, 2.2 MB of answers if all ran
            writer.write(request * 10)
            sent += 10
            await writer.drain()

    task = asyncio.create_task(flood())
    await asyncio.sleep(1.0)
    assert not task.done(), "the server read every request although no answer was read"
    (conn,) = server.connections
    transport = conn._transport
    assert transport is not None
    # Answers wait in the server's buffer only up to about its high-water mark.
    assert transport.get_write_buffer_size() < 1_000_000
    task.cancel()
    writer.transport.abort()


async def test_trailers_too_large_fail_the_body(served: Served) -> None:
    _, _, connect = served
    reader, writer = await connect()
    writer.write(b"POST /t HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n")
    writer.write(b"1\r\na\r\n0\r\n")
    await writer.drain()
    writer.write(b"X-Trailer: ")
    for _ in range(40):  # far past head (2 KB) + body (100 B) limits, never ending
        await asyncio.sleep(0.005)
        writer.write(b"t" * 1000)
    status, _, body = await answer(reader)
    assert status.startswith(b"HTTP/1.1 400") and b"trailers" in body
    assert await closed(reader)
    writer.close()


@pytest.mark.parametrize(
    "line",
    [b"GET /health", b"GET /health HTTP/0.9", b"GET /health HTTP/2.0", b"PRI * HTTP/2.0"],
)
async def test_a_request_line_without_http_1_is_malformed(served: Served, line: bytes) -> None:
    # llhttp reads a request line without a version as HTTP/0.9, and takes HTTP/2.0.
    _, _, connect = served
    reader, writer = await connect()
    writer.write(line + b"\r\nHost: h\r\n\r\n")
    status, _, body = await answer(reader)
    assert status.startswith(b"HTTP/1.1 400") and body == b'{"status":400}'
    assert await closed(reader)
    writer.close()


async def test_http_1_0_is_still_answered(served: Served) -> None:
    _, _, connect = served
    reader, writer = await connect()
    writer.write(b"GET /old HTTP/1.0\r\n\r\n")
    status, _, body = await answer(reader)
    assert status == b"HTTP/1.1 200 OK" and body == b"GET /old {} "
    writer.close()


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("offer", [b"h2c", b"websocket"])
async def test_an_upgrade_offered_with_a_body_is_ignored_and_the_body_read(
    served: Served, split: bool, offer: bytes
) -> None:
    """`curl --http2` on http:// offers h2c with its POST: the offer is declined by
    answering the request as HTTP/1.1, its body read (it was lost: 400 "request body is
    empty", found by a new user)."""
    _, _, connect = served
    reader, writer = await connect()
    head = (
        b"POST /echo HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        b"Upgrade: " + offer + b"\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
        b"Content-Length: 8\r\n\r\n"
    )
    writer.write(head if split else head + b'{"x": 1}')
    if split:
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b'{"x": 1}')
    status, _, body = await answer(reader)
    assert status == b"HTTP/1.1 200 OK" and body == b'POST /echo {} {"x": 1}'
    writer.close()


@pytest.mark.parametrize(
    "after", [b"GARBAGE\r\n\r\n", b"GET / HTTP/2.0\r\nHost: x\r\n\r\n", b"GET /" + b"a" * 4000]
)
async def test_what_cannot_be_parsed_behind_a_request_is_refused_after_its_answer(
    served: Served, after: bytes
) -> None:
    """A valid request with garbage (or an oversized head) pipelined behind it got its
    answer, then the connection closed with no word on the rest (found by a new user)."""
    _, _, connect = served
    reader, writer = await connect()
    writer.write(b"GET /first HTTP/1.1\r\nHost: x\r\n\r\n" + after)
    status, _, body = await answer(reader)
    assert status == b"HTTP/1.1 200 OK" and body.startswith(b"GET /first")
    status, headers, _ = await answer(reader)
    assert status in (b"HTTP/1.1 400 Bad Request", b"HTTP/1.1 431 Request Header Fields Too Large")
    assert headers.get("connection") == "close"
    writer.close()
