"""The agent's engine client against a real socket server on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from hivenet_router.http1.client import EngineClient, EngineError, Origin, Unreachable
from tests.cycles import freed_by_refcount

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[str, dict[str, str], bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = {}
    for line in head[1:]:
        if line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return head[0], headers, body


class Server:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[tuple[str, dict[str, str], bytes]] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


Start = Callable[[Handler], Awaitable[tuple[Server, str]]]


@pytest.fixture
async def serve() -> AsyncIterator[Start]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> tuple[Server, str]:
        state = Server(handler)
        server = await asyncio.start_server(state._serve, "127.0.0.1", 0)
        servers.append(server)
        port = server.sockets[0].getsockname()[1]
        return state, f"http://127.0.0.1:{port}/base"

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


def keep_alive_echo(state_holder: list[Server]) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            line, headers, body = await read_request(reader)
            state_holder[0].requests.append((line, headers, body))
            answer = line.encode() + b"|" + body
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\n"
                b"Content-Length: " + str(len(answer)).encode() + b"\r\n\r\n" + answer
            )
            await writer.drain()

    return handler


async def test_requests_reuse_one_keep_alive_connection(serve: Start) -> None:
    holder: list[Server] = []
    state, url = await serve(keep_alive_echo(holder))
    holder.append(state)
    client = EngineClient(url)
    for n in range(3):
        response = await client.request("POST", "/v1/x", [("X-N", str(n))], b"hello")
        assert response.status == 200
        assert response.content_type == "text/plain"
        assert await response.read(1024) == b"POST /base/v1/x HTTP/1.1|hello"
    assert state.connections == 1
    assert state.requests[0][1]["host"] == url.split("/")[2]
    assert state.requests[2][1]["x-n"] == "2"
    await client.close()


async def test_an_idle_connection_closed_by_the_engine_is_replaced(serve: Start) -> None:
    async def one_per_connection(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        # keeps the connection open as if keep-alive, then closes it while idle

    state, url = await serve(one_per_connection)
    client = EngineClient(url)
    for _ in range(3):
        response = await client.request("GET", "/ping", [])
        assert await response.read(10) == b"ok"
        await asyncio.sleep(0.05)  # the server's close reaches the pooled connection
    assert state.connections == 3
    await client.close()


async def test_chunked_bodies_arrive_piece_by_piece(serve: Start) -> None:
    release = asyncio.Event()

    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await release.wait()
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await writer.drain()

    _, url = await serve(chunked)
    client = EngineClient(url)
    response = await client.request("GET", "/stream", [])
    assert await response.next_chunk() == b"first"
    release.set()
    assert await response.next_chunk() == b"second"
    assert await response.next_chunk() is None
    await client.close()


async def test_a_body_over_the_limit_is_refused_or_truncated(serve: Start) -> None:
    holder: list[Server] = []
    state, url = await serve(keep_alive_echo(holder))
    holder.append(state)
    client = EngineClient(url)
    response = await client.request("POST", "/", [], b"x" * 100)
    with pytest.raises(EngineError, match="larger than"):
        await response.read(10)
    response = await client.request("POST", "/", [], b"y" * 100)
    assert await response.read(10, truncate=True) == b"POST /base"
    await client.close()


async def test_an_answer_cut_mid_body_is_an_error(serve: Start) -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()

    _, url = await serve(cut)
    client = EngineClient(url)
    response = await client.request("GET", "/", [])
    with pytest.raises(EngineError, match="mid-answer"):
        await response.read(1000)
    await client.close()


async def test_garbage_from_the_engine_is_an_error(serve: Start) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    _, url = await serve(garbage)
    client = EngineClient(url)
    with pytest.raises(EngineError, match="malformed"):
        await client.request("GET", "/", [])
    await client.close()


async def test_header_injection_is_refused_before_anything_is_sent() -> None:
    client = EngineClient("http://127.0.0.1:9")
    with pytest.raises(EngineError, match="cannot be sent"):
        await client.request("GET", "/", [("X-A", "v\r\nX-Injected: 1")])


async def test_an_engine_that_is_not_listening_is_unreachable() -> None:
    client = EngineClient("http://127.0.0.1:9", connect_timeout=2)
    with pytest.raises(Unreachable):
        await client.request("GET", "/health", [])


def test_origins_parse_ports_prefixes_and_ipv6() -> None:
    assert Origin.parse("http://h:8000/v1/").prefix == "/v1"
    assert Origin.parse("https://h").port == 443
    assert Origin.parse("http://h").host_header == "h"
    assert Origin.parse("http://[::1]:81").host_header == "[::1]:81"
    with pytest.raises(ValueError):
        Origin.parse("ftp://h")


async def test_a_connection_the_engine_closed_is_freed_without_the_cycle_collector(
    serve: Start,
) -> None:
    async def close_after_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    _, url = await serve(close_after_one)
    client = EngineClient(url)
    with freed_by_refcount("_Connection", "HttpResponseParser"):
        response = await client.request("GET", "/ping", [])
        assert await response.read(10) == b"ok"
        del response
        await asyncio.sleep(0.05)  # the engine's close reaches the pooled connection
    await client.close()


async def test_a_connection_released_while_paused_reads_again_in_the_pool(serve: Start) -> None:
    body = b"x" * ((1 << 20) + 100)  # past the high-water mark, in one answer

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            await writer.drain()

    state, url = await serve(handler)
    client = EngineClient(url)
    first = await client.request("GET", "/one", [])
    while not first._conn.complete:  # the whole body arrived; nobody read it
        await asyncio.sleep(0.01)
    first.release()
    second = await asyncio.wait_for(client.request("GET", "/two", []), 2)
    assert len(await asyncio.wait_for(second.read(1 << 21), 2)) == len(body)
    assert state.connections == 1  # the same connection, reused
    await client.close()


async def test_interim_answers_are_skipped(serve: Start) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(b"HTTP/1.1 200 OK\r\nX-Final: yes\r\nContent-Length: 1\r\n\r\nA")

    _, url = await serve(handler)
    client = EngineClient(url)
    for _ in range(2):
        answer = await client.request("POST", "/p", [], b"{}")
        assert answer.status == 200 and answer.header("x-final") == "yes"
        assert answer.header("link") is None
        assert await answer.read(10) == b"A"
    await client.close()


async def test_an_answer_to_no_request_closes_the_connection(serve: Start) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            ok = b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n"
            writer.write(ok + b"A")
            await asyncio.sleep(0.05)
            writer.write(ok + b"B")  # a second answer to the same request

    state, url = await serve(handler)
    client = EngineClient(url)
    first = await client.request("GET", "/one", [])
    assert await first.read(10) == b"A"
    await asyncio.sleep(0.1)  # the stray answer arrives while the connection is idle
    second = await client.request("GET", "/two", [])
    assert await second.read(10) == b"A"  # its own answer, on a new connection
    assert state.connections == 2
    await client.close()


async def test_an_answer_head_over_the_limit_is_an_engine_error(serve: Start) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nX-Big: " + b"b" * 20_000 + b"\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    _, url = await serve(handler)
    client = EngineClient(url)
    with pytest.raises(EngineError, match="head over"):
        await asyncio.wait_for(client.request("GET", "/big", []), 2)
    await client.close()


async def test_an_answer_ended_by_closing_the_connection_is_whole(serve: Start) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nhello")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b" world")  # then the handler returns and the connection closes

    _, url = await serve(handler)
    client = EngineClient(url)
    answer = await client.request("GET", "/eof", [])
    assert await asyncio.wait_for(answer.read(100), 2) == b"hello world"
    await client.close()


async def test_a_switch_of_protocols_is_an_engine_error(serve: Start) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: upgrade\r\n\r\nzz"
        )
        await writer.drain()
        await asyncio.sleep(5)

    _, url = await serve(handler)
    client = EngineClient(url)
    with pytest.raises(EngineError):
        await asyncio.wait_for(client.request("GET", "/up", []), 2)
    await client.close()
