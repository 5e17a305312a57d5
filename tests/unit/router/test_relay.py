from __future__ import annotations

import asyncio
import socket

import pytest

from hivenet_router.domain.answer import Answer, Outcome
from hivenet_router.domain.request import Job
from hivenet_router.http1 import messages as http
from hivenet_router.http1.server import HttpServer, Limits
from hivenet_router.observability.events import Observers
from hivenet_router.pipeline.ticket import Ticket
from hivenet_router.router.relay import ERROR_WRITE, Relay, complete


@pytest.mark.parametrize(
    "chunk",
    [
        b"data: [DONE]\n\n",
        b'data: {"choices":[]}\n\ndata: [DONE]\n\n',
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
    ],
)
def test_the_last_event_of_an_answer_completes_it(chunk: bytes) -> None:
    assert complete(chunk)


@pytest.mark.parametrize(
    "chunk",
    [
        b"",
        b'data: {"choices":[{"delta":{"content":"[DONE]"}}]}\n\n',
        b'event: content_block_delta\ndata: {"delta":{"text":"message_stop"}}\n\n',
    ],
)
def test_any_other_chunk_leaves_it_open(chunk: bytes) -> None:
    assert not complete(chunk)


class Endless:
    """A stream source that always has another 64 KB event, and hears how it was closed."""

    def __init__(self) -> None:
        self.closed: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()

    async def read(self) -> bytes | None:
        await asyncio.sleep(0)
        return b"data: " + b"x" * 65536 + b"\n\n"

    def close(self, outcome: Outcome) -> None:
        self.closed.set_result(outcome)


async def test_a_client_that_stops_reading_cannot_hold_a_stream_past_its_deadline() -> None:
    relay = Relay()
    source = Endless()
    loop = asyncio.get_running_loop()
    deadline = 0.0

    async def app(request: http.Request) -> http.Answer:
        nonlocal deadline
        ticket = Ticket("rid", "/v1/chat/completions", loop.time(), Observers([]))
        deadline = ticket.deadline = loop.time() + 0.3
        answer = Answer(200, [("content-type", "text/event-stream")], source, first=b"data: 1\n\n")
        return await relay(request, ticket, answer)

    server = HttpServer(app, Limits(), error_page=lambda status, message: b"{}")
    await server.listen("127.0.0.1", 0)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and never read
    sock.connect(("127.0.0.1", server.ports[0]))
    sock.sendall(b"POST /s HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n")
    try:
        outcome = await asyncio.wait_for(source.closed, 5)
        assert outcome is Outcome.TIMEOUT
        # The error event that ends the stream waited for the client a bounded time.
        assert loop.time() <= deadline + ERROR_WRITE + 1.0
    finally:
        sock.close()
        await server.close()


class Slow:
    """A stream source that sends nothing after its first event until it is closed."""

    def __init__(self) -> None:
        self.closed: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()

    async def read(self) -> bytes | None:
        await asyncio.Event().wait()
        return None

    def close(self, outcome: Outcome) -> None:
        self.closed.set_result(outcome)


async def test_a_stream_cut_at_shutdown_ends_its_body_after_the_error_event() -> None:
    relay = Relay()
    source = Slow()
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[object]] = []

    async def app(request: http.Request) -> http.Answer:
        task = asyncio.current_task()
        assert task is not None
        tasks.append(task)
        ticket = Ticket("rid", "/v1/chat/completions", loop.time(), Observers([]))
        ticket.deadline = loop.time() + 60
        answer = Answer(200, [("content-type", "text/event-stream")], source, first=b"data: 1\n\n")
        return await relay(request, ticket, answer)

    server = HttpServer(app, Limits(), error_page=lambda status, message: b"{}")
    await server.listen("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.ports[0])
    try:
        writer.write(b"POST /s HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n")
        await asyncio.wait_for(reader.readuntil(b"data: 1\n\n\r\n"), 5)
        # What Edge.drain does when the grace is over.
        relay.stopping = True
        tasks[0].cancel()
        rest = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 5)
        assert b"shutting down" in rest and rest.endswith(b"}\n\n\r\n0\r\n\r\n")
        assert await asyncio.wait_for(source.closed, 5) is Outcome.BROKEN
    finally:
        writer.close()
        await server.close()


class Pieces:
    def __init__(self, pieces: list[bytes]) -> None:
        self._pieces = list(pieces)

    async def read(self) -> bytes | None:
        return self._pieces.pop(0) if self._pieces else None

    def close(self, outcome: Outcome) -> None:
        return None


TOKENS = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n' * 3
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":3}}\n\n'
DONE = b"data: [DONE]\n\n"


@pytest.mark.parametrize("asked", [False, True])
async def test_the_usage_event_reaches_only_a_client_that_asked(asked: bool) -> None:
    """Metered either way; relayed only to a client that asked, every other byte as is."""
    stream = TOKENS + USAGE + DONE
    cut = len(TOKENS) + 20  # the usage event split across two chunks
    options = b', "stream_options": {"include_usage": true}' if asked else b""
    body = b'{"model": "m", "stream": true, "messages": []' + options + b"}"
    relay = Relay()
    loop = asyncio.get_running_loop()
    answers: list[Answer] = []

    async def app(request: http.Request) -> http.Answer:
        ticket = Ticket("rid", "/v1/chat/completions", loop.time(), Observers([]))
        ticket.deadline = loop.time() + 60
        ticket.job = Job("/v1/chat/completions", "m", "llm", True, body, [])
        source = Pieces([stream[cut:]])
        answer = Answer(200, [("content-type", "text/event-stream")], source, first=stream[:cut])
        answers.append(answer)
        return await relay(request, ticket, answer)

    server = HttpServer(app, Limits(), error_page=lambda status, message: b"{}")
    await server.listen("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.ports[0])
    try:
        writer.write(b"POST /s HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n")
        raw = await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 5)
    finally:
        writer.close()
        await server.close()
    chunked = raw.split(b"\r\n\r\n", 1)[1]
    sent = b""
    while True:
        size_line, chunked = chunked.split(b"\r\n", 1)
        size = int(size_line, 16)
        if not size:
            break
        sent, chunked = sent + chunked[:size], chunked[size + 2 :]
    assert sent == (stream if asked else TOKENS + DONE)
    usage = answers[0].usage
    assert usage is not None and (usage.input_tokens, usage.output_tokens) == (4, 3)
    assert not answers[0].usage_estimated
