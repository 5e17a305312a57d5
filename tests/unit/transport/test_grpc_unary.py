"""The agent's unary gRPC call (h2), against a real grpcio server on loopback, and against
peers that are not gRPC servers at all: each way a call can fail has its status name."""

from __future__ import annotations

import asyncio
import gc
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import grpc
import pytest

from hivenet_router.agent.session import GrpcRouterAuth, RouterRejected, call_authenticate
from hivenet_router.config.values import ListenAddress
from hivenet_router.transport.grpc_unary import CallFailed, unary_call
from hivenet_router.transport.identity import Identity
from hivenet_router.transport.tls import GRPC_ALPN, RouterTlsIdentity

SERVICE = "test.Echo"
Handler = Callable[[bytes, grpc.aio.ServicerContext[bytes, bytes]], Awaitable[bytes]]


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[int]]]:
    servers: list[grpc.aio.Server] = []

    async def start(handler: Handler) -> int:
        server = grpc.aio.server(options=[("grpc.max_send_message_length", 8 * 1024 * 1024)])
        methods = {"Call": grpc.unary_unary_rpc_method_handler(handler)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, methods),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return port

    yield start
    for server in servers:
        await server.stop(grace=None)
    # grpcio shuts its asyncio runtime down when its last server is freed, and joins a
    # poller thread to do it. Freed here, in the test's own frame; left to the collector, it
    # could happen inside the project's code in a later test, where blockbuster (rightly)
    # fails a blocking call.
    servers.clear()
    gc.collect()


async def call(port: int, request: bytes, path: str = f"/{SERVICE}/Call", **kw: float) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    return await unary_call(
        reader,
        writer,
        authority="127.0.0.1",
        path=path,
        request=request,
        timeout=kw.get("timeout", 5.0),
    )


async def test_a_call_returns_the_answer_message(serve: Callable[..., Awaitable[int]]) -> None:
    async def echo(request: bytes, context: object) -> bytes:
        return b"echo:" + request

    port = await serve(echo)
    assert await call(port, b'{"token": "t"}') == b'echo:{"token": "t"}'
    assert await call(port, b"") == b"echo:"
    big = bytes(range(256)) * 1024  # larger than one HTTP/2 frame and the first window
    assert await call(port, big) == b"echo:" + big


async def test_a_refusal_keeps_its_status_and_message(serve: Callable[..., Awaitable[int]]) -> None:
    async def refuse(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad token: 100% wrong, né")
        return b""

    port = await serve(refuse)
    with pytest.raises(CallFailed) as caught:
        await call(port, b"{}")
    assert caught.value.code == "UNAUTHENTICATED"
    assert caught.value.details == "bad token: 100% wrong, né"


async def test_an_unknown_method_is_unimplemented(serve: Callable[..., Awaitable[int]]) -> None:
    async def echo(request: bytes, context: object) -> bytes:
        return request

    port = await serve(echo)
    with pytest.raises(CallFailed) as caught:
        await call(port, b"{}", path=f"/{SERVICE}/Missing")
    assert caught.value.code == "UNIMPLEMENTED"


async def test_an_answer_past_the_limit_is_refused(serve: Callable[..., Awaitable[int]]) -> None:
    async def flood(request: bytes, context: object) -> bytes:
        return b"x" * (5 * 1024 * 1024)

    port = await serve(flood)
    with pytest.raises(CallFailed) as caught:
        await call(port, b"{}")
    assert caught.value.code == "RESOURCE_EXHAUSTED"


async def test_a_server_that_never_answers_runs_into_the_deadline(
    serve: Callable[..., Awaitable[int]],
) -> None:
    async def stall(request: bytes, context: object) -> bytes:
        await asyncio.sleep(30)
        return b""

    port = await serve(stall)
    started = time.monotonic()
    with pytest.raises(CallFailed) as caught:
        await call(port, b"{}", timeout=0.5)
    assert caught.value.code == "DEADLINE_EXCEEDED"
    assert time.monotonic() - started < 5


async def plain_server(
    answer: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> tuple[asyncio.Server, int]:
    """A TCP server that is no gRPC server; each connection is closed when `answer` ends
    (the client's hanging up ends a read)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await answer(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    pass


async def speak_http1(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read(100)
    writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    await writer.drain()
    while await reader.read(1024):  # until the client hangs up
        pass


@pytest.mark.parametrize(
    ("peer", "code"),
    [(hang_up, "UNAVAILABLE"), (speak_http1, "INTERNAL")],
    ids=["hangs up", "speaks HTTP/1.1"],
)
async def test_a_peer_that_is_no_grpc_server_fails_the_call(
    peer: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]], code: str
) -> None:
    server, port = await plain_server(peer)
    try:
        with pytest.raises(CallFailed) as caught:
            await call(port, b"{}")
        assert caught.value.code == code
    finally:
        server.close()


async def test_a_call_abandoned_or_out_of_time_closes_its_connection() -> None:
    """The connection goes when the deadline passes and when the caller is cancelled:
    the peer, which never answers, reads the end of it."""
    ended: list[asyncio.Event] = []

    async def listen_silently(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        done = asyncio.Event()
        ended.append(done)
        while await reader.read(1024):
            pass
        done.set()

    server, port = await plain_server(listen_silently)
    try:
        with pytest.raises(CallFailed, match="DEADLINE_EXCEEDED"):
            await call(port, b"{}", timeout=0.2)
        abandoned = asyncio.create_task(call(port, b"{}"))
        while len(ended) < 2:
            await asyncio.sleep(0.01)
        abandoned.cancel()
        with pytest.raises(asyncio.CancelledError):
            await abandoned
        assert len(ended) == 2
        async with asyncio.timeout(5):
            for done in ended:
                await done.wait()
    finally:
        server.close()


@pytest.fixture
def contexts() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A router's server context for one secret, and an agent's client context for
    another (made outside the event loop: they write their key to a scratch folder)."""
    other = RouterTlsIdentity.from_secret(b"o" * 32).server_context()
    return other, RouterTlsIdentity.from_secret(b"m" * 32).client_context()


async def test_authenticate_refuses_a_router_with_another_key(
    contexts: tuple[ssl.SSLContext, ssl.SSLContext],
) -> None:
    """The agent's secret derives one certificate; a router holding another is refused
    before anything is sent."""
    seen: list[bytes] = []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.read(100))
        writer.close()

    other, mine = contexts
    server = await asyncio.start_server(record, "127.0.0.1", 0, ssl=other)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(RouterRejected, match="does not match the shared secret"):
            await call_authenticate(ListenAddress("127.0.0.1", port), mine, b'{"token": "t"}')
        assert not any(seen)
    finally:
        server.close()


async def test_authenticate_reports_a_router_that_cannot_be_reached(
    contexts: tuple[ssl.SSLContext, ssl.SSLContext],
) -> None:
    server, port = await plain_server(lambda reader, writer: asyncio.sleep(0))
    server.close()
    await server.wait_closed()
    tls = contexts[1]
    with pytest.raises(ConnectionError, match="router unreachable"):
        await call_authenticate(ListenAddress("127.0.0.1", port), tls, b"{}")


@pytest.fixture
def alpn_h2_router() -> Iterator[tuple[socket.socket, ssl.SSLContext, GrpcRouterAuth]]:
    """A listening socket, a router's TLS context that selects h2 in ALPN, and an agent's
    authentication for the same secret (all made outside the event loop: the contexts
    read and write key files)."""
    secret = b"a" * 32
    server_tls = RouterTlsIdentity.from_secret(secret).server_context(GRPC_ALPN)
    listening = socket.create_server(("127.0.0.1", 0))
    router = ListenAddress("127.0.0.1", listening.getsockname()[1])
    with listening:
        yield listening, server_tls, GrpcRouterAuth(router, secret, Identity.generate(), 4)


async def test_the_agent_offers_http2_in_alpn(
    alpn_h2_router: tuple[socket.socket, ssl.SSLContext, GrpcRouterAuth],
) -> None:
    """A gRPC server built on grpc-go refuses a TLS client that offers no application
    protocol; the agent's Authenticate connection offers h2, as every gRPC client does."""
    listening, server_tls, auth = alpn_h2_router
    agreed: list[str | None] = []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        agreed.append(writer.get_extra_info("ssl_object").selected_alpn_protocol())
        writer.close()

    server = await asyncio.start_server(record, sock=listening, ssl=server_tls)
    try:
        with pytest.raises(ConnectionError):  # the stand-in hangs up after the handshake
            await auth.authenticate()
        assert agreed == ["h2"]
    finally:
        server.close()
